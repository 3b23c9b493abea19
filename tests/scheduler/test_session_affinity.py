"""A session's turn goes to the worker holding its KV unless that one is gone, cannot take it
or is much busier than the least loaded one, and a turn sent elsewhere says why (a re-pin);
the first turns of sessions of one prompt (a group) follow one another (the pure policy,
table-driven)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.scheduler.test_scheduler import CFG, UNMEASURED, dev, placed, wk
from tltd.scheduler import JobView, PendingWork, Snapshot, expected_wait_steps, schedule, sticky


def turn(key: str = "s1", job: str = "j", context: int = 0) -> PendingWork:
    return PendingWork(
        f"session:{key}:1:0", 0, job, 1, 100, 0.0, cache_key=key, context_tokens=context
    )


def _snap(workers, pending, holders) -> Snapshot:
    devices = tuple(dev(i) for i in range(4))
    return Snapshot(100.0, devices, tuple(workers), (), tuple(pending), (JobView("j"),), holders)


@pytest.mark.parametrize(
    "name, workers, holders, expected, repin",
    [
        ("a first turn: the least loaded", [wk(0, running=2, tokens=200), wk(1)], {}, "w1", ""),
        (
            "a later turn: its holder, though busier",
            [wk(0, running=2, tokens=900), wk(1)],
            {"s1": "w0"},
            "w0",
            "",
        ),
        (
            "a holder much busier than the least loaded: another worker",
            [wk(0, running=5, tokens=500), wk(1)],
            {"s1": "w0"},
            "w1",
            "overloaded",
        ),
        (
            "a holder that is gone: the least loaded",
            [wk(1, running=1), wk(2)],
            {"s1": "w0"},
            "w2",
            "gone",
        ),
        ("a holder lost with its KV", [wk(0), wk(1, running=1)], {"s1": ""}, "w0", "gone"),
        (
            "a full holder whose queue is over the slack: another worker",
            [wk(0, running=8), wk(1, running=3)],
            {"s1": "w0"},
            "w1",
            "full",
        ),
        (
            "a holder now serving another job: another worker",
            [wk(0, job="other"), wk(1, running=3)],
            {"s1": "w0"},
            "w1",
            "version",
        ),
        ("another session's holder is no pull", [wk(0), wk(1, running=2)], {"s2": "w1"}, "w0", ""),
    ],
)
def test_a_turn_goes_to_its_kv_unless_that_costs_more(name, workers, holders, expected, repin):
    decision = schedule(_snap(workers, [turn()], holders), CFG)
    assert placed(decision) == {expected: 1}, name
    assert [a.repin for a in decision.assignments] == [repin], name


def test_a_turn_placed_by_another_rule_away_from_its_kv_is_a_re_pin_by_rule():
    rotation = replace(CFG, session_placement="round_robin")
    snap = replace(_snap([wk(0), wk(1)], [turn()], {"s1": "w0"}), turns_handed_out=1)
    decision = schedule(snap, rotation)
    assert [(a.worker_id, a.repin) for a in decision.assignments] == [("w1", "rule")]
    # Its holder full, round robin's turn is still sent away by the rule, not for the load.
    full = replace(_snap([wk(0, running=8), wk(1)], [turn()], {"s1": "w0"}), turns_handed_out=1)
    assert [a.repin for a in schedule(full, rotation).assignments] == ["rule"]


def test_the_slack_is_in_samples_and_inclusive():
    both = (["w0", "w1"], ["w0", "w1"])
    load = ({"w0": (4, 0), "w1": (0, 0)}, {}, UNMEASURED)
    assert sticky("w0", both, load, 4) == "w0"
    assert sticky("w0", both, load, 3) is None
    assert sticky(None, both, load, 4) is None
    assert sticky("w0", (["w1"], ["w1"]), load, 4) is None  # w0 takes no turn of this job
    # Turns queued for a worker count as its load.
    queued = ({"w0": (2, 0), "w1": (0, 0)}, {"w0": 2, "w1": 1}, UNMEASURED)
    assert sticky("w0", both, queued, 3) == "w0"
    assert sticky("w0", both, queued, 2) is None


def test_a_full_holder_within_the_slack_is_waited_for():
    # w0 (full at 8) holds s1's KV; w1 has room but is nearly as busy: the turn waits for
    # w0, and the job's next turn, whose KV w1 holds, goes on meanwhile.
    workers = [wk(0, running=8), wk(1, running=6)]
    decision = schedule(_snap(workers, [turn("s1"), turn("s2")], {"s1": "w0", "s2": "w1"}), CFG)
    assert {a.request_id: a.worker_id for a in decision.assignments} == {"session:s2:1:0": "w1"}
    # Six turns queued for w0 (full at 8), w1 running 5: the oldest ones move (re-pins,
    # "full") while w0's load stays over w1's by more than the slack: 8 + 5 > 5 + 4, then
    # 8 + 4 > 6 + 4; then 8 + 3 <= 7 + 4, and the other four wait for w0.
    workers = [wk(0, running=8), wk(1, running=5)]
    queue = [turn(f"q{i}") for i in range(6)]
    decision = schedule(_snap(workers, queue, {f"q{i}": "w0" for i in range(6)}), CFG)
    assert [(a.request_id, a.worker_id, a.repin) for a in decision.assignments] == [
        ("session:q0:1:0", "w1", "full"),
        ("session:q1:1:0", "w1", "full"),
    ]


def test_a_full_holder_is_left_when_its_wait_costs_more_than_a_re_prefill():
    # w0 (full at 8) holds the KV, 160 tokens left over its 8 samples: a slot frees in about
    # 2 x 160 / (8 x 9) = 4.4 decode steps. A re-prefill costs 0.02 steps a token on w1, paid
    # by the turn and by the 4 samples running there (stalled by it): 0.1 steps a token.
    assert expected_wait_steps(8, 160, 0) == pytest.approx(4.44, abs=0.01)
    assert expected_wait_steps(8, 160, 2) == pytest.approx(13.33, abs=0.01)
    measured = [
        wk(0, running=8, tokens=160),
        replace(wk(1, running=4), prefill_steps_per_token=0.02),
    ]
    holders = {"s1": "w0"}
    for context, where, repin in ((32, "w1", "full"), (64, None, None)):  # 3.2 vs 6.4 steps
        decision = schedule(_snap(measured, [turn(context=context)], holders), CFG)
        got = [(a.worker_id, a.repin) for a in decision.assignments]
        assert got == ([(where, repin)] if where else []), context
    # w1's free slots owed to turns queued for it (its KV's sessions): none to spare, it waits.
    owed = [turn(context=32)] + [turn(f"w1.{i}") for i in range(4)]
    at_w1 = holders | {f"w1.{i}": "w1" for i in range(4)}
    decision = schedule(_snap(measured, owed, at_w1), CFG)
    assert [(a.request_id, a.worker_id) for a in decision.assignments] == [
        (f"session:w1.{i}:1:0", "w1") for i in range(4)
    ]
    # Unmeasured (no prefill slope reported yet): it waits, whatever the context.
    unmeasured = [wk(0, running=8, tokens=160), wk(1, running=4)]
    assert schedule(_snap(unmeasured, [turn(context=16)], holders), CFG).assignments == ()


def test_turns_of_two_sessions_each_go_to_their_holder():
    decision = schedule(_snap([wk(0), wk(1)], [turn("a"), turn("b")], {"a": "w1", "b": "w1"}), CFG)
    assert placed(decision) == {"w1": 2}


def first_turn(key: str, prompt_key: str = "#p", at: float = 0.0) -> PendingWork:
    return PendingWork(
        f"session:{key}:0:0", 0, "j", 1, 100, at, cache_key=key, share_key=prompt_key
    )


def test_first_turns_of_one_prompt_follow_one_another_within_the_slack():
    """Placed in one tick: the first goes to the least loaded worker (w1), the others after
    it while it runs at most `sticky_slack_samples` (4) more than w0 (1): six, then w0."""
    group = [first_turn(f"g.{i}", at=float(i)) for i in range(7)]
    decision = schedule(_snap([wk(0, running=1, tokens=100), wk(1)], group, {}), CFG)
    by_turn = [a.worker_id for a in sorted(decision.assignments, key=lambda a: a.request_id)]
    assert by_turn == ["w1"] * 6 + ["w0"]
    assert all(a.repin == "" for a in decision.assignments)  # no session's KV was left
    # Another prompt's first turn is no pull.
    other = schedule(_snap([wk(0), wk(1, running=1)], [first_turn("h.0", "#q")], {}), CFG)
    assert placed(other) == {"w0": 1}


def test_a_later_first_turn_follows_where_its_prompt_went_before():
    decision = schedule(_snap([wk(0), wk(1, running=3)], [first_turn("g.5")], {"#p": "w1"}), CFG)
    assert placed(decision) == {"w1": 1}
