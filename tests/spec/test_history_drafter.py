"""The history drafter: best-supported continuations, variable length, bounded memory."""

from __future__ import annotations

import pytest

from tltd_workers.engine.history import HistoryDrafter

PROMPT = list(range(100, 140))  # longer than every context: answers' starts are indexed
ANSWER = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]


def _live(h: HistoryDrafter, prompt: list[int], tokens: list[int]) -> tuple[tuple, int]:
    key = h.open(prompt)
    aid = h.start(key)
    h.extend(key, aid, tokens)
    return key, aid


def test_a_past_answer_is_proposed_from_the_start_of_a_new_sample():
    h = HistoryDrafter()
    key = h.open(PROMPT, [("old", ANSWER)])
    aid = h.start(key)
    assert h.propose(key, aid, 5) == ANSWER[:5]
    h.extend(key, aid, ANSWER[:3])
    assert h.propose(key, aid, 100) == ANSWER[3:]  # as long as the history supports
    assert h.propose(key, aid, 0) == []


def test_the_most_frequent_continuation_wins_and_ties_go_to_the_newest():
    h = HistoryDrafter(min_support=0.0)
    a, b = [1, 2, 3, 4, 50, 51], [1, 2, 3, 4, 60, 61]
    key = h.open(PROMPT, [("s1", a), ("s2", b), ("s3", a)])
    key, aid = _live(h, PROMPT, [1, 2, 3, 4])
    assert h.propose(key, aid, 2) == [50, 51]  # two answers against one
    h2 = HistoryDrafter(min_support=0.0)
    key2 = h2.open(PROMPT, [("s1", a), ("s2", b)])
    aid2 = h2.start(key2)
    h2.extend(key2, aid2, [1, 2, 3, 4])
    assert h2.propose(key2, aid2, 2) == [60, 61]  # one each: the newer answer


def test_drafts_stop_where_the_history_disagrees():
    h = HistoryDrafter(min_support=0.6)
    answers = [("a", [1, 2, 3, 4, 5, 7]), ("b", [1, 2, 3, 4, 5, 8]), ("c", [1, 2, 3, 4, 5, 9])]
    key = h.open(PROMPT, answers)
    aid = h.start(key)
    # Agreed up to 5; three continuations of 1/3 each after it: below the support.
    assert h.propose(key, aid, 10) == [1, 2, 3, 4, 5]


def test_an_unseen_context_or_prompt_proposes_nothing():
    h = HistoryDrafter()
    key, aid = _live(h, PROMPT, [90, 91, 92, 93])
    assert h.propose(key, aid, 4) == []
    other = h.open([7] * 40)
    assert h.propose(other, h.start(other), 4) == []


def test_live_siblings_are_drafted_from():
    h = HistoryDrafter()
    key, first = _live(h, PROMPT, ANSWER)
    second = h.start(key)
    assert h.propose(key, second, 4) == ANSWER[:4]


def test_store_answers_are_added_once_per_sample_id():
    h = HistoryDrafter()
    key = h.open(PROMPT, [("s1", ANSWER)])
    assert h.open(PROMPT, [("s1", ANSWER), ("s2", ANSWER)]) == key
    assert h.answers(key) == 2 and h.tokens == 2 * len(ANSWER)
    h.start(key, sample_id="s3")  # a sample run here, later read back from the store
    h.open(PROMPT, [("s3", ANSWER)])
    assert h.answers(key) == 3


def test_per_prompt_bound_drops_the_oldest_finished_answers():
    h = HistoryDrafter(max_tokens=100, max_prompt_tokens=20, min_support=0.0)
    old, new = [1, 2, 3, 4, 70, 71, 72, 73, 74, 75], [1, 2, 3, 4, 80, 81, 82, 83, 84, 85]
    key = h.open(PROMPT, [("old", old), ("new", new), ("newer", new)])
    assert h.answers(key) == 2 and h.tokens == 20
    _, aid = _live(h, PROMPT, [1, 2, 3, 4])
    assert h.propose(key, aid, 2) == [80, 81]
    # The dropped answer's counts are gone: the tables equal those of the answers kept.
    kept = HistoryDrafter(max_tokens=100, max_prompt_tokens=20, min_support=0.0)
    kept.open(PROMPT, [("new", new), ("newer", new)])
    _live(kept, PROMPT, [1, 2, 3, 4])
    assert h._prompts[key].counts == kept._prompts[key].counts


def test_engine_bound_drops_least_recently_used_prompts_but_never_live_ones():
    h = HistoryDrafter(max_tokens=30, max_prompt_tokens=30)
    p1, p2, p3 = PROMPT, [p + 100 for p in PROMPT], [p + 200 for p in PROMPT]
    k1 = h.open(p1, [("a", ANSWER)])
    live = h.start(k1)  # p1 stays: it has a live sample
    k2 = h.open(p2, [("b", ANSWER)])
    h.open(p3, [("c", ANSWER)])  # 36 tokens > 30: the least recently used idle prompt goes
    assert h.answers(k1) == 2 and h.answers(k2) == 0 and h.tokens == 24
    h.finish(k1, live)
    assert len(h) == 2


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        HistoryDrafter(max_tokens=10, max_prompt_tokens=20)
    with pytest.raises(ValueError, match="min_support"):
        HistoryDrafter(min_support=1.5)


def test_a_short_match_gives_a_short_draft():
    h = HistoryDrafter()
    key = h.open(PROMPT, [("old", list(range(1, 40)))])
    key, aid = _live(h, PROMPT, [50, 51, 52, 53, 54, 55, 56, 57, 1, 2, 3, 4])
    # Only the last 4 tokens match the history: at most 2 x 4 drafts, though 35 follow.
    assert h.propose(key, aid, 30) == list(range(5, 13))
