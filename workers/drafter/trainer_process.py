"""The drafter-training worker process: trains on the device it is given, yields it on request.

Protocol over one duplex pipe: the typed messages of `tltd.contract.drafter_messages` (commands
`AddSamples`, `Train`, `Preempt`, `WriteCheckpoint`, `Measure`, `SetPolicy`, `Stop`; reports
`Ready`, `Stepped`, `Idle`, `DeviceFree`, `Checkpointed`, `Measured`, `Stopped`, `Failed`, and a
`Heartbeat` every `heartbeat_seconds` after `Ready`, from a thread: a long step or measure is
not silence). The trainer measures; the daemon decides what becomes a drafter version.

A preempt is honoured between micro-steps (`Trainer.train_step(should_stop)`): the partial step
is dropped, host copies of the trainable + optimizer state are taken, accelerator memory is
released, "device_free" is sent, and only then is the checkpoint written on a background thread.
The worker keeps its buffer and state in memory while idle, so a later ("train") resumes exactly
there; a restarted worker resumes from `checkpoint_dir/LATEST` (the buffer is volatile: the
daemon re-feeds recent samples, and ids of the saved epoch order that are missing are skipped).
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TypeVar

import torch

from tltd.contract import drafter_messages as proto
from tltd.contract.processes import with_environment, worker_context
from tltd_workers.drafter.buffer import TrainingBuffer
from tltd_workers.drafter.trainer import (
    CheckpointWriter,
    Stop,
    Trainer,
    TrainerConfig,
    latest_checkpoint,
    load_state,
)
from tltd_workers.signals import ignore_stop_signals

M = TypeVar("M", bound=proto.FromTrainer)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TrainerSpec:
    model_path: str  # the target (policy) checkpoint, HF layout
    checkpoint_dir: str
    device: str = "cpu"
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    buffer_bytes: int = 256 << 20
    keep_hidden: bool = True
    hidden_dtype: str = "bfloat16"
    drafter_path: str | None = None  # start from this drafter (save_pretrained dir)
    drafter_seed: int = 0  # ... or from EagleDrafter.random_init(seed)
    start_step: int = 0  # the step count of `drafter_path` (a run continued on another node)
    resume: bool = True  # continue from checkpoint_dir/LATEST when there is one
    checkpoint_every: int = 0  # optimizer steps between async checkpoints (0: preempt/stop only)
    threads: int = 1
    heartbeat_seconds: float = 2.0
    # Added to the process's nice value: on a node whose cores the rollout workers and the
    # daemon also use, the OS gives the trainer only CPU time they leave (0: as the daemon).
    nice: int = 19


class _TrainingLoop:
    def __init__(self, spec: TrainerSpec, conn: Connection) -> None:
        from tltd_workers.engine.eagle import EagleDrafter
        from tltd_workers.engine.transformer import load_model

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
        else:
            self.trainer.step = spec.start_step
        self.resumed_from = str(latest) if latest else None
        self.training = False
        self.max_steps: int | None = None
        self.interrupt: proto.Preempt | proto.Stop | None = None  # received mid-step
        self.running = True
        self._deferred: list[proto.ToTrainer] = []  # messages that wait for a step boundary

    def send(self, m: proto.FromTrainer) -> None:
        with self._send_lock:  # the checkpoint thread reports too
            self.conn.send(m)

    # -- messages -------------------------------------------------------------------------------

    def handle(self, m: proto.ToTrainer) -> None:
        match m:
            case proto.AddSamples(samples=samples):
                for x in samples:
                    self.buffer.add(
                        x.token_ids, x.response_start, x.policy_version, x.step, x.hidden
                    )
            case proto.Train(max_steps=max_steps):
                self.trainer.reclaim_device(self.spec.device)
                self.max_steps = max_steps
                self.training = True
            case proto.Preempt():
                self.preempt()
            case proto.WriteCheckpoint():
                self.checkpoint()
            case proto.Measure():
                self.measure(m)
            case proto.SetPolicy(model_path=path):
                from tltd_workers.engine.transformer import load_weights, read_state_dict

                # In place: the drafter holds the target's embeddings and LM head by reference.
                load_weights(self.trainer.drafter.target, read_state_dict(path))
            case proto.Stop():
                self.training = False
                self.writer.submit(self.trainer.state())
                path = self.writer.wait()
                self.writer.close()
                self.send(proto.Stopped(self.trainer.step, str(path)))
                self.running = False
            case _:
                raise ValueError(f"unknown message {m!r}")

    def should_stop(self) -> bool:
        """Between micro-steps: apply cheap messages at once, interrupt on preempt/stop."""
        while self.interrupt is None and self.conn.poll():
            m = self.conn.recv()
            if isinstance(m, proto.Preempt | proto.Stop):
                self.interrupt = m
            elif isinstance(m, proto.AddSamples | proto.Train):
                self.handle(m)
            else:
                self._deferred.append(m)
        return self.interrupt is not None

    def preempt(self) -> None:
        was_training = self.training
        self.training = False
        state = self.trainer.state()  # host copies: the write below does not touch the device
        self.trainer.release_device()
        self.send(proto.DeviceFree(time.monotonic(), self.trainer.step, was_training))
        self.checkpoint(state)

    def checkpoint(self, state=None) -> None:
        step = self.trainer.step
        fut = self.writer.submit(state or self.trainer.state())
        fut.add_done_callback(
            lambda f: self.send(
                proto.Checkpointed(step, path=str(f.result()))
                if f.exception() is None
                else proto.Checkpointed(step, error=repr(f.exception()))
            )
        )

    def measure(self, m: proto.Measure) -> None:
        """Measure and report; a preempt or stop arriving meanwhile gives the measurement up
        (between held-out samples: nothing is reported, the daemon asks again next round)
        and is carried out."""
        from tltd_workers.drafter.versions import HeldOut, MeasureStopped, measure

        held = [
            HeldOut(torch.as_tensor(x.token_ids), x.response_start, x.hidden) for x in m.held_out
        ]
        try:
            measured = measure(
                self.trainer.drafter,
                held,
                active=m.active,
                policy_version=m.policy_version,
                train_steps=self.trainer.step,
                loss=self.trainer.last_loss,
                out_dir=m.out_dir,
                k=m.k,
                should_stop=self.should_stop,
            )
        except MeasureStopped:
            interrupt, self.interrupt = self.interrupt, None
            self.handle(interrupt)
            return
        finally:
            self.trainer.drafter.train()
        self.send(measured)

    def _beat(self) -> None:
        """Heartbeat thread: the daemon kills a trainer silent for too long (a hung process)."""
        while self.running:
            time.sleep(self.spec.heartbeat_seconds)
            try:
                self.send(proto.Heartbeat())
            except (OSError, ValueError):
                return  # the daemon is gone

    # -- loop -----------------------------------------------------------------------------------

    def run(self) -> None:
        self.send(proto.Ready(self.trainer.step, self.resumed_from, len(self.buffer)))
        threading.Thread(target=self._beat, daemon=True, name="heartbeat").start()
        while self.running:
            if self._deferred:
                self.handle(self._deferred.pop(0))
                continue
            if not self.training:
                self.handle(self.conn.recv())
                continue
            if self.max_steps is not None and self.trainer.step >= self.max_steps:
                self.training = False
                self.send(proto.Idle("max_steps", self.trainer.step))
                continue
            res = self.trainer.train_step(self.should_stop)
            if self.interrupt is not None:
                interrupt, self.interrupt = self.interrupt, None
                self.handle(interrupt)
                continue
            if res is Stop.NO_DATA:
                self.training = False
                self.send(proto.Idle("no_data", self.trainer.step))
                continue
            assert not isinstance(res, Stop)
            self.send(proto.Stepped(res))
            every = self.spec.checkpoint_every
            if every and self.trainer.step % every == 0:
                self.checkpoint()


def run_trainer(spec: TrainerSpec, conn: Connection) -> None:
    """Process entry point (a worker process: tltd.contract.processes)."""
    ignore_stop_signals()
    if spec.nice:
        os.nice(spec.nice)
    torch.set_num_threads(spec.threads)
    worker = None
    try:
        worker = _TrainingLoop(spec, conn)
        worker.run()
    except BaseException:
        error = traceback.format_exc()
        if worker is not None:
            worker.send(proto.Failed(error))  # under its lock: the heartbeat thread sends too
        else:
            conn.send(proto.Failed(error))
        raise


class TrainerFailed(RuntimeError):
    pass


class TrainerProcess:
    """Parent-side handle of one drafter-training worker process."""

    def __init__(self, spec: TrainerSpec) -> None:
        ctx = worker_context()
        self.spec = spec
        self.conn, child = ctx.Pipe(duplex=True)
        target, args = with_environment(run_trainer, spec, child)
        self.proc = ctx.Process(target=target, args=args, daemon=True, name="tltd-drafter-train")
        self._child = child
        self.steps: list[proto.StepResult] = []  # every step reported, in order
        self.events: list[proto.FromTrainer] = []  # everything else but heartbeats

    def start(self, timeout: float = 120.0) -> proto.Ready:
        self.spawn()
        return self.wait_for(proto.Ready, timeout)

    def spawn(self) -> None:
        """Start the process (its pid is known from here); `start` also waits for `Ready`."""
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
            case proto.Heartbeat():
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
        self.send(proto.Stop())
        info = self.wait_for(proto.Stopped, timeout)
        self.proc.join(timeout)
        return info

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
