"""One drafter trainer process as the daemon starts and holds it (the parent-side handle), and
the spec a job's trainer is started with.

The handle names the trainer's entry point through `tltd.worker_code` (light to import); torch
and the trainer's code load in the process, never in the daemon.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from tltd import worker_code
from tltd.contract import drafter_messages as proto
from tltd.contract.drafter_messages import TrainerConfig, TrainerSpec
from tltd.contract.processes import with_environment
from tltd.settings import Settings

if TYPE_CHECKING:
    from tltd.store import Store

M = TypeVar("M", bound=proto.FromTrainer)


class TrainerFailed(RuntimeError):
    """The trainer process reported a failure (its traceback)."""


class TrainerProcess:
    """Parent-side handle of one drafter-training worker process.

    The daemon spawns it, waits for its `TrainerReady` and then serves its pipe from threads
    (`tltd.supervisor.worker_pipe`); tests and benchmarks drive it through the synchronous
    calls below."""

    def __init__(self, spec: TrainerSpec) -> None:
        ctx = worker_code.worker_context()
        self.spec = spec
        self.conn, child = ctx.Pipe(duplex=True)
        target, args = with_environment(worker_code.trainer_entry(), spec, child)
        self.proc = ctx.Process(target=target, args=args, daemon=True, name="tltd-drafter-train")
        self._child = child
        self.steps: list[proto.StepResult] = []  # every step reported, in order
        self.events: list[proto.FromTrainer] = []  # everything else but heartbeats

    def start(self, timeout: float = 120.0) -> proto.TrainerReady:
        self.spawn()
        return self.wait_for(proto.TrainerReady, timeout)

    def spawn(self) -> None:
        """Start the process (its pid is known from here); `start` also waits for its Ready."""
        Path(self.spec.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        self.proc.start()
        self._child.close()

    def send(self, m: proto.ToTrainer) -> None:
        self.conn.send(m)

    def add(self, samples: list[proto.TrainingSample]) -> None:
        self.send(proto.AddSamples(tuple(samples)))

    def train(self, max_steps: int | None = None) -> None:
        self.send(proto.Train(max_steps))

    def _recv(self, timeout: float) -> proto.FromTrainer:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"drafter worker sent nothing for {timeout}s")
        m = self.conn.recv()
        match m:
            case proto.Failed(traceback=tb):
                raise TrainerFailed(tb)
            case proto.TrainerHeartbeat():
                pass  # not kept: `events` would grow for as long as it lives
            case proto.Stepped(result=result):
                self.steps.append(result)
            case _:
                self.events.append(m)
        return m

    def wait_for(self, kind: type[M], timeout: float = 60.0) -> M:
        """Read messages (recording them) until one of type `kind` arrives; return it."""
        deadline = time.monotonic() + timeout
        while True:
            m = self._recv(max(0.0, deadline - time.monotonic()))
            if isinstance(m, kind):
                return m

    def preempt(self, timeout: float = 30.0) -> float:
        """Ask for the device back; returns the latency (s) until `DeviceFree` arrived."""
        t0 = time.monotonic()
        self.send(proto.Preempt())
        self.wait_for(proto.DeviceFree, timeout)
        return time.monotonic() - t0

    def measure(self, m: proto.Measure) -> proto.Measured:
        self.send(m)
        return self.wait_for(proto.Measured, 300.0)

    def stop(self, timeout: float = 60.0) -> proto.Stopped:
        self.send(proto.StopTrainer())
        info = self.wait_for(proto.Stopped, timeout)
        self.proc.join(timeout)
        return info

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


def new_trainer(
    store: Store,
    settings: Settings,
    root: Path,
    job_id: str,
    policy_version: int,
    device: str,
    active_drafter: int,
    taken_over: bool = False,
) -> tuple[TrainerProcess, dict | None]:
    """A trainer process (not spawned yet) for a job's policy version on `device` (a torch
    device), and the policy's config.json: it resumes from this node's checkpoint, or a fresh
    one starts from the drafter the rollout workers use (`active_drafter`, 0: none) where this
    node can read it; `taken_over`: the lease came from another node, whose drafter is newer
    than this node's checkpoint. Reads the store."""
    policy = store.policies.get(job_id, policy_version)
    start_from, start_step = None, 0
    if active_drafter:
        dv = store.drafters.get(job_id, active_drafter)
        if dv.readable_on(store.node_id) and Path(dv.path).is_dir():
            start_from = dv.path
            start_step = dv.train_steps if taken_over else 0
    process = TrainerProcess(
        TrainerSpec(
            model_path=policy.path,
            checkpoint_dir=str(root / job_id / "train"),
            device=device,
            trainer=TrainerConfig(row_len=settings.training_row_len),
            buffer_bytes=settings.training_buffer_bytes,
            keep_hidden=False,
            drafter_path=start_from,
            start_step=start_step,
            # Another node trained since this one's checkpoint: it is older than `start_from`.
            resume=not taken_over,
            threads=settings.worker_threads,
            heartbeat_seconds=settings.worker_heartbeat_seconds,
        )
    )
    return process, policy_config(policy.path)


def policy_config(path: str) -> dict | None:
    """A policy checkpoint's config.json (None when it cannot be read: no in-place load)."""
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
