"""The torch rollout worker process: steps an Engine, polls its pipe between steps."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

from tltd.contract.rollout_messages import AddWork, JoinBroadcast, LoadModel
from tltd.domain import Sample
from tltd_workers.rollout.loop import WorkerLoop, contiguous_runs, serve
from tltd_workers.signals import ignore_stop_signals

if TYPE_CHECKING:  # the engine (torch) is imported only by the worker process, at load
    from tltd_workers.engine.costs import CostModel
    from tltd_workers.engine.gate import GateState
    from tltd_workers.engine.trace import EngineTrace

__all__ = ["RolloutWorker", "contiguous_runs", "main"]

# Jobs whose SD gate state a worker keeps (a job that comes back continues where it was).
GATE_STATES_KEPT = 4


def main(
    conn: Connection, threads: int = 1, heartbeat_seconds: float = 0.5, trace_dir: str = ""
) -> None:
    """Process entry point (multiprocessing spawn target). Exit 0 on Shutdown or a closed pipe,
    1 after a fatal error (reported first, when the pipe still works). `trace_dir`: record
    the engine's steps to <trace_dir>/<worker id>.jsonl ("" = not)."""
    ignore_stop_signals()
    import torch

    torch.set_num_threads(max(1, threads))
    serve(conn, RolloutWorker(conn, heartbeat_seconds, trace_dir))


class RolloutWorker(WorkerLoop):
    """The shared loop over the project's own torch `Engine`."""

    def __init__(self, conn: Connection, heartbeat_seconds: float, trace_dir: str = "") -> None:
        super().__init__(conn, heartbeat_seconds)
        self.engine = None  # tltd_workers.engine.engine.Engine once a LoadModel arrived
        # Kept across engines: the decode costs measured on this device (reused while the
        # architecture is the same) and, per job, what the SD gate learned.
        self.costs: CostModel | None = None
        self.gate_states: dict[str, GateState] = {}  # by job id, oldest first
        # What the engine did per step, read from outside it (the daemon's engine_trace_dir).
        self.trace: EngineTrace | None = None
        if trace_dir:
            from tltd_workers.engine.trace import EngineTrace

            name = mp.current_process().name
            self.trace = EngineTrace(Path(trace_dir) / f"{name}.jsonl", name)

    def loaded(self) -> bool:
        return self.engine is not None

    def policy_version(self) -> int:
        return self.engine.policy_version if self.engine is not None else 0

    def busy(self) -> bool:
        return self.engine is not None and self.engine.has_work()

    def step(self) -> list[Sample]:
        assert self.engine is not None
        if self.trace is not None:
            return [out.to_domain() for out in self.trace.step(self.engine, self.job_id)]
        return [out.to_domain() for out in self.engine.step()]

    def load(self, msg: LoadModel) -> None:
        from tltd_workers.engine.engine import Engine, EngineConfig
        from tltd_workers.engine.transformer import serving_dtype

        if self.trace is not None:
            self.trace.engine_loaded()
        self.engine = None  # free the old model before loading the next one
        self.policy_source = ""
        self.broadcasts.drop()  # weights received for the job it held are not needed now
        cfg = EngineConfig.from_spec(msg.engine)
        engine = Engine(
            msg.path,
            replace(cfg, dtype=serving_dtype(msg.path, cfg.device)),
            costs=self.costs,
            gate_state=self.gate_states.get(msg.job_id),
        )
        engine.policy_version = msg.policy_version
        self.engine = engine
        self.costs = engine.costs or self.costs
        self.gate_states.pop(msg.job_id, None)
        if engine.gate_state is not None:
            self.gate_states[msg.job_id] = engine.gate_state  # now the newest
            while len(self.gate_states) > GATE_STATES_KEPT:
                del self.gate_states[next(iter(self.gate_states))]

    def load_policy(self, path: str, version: int) -> None:
        assert self.engine is not None
        received = self.broadcasts.take(path)
        self.engine.load_policy(path if received is None else received, version)
        self.policy_source = "" if received is None else "broadcast"

    def join_broadcast(self, msg: JoinBroadcast) -> None:
        # An nccl broadcast lands on the engine's device (the default is the host).
        device = str(self.engine.device) if self.engine is not None else "cpu"
        self.broadcasts.join(msg, device)

    def set_drafter(self, path: str, version: int) -> int:
        from tltd_workers.engine.eagle import EagleDrafter

        assert self.engine is not None
        drafter = EagleDrafter.from_pretrained(path, self.engine.model) if path else None
        self.engine.set_drafter(drafter, version if drafter is not None else 0)
        return self.engine.drafter_version

    def add(self, msg: AddWork) -> None:
        assert self.engine is not None
        resumed: set[int] = set()
        for stored in msg.resume:
            if stored.sample_index not in msg.sample_indices:
                continue
            try:
                self.engine.add_request(
                    msg.request_id, msg.prompt_ids, replace(msg.sampling, n=1),
                    prompt_index=msg.prompt_index, speculative=msg.speculative,
                    sample_offset=stored.sample_index, history=msg.history, resume=stored,
                    pause_after=msg.pause_after, cache_key=msg.cache_key,
                    share_key=msg.share_key,
                )  # fmt: skip
                resumed.add(stored.sample_index)
            except ValueError:  # it cannot go on from those tokens: it runs again from its seed
                pass
        fresh = [i for i in msg.sample_indices if i not in resumed]
        for first, count in contiguous_runs(fresh):
            try:
                self.engine.add_request(
                    msg.request_id,
                    msg.prompt_ids,
                    replace(msg.sampling, n=count),
                    prompt_index=msg.prompt_index,
                    speculative=msg.speculative,
                    sample_offset=first,
                    history=msg.history,
                    pause_after=msg.pause_after,
                    cache_key=msg.cache_key,
                    share_key=msg.share_key,
                )
            except ValueError as exc:  # e.g. a prompt longer than this engine's max_seq_len
                self.fail(msg, range(first, first + count), str(exc))

    def cancel(self, request_id: str) -> None:
        assert self.engine is not None
        self.engine.cancel(request_id)

    def take_finished(self) -> list[Sample]:
        assert self.engine is not None
        return [out.to_domain() for out in self.engine.take_finished()]

    def abort_everything(self) -> list[Sample]:
        assert self.engine is not None
        if self.trace is not None:
            self.trace.flush()
        return [out.to_domain() for out in self.engine.abort_all()]

    def checkpoints(self) -> list[Sample]:
        assert self.engine is not None
        return [out.to_domain() for out in self.engine.snapshot()]

    def close(self) -> None:
        if self.trace is not None:
            self.trace.flush()

    def load_summary(self) -> tuple[int, int, dict[str, object]]:
        assert self.engine is not None
        e = self.engine
        held = e.load()
        extra = {"prefills": e.prefills, "prefix_cache": e.prefix.summary()}
        return held.samples, held.remaining_tokens, e.stats.summary() | extra
