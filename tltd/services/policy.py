"""Policy use cases: record new policy weights pushed by the trainer, read versions."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from tltd.domain import JobStatus, PolicyVersion
from tltd.errors import FailedPrecondition, InvalidArgument, Unimplemented
from tltd.services.checkpoints import check_model_dir, check_policy_checkpoint
from tltd.services.validation import MAX_REASON, check_id, check_text

if TYPE_CHECKING:
    from tltd.store import Store
    from tltd.supervisor import Supervisor


class PolicyService:
    def __init__(self, store: Store, supervisor: Supervisor | None = None) -> None:
        self.store = store
        self.supervisor = supervisor

    def update(
        self, job_id: str, source: str | None, path: str = "", note: str = ""
    ) -> PolicyVersion:
        """Record a new policy version for an active job; new requests run on it.

        Requests accepted before keep running on the version they started with (every sample
        records the version that produced it); workers switch once they are free of them.

        `source` is which arm of the request's oneof was set: "checkpoint" (a Hugging Face
        directory with config.json and *.safetensors), "tensors" or "nccl" (reserved arms:
        PushPolicy and OpenBroadcast carry those), None.
        """
        check_id(job_id, "job_id")
        check_text(note, "note", MAX_REASON)
        if source is None:
            raise InvalidArgument("one of checkpoint, tensors or nccl is required", field="source")
        if source in ("tensors", "nccl"):
            instead = {
                "tensors": "send the tensors with PushPolicy (chunked, resumable, or a delta)",
                "nccl": "open a broadcast with OpenBroadcast (backend gloo or nccl), then "
                "commit it with PushPolicy",
            }[source]
            raise Unimplemented(f"UpdatePolicy from {source} is reserved: {instead}")
        if source != "checkpoint":
            raise InvalidArgument(f"unknown source {source!r}", field="source")
        job = self.store.jobs.get(job_id)
        if job.status is not JobStatus.ACTIVE:
            raise FailedPrecondition(f"job {job_id} is {job.status.value}", field="job_id")
        resolved = check_model_dir(path, "checkpoint.path", require_weights=True)
        check_policy_checkpoint(resolved, Path(job.model_path), "checkpoint.path")
        return self.record(job_id, "checkpoint", str(resolved), note)

    def record(self, job_id: str, source: str, path: str, note: str) -> PolicyVersion:
        """Make the checked checkpoint in `path` the job's next version (every path to a new
        version ends here: a checkpoint directory, a push)."""
        # Announced to the supervisor around the write, so that a tick which read the jobs
        # before it cannot start drafter training on that stale read.
        gate = self.supervisor.updating_policy(job_id) if self.supervisor else nullcontext()
        with gate:
            version = self.store.policies.add(job_id, source, path, note=note)
        if self.supervisor is not None:
            # Idle workers load it now; busy ones once their old-version work is done.
            self.supervisor.kick_threadsafe()
        return version

    def get(self, job_id: str, version: int | None = None) -> PolicyVersion:
        check_id(job_id, "job_id")
        return self.store.policies.get(job_id, version)
