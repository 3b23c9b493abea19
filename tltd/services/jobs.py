"""Job use cases: create (idempotent), read, list, cancel."""

from __future__ import annotations

import importlib.util
import math
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tltd.domain import Backend, Job, JobStatus, RequestStatus, SpeculativeConfig
from tltd.errors import FailedPrecondition, InvalidArgument
from tltd.services.checkpoints import check_model_dir
from tltd.services.validation import check_id
from tltd.settings import Settings

if TYPE_CHECKING:
    from tltd.store import Store
    from tltd.supervisor import Supervisor

_DRAFTERS = ("auto", "ngram", "eagle")


@dataclass(frozen=True)
class NewJob:
    """What a caller asks for; None / 0 mean "the daemon's default" and are resolved here."""

    job_id: str = ""
    model_path: str = ""
    name: str = ""
    backend: Backend | None = None
    priority: int = 0
    weight: float = 0.0  # 0 -> 1.0
    speculative: SpeculativeConfig | None = None  # batch_threshold 0 -> settings default


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None


class JobService:
    def __init__(
        self, store: Store, settings: Settings, supervisor: Supervisor | None = None
    ) -> None:
        self.store = store
        self.settings = settings
        self.supervisor = supervisor

    def create(self, new: NewJob) -> tuple[Job, bool]:
        """Create a job, or return the existing one for a retried job_id (created=False).

        A retry with different parameters is ALREADY_EXISTS (raised by the store).
        """
        check_id(new.job_id, "job_id", required=False)
        model_path = new.model_path or self.settings.default_model_path
        resolved = check_model_dir(model_path, "model_path")
        if math.isnan(new.weight) or new.weight < 0:
            raise InvalidArgument(f"must be >= 0 (0 = 1.0), got {new.weight}", field="weight")
        backend = new.backend or Backend(self.settings.default_backend)
        if backend is Backend.SGLANG and not sglang_available():
            raise FailedPrecondition(
                "sglang backend needs a GPU host with sglang installed", field="backend"
            )
        job = Job(
            job_id=new.job_id or f"job-{uuid.uuid4().hex[:12]}",
            model_path=str(resolved),
            name=new.name,
            backend=backend,
            priority=new.priority,
            weight=new.weight or 1.0,
            speculative=self._speculative(new.speculative),
        )
        return self.store.create_job(job)

    def _speculative(self, spec: SpeculativeConfig | None) -> SpeculativeConfig:
        spec = spec or SpeculativeConfig(batch_threshold=0)
        if spec.drafter not in _DRAFTERS:
            raise InvalidArgument(
                f"must be one of {', '.join(_DRAFTERS)}, got {spec.drafter!r}",
                field="speculative.drafter",
            )
        for i, k in enumerate(spec.draft_lengths):
            if k < 1:
                raise InvalidArgument("must be >= 1", field=f"speculative.draft_lengths[{i}]")
        if spec.batch_threshold == 0:
            spec = replace(spec, batch_threshold=self.settings.spec_batch_threshold)
        return spec

    def get(self, job_id: str) -> Job:
        check_id(job_id, "job_id")
        return self.store.get_job(job_id)

    def list(self, statuses: list[JobStatus] | None = None, limit: int = 0) -> list[Job]:
        return self.store.list_jobs(statuses=statuses or None, limit=limit or 100)

    def cancel(self, job_id: str, reason: str = "") -> Job:
        """Cancel a job and its unfinished requests; cancelling a cancelled job is a no-op."""
        job = self.get(job_id)
        if job.status is JobStatus.CANCELLED:
            return job
        reason = reason or "cancelled by caller"
        job = self.store.set_job_status(job_id, JobStatus.CANCELLED, reason)
        open_statuses = [RequestStatus.QUEUED, RequestStatus.RUNNING]
        for req in self.store.list_requests(statuses=open_statuses, job_id=job_id):
            why = f"job cancelled: {reason}"
            self.store.set_request_status(req.request_id, RequestStatus.CANCELLED, why)
            if self.supervisor is not None:
                self.supervisor.cancel_threadsafe(req.request_id, why)
        return job
