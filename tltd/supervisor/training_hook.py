"""The seam between the supervisor and drafter training (implemented by `tltd.drafter_training`)."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from tltd.domain import Sample
from tltd.scheduler import TrainingView


class JobTraining(NamedTuple):
    """What the scheduler sees of one job's drafter training."""

    fresh: int  # finished samples since its last round started
    last_started: float | None  # when that round started (monotonic)
    cut_short: bool  # that round was preempted before its steps were done
    buffered: int = 0  # samples its trainer can train on now, fresh or not


class TrainingHook(Protocol):
    """The seam for drafter-training workers (kind `drafter_training`, see workers/drafter).

    The supervisor passes the hook's view into every snapshot and applies the scheduler's
    training decisions through it; without a hook no training is scheduled.
    """

    def views(self) -> tuple[TrainingView, ...]: ...

    def job_view(self, job_id: str) -> JobTraining: ...

    def on_sample(self, job_id: str, prompt: tuple[int, ...], sample: Sample) -> None:
        """A complete sample (stop/length) for the training buffer: tokens = prompt +
        sample.token_ids, the response starting at len(prompt)."""
        ...

    async def start(self, device_id: str, job_id: str) -> None: ...

    async def preempt(self, device_id: str, reason: str) -> None: ...
