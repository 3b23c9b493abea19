"""Pure scheduling policy: from a node snapshot, decide placement, idleness, training, preemption.

No I/O and no clock: the caller passes `now`, so every decision is reproducible in a table-driven
test. The supervisor (issue 5) turns a `Decision` into process actions.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SchedulerConfig:
    idle_grace_seconds: float = 2.0  # a device must be idle this long before training starts on it
    min_fresh_samples: int = 32  # fresh rollout samples a job needs before a training round
    training_cadence_seconds: float = 30.0  # minimum time between training starts for one job
    max_samples_per_worker: int = 64  # the engine's batch capacity


@dataclass(frozen=True)
class DeviceView:
    device_id: str
    schedulable: bool  # not foreign, not cordoned, not draining


@dataclass(frozen=True)
class RolloutWorkerView:
    worker_id: str
    device_id: str
    job_id: str  # the job whose policy it has loaded ("" = any)
    ready: bool
    running_samples: int = 0
    remaining_tokens: int = 0  # expected tokens still to decode for what it runs
    idle_since: float | None = None  # when it last had nothing to do; None = busy
    policy_version: int = 0  # the policy version its engine has loaded


@dataclass(frozen=True)
class TrainingView:
    device_id: str
    job_id: str


@dataclass(frozen=True)
class PendingWork:
    """One prompt's samples waiting for a worker (n samples of a prompt may spread)."""

    request_id: str
    prompt_index: int
    job_id: str
    samples: int
    expected_tokens: int  # per sample (max_new_tokens, or an estimate from recent lengths)
    enqueued_at: float
    # A request runs on one policy version from start to end: only workers that have loaded
    # this version may take it (None = any version).
    policy_version: int | None = None


@dataclass(frozen=True)
class JobView:
    job_id: str
    weight: float = 1.0
    priority: int = 0
    served_tokens: int = 0  # tokens decoded for this job so far (the fair-share account)
    fresh_samples: int = 0  # finished samples not yet used for drafter training
    last_training_at: float | None = None
    policy_updating: bool = False
    online_training: bool = True


@dataclass(frozen=True)
class Snapshot:
    now: float
    devices: tuple[DeviceView, ...]
    workers: tuple[RolloutWorkerView, ...]
    training: tuple[TrainingView, ...]
    pending: tuple[PendingWork, ...]
    jobs: tuple[JobView, ...]


@dataclass(frozen=True)
class Assignment:
    request_id: str
    prompt_index: int
    samples: int
    worker_id: str


@dataclass(frozen=True)
class Decision:
    assignments: tuple[Assignment, ...] = ()
    idle_devices: tuple[str, ...] = ()
    start_training: tuple[TrainingView, ...] = ()
    preempt_training: tuple[str, ...] = ()  # device ids whose training must yield now
    reasons: dict[str, str] = field(default_factory=dict)  # device id -> why (for events)


def schedule(snap: Snapshot, cfg: SchedulerConfig = SchedulerConfig()) -> Decision:
    """One scheduling tick: preempt, place pending work, detect idle devices, start training."""
    schedulable = {d.device_id for d in snap.devices if d.schedulable}
    jobs = {j.job_id: j for j in snap.jobs}
    reasons: dict[str, str] = {}

    # Rollout always wins: training yields the moment its device is needed or no longer ours.
    waiting_jobs = {p.job_id for p in snap.pending}
    preempt = []
    for t in snap.training:
        if t.device_id not in schedulable:
            preempt.append(t.device_id)
            reasons[t.device_id] = "device cordoned, draining or foreign"
        elif _device_has_rollout_worker_for(snap, t.device_id, waiting_jobs):
            preempt.append(t.device_id)
            reasons[t.device_id] = "rollout work is waiting"
    training_devices = {t.device_id for t in snap.training} - set(preempt)

    assignments, load = _place(snap, cfg, schedulable, training_devices, jobs)

    idle = _idle_devices(snap, cfg, schedulable, load, training_devices)
    starts = _training_starts(snap, cfg, idle, jobs, training_devices)
    for s in starts:
        reasons[s.device_id] = f"idle for >= {cfg.idle_grace_seconds:g}s with fresh data"
    return Decision(tuple(assignments), tuple(idle), tuple(starts), tuple(preempt), reasons)


def _device_has_rollout_worker_for(snap: Snapshot, device_id: str, job_ids: set[str]) -> bool:
    return any(
        w.device_id == device_id and (w.job_id in job_ids or (w.job_id == "" and job_ids))
        for w in snap.workers
    )


def _place(
    snap: Snapshot,
    cfg: SchedulerConfig,
    schedulable: set[str],
    training_devices: set[str],
    jobs: dict[str, JobView],
) -> tuple[list[Assignment], dict[str, tuple[int, int]]]:
    """Weighted fair share across jobs, least expected remaining work across workers."""
    # (running samples, remaining tokens) per eligible worker; mutated as we place.
    load = {
        w.worker_id: (w.running_samples, w.remaining_tokens)
        for w in snap.workers
        if w.ready and w.device_id in schedulable and w.device_id not in training_devices
    }
    by_worker = {w.worker_id: w for w in snap.workers}
    # Virtual time per job: tokens served / weight. Higher priority always goes first.
    served = {j: float(v.served_tokens) for j, v in jobs.items()}
    queues: dict[str, list[PendingWork]] = {}
    for p in sorted(snap.pending, key=lambda p: (p.enqueued_at, p.request_id, p.prompt_index)):
        if p.job_id in jobs:
            queues.setdefault(p.job_id, []).append(p)

    assignments: list[Assignment] = []
    while queues:
        job_id = min(
            queues,
            key=lambda j: (-jobs[j].priority, served[j] / max(jobs[j].weight, 1e-9), j),
        )
        work = queues[job_id][0]
        per_worker: dict[str, int] = {}
        remaining = work.samples
        # One sample at a time to the worker with the least expected remaining work, so the n
        # samples of a prompt spread when that balances the load (long tails are the cost).
        while remaining > 0:
            candidates = [
                wid
                for wid, (running, _) in load.items()
                if by_worker[wid].job_id in (job_id, "")
                and work.policy_version in (None, by_worker[wid].policy_version)
                and running < cfg.max_samples_per_worker
            ]
            if not candidates:
                break
            wid = min(candidates, key=lambda w: (load[w][1], load[w][0], w))
            running, tokens = load[wid]
            load[wid] = (running + 1, tokens + work.expected_tokens)
            per_worker[wid] = per_worker.get(wid, 0) + 1
            served[job_id] += work.expected_tokens
            remaining -= 1
        assignments += [
            Assignment(work.request_id, work.prompt_index, count, wid)
            for wid, count in per_worker.items()
        ]
        if remaining > 0:
            # No room for this prompt (workers of its job and version are full): the job's
            # later prompts wait too, so that a job keeps its FIFO order; other jobs may place.
            del queues[job_id]
            continue
        queues[job_id].pop(0)
        if not queues[job_id]:
            del queues[job_id]
    return assignments, load


def _idle_devices(
    snap: Snapshot,
    cfg: SchedulerConfig,
    schedulable: set[str],
    load: dict[str, tuple[int, int]],
    training_devices: set[str],
) -> list[str]:
    """A device is idle when no worker on it has work, for at least the idle grace period."""
    idle = []
    for d in snap.devices:
        if d.device_id not in schedulable or d.device_id in training_devices:
            continue
        workers = [w for w in snap.workers if w.device_id == d.device_id]
        busy = any(load.get(w.worker_id, (w.running_samples, 0))[0] > 0 for w in workers)
        if busy:
            continue
        since = min((w.idle_since for w in workers if w.idle_since is not None), default=None)
        if workers and (since is None or snap.now - since < cfg.idle_grace_seconds):
            continue
        idle.append(d.device_id)
    return idle


def _training_starts(
    snap: Snapshot,
    cfg: SchedulerConfig,
    idle: list[str],
    jobs: dict[str, JobView],
    training_devices: set[str],
) -> list[TrainingView]:
    """Start drafter training on idle devices for jobs with enough fresh data, at a cadence."""
    training_jobs = {t.job_id for t in snap.training if t.device_id in training_devices}
    eligible = sorted(
        (
            j
            for j in jobs.values()
            if j.online_training
            and not j.policy_updating
            and j.job_id not in training_jobs
            and j.fresh_samples >= cfg.min_fresh_samples
            and (
                j.last_training_at is None
                or snap.now - j.last_training_at >= cfg.training_cadence_seconds
            )
        ),
        key=lambda j: (-j.fresh_samples, j.job_id),
    )
    # One training task per job; the most data-rich job gets the first idle device.
    return [TrainingView(d, j.job_id) for d, j in zip(idle, eligible, strict=False)]
