"""What the scheduler sees: the supervisor's state folded into a `tltd.scheduler.Snapshot`.

Kept apart from the process code so the folding rules (which device is schedulable, which
worker is ready, what a job's training account is) are plain functions of plain values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from tltd.domain import Device, Job, PolicySwitch
from tltd.scheduler import DeviceView, JobView, RolloutWorkerView, Snapshot
from tltd.supervisor.training_hook import JobTraining, TrainingHook
from tltd.supervisor.work_queue import WorkQueue
from tltd.supervisor.worker_process import Phase, WorkerHandle

NO_TRAINING = JobTraining(0, None, False)


def device_view(d: Device) -> DeviceView:
    """Cordoned, draining, foreign and unavailable devices all get no new work."""
    return DeviceView(d.device_id, d.schedulable)


def worker_view(s: WorkerHandle, queue: WorkQueue) -> RolloutWorkerView:
    # Work sent but not yet acknowledged by a heartbeat counts at its full token budget.
    tokens = (s.heartbeat.remaining_tokens if s.heartbeat else 0) + sum(s.unacked.values())
    return RolloutWorkerView(
        s.worker_id,
        s.device.device_id,
        s.job_id,
        ready=s.phase is Phase.READY and bool(s.job_id),
        running_samples=queue.inflight(s.worker_id),
        remaining_tokens=tokens,
        idle_since=s.idle_since,
        policy_version=s.policy_version,
        switching_to=s.next_job or s.loading_job,
        prefill_steps_per_token=prefill_steps_per_token(s.heartbeat.stats if s.heartbeat else {}),
    )


def prefill_steps_per_token(stats: Mapping[str, object]) -> float | None:
    """What one more prompt token of a prefill costs, in decode steps, from an engine's
    counters (its prefill slope over its mean decode pass); None until it has measured both
    (and for engines that do not report them)."""
    slope = stats.get("prefill_seconds_per_token")
    steps, seconds = stats.get("steps"), stats.get("seconds")
    if not isinstance(slope, float) or not isinstance(steps, dict) or not steps.get("total"):
        return None
    if not isinstance(seconds, dict):
        return None
    decode = sum(seconds.get(k, 0.0) for k in ("plain_decode", "draft", "verify"))
    return slope * steps["total"] / decode if decode > 0 else None


def build_snapshot(
    now: float,
    devices: Iterable[Device],
    jobs: Iterable[Job],
    handles: Iterable[WorkerHandle],
    queue: WorkQueue,
    served_tokens: Mapping[str, int],
    training: TrainingHook | None,
) -> Snapshot:
    """The scheduler's input for one tick (live workers, and dead ones already switched to a
    job: those restart on another backend, and still count as going to that job).

    A job's policy is updating while any live worker loads its policy weights (UpdatePolicy
    being applied, or a worker switching to the job): its drafter training must not start then.
    """
    jobs = list(jobs)
    switched = [s for s in handles if not s.alive and s.next_job]
    handles = [s for s in handles if s.alive]
    loading = {s.policy_load for s in handles if s.policy_load}
    job_views = []
    for j in jobs:
        view = training.job_view(j.job_id) if training else NO_TRAINING
        job_views.append(
            JobView(
                j.job_id,
                weight=j.weight,
                priority=j.priority,
                served_tokens=served_tokens.get(j.job_id, 0),
                fresh_samples=view.fresh,
                buffered_samples=view.buffered,
                last_training_at=view.last_started,
                round_cut_short=view.cut_short,
                policy_updating=j.job_id in loading,
                online_training=training is not None and j.speculative.online_training,
            )
        )
    # A job whose samples switch version between steps: its waiting work runs on any version.
    at_step = {j.job_id for j in jobs if j.policy_switch is PolicySwitch.NEXT_STEP}
    pending = tuple(
        replace(p, policy_version=None) if p.job_id in at_step else p for p in queue.pending_work()
    )
    pins = queue.pins
    # Only the waiting turns' holders (their sessions' and first prompts'): the pins hold
    # every recent session.
    holders = {
        key: holder
        for p in pending
        for key in (p.cache_key, p.share_key)
        if key and (holder := pins.holder(key)) is not None
    }
    return Snapshot(
        now=now,
        devices=tuple(device_view(d) for d in devices),
        workers=tuple(worker_view(s, queue) for s in [*handles, *switched]),
        training=training.views() if training else (),
        pending=pending,
        jobs=tuple(job_views),
        holders=holders,
        turns_handed_out=queue.turns_handed_out,
    )
