"""The drafter-training process's loop: trains on the device it is given, yields it on request.

Protocol over one duplex pipe: the typed messages of `tltd.contract.drafter_messages` (commands
`AddSamples`, `Train`, `Preempt`, `WriteCheckpoint`, `Measure`, `SetPolicy`, `StopTrainer`;
reports `TrainerReady`, `Stepped`, `Idle`, `DeviceFree`, `Checkpointed`, `Measured`, `Stopped`,
`Failed`, and a `TrainerHeartbeat` every `heartbeat_seconds` after `TrainerReady`, from a thread:
a long step or measure is not silence). The trainer measures; the daemon decides what becomes a
drafter version.

A preempt is honoured between micro-steps (`Trainer.train_step(should_stop)`): the partial step
is dropped, host copies of the trainable + optimizer state are taken, accelerator memory is
released, "device_free" is sent, and only then is the checkpoint written on a background thread.
The worker keeps its buffer and state in memory while idle, so a later ("train") resumes exactly
there; a restarted worker resumes from `checkpoint_dir/LATEST` (the buffer is volatile: the
daemon re-feeds recent samples, and ids of the saved epoch order that are missing are skipped).
"""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import Connection

import torch

from tltd.contract import drafter_messages as proto
from tltd.contract.drafter_messages import TrainerSpec
from tltd_workers.drafter.buffer import TrainingBuffer
from tltd_workers.drafter.trainer import (
    CheckpointWriter,
    Stop,
    Trainer,
    latest_checkpoint,
    load_state,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TrainingLoop:
    """One trainer process's state and loop: messages in, steps and reports out."""

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
        self.interrupt: proto.Preempt | proto.StopTrainer | None = None  # received mid-step
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
            case proto.StopTrainer():
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
            if isinstance(m, proto.Preempt | proto.StopTrainer):
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
                self.send(proto.TrainerHeartbeat())
            except (OSError, ValueError):
                return  # the daemon is gone

    # -- loop -----------------------------------------------------------------------------------

    def run(self) -> None:
        self.send(proto.TrainerReady(self.trainer.step, self.resumed_from, len(self.buffer)))
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
