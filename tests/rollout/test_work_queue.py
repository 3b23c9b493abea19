"""The work queue's bookkeeping and the scheduler's policy-version rule (pure, no processes)."""

from __future__ import annotations

from tltd.domain import RequestStatus, RolloutRequest, SamplingParams
from tltd.scheduler import (
    DeviceView,
    JobView,
    PendingWork,
    RolloutWorkerView,
    SchedulerConfig,
    Snapshot,
    schedule,
)
from tltd.supervisor.work_queue import WorkQueue


def _req(rid: str = "r", prompts: int = 2, n: int = 3) -> RolloutRequest:
    return RolloutRequest(rid, "job", tuple((1, 2) for _ in range(prompts)), SamplingParams(n=n))


def test_add_is_idempotent_and_skips_finished_samples():
    q = WorkQueue()
    live, created = q.add(_req(), 4, {(0, 1)}, now=1.0)
    assert created and live.pending == {0: [0, 2], 1: [0, 1, 2]} and live.finished == {(0, 1)}
    again, created = q.add(_req(), 9, set(), now=2.0)
    assert again is live and not created and again.policy_version == 4
    work = q.pending_work()
    assert [(w.prompt_index, w.samples, w.policy_version) for w in work] == [(0, 2, 4), (1, 3, 4)]


def test_pending_work_carries_the_predicted_length_from_the_prompts_history():
    q = WorkQueue()
    live, _ = q.add(_req(prompts=3), 0, set(), now=1.0)
    live.history[0] = ((("old", 0, 0), (5,) * 40), (("old", 0, 1), (5,) * 60))
    live.history[1] = ((("old", 1, 0), (5,) * 9000),)  # longer than max_new_tokens (256)
    work = {w.prompt_index: w.predicted_tokens for w in q.pending_work()}
    # prompt 2 has no answers of its own: the mean over the request's other prompts' answers
    assert work == {0: 50, 1: 256, 2: 256}
    live.history.clear()
    assert {w.predicted_tokens for w in q.pending_work()} == {None}


def test_take_finish_and_done():
    q = WorkQueue()
    live, _ = q.add(_req(prompts=1, n=3), 0, set(), 0.0)
    assert q.take("r", 0, 2, "w0") == [0, 1] and q.take("r", 0, 5, "w1") == [2]
    assert q.inflight("w0") == 2 and q.inflight("w1") == 1 and not live.pending
    assert q.finish("r", (0, 0)) is live
    assert q.finish("r", (0, 0)) is None  # a duplicate
    q.finish("r", (0, 1), failed_error="boom")
    assert not live.done and live.failed == 1 and live.first_error == "boom"
    q.finish("r", (0, 2))
    assert live.done and q.inflight("w0") == q.inflight("w1") == 0


def test_lost_worker_requeues_until_attempts_run_out():
    q = WorkQueue()
    live, _ = q.add(_req(prompts=1, n=2), 0, set(), 0.0)
    q.take("r", 0, 2, "w0")
    assert q.lose_worker("w0", max_attempts=2) == []
    assert live.pending == {0: [0, 1]} and q.inflight("w0") == 0
    q.take("r", 0, 1, "w1")
    give_up = q.lose_worker("w1", max_attempts=2)  # sample 0's second loss
    assert [(lv.request_id, key) for lv, key in give_up] == [("r", (0, 0))]
    assert live.pending == {0: [1]}


def test_close_stops_handing_out_and_returns_pending():
    q = WorkQueue()
    live, _ = q.add(_req(prompts=2, n=2), 0, set(), 0.0)
    q.take("r", 0, 2, "w0")
    assert q.close("r", RequestStatus.CANCELLED, "bye") == [(1, 0), (1, 1)]
    assert q.pending_work() == [] and q.take("r", 1, 2, "w0") == []
    # A closing request's running samples are not retried when their worker dies.
    assert len(q.lose_worker("w0", max_attempts=5)) == 2
    for key in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        q.finish("r", key)
    assert live.done and live.outcome is RequestStatus.CANCELLED


def _snap(workers, pending):
    return Snapshot(
        now=10.0,
        devices=(DeviceView("cpu:0", True), DeviceView("cpu:1", True)),
        workers=tuple(workers),
        training=(),
        pending=tuple(pending),
        jobs=(JobView("j"),),
    )


def test_scheduler_places_work_only_on_workers_with_its_policy_version():
    old = RolloutWorkerView("w0", "cpu:0", "j", True, policy_version=0)
    new = RolloutWorkerView("w1", "cpu:1", "j", True, policy_version=1)
    cfg = SchedulerConfig(max_samples_per_worker=8)
    cases = [
        ("v0 work -> the v0 worker", [PendingWork("a", 0, "j", 4, 10, 0.0, 0)], {"w0": 4}),
        ("v1 work -> the v1 worker", [PendingWork("b", 0, "j", 4, 10, 0.0, 1)], {"w1": 4}),
        ("any version spreads", [PendingWork("c", 0, "j", 4, 10, 0.0, None)], {"w0": 2, "w1": 2}),
        ("no worker has v2: waits", [PendingWork("d", 0, "j", 4, 10, 0.0, 2)], {}),
    ]
    for name, pending, expected in cases:
        decision = schedule(_snap([old, new], pending), cfg)
        placed: dict[str, int] = {}
        for a in decision.assignments:
            placed[a.worker_id] = placed.get(a.worker_id, 0) + a.samples
        assert placed == expected, name


def test_a_session_turn_carries_its_key_and_its_worker_is_remembered():
    q = WorkQueue()
    turn = RolloutRequest("session:ep:7:0:3:0", "job", ((1, 2),), SamplingParams(n=1))
    other = RolloutRequest("r", "job", ((1, 2),), SamplingParams(n=1))
    q.add(turn, 0, set(), now=1.0)
    q.add(other, 0, set(), now=1.0)
    keys = {w.request_id: w.cache_key for w in q.pending_work()}
    assert keys == {"session:ep:7:0:3:0": "ep:7:0", "r": ""}  # a session id may hold ':'
    q.take(other.request_id, 0, 1, "w0")
    assert q.turns_handed_out == 0  # the round robin counts session turns only
    q.take(turn.request_id, 0, 1, "w1")
    assert q.turns_handed_out == 1
    assert q.get(turn.request_id).work(1, 0, [0]).cache_key == "ep:7:0"
    q.finish(turn.request_id, (0, 0))
    assert dict(q.holders) == {"ep:7:0": "w1"}
    q.lose_worker("w1", max_attempts=3)
    assert not q.holders  # the KV it held is gone with it


def test_pins_count_open_sessions_per_worker_and_remember_a_lost_one():
    q = WorkQueue()
    for sid, wid in (("a", "w0"), ("b", "w0"), ("c", "w1")):
        rid = f"session:{sid}:1:0"
        q.add(RolloutRequest(rid, "job", ((1, 2),), SamplingParams(n=1)), 0, set(), now=1.0)
        q.take(rid, 0, 1, wid)
        q.finish(rid, (0, 0), reused_tokens=5 if sid == "a" else 0)
    pins = q.pins
    assert (pins.pinned_on("w0"), pins.pinned_on("w1")) == (2, 1)
    a = pins.get("a")
    assert (a.worker_id, a.turns, a.hits, a.reused_tokens) == ("w0", 1, 1, 5)
    pins.release("b")  # closed
    assert pins.pinned_on("w0") == 1 and pins.holder("b") is None
    q.lose_worker("w0", max_attempts=3)
    assert pins.pinned_on("w0") == 0
    assert pins.holder("a") == ""  # its next turn is a re-pin: "gone"
    assert pins.get("a").hits == 1  # its counters stay
    # A closed session's turn that ends after the close (cancelled) pins nothing.
    q.add(RolloutRequest("session:b:2:0", "job", ((1, 2),), SamplingParams(n=1)), 0, set(), 1.0)
    q.take("session:b:2:0", 0, 1, "w1")
    q.finish("session:b:2:0", (0, 0))
    assert pins.pinned_on("w1") == 1 and pins.holder("b") is None


def test_a_first_turn_carries_its_prompt_key_and_its_worker_is_noted_when_handed_out():
    q = WorkQueue()
    firsts = [RolloutRequest(f"session:g.{i}:0:0", "job", ((1, 2, 3),), SamplingParams(n=1))
              for i in range(2)]  # fmt: skip
    later = RolloutRequest("session:g.0:1:0", "job", ((1, 2, 3),), SamplingParams(n=1))
    other_job = RolloutRequest("session:h.0:0:0", "job2", ((1, 2, 3),), SamplingParams(n=1))
    for r in (*firsts, later, other_job):
        q.add(r, 0, set(), now=1.0)
    keys = {w.request_id: w.share_key for w in q.pending_work()}
    assert keys["session:g.0:0:0"] == keys["session:g.1:0:0"] != ""
    assert keys["session:g.0:1:0"] == ""  # only a first turn shares its prompt
    assert keys["session:h.0:0:0"] not in ("", keys["session:g.0:0:0"])  # per job
    q.take("session:g.0:0:0", 0, 1, "w1")
    assert q.pins.holder(keys["session:g.1:0:0"]) == "w1"
    assert q.get("session:g.0:0:0").work(1, 0, [0]).share_key == keys["session:g.0:0:0"]
