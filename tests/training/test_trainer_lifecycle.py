"""A drafter trainer's lifecycle off the supervisor's tick: a new policy version of the same
architecture goes into the running trainer, `start` returns while an old trainer it replaces
is still stopping, a launch during `close` spawns nothing and always gives the device back, and
a hung trainer is killed by the heartbeat reaper. Real trainer processes, a real store."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

from tests.rollout.support import pid_alive
from tests.training.conftest import training_settings, until
from tltd.contract import drafter_messages as proto
from tltd.devices import cpu_devices
from tltd.domain import DeviceState, FinishReason, Job, Sample, SpeculativeConfig, WorkerState
from tltd.drafter_training import DrafterTraining
from tltd.drafter_training.process import TrainerProcess
from tltd.drafter_training.runs import TrainerPhase, TrainerRun
from tltd.metrics import METRICS
from tltd.periodic import build_scheduler, reap_trainers
from tltd.stall import StallWatch


def _setup(store, policy_path) -> None:
    store.jobs.create(Job("job", str(policy_path)))
    store.devices.upsert(cpu_devices(1))


def _sample(i: int) -> Sample:
    tokens = tuple(5 + (i + j) % 40 for j in range(12))
    return Sample("r", i, 0, tokens, (0.0,) * len(tokens), FinishReason.STOP)


async def _round_one_then(training: DrafterTraining, store, next_policy) -> tuple[TrainerRun, int]:
    """Round 1 on policy version 0 (no samples: it ends at once and the trainer idles), then
    `next_policy` recorded as version 1; returns the run and its trainer's pid."""
    await training.start("cpu:0", "job")
    run = training._runs["job"]
    await until(lambda: run.phase is TrainerPhase.IDLE, "round 1 over")
    store.policies.add("job", "checkpoint", str(next_policy))
    return run, run.worker.proc.pid


def test_start_returns_while_the_trainer_it_replaces_is_still_stopping(
    sqlite_store, tmp_path, ckpt, ckpt_other_config
):
    store = sqlite_store
    _setup(store, ckpt)
    training = DrafterTraining(store, training_settings(tmp_path))

    async def main() -> None:
        old, pid = await _round_one_then(training, store, ckpt_other_config)
        os.kill(pid, signal.SIGSTOP)  # hung: it cannot answer the stop of the restart
        try:
            # What the supervisor's tick awaits; the bound only turns a hang into a failure.
            await asyncio.wait_for(training.start("cpu:0", "job"), 30)
            new = training._runs["job"]
            # Returned with the old trainer still there and the new one not yet spawned;
            # the device is recorded training and held by the new run meanwhile.
            assert pid_alive(pid) and new is not old and new.phase is TrainerPhase.STARTING
            assert new.worker is None and new.spawning is None
            assert store.devices.get("cpu:0").state is DeviceState.TRAINING
            assert [(v.device_id, v.job_id) for v in training.views()] == [("cpu:0", "job")]
        finally:
            os.kill(pid, signal.SIGCONT)  # now it stops, writing its checkpoint
        await until(lambda: new.worker is not None, "the new trainer up")
        assert not pid_alive(pid) and new.policy_version == 1
        await training.close()

    asyncio.run(main())
    reasons = [e.reason for e in store.history.list_events("worker", "drafter-job")]
    restart = next(i for i, r in enumerate(reasons) if "restarting for policy version 1" in r)
    assert any("resumed from" in r for r in reasons[restart:]), reasons


def test_a_new_policy_of_the_same_architecture_goes_into_the_running_trainer(
    sqlite_store, tmp_path, ckpt, ckpt2
):
    store = sqlite_store
    _setup(store, ckpt)
    training = DrafterTraining(store, training_settings(tmp_path))

    async def main() -> None:
        run, pid = await _round_one_then(training, store, ckpt2)
        await training.start("cpu:0", "job")
        # The same process trains round 2 on the new target: no stop, no spawn.
        assert training._runs["job"] is run and run.policy_version == 1
        assert run.worker.proc.pid == pid and run.phase is not TrainerPhase.STARTING
        await until(lambda: run.phase is TrainerPhase.IDLE, "round 2 over")
        assert run.worker.proc.pid == pid
        await training.close()

    asyncio.run(main())
    reasons = [e.reason for e in store.history.list_events("worker", "drafter-job")]
    assert any("; policy version 1 loaded in place (steps" in r for r in reasons), reasons
    assert not any("restarting" in r or "spawning" in r for r in reasons[1:]), reasons


def test_a_round_cut_short_is_reported_resumable_and_an_ended_one_is_not(
    sqlite_store, tmp_path, ckpt
):
    store = sqlite_store
    _setup(store, ckpt)
    training = DrafterTraining(store, training_settings(tmp_path, training_steps_per_round=10_000))

    async def main() -> None:
        for i in range(8):
            training.on_sample("job", (1, 2, 3), _sample(i))
        await training.start("cpu:0", "job")
        run = training._runs["job"]
        await until(lambda: run.phase is TrainerPhase.TRAINING and run.step >= 1, "a step taken")
        await training.preempt("cpu:0", "rollout work waiting")
        await until(lambda: run.phase is TrainerPhase.IDLE, "device free")
        assert training.job_view("job").cut_short is True  # the scheduler resumes it at once
        run.round.target = run.step + 1  # let it end: one more step
        await training.start("cpu:0", "job")
        await until(lambda: run.phase is TrainerPhase.IDLE, "round over")
        assert training.job_view("job").cut_short is False  # a new round waits its rule
        # What a round in a rollout's tail trains on: 8 finished, every third held out.
        assert training.job_view("job").buffered == 6
        await training.close()

    asyncio.run(main())


def test_a_trainer_that_found_nothing_to_train_on_waits_for_a_new_sample(sqlite_store, tmp_path):
    """In a rollout's tail a round follows the last while the trainer holds samples; one whose
    round ended with no data (Idle "no_data") holds none worth another round until a sample
    arrives, or rounds would start and end at every tick."""
    training = DrafterTraining(sqlite_store, training_settings(tmp_path))
    for i in range(4):
        training.on_sample("job", (1, 2, 3), _sample(i))
    assert training.job_view("job").buffered == 3  # every third held out
    run = training._runs["job"] = TrainerRun("job", "cpu:0", "cpu", 0, phase=TrainerPhase.TRAINING)
    asyncio.run(training._handle((run, proto.Idle("no_data", 0))))
    assert run.phase is TrainerPhase.RELEASING and training.job_view("job").buffered == 0
    training.on_sample("job", (1, 2, 3), _sample(4))
    assert training.job_view("job").buffered == 4


def test_no_trainer_is_spawned_once_close_began(sqlite_store, tmp_path, monkeypatch):
    store = sqlite_store
    _setup(store, tmp_path / "policy")
    spawned = []

    def spawn(self):
        spawned.append(self)
        raise RuntimeError("spawned after close")

    monkeypatch.setattr(TrainerProcess, "spawn", spawn)
    training = DrafterTraining(store, training_settings(tmp_path))

    async def main() -> None:
        await training.start("cpu:0", "job")  # its launch has not run yet
        await training.close()

    asyncio.run(main())
    assert not spawned
    row = store.workers.get("drafter-job")
    assert row.state is WorkerState.STOPPED and "shutting down" in row.state_reason
    assert store.devices.get("cpu:0").state is DeviceState.IDLE


def test_a_launch_failing_while_closing_gives_the_device_back(sqlite_store, tmp_path, monkeypatch):
    store = sqlite_store
    _setup(store, tmp_path / "policy")
    loading, closing = threading.Event(), threading.Event()
    procs = []

    def wait_for(self, kind, timeout=60.0):  # the target's load fails once `close` began
        procs.append(self.proc)
        loading.set()
        closing.wait(30)
        raise RuntimeError("out of memory loading the target")

    monkeypatch.setattr(TrainerProcess, "wait_for", wait_for)
    training = DrafterTraining(store, training_settings(tmp_path))

    async def main() -> None:
        await training.start("cpu:0", "job")
        assert store.devices.get("cpu:0").state is DeviceState.TRAINING
        await asyncio.to_thread(loading.wait, 30)
        closed = training.close()
        closing.set()
        await closed

    asyncio.run(main())
    row = store.workers.get("drafter-job")
    assert row.state is WorkerState.FAILED and "out of memory" in row.state_reason
    assert store.devices.get("cpu:0").state is DeviceState.IDLE
    assert procs and not procs[0].is_alive()


def test_a_hung_trainer_is_killed_by_the_heartbeat_reaper(sqlite_store, tmp_path, ckpt):
    store = sqlite_store
    _setup(store, ckpt)
    timeout = 3.0
    settings = training_settings(
        tmp_path,
        training_heartbeat_timeout_seconds=timeout,
        training_steps_per_round=100_000,
        training_held_out_every=1000,
    )
    training = DrafterTraining(store, settings)
    jobs = {j.id: j for j in build_scheduler(settings, store, None, training=training).get_jobs()}
    assert jobs["trainer-reaper"].func is reap_trainers  # declared with the periodic work

    async def main() -> None:
        await training.start("cpu:0", "job")
        run = training._runs["job"]
        await until(lambda: run.phase is TrainerPhase.IDLE, "round 1 over (no samples yet)")
        # Idle, its main thread waits for a command: the heartbeat thread keeps it alive.
        await asyncio.sleep(timeout + 1.0)
        watch = StallWatch(0.1, "trainers")
        assert await reap_trainers(training, watch) == []
        assert store.workers.get("drafter-job").last_heartbeat is not None  # tltctl shows it
        for i in range(8):
            training.on_sample("job", (1, 2, 3), _sample(i))
        await training.start("cpu:0", "job")
        await until(lambda: run.step >= 1, "training")
        assert store.devices.get("cpu:0").state is DeviceState.TRAINING
        pid = run.worker.proc.pid
        os.kill(pid, signal.SIGSTOP)  # hung, not dead: its pipe stays open
        # The daemon stalled too (its loop blocked) past the timeout: not the trainer's fault.
        time.sleep(timeout + 2.0)
        assert await reap_trainers(training, watch) == [] and pid_alive(pid)
        killed: list[str] = []
        deadline = time.monotonic() + 60
        while not killed and time.monotonic() < deadline:
            killed = await reap_trainers(training, watch)
            await asyncio.sleep(0.1)
        assert killed == ["drafter-job"] and not pid_alive(pid)
        await training.close()

    asyncio.run(main())
    row = store.workers.get("drafter-job")
    assert row.state is WorkerState.FAILED and "no heartbeat for 3s" in row.state_reason
    assert store.devices.get("cpu:0").state is DeviceState.IDLE


def test_a_launch_preempted_while_it_stops_the_old_trainer_spawns_nothing(
    sqlite_store, tmp_path, ckpt, ckpt_other_config, monkeypatch
):
    store = sqlite_store
    _setup(store, ckpt)
    training = DrafterTraining(store, training_settings(tmp_path))
    spawned = []

    async def main() -> None:
        old, pid = await _round_one_then(training, store, ckpt_other_config)
        os.kill(pid, signal.SIGSTOP)  # the restart's stop waits for it
        try:
            await training.start("cpu:0", "job")
            new = training._runs["job"]
            real_spawn = TrainerProcess.spawn
            monkeypatch.setattr(
                TrainerProcess, "spawn", lambda self: (spawned.append(self), real_spawn(self))
            )
            # Rollout work arrives while the launch is still stopping the old trainer.
            await training.preempt("cpu:0", "rollout work waiting")
            assert new.phase is TrainerPhase.PREEMPTING
        finally:
            os.kill(pid, signal.SIGCONT)
        await until(lambda: new.phase is TrainerPhase.STOPPED, "the launch gave up")
        assert not pid_alive(pid)
        await training.close()

    asyncio.run(main())
    # No trainer loaded its target onto a device rollout has taken back.
    assert spawned == []
    assert store.devices.get("cpu:0").state is DeviceState.IDLE
    row = store.workers.get("drafter-job")
    assert "preempted: rollout work waiting" in row.state_reason
    assert [p.reason for p in training.preemptions] == ["rollout work waiting"]


def test_a_preempted_round_resumes_towards_its_own_end(sqlite_store, tmp_path, ckpt):
    # Rounds spread over short idle windows (a rollout's tails, training_window "rollout")
    # must still end and publish: a preempted round keeps its end step.
    store = sqlite_store
    _setup(store, ckpt)
    settings = training_settings(
        tmp_path, training_steps_per_round=100_000, training_held_out_every=1000
    )
    training = DrafterTraining(store, settings)

    async def main() -> None:
        for i in range(8):
            training.on_sample("job", (1, 2, 3), _sample(i))
        await training.start("cpu:0", "job")
        run = training._runs["job"]
        await until(lambda: run.step >= 2, "training")
        target = run.round.target
        assert target == 100_000
        await training.preempt("cpu:0", "rollout work is waiting")
        await until(lambda: run.phase is TrainerPhase.IDLE, "preempted")
        stepped = run.step
        assert 2 <= stepped < target
        await training.start("cpu:0", "job")
        await until(lambda: run.step > stepped, "training again")
        assert run.round.target == target  # not stepped + 100_000
        assert f"(steps {stepped} -> {target})" in store.workers.get("drafter-job").state_reason
        await training.close()

    asyncio.run(main())


def test_a_warm_started_trainer_waits_loaded_and_its_first_round_trains_at_once(
    sqlite_store, tmp_path, ckpt
):
    """`training_warm_start`: a job's first finished sample spawns its trainer, which loads
    holding no device; the first round then takes that process, with no start-up counted as
    training. A job without online training gets none."""
    store = sqlite_store
    _setup(store, ckpt)
    store.jobs.create(
        Job("frozen", str(ckpt), speculative=SpeculativeConfig(online_training=False))
    )
    training = DrafterTraining(store, training_settings(tmp_path, training_warm_start=True))

    async def main() -> None:
        for i in range(4):
            training.on_sample("job", (1, 2, 3), _sample(i))
            training.on_sample("frozen", (1, 2, 3), _sample(i))
        await until(lambda: "job" in training._runs, "a warm start")
        run = training._runs["job"]
        await until(lambda: run.phase is TrainerPhase.IDLE, "the warm trainer up", timeout=120)
        # Up, holding nothing: the device is idle, the scheduler sees no training and no
        # round to resume.
        assert run.device_id == "" and store.devices.get("cpu:0").state is DeviceState.IDLE
        assert training.views() == () and training.job_view("job").cut_short is False
        assert "frozen" not in training._runs
        pid, loading = run.worker.proc.pid, METRICS.trainer_loading_seconds().get("cpu:0", 0.0)

        await training.start("cpu:0", "job")
        # The same process trains at once: no spawn, no start-up on the device.
        assert training._runs["job"] is run and run.phase is TrainerPhase.TRAINING
        assert run.worker.proc.pid == pid and run.device_id == "cpu:0"
        assert store.devices.get("cpu:0").state is DeviceState.TRAINING
        assert METRICS.trainer_loading_seconds().get("cpu:0", 0.0) == loading
        await until(lambda: run.step >= 1, "a step taken on the warm trainer")
        await training.close()

    asyncio.run(main())
    reasons = [e.reason for e in store.history.list_events("worker", "drafter-job")]
    assert sum("spawning" in r for r in reasons) == 1, reasons
    assert any("warm start" in r for r in reasons) and any(r.endswith("; idle") for r in reasons)
    assert store.devices.get("cpu:0").state is DeviceState.IDLE
