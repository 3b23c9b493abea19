"""The daemon's side of a drafter version: what a candidate is measured against, and the
decision (promote or reject) recorded from what the trainer measured."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tltd.domain import DrafterStatus, DrafterVersion
from tltd_workers.drafter.protocol import ActiveDrafter, Measured

if TYPE_CHECKING:
    from tltd.store import Store


def active_drafter(store: Store, job_id: str) -> ActiveDrafter | None:
    """The version a job's next candidate must beat (pinned, else newest promoted)."""
    version = store.active_drafter_version(job_id)
    if not version:
        return None
    current = store.get_drafter(job_id, version)
    return ActiveDrafter(version, current.path, current.acceptance_length)


def record(store: Store, job_id: str, m: Measured, min_gain: float = 0.0) -> DrafterVersion:
    """Record a measured candidate as a version: PROMOTED (active from now) only when its
    held-out acceptance exceeds the baseline by more than `min_gain`, else REJECTED (kept on
    disk for inspection)."""
    dv = store.add_drafter_version(
        DrafterVersion(
            job_id=job_id,
            version=0,
            policy_version=m.policy_version,
            path=m.path,
            train_steps=m.train_steps,
            loss=m.loss,
            acceptance_length=m.acceptance,
        )
    )
    better = m.acceptance > m.baseline + min_gain
    reason = (
        f"held-out acceptance {m.acceptance:.3f} vs {m.baseline:.3f} of {m.against} "
        f"on {m.held_out} samples, k={m.k}"
    )
    status = DrafterStatus.PROMOTED if better else DrafterStatus.REJECTED
    return store.set_drafter_status(job_id, dv.version, status, reason)
