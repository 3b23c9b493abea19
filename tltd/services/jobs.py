"""Job use cases: create (idempotent), read, list, cancel."""

from __future__ import annotations

import importlib.util
import math
import shutil
import uuid
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tltd.domain import (
    MODEL_FREE_DRAFTERS,
    Backend,
    DrafterVersion,
    Job,
    JobStatus,
    NewJob,
    PolicySwitch,
    SpeculativeConfig,
    SpeculativeMode,
)
from tltd.errors import FailedPrecondition, InvalidArgument
from tltd.services.checkpoints import check_drafter_dir, check_model_dir, check_model_weights
from tltd.services.validation import MAX_NAME, MAX_REASON, check_id, check_text
from tltd.settings import Settings

if TYPE_CHECKING:
    from tltd.store import Store
    from tltd.supervisor import Supervisor

_DRAFTERS = ("auto", "ngram", "eagle", "history")
# A draft of k tokens reserves k extra cache positions per sequence; longer drafts are almost
# never accepted in full.
MAX_DRAFT_LENGTH = 64
_INITIAL_DRAFTER = "speculative.initial_drafter_path"


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

        A retry with different parameters is ALREADY_EXISTS (raised by the store). With
        `speculative.initial_drafter_path` the checkpoint is checked against the job's model,
        copied into the daemon's drafter storage and recorded as drafter version 1, promoted.
        """
        check_id(new.job_id, "job_id", required=False)
        model_path = new.model_path or self.settings.default_model_path
        resolved = check_model_dir(model_path, "model_path")
        check_model_weights(resolved, "model_path")
        check_text(new.name, "name", MAX_NAME)
        if not math.isfinite(new.weight) or new.weight < 0:
            raise InvalidArgument(
                f"must be a finite number > 0 (0 = 1.0), got {new.weight}", field="weight"
            )
        backend = new.backend or Backend(self.settings.default_backend)
        switch = new.policy_switch or PolicySwitch.FINISH_ON_START_VERSION
        if switch is PolicySwitch.NEXT_STEP and backend is not Backend.TORCH:
            raise InvalidArgument(
                "NEXT_STEP (switching running samples to a new policy version) is implemented "
                "by the torch backend only",
                field="policy_switch",
            )
        if backend is Backend.SGLANG and not sglang_available():
            raise FailedPrecondition(
                "sglang backend needs a GPU host with sglang installed", field="backend"
            )
        spec = self._speculative(new.speculative)
        if backend is Backend.SIM:
            self._check_simulated(spec)
        source = None
        if spec.initial_drafter_path:
            source = self._check_initial_drafter(spec, resolved)
            spec = replace(spec, initial_drafter_path=str(source))
        job = Job(
            job_id=new.job_id or f"job-{uuid.uuid4().hex[:12]}",
            model_path=str(resolved),
            name=new.name,
            backend=backend,
            priority=new.priority,
            weight=new.weight or 1.0,
            speculative=spec,
            policy_switch=switch,
            max_staleness=new.max_staleness,
        )
        if source is None:
            return self.store.jobs.create(job)
        return self._create_with_drafter(job, source)

    def _check_simulated(self, spec: SpeculativeConfig) -> None:
        """A simulated engine serves only a job that asked for it, on a daemon set to allow it."""
        if not self.settings.sim_engine:
            raise FailedPrecondition(
                "the sim backend (simulated engine: samples drawn, not computed) is off on "
                "this daemon; start it with sim_engine set (TLTD_SIM_ENGINE) to allow it",
                field="backend",
            )
        if spec.online_training:
            raise InvalidArgument(
                "the sim backend draws its tokens: there is nothing to train a drafter on; "
                "set it to false",
                field="speculative.online_training",
            )

    def _check_initial_drafter(self, spec: SpeculativeConfig, model_dir: Path) -> Path:
        if spec.mode is SpeculativeMode.OFF or spec.drafter in MODEL_FREE_DRAFTERS:
            raise InvalidArgument(
                "needs a learned drafter: speculative mode must not be OFF and drafter must "
                "not be 'ngram' or 'history'",
                field=_INITIAL_DRAFTER,
            )
        return check_drafter_dir(spec.initial_drafter_path, _INITIAL_DRAFTER, model_dir)

    def _create_with_drafter(self, job: Job, source: Path) -> tuple[Job, bool]:
        """Copy the drafter into the daemon's storage (the caller's directory may change or go
        away), then create the job with it as version 1; a retry drops the fresh copy."""
        dest = self.settings.drafter_versions_dir(job.job_id) / (
            f"drafter-initial-{uuid.uuid4().hex[:8]}"
        )
        try:
            dest.mkdir(parents=True)
            for name in ("config.json", "model.safetensors"):
                shutil.copyfile(source / name, dest / name)
        except OSError as exc:
            shutil.rmtree(dest, ignore_errors=True)
            raise InvalidArgument(
                f"cannot copy {source} into the daemon's drafter storage: {exc}",
                field=_INITIAL_DRAFTER,
            ) from exc
        initial = DrafterVersion(
            job_id=job.job_id,
            version=1,
            policy_version=0,
            path=str(dest),
            node_id=self.store.node_id,
            shared=bool(self.settings.shared_dir),
        )
        try:
            created, is_new = self.store.jobs.create(job, initial)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        if not is_new:
            shutil.rmtree(dest, ignore_errors=True)
        return created, is_new

    def _speculative(self, spec: SpeculativeConfig | None) -> SpeculativeConfig:
        spec = spec or SpeculativeConfig(batch_threshold=0)
        if spec.drafter not in _DRAFTERS:
            raise InvalidArgument(
                f"must be one of {', '.join(_DRAFTERS)}, got {spec.drafter!r}",
                field="speculative.drafter",
            )
        for i, k in enumerate(spec.draft_lengths):
            if not 1 <= k <= MAX_DRAFT_LENGTH:
                raise InvalidArgument(
                    f"must be in [1, {MAX_DRAFT_LENGTH}], got {k}",
                    field=f"speculative.draft_lengths[{i}]",
                )
            if k in spec.draft_lengths[:i]:  # each length is one arm of the workers' bandit
                raise InvalidArgument(
                    f"repeats draft length {k}", field=f"speculative.draft_lengths[{i}]"
                )
        if spec.batch_threshold == 0:
            spec = replace(spec, batch_threshold=self.settings.spec_batch_threshold)
        return spec

    def get(self, job_id: str) -> Job:
        """The job, with how its bounded requests went (if it has any)."""
        check_id(job_id, "job_id")
        job = self.store.jobs.get(job_id)
        stats = self.store.deliveries.bounded_stats(job_id)
        return job if stats is None else replace(job, bounded=stats)

    def list(self, statuses: list[JobStatus] | None = None, limit: int = 0) -> list[Job]:
        return self.store.jobs.list(statuses=statuses or None, limit=limit or 100)

    def cancel(self, job_id: str, reason: str = "") -> Job:
        """Cancel a job and its unfinished requests.

        Idempotent and converging: cancelling a cancelled job cancels any of its requests still
        open (left by a daemon killed mid-cancel), with the reason the job was cancelled for.
        """
        check_id(job_id, "job_id")
        check_text(reason, "reason", MAX_REASON)
        # A no-op returning the job when it is already cancelled (FailedPrecondition if failed).
        job = self.store.jobs.set_status(
            job_id, JobStatus.CANCELLED, reason or "cancelled by caller"
        )
        why = f"job cancelled: {job.status_reason}"
        # All of them, in one transaction: the store refuses new requests of a cancelled job,
        # so none is left open; one that ended meanwhile keeps its end.
        for request_id in self.store.cancels.cancel_job_requests(job_id, why):
            if self.supervisor is not None:
                self.supervisor.cancel_threadsafe(request_id, why)
        return job
