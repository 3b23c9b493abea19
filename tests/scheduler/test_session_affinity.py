"""A session's turn goes to the worker holding its KV unless that one is gone, cannot take it
or is much busier than the least loaded one (the pure policy, table-driven)."""

from __future__ import annotations

import pytest

from tests.scheduler.test_scheduler import CFG, dev, placed, wk
from tltd.scheduler import JobView, PendingWork, Snapshot, schedule, sticky


def turn(key: str = "s1", job: str = "j") -> PendingWork:
    return PendingWork(f"session:{key}:1:0", 0, job, 1, 100, 0.0, cache_key=key)


def _snap(workers, pending, holders) -> Snapshot:
    devices = tuple(dev(i) for i in range(4))
    return Snapshot(100.0, devices, tuple(workers), (), tuple(pending), (JobView("j"),), holders)


@pytest.mark.parametrize(
    "name, workers, holders, expected",
    [
        ("a first turn: the least loaded", [wk(0, running=2, tokens=200), wk(1)], {}, "w1"),
        (
            "a later turn: its holder, though busier",
            [wk(0, running=2, tokens=900), wk(1)],
            {"s1": "w0"},
            "w0",
        ),
        (
            "a holder much busier than the least loaded: another worker",
            [wk(0, running=5, tokens=500), wk(1)],
            {"s1": "w0"},
            "w1",
        ),
        ("a holder that is gone: the least loaded", [wk(1, running=1), wk(2)], {"s1": "w0"}, "w2"),
        ("a full holder: another worker", [wk(0, running=8), wk(1, running=7)], {"s1": "w0"}, "w1"),
        (
            "a holder now serving another job: another worker",
            [wk(0, job="other"), wk(1, running=3)],
            {"s1": "w0"},
            "w1",
        ),
        ("another session's holder is no pull", [wk(0), wk(1, running=2)], {"s2": "w1"}, "w0"),
    ],
)
def test_a_turn_goes_to_its_kv_unless_that_costs_more(name, workers, holders, expected):
    decision = schedule(_snap(workers, [turn()], holders), CFG)
    assert placed(decision) == {expected: 1}, name


def test_the_slack_is_in_samples_and_inclusive():
    load = {"w0": (4, 0), "w1": (0, 0)}
    assert sticky("w0", ["w0", "w1"], load, 4) == "w0"
    assert sticky("w0", ["w0", "w1"], load, 3) is None
    assert sticky(None, ["w0", "w1"], load, 4) is None
    assert sticky("w0", ["w1"], load, 4) is None


def test_turns_of_two_sessions_each_go_to_their_holder():
    decision = schedule(_snap([wk(0), wk(1)], [turn("a"), turn("b")], {"a": "w1", "b": "w1"}), CFG)
    assert placed(decision) == {"w1": 2}
