"""The backend-neutral rollout worker loop: commands between engine steps, heartbeats, drain.

A backend subclasses `WorkerLoop` and implements its engine hooks (torch:
`tltd_workers.rollout.worker`, SGLang: `tltd_workers.rollout.sglang_worker`). The loop, the command
dispatch, Ready / LoadFailed / Heartbeat reporting, failing work that cannot run and the drain
live here once, so every backend speaks `tltd.contract.rollout_messages` the same way.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import replace
from multiprocessing.connection import Connection

from tltd.contract.rollout_messages import (
    AddWork,
    Cancel,
    Drain,
    Drained,
    Finished,
    Freeze,
    Heartbeat,
    JoinBroadcast,
    LoadFailed,
    LoadModel,
    LoadPolicy,
    Ready,
    SampleCheckpoint,
    SetDrafter,
    Shutdown,
    ToWorker,
    WorkerError,
)
from tltd.domain import FinishReason, Sample
from tltd_workers.rollout.broadcast import BroadcastReceiver


def serve(conn: Connection, worker: WorkerLoop) -> None:
    """Run `worker` on its pipe. Returns on Shutdown or a closed pipe; after a fatal error it
    reports it (when the pipe still works) and exits the process with status 1."""
    try:
        worker.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the daemon is gone: nobody is left to report to
    except BaseException:
        try:
            conn.send(WorkerError(traceback.format_exc(), fatal=True))
        except OSError:
            pass
        os._exit(1)  # skip atexit/finalizers of a possibly broken engine state
    worker.close()


def contiguous_runs(indices: Iterable[int]) -> list[tuple[int, int]]:
    """[0, 1, 2, 5, 6] -> [(0, 3), (5, 2)]: (first index, count) of each contiguous run."""
    runs: list[tuple[int, int]] = []
    for i in sorted(indices):
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class WorkerLoop:
    """One engine, one pipe. Single-threaded: a command never interrupts a step.

    Subclasses implement the engine hooks below; everything else is shared.

    Frozen (a Freeze command: a job paused with its requests kept in place), the loop takes
    no step: the engine's samples keep their tokens and KV cache, new work waits in it, and
    the commands still apply (a cancel's samples are sent at once, a drain ends them as
    partial, a new policy loads, and the samples continue on it once thawed).
    """

    # False: the backend's engine runs by itself (SGLang's processes), not stepping it
    # does not stop its samples, so a Freeze is not honoured (heartbeats say None).
    can_freeze = True

    def __init__(self, conn: Connection, heartbeat_seconds: float) -> None:
        self.conn = conn
        self.heartbeat_seconds = heartbeat_seconds
        self.job_id = ""
        self.drafter_version = 0
        self.acked_seq = 0
        self.idle_since: float | None = time.time()
        self.drain_deadline: float | None = None
        self.stopping = False
        self.frozen = False
        self.pausing: set[str] = set()  # requests paused at a step bound (Cancel.pause)
        self._last_heartbeat = 0.0
        # Policy weights received by a joined broadcast, until their version is loaded.
        self.broadcasts = BroadcastReceiver()
        self.policy_source = ""  # "broadcast" when the loaded policy came from one
        # LoadModel's: how often the samples running are checkpointed (0 = never).
        self.checkpoint_seconds = 0.0
        self._checkpoint_at = 0.0  # monotonic time of the next checkpoint round
        # Samples running at the last round -> tokens last sent as a checkpoint (0 = none).
        self._checkpoint_round: dict[tuple[str, int, int], int] = {}

    # -- engine hooks (a backend implements these) ----------------------------------------

    def loaded(self) -> bool:
        """A model is loaded."""
        raise NotImplementedError

    def policy_version(self) -> int:
        """The policy version loaded now (0 when nothing is)."""
        raise NotImplementedError

    def busy(self) -> bool:
        """The engine holds unfinished work (or results not yet sent)."""
        raise NotImplementedError

    def step(self) -> list[Sample]:
        """Advance the engine once; the samples that finished."""
        raise NotImplementedError

    def load(self, msg: LoadModel) -> None:
        """Replace the engine with one for `msg` (the old one is gone even when this raises)."""
        raise NotImplementedError

    def load_policy(self, path: str, version: int) -> None:
        """New weights of the loaded model (raises when they cannot be applied)."""
        raise NotImplementedError

    def set_drafter(self, path: str, version: int) -> int:
        """Swap the learned drafter ("" = none); returns the drafter version now in use."""
        raise NotImplementedError

    def add(self, msg: AddWork) -> None:
        """Queue the samples of `msg` (a model is loaded); `fail` those that cannot run."""
        raise NotImplementedError

    def cancel(self, request_id: str) -> None:
        """Finish the request's samples soon as CANCELLED (returned by a later `step`)."""
        raise NotImplementedError

    def take_finished(self) -> list[Sample]:
        """Samples already finished without a step (a cancel), which the next `step` would
        report: a frozen loop sends them at once."""
        return []

    def abort_everything(self) -> list[Sample]:
        """End all unfinished work now; what was cut short comes back CANCELLED."""
        raise NotImplementedError

    def checkpoints(self) -> list[Sample]:
        """The samples running now with their tokens so far (ABORTED, partial), left running.
        A backend without them (none by default) is not checkpointed: after a loss its
        samples run again from their seeds."""
        return []

    def load_summary(self) -> tuple[int, int, dict[str, object]]:
        """(running samples, upper bound of tokens still to decode, engine counters)."""
        raise NotImplementedError

    def join_broadcast(self, msg: JoinBroadcast) -> None:
        """Take part in a policy broadcast beside the engine (torch: into memory)."""
        self.broadcasts.join(msg)

    def broadcast_errors(self) -> list[str]:
        """Broadcasts that failed since the last call (for the daemon's log)."""
        return self.broadcasts.errors()

    def close(self) -> None:
        """Release the engine at a normal exit."""

    # -- loop -----------------------------------------------------------------------------

    def run(self) -> None:
        self._ready()
        while not self.stopping:
            timeout = 0.0 if self.busy() and not self.frozen else self.heartbeat_seconds
            if self.drain_deadline is not None:
                timeout = min(timeout, max(0.0, self.drain_deadline - time.monotonic()))
            # Commands first: a cancel or drain takes effect before the next step.
            while self.conn.poll(timeout):
                self._handle(self.conn.recv())
                if self.stopping:
                    return
                timeout = 0.0
            if self.drain_deadline is not None and time.monotonic() >= self.drain_deadline:
                self.drain_deadline = None
                self.conn.send(Drained(self._abort_all()))
            elif self.frozen:
                if self.loaded():  # a cancel's samples, sent while not stepping
                    self._send_finished(self.take_finished())
            elif self.busy():
                self._step()
                self._maybe_checkpoint()
            self._maybe_heartbeat()

    def _step(self) -> None:
        self._send_finished(self.step())
        if not self.busy():
            self.idle_since = time.time()

    def _maybe_checkpoint(self) -> None:
        """Every `checkpoint_seconds`, send the samples that were running at the last round
        and have emitted tokens since last sent: a sample is stored once it has run that
        long, then again each time as long again (a short sample never is)."""
        now = time.monotonic()
        if self.checkpoint_seconds <= 0 or now < self._checkpoint_at or not self.loaded():
            return
        self._checkpoint_at = now + self.checkpoint_seconds
        before, self._checkpoint_round = self._checkpoint_round, {}
        out = []
        for sample in self.checkpoints():
            key = (sample.request_id, sample.prompt_index, sample.sample_index)
            sent = before.get(key)
            if sent is not None and len(sample.token_ids) > sent:
                out.append(SampleCheckpoint(sample))
                sent = len(sample.token_ids)
            self._checkpoint_round[key] = sent or 0
        if out:
            self.conn.send(out)

    def _send_finished(self, samples: list[Sample]) -> None:
        if self.pausing:  # a paused request's samples are cut short, not cancelled
            samples = [_paused(x) if x.request_id in self.pausing else x for x in samples]
        # A step's samples in one pipe message: one pickle and one write, not one each.
        if samples:
            self.conn.send([Finished(sample) for sample in samples])

    def _maybe_heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_heartbeat < self.heartbeat_seconds:
            return
        self._last_heartbeat = now
        for error in self.broadcast_errors():
            self.conn.send(WorkerError(error))
        running, remaining, stats = self.load_summary() if self.loaded() else (0, 0, {})
        self.conn.send(
            Heartbeat(
                running,
                remaining,
                self.acked_seq,
                None if running else self.idle_since,
                stats,
                self.frozen if self.can_freeze else None,
            )
        )

    # -- commands -------------------------------------------------------------------------

    def _handle(self, msg: ToWorker) -> None:
        match msg:
            case AddWork():
                self._add(msg)
            case Cancel(request_id=rid, pause=pause):
                if self.loaded():
                    if pause:
                        self.pausing.add(rid)
                    self.cancel(rid)
            case Freeze(frozen=frozen):
                self.frozen = frozen and self.can_freeze
                self._maybe_heartbeat(force=True)  # the daemon's ack: stopped (or not) now
            case Drain(seconds=s):
                self.drain_deadline = time.monotonic() + max(0.0, s)
            case Shutdown():
                self.stopping = True
            case LoadModel():
                self._load_model(msg)
            case LoadPolicy(path=path, version=version):
                self._guarded(version, False, lambda: self.load_policy(path, version))
            case SetDrafter(path=path, version=version):
                self._guarded(version, True, lambda: self._set_drafter(path, version))
            case JoinBroadcast():
                self.join_broadcast(msg)
            case _:
                self.conn.send(WorkerError(f"unknown command {type(msg).__name__}"))

    def _add(self, msg: AddWork) -> None:
        self.acked_seq = max(self.acked_seq, msg.seq)
        self.pausing.discard(msg.request_id)  # parked and resumed: it runs again
        if not self.loaded():
            self.fail(msg, msg.sample_indices, "no model loaded on this worker")
            return
        self.add(msg)
        self.idle_since = None

    def fail(self, msg: AddWork, indices: Iterable[int], error: str) -> None:
        """Send the samples `indices` of `msg` as FAILED with no tokens."""
        for i in indices:
            self.conn.send(
                Finished(
                    Sample(
                        msg.request_id,
                        msg.prompt_index,
                        i,
                        (),
                        (),
                        FinishReason.FAILED,
                        policy_version=self.policy_version(),
                        partial=True,
                        error=error,
                    )
                )
            )

    def _load_model(self, msg: LoadModel) -> None:
        if self.busy():
            self._abort_all(FinishReason.FAILED, "worker switched to another model")
        try:
            self.load(msg)
        except Exception as exc:  # a bad checkpoint is the job's problem, not the worker's
            self.job_id = ""
            self.conn.send(LoadFailed(msg.job_id, msg.policy_version, describe(exc)))
            self._ready()  # tells the daemon what is loaded now: nothing
            return
        self.job_id, self.drafter_version = msg.job_id, 0
        self.checkpoint_seconds, self._checkpoint_round = msg.checkpoint_seconds, {}
        self.idle_since = time.time()
        self._ready()

    def _set_drafter(self, path: str, version: int) -> None:
        self.drafter_version = self.set_drafter(path, version)

    def _guarded(self, version: int, drafter: bool, apply: Callable[[], None]) -> None:
        """Apply a LoadPolicy / SetDrafter; a failure names the version that failed (the
        drafter's for a drafter, so that the daemon stops offering that one)."""
        if not self.loaded():
            self.conn.send(LoadFailed(self.job_id, version, "no model loaded", drafter))
            self._ready()
            return
        try:
            apply()
        except Exception as exc:
            self.conn.send(LoadFailed(self.job_id, version, describe(exc), drafter))
        self._ready()  # what is loaded now (unchanged after a failure)

    def _ready(self) -> None:
        self.conn.send(
            Ready(
                os.getpid(),
                self.job_id,
                self.policy_version(),
                self.drafter_version,
                self.policy_source,
            )
        )
        self._maybe_heartbeat(force=True)

    def _abort_all(self, reason: FinishReason = FinishReason.ABORTED, error: str = "") -> int:
        """Finish everything in the engine now and send it (what was cut short as partial
        samples); returns how many were partial."""
        if not self.loaded():
            return 0
        partial = 0
        for sample in self.abort_everything():
            if sample.finish_reason is FinishReason.CANCELLED:
                sample = replace(sample, finish_reason=reason, partial=True, error=error)
            partial += sample.partial
            self.conn.send(Finished(sample))
        self.idle_since = time.time()
        return partial


def _paused(sample: Sample) -> Sample:
    """A sample cut short by a pause: ABORTED (the daemon parks it), not CANCELLED."""
    if sample.finish_reason is FinishReason.CANCELLED:
        return replace(sample, finish_reason=FinishReason.ABORTED, partial=True)
    return sample
