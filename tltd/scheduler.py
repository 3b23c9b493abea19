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
    policy_updating: bool = False  # a worker is loading new policy weights for this job
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
    """One scheduling tick: place pending work, preempt training it needs, detect idle devices,
    start training.

    Rollout always wins over drafter training, for any job's work: training yields on a device
    whose rollout worker gets work in the balanced placement, and on devices that must switch
    to a job whose work no worker can take (its workers are full or hold another version).
    """
    schedulable = {d.device_id for d in snap.devices if d.schedulable}
    jobs = {j.job_id: j for j in snap.jobs}
    training = {t.device_id for t in snap.training}
    reasons: dict[str, str] = {}

    preempt = [t.device_id for t in snap.training if t.device_id not in schedulable]
    for device_id in preempt:
        reasons[device_id] = "device cordoned, draining or foreign"

    # Place as if training had already yielded, so weighted fair share and load balance decide
    # alone; a training device whose worker got work is needed now.
    assignments, load = _place(snap, cfg, schedulable, training, jobs)
    worker_device = {w.worker_id: w.device_id for w in snap.workers}
    needed = {worker_device[a.worker_id] for a in assignments} & training
    for t in snap.training:
        if t.device_id in needed and t.device_id not in preempt:
            preempt.append(t.device_id)
            reasons[t.device_id] = "rollout work is waiting"

    # Work that fits no worker now needs a free worker switched to its job (the supervisor loads
    # the model): free rollout devices are used first, training yields only for the rest.
    reserved, waiting = _reserve_for_unplaced(snap, cfg, schedulable, training, jobs, assignments)
    for device_id in reserved:
        if device_id in training and device_id not in preempt:
            preempt.append(device_id)
            reasons[device_id] = f"rollout work is waiting (no free worker for job {waiting})"

    # A training device is not idle even when preempted: it is busy yielding this tick.
    busy = training | set(reserved)
    idle = _idle_devices(snap, cfg, schedulable, load, busy)
    starts = _training_starts(snap, cfg, idle, jobs, training - set(preempt))
    for s in starts:
        reasons[s.device_id] = f"idle for >= {cfg.idle_grace_seconds:g}s with fresh data"
    return Decision(tuple(assignments), tuple(idle), tuple(starts), tuple(preempt), reasons)


def _place(
    snap: Snapshot,
    cfg: SchedulerConfig,
    schedulable: set[str],
    training_devices: set[str],
    jobs: dict[str, JobView],
) -> tuple[list[Assignment], dict[str, tuple[int, int]]]:
    """Weighted fair share across jobs, least expected remaining work across workers.

    Workers on training devices count as free (rollout wins), but on a tie a worker whose
    device is not training is preferred, so training is not preempted for nothing.
    """
    # (running samples, remaining tokens) per eligible worker; mutated as we place.
    load = {
        w.worker_id: (w.running_samples, w.remaining_tokens)
        for w in snap.workers
        if w.ready and w.device_id in schedulable
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
            wid = min(
                candidates,
                key=lambda w: (
                    load[w][1],
                    load[w][0],
                    by_worker[w].device_id in training_devices,
                    w,
                ),
            )
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


def _reserve_for_unplaced(
    snap: Snapshot,
    cfg: SchedulerConfig,
    schedulable: set[str],
    training_devices: set[str],
    jobs: dict[str, JobView],
    assignments: list[Assignment],
) -> tuple[list[str], str]:
    """Devices whose free workers should switch to the work left unplaced, and its job ids.

    A worker is free when it runs nothing and got nothing this tick; its device counts for
    `max_samples_per_worker` per free worker. Free rollout devices come first, then training
    devices, each in id order, until the unplaced samples are covered.
    """
    placed: dict[tuple[str, int], int] = {}
    for a in assignments:
        key = (a.request_id, a.prompt_index)
        placed[key] = placed.get(key, 0) + a.samples
    unplaced: dict[str, int] = {}
    for p in snap.pending:
        left = p.samples - placed.get((p.request_id, p.prompt_index), 0)
        if left > 0 and p.job_id in jobs:
            unplaced[p.job_id] = unplaced.get(p.job_id, 0) + left
    need = sum(unplaced.values())
    if not need:
        return [], ""
    taken = {a.worker_id for a in assignments}
    in_use = {w.device_id for w in snap.workers if w.running_samples or w.worker_id in taken}
    capacity: dict[str, int] = {}
    for w in snap.workers:
        if w.device_id in schedulable and w.device_id not in in_use:
            capacity[w.device_id] = capacity.get(w.device_id, 0) + cfg.max_samples_per_worker
    reserved = []
    for device_id in sorted(capacity, key=lambda d: (d in training_devices, d)):
        if need <= 0:
            break
        reserved.append(device_id)
        need -= capacity[device_id]
    return reserved, ", ".join(sorted(unplaced))


def _idle_devices(
    snap: Snapshot,
    cfg: SchedulerConfig,
    schedulable: set[str],
    load: dict[str, tuple[int, int]],
    busy_devices: set[str],
) -> list[str]:
    """A device is idle when no worker on it has work, for at least the idle grace period."""
    idle = []
    for d in snap.devices:
        if d.device_id not in schedulable or d.device_id in busy_devices:
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
