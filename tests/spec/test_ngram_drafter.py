"""Tests for the model-free n-gram drafter."""

from __future__ import annotations

import random

import pytest

from tltd_workers.engine.ngram import NgramDrafter

PROMPT = [100, 101, 102, 103, 104, 105]


def _group(prompt: list[int] = PROMPT, seqs: tuple[str, ...] = ("a", "b")) -> NgramDrafter:
    d = NgramDrafter(max_match=8, min_match=2)
    d.add_group("g", prompt)
    for s in seqs:
        d.add_sequence("g", s)
    return d


def test_span_generated_by_one_sibling_is_proposed_to_another() -> None:
    d = _group()
    d.extend("g", "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    d.extend("g", "b", [1, 2, 3])
    assert d.propose("g", "b", 4) == [4, 5, 6, 7]


def test_a_fresh_sample_gets_a_siblings_first_tokens() -> None:
    # The suffix (the prompt's tail) continues into sibling a's output.
    d = _group()
    d.extend("g", "a", [7, 8, 9])
    assert d.propose("g", "b", 5) == [7, 8, 9]


def test_prompt_matches() -> None:
    d = _group(prompt=[5, 6, 7, 8, 9, 1, 2, 3], seqs=("a",))
    d.extend("g", "a", [5, 6])
    assert d.propose("g", "a", 3) == [7, 8, 9]


def test_longest_match_wins_over_a_more_recent_shorter_one() -> None:
    d = _group(seqs=("a", "b", "c"))
    d.extend("g", "a", [1, 2, 3, 4, 50, 51])  # the 4-gram 1 2 3 4 -> 50
    d.extend("g", "b", [9, 3, 4, 60, 61])  # the 2-gram 3 4 -> 60, indexed later
    d.extend("g", "c", [1, 2, 3, 4])
    assert d.propose("g", "c", 2) == [50, 51]


def test_most_recent_continuation_among_equal_matches() -> None:
    d = _group(seqs=("a", "b", "c"))
    d.extend("g", "a", [1, 2, 3, 70])
    d.extend("g", "b", [1, 2, 3, 80])
    d.extend("g", "c", [1, 2, 3])
    assert d.propose("g", "c", 1) == [80]


def test_k_truncates_and_a_short_source_gives_fewer_tokens() -> None:
    d = _group()
    d.extend("g", "a", [1, 2, 3, 4, 5])
    d.extend("g", "b", [1, 2])
    assert d.propose("g", "b", 2) == [3, 4]
    assert d.propose("g", "b", 10) == [3, 4, 5]
    assert d.propose("g", "b", 0) == []


def test_no_match_returns_empty() -> None:
    d = _group(prompt=[100, 101], seqs=("a",))
    d.extend("g", "a", [1, 2, 3])
    assert d.propose("g", "a", 4) == []


def test_min_match_is_respected() -> None:
    d = NgramDrafter(max_match=4, min_match=3)
    d.add_group("g", [100, 101])
    d.add_sequence("g", "a")
    d.add_sequence("g", "b")
    d.extend("g", "a", [1, 2, 3, 4])
    d.extend("g", "b", [9, 2, 3])  # only a 2-gram (2 3) matches
    assert d.propose("g", "b", 2) == []
    d.extend("g", "b", [4])  # now 2 3 4 -> nothing follows in a; 3-gram found nowhere else
    assert d.propose("g", "b", 2) == []


def test_own_repetition_is_copied_with_overlap() -> None:
    d = _group(prompt=[100], seqs=("a",))
    d.extend("g", "a", [1, 2, 1, 2, 1, 2])
    assert d.propose("g", "a", 5) == [1, 2, 1, 2, 1]


def test_samples_of_other_groups_are_not_used() -> None:
    d = _group()
    d.add_group("h", [200, 201])
    d.add_sequence("h", "a")
    d.extend("g", "a", [1, 2, 3, 4])
    d.extend("h", "a", [1, 2])
    assert d.propose("h", "a", 2) == []


def test_removal() -> None:
    d = _group(seqs=("a", "b", "c"))
    d.extend("g", "a", [1, 2, 3, 4])
    d.remove_sequence("g", "a")  # finished: its tokens still help the tail
    assert not d.has_sequence("g", "a")
    with pytest.raises(KeyError):
        d.propose("g", "a", 2)
    d.extend("g", "b", [1, 2])
    assert d.propose("g", "b", 2) == [3, 4]

    d.extend("g", "c", [5, 6, 7, 8])
    d.remove_sequence("g", "c", keep_tokens=False)  # aborted: purge
    d.extend("g", "b", [5, 6])
    assert d.propose("g", "b", 2) == []

    d.remove_group("g")
    assert not d.has_group("g") and len(d) == 0
    with pytest.raises(KeyError):
        d.propose("g", "b", 2)
    d.remove_group("g")  # idempotent


def test_unknown_and_duplicate_ids() -> None:
    d = _group()
    with pytest.raises(KeyError):
        d.extend("g", "zz", [1])
    with pytest.raises(KeyError):
        d.add_sequence("nope", "a")
    with pytest.raises(ValueError):
        d.add_sequence("g", "a")
    d.add_group("g", PROMPT)  # same prompt: no-op
    with pytest.raises(ValueError):
        d.add_group("g", [1, 2, 3])


def _longest_match(ctx: list[int], docs: list[list[int]], lo: int, hi: int) -> int:
    """Brute force: the longest suffix of ctx (lo..hi tokens) that occurs with a continuation."""
    n = len(ctx)
    for m in range(min(hi, n), lo - 1, -1):
        if any(doc[c - m : c] == ctx[n - m :] for doc in docs for c in range(m, len(doc))):
            return m
    return 0


def _continues_a_match(ctx: list[int], got: list[int], docs: list[list[int]], m: int) -> bool:
    """got starts with what followed an m-token match in some doc (the rest, if that doc
    ends early, comes from a further match), or, for the sample's own history, is the
    overlapping copy."""
    n, k = len(ctx), 3
    for doc in docs:
        for c in range(m, len(doc)):
            cont = doc[c : c + k]
            if doc[c - m : c] == ctx[n - m :] and got[: len(cont)] == cont:
                return True
    full = ctx + got
    return any(full[c - m : c] == ctx[n - m :] and full[c : c + k] == got for c in range(m, n))


def test_matches_brute_force_on_random_sequences() -> None:
    # Longest-match semantics checked against a rescan, on a tiny vocabulary (many matches).
    # Only the match length is compared: which of several equal matches wins depends on the
    # indexing order, which a rescan does not reconstruct.
    rng = random.Random(1)
    for trial in range(30):
        prompt = [rng.randrange(4) for _ in range(rng.randrange(3, 12))]
        d = NgramDrafter(max_match=5, min_match=2)
        d.add_group("g", prompt)
        outs: dict[str, list[int]] = {s: [] for s in "abc"}
        for s in outs:
            d.add_sequence("g", s)
        for _ in range(40):
            s = rng.choice("abc")
            toks = [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
            d.extend("g", s, toks)
            outs[s] += toks
            q = rng.choice("abc")
            ctx = prompt + outs[q]
            got = d.propose("g", q, 3)
            docs = [prompt] + [prompt + outs[x] for x in "abc"]
            m = _longest_match(ctx, docs, 2, 5)
            if m == 0:
                assert got == [], trial
            else:
                assert got and _continues_a_match(ctx, got, docs, m), (trial, ctx, got)


def test_a_source_that_ends_early_is_continued_by_a_new_match() -> None:
    d = _group(prompt=[100, 101], seqs=("a", "b", "c"))
    d.extend("g", "c", [3, 4, 50, 51, 52])
    d.extend("g", "a", [1, 2, 3, 4])  # a's newest tokens: 3 4 has no continuation in a
    d.extend("g", "b", [1, 2])
    assert d.propose("g", "b", 5) == [3, 4, 50, 51, 52]
    assert d.propose("g", "b", 3) == [3, 4, 50]
