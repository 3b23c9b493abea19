"""The daemon's side of a drafter version: what a candidate is measured against, and the
decision (promote or reject) recorded from what the trainer measured."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tltd.contract.drafter_messages import ActiveDrafter, Measured
from tltd.domain import DrafterStatus, DrafterVersion

if TYPE_CHECKING:
    from tltd.store import Store


def active_drafter(store: Store, job_id: str) -> ActiveDrafter | None:
    """The version a job's next candidate must beat (pinned, else newest promoted). A version
    this node cannot read (another node's local storage) is compared by its recorded
    acceptance: its path is not given."""
    version = store.drafters.active_version(job_id)
    if not version:
        return None
    current = store.drafters.get(job_id, version)
    path = current.path if current.readable_on(store.node_id) else ""
    return ActiveDrafter(version, path, current.acceptance_length)


def _decide(m: Measured, min_gain: float) -> tuple[DrafterStatus, str]:
    better = m.acceptance > m.baseline + min_gain
    reason = (
        f"held-out acceptance {m.acceptance:.3f} vs {m.baseline:.3f} of {m.against} "
        f"on {m.held_out} samples, k={m.k}"
    )
    return (DrafterStatus.PROMOTED if better else DrafterStatus.REJECTED), reason


def _candidate(job_id: str, m: Measured, shared: bool, **more) -> DrafterVersion:
    """The version row of a measured candidate (its number is given by the store)."""
    return DrafterVersion(
        job_id=job_id,
        version=0,
        policy_version=m.policy_version,
        path=m.path,
        train_steps=m.train_steps,
        loss=m.loss,
        acceptance_length=m.acceptance,
        shared=shared,
        **more,
    )


def publish(
    store: Store,
    job_id: str,
    m: Measured,
    lease_epoch: int,
    shared: bool,
    cursor: int,
    min_gain: float = 0.0,
) -> DrafterVersion:
    """Several nodes: record a measured candidate as a version written by this node, decided
    as `record` decides, with `cursor` (the last sample id it was trained on), fenced by the
    drafter lease (`tltd.errors.Fenced`, nothing recorded, when the lease of `lease_epoch` is
    no longer this node's)."""
    status, reason = _decide(m, min_gain)
    dv = _candidate(job_id, m, shared)
    return store.drafter_leases.publish(dv, lease_epoch, status, reason, cursor)


def record(
    store: Store, job_id: str, m: Measured, min_gain: float = 0.0, shared: bool = False
) -> DrafterVersion:
    """Record a measured candidate as a version: PROMOTED (active from now) only when its
    held-out acceptance exceeds the baseline by more than `min_gain`, else REJECTED (kept on
    disk for inspection)."""
    dv = store.drafters.add(_candidate(job_id, m, shared, node_id=store.node_id))
    status, reason = _decide(m, min_gain)
    return store.drafters.set_status(job_id, dv.version, status, reason)
