"""The rollout workers' lives: start one per usable device, hear what they say, find the dead.

A worker's phase (`worker_process.Phase`) changes only through `WorkerHandle.to`; this module
decides when. Taking a worker out of service (`_take_out_of_service`) is immediate, so the tick
that found it gone assigns it nothing; waiting for its process, recording it and re-queueing
its samples (`_finish_exit`) runs beside the tick, not in it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from tltd import worker_code
from tltd.contract import rollout_messages as msg
from tltd.domain import Backend, Device, DeviceState, Sample, Worker, WorkerKind, WorkerState
from tltd.memory_cgroup import MemoryCgroups
from tltd.metrics import METRICS
from tltd.scheduler import Decision
from tltd.settings import Settings
from tltd.stall import forgiven
from tltd.store.leases import UnitEnd
from tltd.supervisor.live_requests import LiveRequests
from tltd.supervisor.model_planner import ModelPlanner
from tltd.supervisor.worker_process import LoadKind, Phase, WorkerHandle, spawn
from tltd.supervisor.writes import OrderedWrites, upsert_worker

if TYPE_CHECKING:
    from tltd.store import Store

log = logging.getLogger(__name__)

# How long a stopped (or vacated) worker gets to exit before it is killed.
EXIT_SECONDS = 5.0
SWITCH_EXIT_SECONDS = 20.0  # a graceful engine shutdown (SGLang frees its GPU memory)
# A worker goes BUSY and back to READY with every request it runs, its device ROLLOUT and back
# to IDLE: the store (and its event log) gets a worker's flip, and a device's IDLE, once the new
# state has held this long, not twice per request (a device's write also makes the next tick
# read the devices and jobs again). A device's ROLLOUT is written at once.
SETTLE_SECONDS = 0.2
_SETTLING = (WorkerState.BUSY, WorkerState.READY)

# on_finished(handle, sample, stored, end): a sample a worker returned (see
# worker_process.OnMessage).
OnFinished = Callable[[WorkerHandle, Sample, "bool | None", "UnitEnd | None"], None]


def restart_backoff(failures: int) -> float:
    """Seconds before a worker that died `failures` times in a row is started again: 0, then
    0.5 doubling to 30 (the exponent capped: 2.0 ** 1024 overflows in a long crash loop)."""
    return min(30.0, 0.5 * 2 ** min(failures - 1, 16)) if failures > 0 else 0.0


def rollout_device_state(running_samples: int) -> DeviceState:
    """What a device outside training is doing: ROLLOUT while its workers run samples, IDLE
    from the moment they run none. The idle grace (`SchedulerConfig.idle_grace_seconds`)
    decides when training may start on an idle device, not whether the device is idle: a
    device that waits out the grace, or gets work back before it ends, was idle meanwhile."""
    return DeviceState.ROLLOUT if running_samples > 0 else DeviceState.IDLE


class RolloutWorkers:
    """One rollout worker per device: lifecycle, messages, and their recorded states."""

    def __init__(
        self,
        store: Store,
        settings: Settings,
        writes: OrderedWrites,
        requests: LiveRequests,
        models: ModelPlanner,
        *,
        kick: Callable[[], None],
        run_task: Callable[[Coroutine[Any, Any, Any]], None],
        on_finished: OnFinished,
    ) -> None:
        self.store = store
        self.settings = settings
        self.writes = writes
        self.requests = requests
        self.queue = requests.queue
        self.models = models
        self.handles: dict[str, WorkerHandle] = {}
        self.closed = False
        self._kick = kick
        self._run_task = run_task
        self._on_finished = on_finished
        self._device_states: dict[str, DeviceState] = {}  # as written (or to be)
        self._device_now: dict[str, DeviceState] = {}  # as of the last tick
        self._device_settling: dict[str, tuple[asyncio.TimerHandle, str]] = {}
        self._settling: dict[str, asyncio.TimerHandle] = {}
        self._ctx = worker_code.worker_context()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.cgroups: MemoryCgroups | None = None

    def bind(self) -> None:
        """Remember the running loop (the supervisor's `start`): pipe threads post to it.
        With `worker_memory_limit_mb`, make the workers' memory cgroups (ConfigError when
        this machine cannot)."""
        self._loop = asyncio.get_running_loop()
        if self.settings.worker_memory_limit_mb and self.cgroups is None:
            self.cgroups = MemoryCgroups.create(self.settings.worker_memory_limit_mb)

    def on(self, device_id: str) -> list[WorkerHandle]:
        return [s for s in self.handles.values() if s.device.device_id == device_id]

    async def recover(self) -> None:
        """After a crash: the old daemon's workers, and its drafter training, are gone."""
        for w in await asyncio.to_thread(self.store.workers.list):
            if w.state not in (WorkerState.STOPPED, WorkerState.FAILED):
                await self.writes.write(
                    self.store.workers.set_state,
                    w.worker_id,
                    WorkerState.FAILED,
                    "daemon restarted: the previous daemon ended without stopping it",
                )
        # Nothing else rewrites TRAINING.
        for d in await asyncio.to_thread(self.store.devices.list):
            if d.state is DeviceState.TRAINING:
                await self.writes.write(
                    self.store.devices.set_state,
                    d.device_id,
                    DeviceState.IDLE,
                    "daemon restarted: the previous daemon's drafter training is gone",
                )

    # ---- start, vacate, switch ------------------------------------------------------------

    def reconcile(self, devices: list[Device], draining: bool) -> None:
        """One worker per usable device; a device turned foreign is vacated, not fought over."""
        now = time.monotonic()
        for d in devices:
            wid = f"rollout-{d.device_id}"
            handle = self.handles.get(wid)
            usable = d.state is not DeviceState.UNAVAILABLE and not d.foreign and not draining
            if handle is None:
                if not usable:
                    continue
                backend = Backend(self.settings.default_backend)
                handle = self.handles[wid] = WorkerHandle(wid, d, backend)
            handle.device = d
            # Not while the old process is still EXITING: its samples are not re-queued yet,
            # and it may still hold the device.
            if usable and handle.phase in (Phase.NEW, Phase.VACATED):
                self._start(handle)
            elif usable and handle.phase is Phase.DEAD:
                assert handle.dead_at is not None
                if now - handle.dead_at >= restart_backoff(handle.failures):
                    self._start(handle)
            elif not usable and handle.alive and (d.foreign or d.state is DeviceState.UNAVAILABLE):
                why = "device taken by a foreign process" if d.foreign else "device unavailable"
                self.record_state(handle, WorkerState.STOPPING, why)
                handle.send(msg.Shutdown())
                # Out of service now (this tick assigns it nothing); the wait for the process
                # (`EXIT_SECONDS`, then a kill, if it hangs) runs beside the tick, not in it.
                if self._take_out_of_service(handle):
                    self._run_task(
                        self._finish_exit(handle, why, WorkerState.STOPPED, then=Phase.VACATED)
                    )

    def _start(self, handle: WorkerHandle) -> None:
        assert self._loop is not None
        spawn(
            handle, self._ctx, self.settings, self.store, self._loop, self.on_message,
            self._on_exit, self.cgroups,
        )  # fmt: skip
        self.record_state(handle, WorkerState.STARTING, "spawned", pid=handle.proc.pid)
        log.info(
            "rollout worker started", extra={"worker_id": handle.worker_id, "pid": handle.proc.pid}
        )

    async def switch_backend(self, handle: WorkerHandle, backend: Backend) -> None:
        """Stop an empty worker so that a later tick starts it on `backend` (the planner
        switches only workers with nothing running). The wait for the old process runs beside
        the tick, not in it; no new worker starts on the device until the old one is gone."""
        why = f"switching to the {backend} backend"
        log.info("rollout worker switches backend", extra={"worker_id": handle.worker_id})
        handle.backend = backend
        self.record_state(handle, WorkerState.STOPPING, why)
        handle.send(msg.Shutdown())
        if self._take_out_of_service(handle):
            # An SGLang worker frees its GPU before it exits: give it time to, then kill.
            self._run_task(
                self._finish_exit(handle, why, WorkerState.STOPPED, grace=SWITCH_EXIT_SECONDS)
            )

    # ---- health ---------------------------------------------------------------------------

    async def reap(self, stalled: float = 0.0) -> list[str]:
        """Kill workers that stopped answering; returns the ids of those found dead.
        `stalled`: seconds the daemon itself did not run since the last look (not theirs)."""
        now = time.monotonic()
        dead = []
        s = self.settings
        for handle in list(self.handles.values()):
            if not handle.alive:
                continue
            if stalled:
                handle.since = forgiven(handle.since, stalled, now)
                handle.last_heartbeat = forgiven(handle.last_heartbeat, stalled, now)
            if handle.proc.exitcode is not None:
                why = handle.fatal or "process exited"
            elif (
                handle.phase is not Phase.READY
                and now - handle.since > s.worker_start_timeout_seconds
            ):
                why = f"no Ready within {s.worker_start_timeout_seconds:g}s"
            elif (
                handle.phase is Phase.READY
                and now - handle.last_heartbeat > s.worker_heartbeat_timeout_seconds
            ):
                why = f"no heartbeat for {s.worker_heartbeat_timeout_seconds:g}s"
            else:
                continue
            dead.append(handle.worker_id)
            if self._take_out_of_service(handle):
                await self._finish_exit(handle, why, WorkerState.FAILED)
        return dead

    def _on_exit(self, handle: WorkerHandle, gen: int) -> None:
        if gen != handle.generation or not handle.alive:
            return
        if self.closed or handle.state is WorkerState.STOPPING:
            return  # an exit we asked for: stop() / vacating records it
        if self._take_out_of_service(handle):  # no work for it from now, even before the task
            self._run_task(
                self._finish_exit(handle, handle.fatal or "process exited", WorkerState.FAILED)
            )

    def _take_out_of_service(self, handle: WorkerHandle) -> bool:
        """No work, no restart until `_finish_exit` is done; False when it already was."""
        if not handle.alive:
            return False
        handle.to(Phase.EXITING)
        handle.dead_at = time.monotonic()
        if handle.outbox is not None:
            handle.outbox.put(None)
        return True

    async def _finish_exit(
        self,
        handle: WorkerHandle,
        why: str,
        state: WorkerState,
        grace: float = EXIT_SECONDS,
        then: Phase = Phase.DEAD,
    ) -> None:
        """After `_take_out_of_service`: wait `grace` seconds for the process (then kill it),
        record it, re-queue its samples."""
        proc = handle.proc
        try:
            exited = proc is None or not proc.is_alive()  # by itself (not killed here)
            if proc is not None and proc.is_alive() and state is WorkerState.FAILED:
                proc.kill()
            if proc is not None:
                await asyncio.to_thread(proc.join, grace)
                if proc.is_alive():  # hung (e.g. vacated while stuck): never leave it running
                    proc.kill()
                    await asyncio.to_thread(proc.join, 5.0)
                if proc.exitcode is not None and state is WorkerState.FAILED:
                    why = f"{why} (exit code {proc.exitcode})"
            limit = self._oom_kill(handle)
            if limit is not None:
                why = f"killed by the OOM killer: over its memory limit of {limit >> 20} MiB; {why}"
                cause = "oom_kill"
            else:
                cause = "exited" if exited else "killed"
            if state is WorkerState.FAILED:
                METRICS.record_worker_failure(handle.worker_id, cause)
                handle.failures += 1
                if handle.load is not None and handle.load.can_fail:
                    # The load killed the process (no LoadFailed can come): the same failure,
                    # or a fresh process would load it again at once, for ever.
                    ld = handle.load
                    died = f"the worker process died while loading it: {why}"
                    drafter = not ld.policy_weights
                    self._load_failed(handle, msg.LoadFailed(ld.job_id, ld.version, died, drafter))
            handle.load = None
            log.warning(
                "rollout worker gone",
                extra={"worker_id": handle.worker_id, "reason": why, "cause": cause},
            )
            self.record_state(handle, state, why)
            await self.requests.lose_worker(handle.worker_id, why)
        finally:
            # Not after a shutdown began: `stop` records the workers still exiting itself.
            if handle.phase is Phase.EXITING and not self.closed:
                handle.to(then)
            self._kick()  # its device may get a new worker now

    @staticmethod
    def _oom_kill(handle: WorkerHandle) -> int | None:
        """Its process is gone: the memory limit (bytes) it was killed for by the OOM
        killer, or None. Its memory cgroup is removed."""
        group, handle.memory_group = handle.memory_group, None
        if group is None:
            return None
        limit = group.limit() if group.oom_kills() else None
        if not group.remove():
            log.debug("memory cgroup still in use", extra={"cgroup": str(group.path)})
        return limit

    async def stop(self, deadline: float) -> None:
        """Shutdown to every worker; killed when still there at `deadline` (monotonic)."""
        for device_id in list(self._device_settling):
            self._unsettle(device_id, flush=True)
        self.closed = True
        for handle in self.handles.values():
            if handle.alive:
                self.record_state(handle, WorkerState.STOPPING, "daemon shutting down")
                handle.send(msg.Shutdown())
        for handle in self.handles.values():
            if handle.proc is None:
                continue
            left = max(0.0, deadline - time.monotonic())
            await asyncio.to_thread(handle.proc.join, left)
            if handle.proc.is_alive():
                handle.proc.kill()
                await asyncio.to_thread(handle.proc.join, 5.0)
            # An EXITING worker's `_finish_exit` was cancelled with the supervisor's tasks.
            if handle.state is WorkerState.STOPPING or handle.phase is Phase.EXITING:
                self.record_state(handle, WorkerState.STOPPED, "daemon shut down")
            if handle.alive or handle.phase is Phase.EXITING:
                handle.dead_at = handle.dead_at or time.monotonic()
                handle.to(Phase.DEAD)
            if handle.outbox is not None:
                handle.outbox.put(None)
            self._oom_kill(handle)
        if self.cgroups is not None:
            self.cgroups.close()

    def ask_to_drain(self) -> list[WorkerHandle]:
        """Drain to every worker with work: it returns what runs as partial samples."""
        busy = [s for s in self.handles.values() if s.alive and self.queue.inflight(s.worker_id)]
        for handle in busy:
            handle.drained.clear()
            handle.send(msg.Drain(0.0))
        return busy

    async def await_drained(self, busy: list[WorkerHandle], end: Callable[[], float]) -> None:
        """Wait until `end()` (monotonic) for their answers; a worker that did not answer
        loses its samples (they end with no tokens)."""
        # Polled, not one wait: a shutdown may move the end earlier meanwhile.
        while any(not s.drained.is_set() for s in busy) and time.monotonic() < end():
            await asyncio.sleep(0.05)
        for handle in busy:
            if self.queue.inflight(handle.worker_id):
                await self.requests.lose_worker(handle.worker_id, "worker did not drain in time")

    # ---- messages (event loop, posted by the worker's reader thread) ----------------------

    def on_message(
        self,
        handle: WorkerHandle,
        gen: int,
        m: msg.FromWorker,
        stored: bool | None,
        end: UnitEnd | None = None,
    ) -> None:
        if gen != handle.generation:
            return  # from a process that was already replaced
        handle.last_heartbeat = time.monotonic()
        match m:
            case msg.Finished(sample=sample):
                self._on_finished(handle, sample, stored, end)
            case msg.Heartbeat():
                previous = handle.heartbeat.stats if handle.heartbeat is not None else None
                METRICS.observe_engine_summary(handle.device.device_id, previous, m.stats)
                handle.heartbeat = m
                for seq in [q for q in handle.unacked if q <= m.acked_seq]:
                    del handle.unacked[seq]
            case msg.Ready():
                self._on_ready(handle, m)
            case msg.LoadFailed():
                self._load_failed(handle, m)
            case msg.Drained():
                handle.drained.set()
            case msg.WorkerError(message=text, fatal=fatal):
                if text.startswith("policy broadcast"):  # it failed there: nothing to load
                    handle.broadcast_path = ""
                log.error(
                    "rollout worker error",
                    extra={"worker_id": handle.worker_id, "fatal": fatal, "error": text},
                )
                if fatal:
                    handle.fatal = text.strip().splitlines()[-1] if text.strip() else "fatal error"
                    handle.reason = handle.fatal

    def _on_ready(self, handle: WorkerHandle, m: msg.Ready) -> None:
        """Every load ends with a Ready saying what the worker holds now."""
        if not handle.alive:
            return  # out of service already: it is being stopped
        first = handle.phase is Phase.STARTING
        handle.to(Phase.READY)
        load = handle.load
        if (
            load is None
            or load.kind is LoadKind.MODEL
            or (load.kind is LoadKind.POLICY and m.policy_version == load.version)
        ):
            # A joined broadcast ends with the load of a version (or of a model); an engine
            # still receiving answers a LoadPolicy with its old version: offered again.
            handle.broadcast_path = ""
        handle.load = None
        if m.job_id:
            # Only a loaded model ends a crash loop: every fresh process says Ready before its
            # first load, also one whose load is about to kill it again.
            handle.failures = 0
        handle.job_id, handle.policy_version = m.job_id, m.policy_version
        handle.policy_source = m.policy_source
        handle.drafter_version = m.drafter_version
        self.models.loaded(m, handle)  # a version that loads is no longer held back
        handle.reason = (
            f"job {m.job_id} policy v{m.policy_version} drafter v{m.drafter_version}"
            if m.job_id
            else "no model loaded"
        )
        if self.queue.inflight(handle.worker_id) == 0:
            handle.idle_since = time.monotonic()
        self.record_state(
            handle, WorkerState.READY if first else handle.state, handle.reason, pid=m.pid
        )
        self._kick()

    def _load_failed(self, handle: WorkerHandle, m: msg.LoadFailed) -> None:
        """Hold the version back; a policy's live requests fail with the reason."""
        reason = self.models.load_failed(m, handle, self.handles)
        if reason is not None:
            self.requests.fail_version(m.job_id, m.policy_version, reason)

    # ---- recording ------------------------------------------------------------------------

    def record(self, decision: Decision, devices: list[Device]) -> None:
        """Write what changed in device and worker states after a tick's decision."""
        # A device handed to training this tick gets its state from the training hook; an
        # IDLE written here too could land after it (another writer) and hide the training.
        to_training = {t.device_id for t in decision.start_training}
        for d in devices:
            if d.state in (DeviceState.UNAVAILABLE, DeviceState.TRAINING):
                self._unsettle(d.device_id)  # an IDLE settling could land after that
                continue
            if d.device_id in to_training:
                # Not ours to write, but remembered, so that our next state for it is written
                # (and an IDLE still settling is not: it could land after the training's).
                self._device_states[d.device_id] = DeviceState.TRAINING
                self._device_now[d.device_id] = DeviceState.TRAINING
                self._unsettle(d.device_id)
                continue
            busy = sum(self.queue.inflight(s.worker_id) for s in self.on(d.device_id))
            state = rollout_device_state(busy)
            reason = f"{busy} samples running" if busy else "no rollout work"
            self._record_device(d.device_id, state, reason)
        for handle in self.handles.values():
            if handle.answered:
                busy = self.queue.inflight(handle.worker_id) > 0
                self._settle(handle, WorkerState.BUSY if busy else WorkerState.READY)
            METRICS.set_session_pins(handle.worker_id, self.queue.pins.pinned_on(handle.worker_id))
        METRICS.record_repins([a.repin for a in decision.assignments if a.repin])

    def _settle(self, handle: WorkerHandle, state: WorkerState) -> None:
        """`handle` is BUSY or READY now; the store gets it after SETTLE_SECONDS if it holds."""
        handle.state = state
        if handle.stored_state == (state, handle.reason) or handle.worker_id in self._settling:
            return  # nothing to write, or a write of whatever holds then is already due
        assert self._loop is not None
        self._settling[handle.worker_id] = self._loop.call_later(
            SETTLE_SECONDS, self._write_settled, handle
        )

    def _write_settled(self, handle: WorkerHandle) -> None:
        self._settling.pop(handle.worker_id, None)
        # Another state (STOPPED, FAILED, a restart) was recorded meanwhile: it stands.
        if handle.state in _SETTLING and not self.closed and handle.answered:
            self.record_state(handle, handle.state, handle.reason)

    def record_state(
        self, handle: WorkerHandle, state: WorkerState, reason: str, pid: int | None = None
    ) -> None:
        handle.state = state
        if handle.stored_state == (state, reason) and pid is None:
            return
        handle.stored_state = (state, reason)
        worker = Worker(
            worker_id=handle.worker_id,
            kind=WorkerKind.ROLLOUT,
            device_id=handle.device.device_id,
            job_id=handle.job_id,
            state=state,
            pid=pid if pid is not None else (handle.proc.pid if handle.proc is not None else 0),
            state_reason=reason,
        )
        self.writes.write_nowait(upsert_worker, self.store, worker)

    def _record_device(self, device_id: str, state: DeviceState, reason: str) -> None:
        if self._device_now.get(device_id) is not state:
            self._device_now[device_id] = state
            METRICS.set_device_state(device_id, state.value)  # exact; the roll-up polls the store
        if self._device_states.get(device_id) is state:
            return
        if state is not DeviceState.IDLE:
            self._write_device(device_id, state, reason)
        elif device_id not in self._device_settling:
            assert self._loop is not None
            timer = self._loop.call_later(
                SETTLE_SECONDS, self._write_device_settled, device_id, reason
            )
            self._device_settling[device_id] = (timer, reason)

    def _write_device_settled(self, device_id: str, reason: str) -> None:
        self._device_settling.pop(device_id, None)
        # Busy again, or handed to training, meanwhile: that stands.
        if self._device_now.get(device_id) is DeviceState.IDLE and not self.closed:
            if self._device_states.get(device_id) is not DeviceState.IDLE:
                self._write_device(device_id, DeviceState.IDLE, reason)

    def _unsettle(self, device_id: str, flush: bool = False) -> None:
        """Drop the device's IDLE still settling (with `flush`, write it now instead)."""
        settling = self._device_settling.pop(device_id, None)
        if settling is not None:
            settling[0].cancel()
            if flush:
                self._write_device_settled(device_id, settling[1])

    def _write_device(self, device_id: str, state: DeviceState, reason: str) -> None:
        self._device_states[device_id] = state
        self.writes.write_nowait(self.store.devices.set_state, device_id, state, reason)
