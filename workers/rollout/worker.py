"""The torch rollout worker process: steps an Engine, polls its pipe between steps."""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Iterable
from dataclasses import replace
from multiprocessing.connection import Connection

from tltd.domain import FinishReason, Sample, SpeculativeStats
from workers.rollout.protocol import (
    AddWork,
    Cancel,
    Drain,
    Drained,
    EngineSpec,
    Finished,
    Heartbeat,
    LoadFailed,
    LoadModel,
    LoadPolicy,
    Ready,
    SetDrafter,
    Shutdown,
    ToWorker,
    WorkerError,
)

_DRAFTERS = {"auto": ("ngram", "eagle"), "ngram": ("ngram",), "eagle": ("eagle",)}


def main(conn: Connection, threads: int = 1, heartbeat_seconds: float = 0.5) -> None:
    """Process entry point (multiprocessing spawn target). Exit 0 on Shutdown or a closed pipe,
    1 after a fatal error (reported first, when the pipe still works)."""
    import torch

    torch.set_num_threads(max(1, threads))
    worker = RolloutWorker(conn, heartbeat_seconds)
    try:
        worker.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the daemon is gone: nobody is left to report to
    except BaseException:
        try:
            conn.send(WorkerError(traceback.format_exc(), fatal=True))
        except OSError:
            pass
        os._exit(1)  # skip atexit/finalizers of a possibly broken torch state


def contiguous_runs(indices: Iterable[int]) -> list[tuple[int, int]]:
    """[0, 1, 2, 5, 6] -> [(0, 3), (5, 2)]: (first index, count) of each contiguous run."""
    runs: list[tuple[int, int]] = []
    for i in sorted(indices):
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


class RolloutWorker:
    """One engine, one pipe. Single-threaded: a command never interrupts a step."""

    def __init__(self, conn: Connection, heartbeat_seconds: float) -> None:
        self.conn = conn
        self.heartbeat_seconds = heartbeat_seconds
        self.engine = None  # workers.engine.engine.Engine once a LoadModel arrived
        self.job_id = ""
        self.drafter_version = 0
        self.acked_seq = 0
        self.idle_since: float | None = time.time()
        self.drain_deadline: float | None = None
        self.stopping = False
        self._last_heartbeat = 0.0

    # -- loop -----------------------------------------------------------------------------

    def run(self) -> None:
        self._ready()
        while not self.stopping:
            busy = self._busy()
            timeout = 0.0 if busy else self.heartbeat_seconds
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
            elif self._busy():
                self._step()
            self._maybe_heartbeat()

    def _busy(self) -> bool:
        return self.engine is not None and self.engine.has_work()

    def _step(self) -> None:
        assert self.engine is not None
        for out in self.engine.step():
            self.conn.send(Finished(_sample(out)))
        if not self.engine.has_work():
            self.idle_since = time.time()

    def _maybe_heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_heartbeat < self.heartbeat_seconds:
            return
        self._last_heartbeat = now
        running = remaining = 0
        stats: dict[str, object] = {}
        if self.engine is not None:
            e = self.engine
            running = len(e.running) + sum(g.sampling.n for g in e.waiting)
            remaining = sum(s.max_new - len(s.tokens) for s in e.running) + sum(
                g.sampling.n * g.sampling.max_new_tokens for g in e.waiting
            )
            stats = e.stats.summary() | {"prefills": e.prefills}
        self.conn.send(
            Heartbeat(
                running, remaining, self.acked_seq, None if running else self.idle_since, stats
            )
        )

    # -- commands -------------------------------------------------------------------------

    def _handle(self, msg: ToWorker) -> None:
        match msg:
            case AddWork():
                self._add(msg)
            case Cancel(request_id=rid):
                if self.engine is not None:
                    self.engine.cancel(rid)
            case Drain(seconds=s):
                self.drain_deadline = time.monotonic() + max(0.0, s)
            case Shutdown():
                self.stopping = True
            case LoadModel():
                self._load_model(msg)
            case LoadPolicy(path=path, version=version):
                self._guarded(version, False, lambda: self.engine.load_policy(path, version))
            case SetDrafter(path=path, version=version):
                # A failure names the drafter version: the supervisor skips that one from now on.
                self._guarded(version, True, lambda: self._set_drafter(path, version))
            case _:
                self.conn.send(WorkerError(f"unknown command {type(msg).__name__}"))

    def _add(self, msg: AddWork) -> None:
        self.acked_seq = max(self.acked_seq, msg.seq)
        if self.engine is None:
            self._fail(msg, msg.sample_indices, "no model loaded on this worker")
            return
        for first, count in contiguous_runs(msg.sample_indices):
            try:
                self.engine.add_request(
                    msg.request_id,
                    msg.prompt_ids,
                    replace(msg.sampling, n=count),
                    prompt_index=msg.prompt_index,
                    speculative=msg.speculative,
                    sample_offset=first,
                )
            except ValueError as exc:  # e.g. a prompt longer than this engine's max_seq_len
                self._fail(msg, range(first, first + count), str(exc))
        self.idle_since = None

    def _fail(self, msg: AddWork, indices: Iterable[int], error: str) -> None:
        version = self.engine.policy_version if self.engine is not None else 0
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
                        policy_version=version,
                        partial=True,
                        error=error,
                    )
                )
            )

    def _load_model(self, msg: LoadModel) -> None:
        from workers.engine.bandit import Strategy
        from workers.engine.engine import Engine, EngineConfig

        if self.engine is not None and self.engine.has_work():
            self._abort_all(FinishReason.FAILED, "worker switched to another model")
        spec: EngineSpec = msg.engine
        strategies = tuple(
            Strategy(d, k)
            for d in _DRAFTERS.get(spec.drafter, ("ngram",))
            for k in spec.draft_lengths
        )
        try:
            self.engine = None  # free the old model before loading the next one
            engine = Engine(
                msg.path,
                EngineConfig(
                    max_batch=spec.max_batch,
                    max_seq_len=spec.max_seq_len,
                    spec_mode=spec.spec_mode,
                    batch_threshold=spec.batch_threshold,
                    strategies=strategies,
                    device=spec.device,
                    seed=spec.seed,
                ),
            )
        except Exception as exc:  # a bad checkpoint is the job's problem, not the worker's
            self.job_id = ""
            self.conn.send(LoadFailed(msg.job_id, msg.policy_version, _describe(exc)))
            self._ready()  # tells the daemon what is loaded now: nothing
            return
        engine.policy_version = msg.policy_version
        self.engine, self.job_id, self.drafter_version = engine, msg.job_id, 0
        self.idle_since = time.time()
        self._ready()

    def _set_drafter(self, path: str, version: int) -> None:
        from workers.engine.eagle import EagleDrafter

        assert self.engine is not None
        drafter = EagleDrafter.from_pretrained(path, self.engine.model) if path else None
        self.engine.set_drafter(drafter, version if drafter is not None else 0)
        self.drafter_version = self.engine.drafter_version

    def _guarded(self, version: int | None, drafter: bool, apply) -> None:
        if self.engine is None:
            self.conn.send(LoadFailed(self.job_id, version or 0, "no model loaded", drafter))
            self._ready()
            return
        try:
            apply()
        except Exception as exc:
            v = self.engine.policy_version if version is None else version
            self.conn.send(LoadFailed(self.job_id, v, _describe(exc), drafter))
        self._ready()  # what is loaded now (unchanged after a failure)

    def _ready(self) -> None:
        version = self.engine.policy_version if self.engine is not None else 0
        self.conn.send(Ready(os.getpid(), self.job_id, version, self.drafter_version))
        self._maybe_heartbeat(force=True)

    def _abort_all(self, reason: FinishReason = FinishReason.ABORTED, error: str = "") -> int:
        """Finish everything in the engine now and send it as partial samples."""
        if self.engine is None:
            return 0
        e = self.engine
        for rid in {s.group.request_id for s in e.running} | {g.request_id for g in e.waiting}:
            e.cancel(rid)
        outs = e.step()  # returns the cancelled outputs; nothing is left to run
        for out in outs:
            sample = _sample(out)
            if sample.finish_reason is FinishReason.CANCELLED:
                sample = replace(sample, finish_reason=reason, partial=True, error=error)
            self.conn.send(Finished(sample))
        self.idle_since = time.time()
        return len(outs)


def _sample(out) -> Sample:
    """Engine SampleOutput -> domain Sample."""
    return Sample(
        request_id=out.request_id,
        prompt_index=out.prompt_index,
        sample_index=out.sample_index,
        token_ids=tuple(out.token_ids),
        logprobs=tuple(out.logprobs),
        finish_reason=out.finish_reason,
        policy_version=out.policy_version,
        drafter_version=out.drafter_version,
        speculative=SpeculativeStats(
            draft_steps=out.draft_steps,
            plain_steps=out.plain_steps,
            accepted_tokens=out.accepted_tokens,
            mean_accepted_length=out.mean_accepted_length,
        ),
        partial=out.finish_reason is FinishReason.CANCELLED,
    )


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
