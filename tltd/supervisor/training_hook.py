"""The seam between the supervisor and drafter training (implemented by `tltd.drafter_training`)."""

from __future__ import annotations

from typing import Protocol

from tltd.domain import Sample
from tltd.scheduler import TrainingView


class TrainingHook(Protocol):
    """The seam for drafter-training workers (kind `drafter_training`, see workers/drafter).

    The supervisor passes the hook's view into every snapshot and applies the scheduler's
    training decisions through it; without a hook no training is scheduled.
    """

    def views(self) -> tuple[TrainingView, ...]: ...

    def job_view(self, job_id: str) -> tuple[int, float | None, bool]:
        """(fresh samples not yet trained on, when its last round started, whether that round
        was preempted before its steps were done) for a job."""
        ...

    def on_sample(self, job_id: str, prompt: tuple[int, ...], sample: Sample) -> None:
        """A complete sample (stop/length) for the training buffer: tokens = prompt +
        sample.token_ids, the response starting at len(prompt)."""
        ...

    async def start(self, device_id: str, job_id: str) -> None: ...

    async def preempt(self, device_id: str, reason: str) -> None: ...
