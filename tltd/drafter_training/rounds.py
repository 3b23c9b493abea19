"""A round on a live trainer: begin (train towards a step), end (measure and publish a
candidate), give the device back; the preemptions it met and the publishes a lost lease refused.

A round is `training_steps_per_round` optimizer steps on the device the scheduler gave; at its
end the trainer saves its drafter and measures held-out acceptance against the active version
(`Measure`); the version is recorded and promoted only when it beats the active one
(`versions.py`), and the supervisor then hot-swaps a promoted version into the rollout workers.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING

from tltd.contract import drafter_messages as proto
from tltd.domain import DeviceState, WorkerState
from tltd.drafter_training.lease import LeaseHolder
from tltd.drafter_training.records import TrainingRecords
from tltd.drafter_training.runs import Preemption, TrainerPhase, TrainerRun
from tltd.drafter_training.samples import SampleBuffers
from tltd.drafter_training.versions import active_drafter, publish, record
from tltd.errors import Fenced
from tltd.metrics import METRICS
from tltd.settings import Settings

if TYPE_CHECKING:
    from tltd.store import Store

log = logging.getLogger(__name__)


class RoundRunner:
    """Runs the rounds of this node's trainers; keeps their preemptions and refused publishes."""

    def __init__(
        self,
        store: Store,
        settings: Settings,
        samples: SampleBuffers,
        leases: LeaseHolder,
        records: TrainingRecords,
        kick: Callable[[], None],
    ) -> None:
        self.store = store
        self.settings = settings
        self.samples = samples
        self.leases = leases
        self.records = records
        self.kick = kick  # the supervisor's: a device freed or a version promoted
        self.cluster = store.dialect == "postgresql"
        self.preemptions: list[Preemption] = []
        self.fenced: list[tuple[str, int]] = []  # (job, lease epoch) of publishes refused

    async def begin(self, run: TrainerRun, reason: str) -> None:
        """Feed the trainer what it has not seen and train towards the round's target (a
        measurement cut short is asked again first)."""
        unsent = self.samples.take_unsent(run.job_id)
        if unsent:
            run.send(proto.AddSamples(tuple(unsent)))
        if run.round.measure_due:  # the round's steps are done; its measurement was cut short
            phase = run.phase
            why = f"{reason} (measuring step {run.step})"
            await self.records.worker(run, WorkerState.BUSY, why)
            if run.phase is phase:  # not preempted meanwhile (then it is asked again next time)
                await self.end(run, f"round done at step {run.step}")
            return
        run.to(TrainerPhase.TRAINING)
        target = run.round.target
        if target <= run.step:
            target = run.step + self.settings.training_steps_per_round
        run.round.target, run.round.open = target, True
        run.send(proto.Train(target))
        await self.records.worker(run, WorkerState.BUSY, f"{reason} (steps {run.step} -> {target})")

    async def end(self, run: TrainerRun, why: str) -> None:
        """The round's steps are done: measure a candidate if it trained, else give back."""
        held = self.samples.held(run.job_id)
        if run.step > run.round.published_step and held:
            run.to(TrainerPhase.PUBLISHING)
            active = await asyncio.to_thread(active_drafter, self.store, run.job_id)
            out_dir = str(self.settings.drafter_versions_dir(run.job_id))
            run.lease.measured_to = self.leases.read_to.get(run.job_id, 0)
            run.round.measure_due = True
            run.send(proto.Measure(held, run.policy_version, out_dir, active))
            return
        run.round.measure_due = False
        self.release(run, why)

    def release(self, run: TrainerRun, why: str) -> None:
        """The round is over: free the device (moves state off an accelerator, checkpoints)."""
        run.to(TrainerPhase.RELEASING)
        run.preempt_reason = why
        run.send(proto.Preempt())

    async def on_measured(self, run: TrainerRun, m: proto.Measured) -> str | None:
        """Record the candidate; the daemon decides whether it is promoted. Several nodes: the
        publish is fenced by the lease; a refused one is deleted and the reason to stop its
        trainer returned (None: recorded)."""
        run.round.published_step = m.train_steps
        run.round.measure_due = run.round.open = False
        shared = bool(self.settings.shared_dir)
        if self.cluster:
            args = (run.job_id, m, run.lease.epoch, shared, run.lease.measured_to)
            try:
                dv = await self.records.write(publish, self.store, *args, fenced=True)
            except Fenced as exc:
                log.warning(
                    "drafter lease lost: version not published, trainer stopped",
                    extra={"job_id": run.job_id, "error": str(exc)},
                )
                self.fenced.append((run.job_id, run.lease.epoch))
                await asyncio.to_thread(shutil.rmtree, m.path, True)
                self.leases.held.pop(run.job_id, None)
                return f"drafter lease lost: {exc}"
        else:
            dv = await self.records.write(record, self.store, run.job_id, m, 0.0, shared)
        status = dv.status.value if dv is not None else "not recorded"
        version = dv.version if dv is not None else 0
        log.info(
            "drafter version published",
            extra={"job_id": run.job_id, "version": version, "status": status},
        )
        self.kick()  # a promoted version is hot-swapped by the supervisor's next tick
        if run.phase is TrainerPhase.PUBLISHING:
            self.release(run, f"round done: published version {version} ({status})")
        return None

    async def on_device_free(self, run: TrainerRun, m: proto.DeviceFree) -> None:
        """The trainer gave its device back (preempted, or its round over): record it idle."""
        if run.phase not in (TrainerPhase.PREEMPTING, TrainerPhase.RELEASING):
            return
        why = run.preempt_reason
        if run.phase is TrainerPhase.PREEMPTING:
            why = self.note_preemption(run, m.step)
        if run.round.measure_due:  # its measurement was given up: resumed on the next idle device
            run.round.open = True
            why = f"{why}; the round's measurement is asked again next time"
        # Idle once the device's IDLE is written: a start seen idle before that would record
        # TRAINING first, and this IDLE would land after it.
        await self.records.worker(run, WorkerState.READY, why)
        await self.records.device(run.device_id, DeviceState.IDLE, why)
        if run.phase in (TrainerPhase.PREEMPTING, TrainerPhase.RELEASING):  # not stopped meanwhile
            run.to(TrainerPhase.IDLE)
        run.preempt_at = None
        self.kick()

    def note_preemption(self, run: TrainerRun, step: int) -> str:
        """Record a preemption whose device is free now; returns the reason to record."""
        p = run.preemption(step)
        if p is None:
            return run.preempt_reason
        self.preemptions.append(p)
        METRICS.record_preemption(run.device_id, "rollout", latency_seconds=p.latency_seconds)
        ms = round(p.latency_seconds * 1000, 1)
        log.info("drafter training preempted", extra={"job_id": run.job_id, "latency_ms": ms})
        return f"preempted: {run.preempt_reason}; device free after {ms:.0f} ms"
