"""The drafter-training worker process: trains on the device it is given, yields it on request.

Protocol over one duplex pipe (tuples `(kind, payload)`), parent -> worker:
  ("add", [sample dicts])  buffer samples: token_ids, response_start, policy_version, step,
                           hidden ([T, H] tensor or None)
  ("train", max_steps)     train until `max_steps` optimizer steps in total; None: until
                           preempted (epochs repeat while the buffer has data)
  ("preempt", None)        stop within one micro-step, free the device, report, then idle
  ("checkpoint", None)     write a checkpoint now (between steps, off the training thread)
  ("publish", {...})       evaluate + record a drafter version (workers.drafter.versions.publish)
  ("stop", None)           write a checkpoint, wait for it, exit
worker -> parent: ("ready", info), ("step", StepResult fields), ("idle", info),
  ("device_free", info), ("checkpointed", info), ("published", DrafterVersion fields),
  ("stopped", info), ("error", traceback), and ("heartbeat", None) every
  `heartbeat_seconds` after "ready" (from a thread: a long step or publish is not silence).

A preempt is honoured between micro-steps (`Trainer.train_step(should_stop)`): the partial step
is dropped, host copies of the trainable + optimizer state are taken, accelerator memory is
released, "device_free" is sent, and only then is the checkpoint written on a background thread.
The worker keeps its buffer and state in memory while idle, so a later ("train") resumes exactly
there; a restarted worker resumes from `checkpoint_dir/LATEST` (the buffer is volatile: the
daemon re-feeds recent samples, and ids of the saved epoch order that are missing are skipped).
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from workers.drafter.buffer import TrainingBuffer
from workers.drafter.trainer import (
    CheckpointWriter,
    Stop,
    Trainer,
    TrainerConfig,
    latest_checkpoint,
    load_state,
)
from workers.signals import ignore_stop_signals

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class WorkerSpec:
    model_path: str  # the target (policy) checkpoint, HF layout
    checkpoint_dir: str
    device: str = "cpu"
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    buffer_bytes: int = 256 << 20
    keep_hidden: bool = True
    hidden_dtype: str = "bfloat16"
    drafter_path: str | None = None  # start from this drafter (save_pretrained dir)
    drafter_seed: int = 0  # ... or from EagleDrafter.random_init(seed)
    resume: bool = True  # continue from checkpoint_dir/LATEST when there is one
    checkpoint_every: int = 0  # optimizer steps between async checkpoints (0: preempt/stop only)
    threads: int = 1
    heartbeat_seconds: float = 2.0


class _Worker:
    def __init__(self, spec: WorkerSpec, conn: Connection) -> None:
        from workers.engine.eagle import EagleDrafter
        from workers.engine.model import load_model

        self.spec = spec
        self.conn = conn
        self._send_lock = threading.Lock()
        target = load_model(spec.model_path, device=spec.device)
        if spec.drafter_path:
            drafter = EagleDrafter.from_pretrained(spec.drafter_path, target)
        else:
            drafter = EagleDrafter.random_init(target, seed=spec.drafter_seed)
        self.buffer = TrainingBuffer(
            spec.buffer_bytes, spec.keep_hidden, _DTYPES[spec.hidden_dtype]
        )
        self.trainer = Trainer(drafter, self.buffer, spec.trainer)
        self.writer = CheckpointWriter(spec.checkpoint_dir)
        latest = latest_checkpoint(spec.checkpoint_dir) if spec.resume else None
        if latest is not None:
            self.trainer.restore(load_state(latest))
        self.resumed_from = str(latest) if latest else None
        self.training = False
        self.max_steps: int | None = None
        self.interrupt: str | None = None  # "preempt" | "stop" received mid-step
        self.running = True
        self._deferred: list[tuple[str, Any]] = []  # messages that wait for a step boundary

    def send(self, kind: str, payload: Any = None) -> None:
        with self._send_lock:  # the checkpoint thread reports too
            self.conn.send((kind, payload))

    # -- messages -------------------------------------------------------------------------------

    def handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            for s in payload:
                self.buffer.add(
                    s["token_ids"],
                    s["response_start"],
                    s["policy_version"],
                    s["step"],
                    s.get("hidden"),
                )
        elif kind == "train":
            self.trainer.reclaim_device(self.spec.device)
            self.max_steps = payload
            self.training = True
        elif kind == "preempt":
            self.preempt()
        elif kind == "checkpoint":
            self.checkpoint()
        elif kind == "publish":
            self.publish(payload)
        elif kind == "stop":
            self.training = False
            self.writer.submit(self.trainer.state())
            path = self.writer.wait()
            self.writer.close()
            self.send("stopped", {"step": self.trainer.step, "path": str(path)})
            self.running = False
        else:
            raise ValueError(f"unknown message {kind!r}")

    def should_stop(self) -> bool:
        """Between micro-steps: apply cheap messages at once, interrupt on preempt/stop."""
        while self.interrupt is None and self.conn.poll():
            kind, payload = self.conn.recv()
            if kind in ("preempt", "stop"):
                self.interrupt = kind
            elif kind in ("add", "train"):
                self.handle(kind, payload)
            else:
                self._deferred.append((kind, payload))
        return self.interrupt is not None

    def preempt(self) -> None:
        was_training = self.training
        self.training = False
        state = self.trainer.state()  # host copies: the write below does not touch the device
        self.trainer.release_device()
        self.send(
            "device_free",
            {"t": time.monotonic(), "step": self.trainer.step, "was_training": was_training},
        )
        self.checkpoint(state)

    def checkpoint(self, state=None) -> None:
        step = self.trainer.step
        fut = self.writer.submit(state or self.trainer.state())
        fut.add_done_callback(
            lambda f: self.send(
                "checkpointed",
                {"step": step, "path": str(f.result())}
                if f.exception() is None
                else {"step": step, "error": repr(f.exception())},
            )
        )

    def publish(self, req: dict) -> None:
        from tltd.store import Store
        from workers.drafter.versions import HeldOut, publish

        held = [
            HeldOut(torch.as_tensor(s["token_ids"]), s["response_start"], s.get("hidden"))
            for s in req["held_out"]
        ]
        store = Store(req["db_url"])
        try:
            dv = publish(
                store,
                req["job_id"],
                self.trainer.drafter,
                held,
                policy_version=req["policy_version"],
                train_steps=self.trainer.step,
                loss=self.trainer.last_loss,
                out_dir=req["out_dir"],
                k=req.get("k", 4),
            )
        finally:
            store.close()
        self.trainer.drafter.train()
        self.send("published", asdict(dv))

    def _beat(self) -> None:
        """Heartbeat thread: the daemon kills a trainer silent for too long (a hung process)."""
        while self.running:
            time.sleep(self.spec.heartbeat_seconds)
            try:
                self.send("heartbeat")
            except (OSError, ValueError):
                return  # the daemon is gone

    # -- loop -----------------------------------------------------------------------------------

    def run(self) -> None:
        self.send(
            "ready",
            {
                "step": self.trainer.step,
                "resumed_from": self.resumed_from,
                "items": len(self.buffer),
            },
        )
        threading.Thread(target=self._beat, daemon=True, name="heartbeat").start()
        while self.running:
            if self._deferred:
                self.handle(*self._deferred.pop(0))
                continue
            if not self.training:
                self.handle(*self.conn.recv())
                continue
            if self.max_steps is not None and self.trainer.step >= self.max_steps:
                self.training = False
                self.send("idle", {"reason": "max_steps", "step": self.trainer.step})
                continue
            res = self.trainer.train_step(self.should_stop)
            if self.interrupt is not None:
                kind, self.interrupt = self.interrupt, None
                if kind == "preempt":
                    self.preempt()
                else:
                    self.handle("stop", None)
                continue
            if res is Stop.NO_DATA:
                self.training = False
                self.send("idle", {"reason": "no_data", "step": self.trainer.step})
                continue
            assert not isinstance(res, Stop)
            self.send("step", asdict(res))
            every = self.spec.checkpoint_every
            if every and self.trainer.step % every == 0:
                self.checkpoint()


def run_worker(spec: WorkerSpec, conn: Connection) -> None:
    """Process entry point (spawn)."""
    ignore_stop_signals()
    torch.set_num_threads(spec.threads)
    worker = None
    try:
        worker = _Worker(spec, conn)
        worker.run()
    except BaseException:
        error = traceback.format_exc()
        if worker is not None:
            worker.send("error", error)  # under its lock: the heartbeat thread sends too
        else:
            conn.send(("error", error))
        raise


class WorkerError(RuntimeError):
    pass


class DrafterWorker:
    """Parent-side handle of one drafter-training worker process."""

    def __init__(self, spec: WorkerSpec) -> None:
        ctx = mp.get_context("spawn")
        self.spec = spec
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=run_worker, args=(spec, child), daemon=True, name="tltd-drafter-train"
        )
        self._child = child
        self.steps: list[dict] = []  # every StepResult reported, in order
        self.events: list[tuple[str, Any]] = []  # everything else

    def start(self, timeout: float = 120.0) -> dict:
        self.spawn()
        return self.wait_for("ready", timeout)

    def spawn(self) -> None:
        """Start the process (its pid is known from here); `start` also waits for "ready"."""
        Path(self.spec.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        self.proc.start()
        self._child.close()

    def send(self, kind: str, payload: Any = None) -> None:
        self.conn.send((kind, payload))

    def add(self, samples: list[dict]) -> None:
        self.send("add", samples)

    def train(self, max_steps: int | None = None) -> None:
        self.send("train", max_steps)

    def _recv(self, timeout: float) -> tuple[str, Any]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"drafter worker sent nothing for {timeout}s")
        kind, payload = self.conn.recv()
        if kind == "error":
            raise WorkerError(payload)
        if kind == "heartbeat":
            return kind, payload  # not kept: `events` would grow for as long as it lives
        if kind == "step":
            self.steps.append(payload)
        else:
            self.events.append((kind, payload))
        return kind, payload

    def wait_for(self, kind: str, timeout: float = 60.0) -> Any:
        """Read messages (recording them) until one of `kind` arrives; return its payload."""
        deadline = time.monotonic() + timeout
        while True:
            got, payload = self._recv(max(0.0, deadline - time.monotonic()))
            if got == kind:
                return payload

    def preempt(self, timeout: float = 30.0) -> float:
        """Ask for the device back; returns the latency (s) until "device_free" arrived."""
        t0 = time.monotonic()
        self.send("preempt")
        self.wait_for("device_free", timeout)
        return time.monotonic() - t0

    def publish(self, **req: Any) -> dict:
        self.send("publish", req)
        return self.wait_for("published", 300.0)

    def stop(self, timeout: float = 60.0) -> dict:
        self.send("stop")
        info = self.wait_for("stopped", timeout)
        self.proc.join(timeout)
        return info

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
