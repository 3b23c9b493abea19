"""The other rules for where a session's turn runs (`session_placement`): "hash" sends a
session's turns to one worker by its key whatever the load (a full one's turns wait for it),
"round_robin" hands turns to the workers in rotation whatever holds their KV (the pure policy;
"sticky" is test_session_affinity.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.scheduler.test_scheduler import CFG, UNMEASURED, dev, placed, wk
from tltd.scheduler import JobView, PendingWork, Snapshot, hashed, rotated, schedule, session_worker

HASH = replace(CFG, session_placement="hash")
ROUND_ROBIN = replace(CFG, session_placement="round_robin")


def turn(key: str, at: float = 0.0) -> PendingWork:
    return PendingWork(f"session:{key}:1:0", 0, "j", 1, 100, at, cache_key=key)


def _snap(workers, pending, holders=None, handed_out: int = 0) -> Snapshot:
    devices = tuple(dev(i) for i in range(4))
    return Snapshot(
        100.0, devices, tuple(workers), (), tuple(pending), (JobView("j"),), holders or {},
        handed_out,
    )  # fmt: skip


def test_hash_sends_every_turn_of_a_session_to_one_worker_whatever_the_load():
    keys = [f"s{i}" for i in range(40)]
    home = {k: hashed(k, ["w0", "w1"]) for k in keys}
    assert set(home.values()) == {"w0", "w1"}  # keys spread over both workers
    loads = ([wk(0), wk(1)], [wk(0, running=7, tokens=9000), wk(1)], [wk(0), wk(1, running=7)])
    for k in keys[:8]:
        for workers in loads:
            # The holder (another worker) and any load difference are no pull.
            other = "w1" if home[k] == "w0" else "w0"
            decision = schedule(_snap(workers, [turn(k)], {k: other}), HASH)
            assert placed(decision) == {home[k]: 1}


def test_hash_moves_only_the_keys_of_a_worker_that_cannot_take_them():
    keys = [f"s{i}" for i in range(60)]
    three = {k: hashed(k, ["w0", "w1", "w2"]) for k in keys}
    two = {k: hashed(k, ["w0", "w2"]) for k in keys}
    assert {k for k in keys if three[k] != two[k]} == {k for k in keys if three[k] == "w1"}
    # A worker that is gone: its keys go to the next one by score.
    k = next(k for k in keys if three[k] == "w1")
    decision = schedule(_snap([wk(0), wk(2)], [turn(k)]), HASH)
    assert placed(decision) == {two[k]: 1}


def test_a_hashed_turn_waits_for_its_full_worker_without_holding_up_the_others():
    keys = [f"s{i}" for i in range(40)]
    on_w1 = [k for k in keys if hashed(k, ["w0", "w1"]) == "w1"]
    on_w0 = [k for k in keys if hashed(k, ["w0", "w1"]) == "w0"]
    full = replace(HASH, max_samples_per_worker=2)
    # w1 is full: its session's turn waits (w0 idles) and the job's later turn, hashed to
    # w0, is placed all the same.
    pending = [turn(on_w1[0], at=0.0), turn(on_w0[0], at=1.0)]
    decision = schedule(_snap([wk(0), wk(1, running=2)], pending), full)
    assert {a.request_id: a.worker_id for a in decision.assignments} == {
        f"session:{on_w0[0]}:1:0": "w0"
    }


def test_hash_does_not_depend_on_the_order_of_the_candidates():
    assert all(hashed(f"s{i}", ["w0", "w1"]) == hashed(f"s{i}", ["w1", "w0"]) for i in range(20))


def test_round_robin_rotates_turns_over_the_workers_by_id():
    assert [rotated(t, ["w1", "w0"]) for t in range(5)] == ["w0", "w1", "w0", "w1", "w0"]
    # One tick's turns continue the rotation from the turns handed out before it; the holder
    # and the load play no part.
    pending = [turn(f"s{i}", at=float(i)) for i in range(3)]
    holders = {f"s{i}": "w0" for i in range(3)}
    workers = [wk(0), wk(1, running=5, tokens=5000)]
    decision = schedule(_snap(workers, pending, holders, handed_out=7), ROUND_ROBIN)
    by_turn = {a.request_id: a.worker_id for a in decision.assignments}
    assert by_turn == {"session:s0:1:0": "w1", "session:s1:1:0": "w0", "session:s2:1:0": "w1"}


@pytest.mark.parametrize("cfg", [HASH, ROUND_ROBIN])
def test_work_that_is_no_session_turn_is_placed_by_load_under_every_rule(cfg):
    other = PendingWork("r", 0, "j", 1, 100, 0.0)
    decision = schedule(_snap([wk(0, running=3, tokens=300), wk(1)], [other]), cfg)
    assert placed(decision) == {"w1": 1}
    assert (
        session_worker(
            "", "w0", 0, (["w0", "w1"],) * 2, ({"w0": (0, 0), "w1": (0, 0)}, {}, UNMEASURED), cfg
        )
        is None
    )


def test_sticky_stays_the_default_rule():
    load = {"w0": (5, 500), "w1": (0, 0)}
    assert CFG.session_placement == "sticky"
    assert (
        session_worker("s", "w0", 0, (["w0", "w1"],) * 2, (load, {}, UNMEASURED), CFG) is None
    )  # over the slack
    assert (
        session_worker(
            "s", "w0", 0, (["w0", "w1"],) * 2, ({"w0": (4, 0), "w1": (0, 0)}, {}, UNMEASURED), CFG
        )
        == "w0"
    )
