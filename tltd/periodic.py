"""All periodic work, declared in one place (APScheduler 3.x); job bodies are plain functions."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.interval import IntervalTrigger

from tltd.devices import discover
from tltd.domain import OPEN_STATUSES, Device, DrafterStatus, JobStatus
from tltd.errors import Fenced
from tltd.metrics import METRICS, Metrics
from tltd.settings import Settings
from tltd.stall import StallWatch

if TYPE_CHECKING:
    from tltd.devices import Nvml
    from tltd.drafter_training import DrafterTraining
    from tltd.services.push import PushService
    from tltd.store import Store
    from tltd.supervisor import Supervisor

log = logging.getLogger(__name__)

# Often enough for a scrape every few seconds to see queue and device changes; one cheap query.
_METRICS_ROLL_UP_SECONDS = 2.0
# A preemption notice leaves tens of seconds at best: look often (one stat call).
_PREEMPTION_NOTICE_SECONDS = 0.5
# A notice file is stale when older than the daemon by more than this: file systems with a
# coarse mtime (FAT: 2 s) may date a notice written just after the start before it.
_NOTICE_MTIME_SLACK_SECONDS = 2.0


def our_pids(store: Store) -> set[int]:
    """The daemon, its workers and every descendant of them (SGLang runs the model in its own
    subprocesses): their GPU use does not make a device foreign."""
    return with_descendants({os.getpid()} | {w.pid for w in store.workers.list() if w.pid})


def with_descendants(pids: set[int], proc: str = "/proc") -> set[int]:
    """`pids` and all their descendants, from the parent pid in /proc/<pid>/stat (Linux; where
    /proc cannot be read, `pids` alone)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir(proc)
    except OSError:
        return set(pids)
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/stat") as f:
                stat = f.read()
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            ppid = int(stat[stat.rindex(")") + 1 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        children.setdefault(ppid, []).append(int(entry))
    out, todo = set(pids), list(pids)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def refresh_devices(store: Store, nvml: Nvml | None, cpu_slots: int) -> list[Device]:
    """Re-read the device inventory and store it (cordon/drain flags are kept by the store)."""
    devices = store.devices.upsert(discover(nvml, cpu_slots, our_pids(store)))
    log.debug("devices refreshed", extra={"devices": len(devices)})
    return devices


def roll_up_metrics(store: Store, metrics: Metrics = METRICS) -> None:
    """Mirror what the store knows into the gauges: device states, queue depth and the policy
    and drafter versions of every active job (workers report finer events themselves); the
    gauges of jobs that are no longer active are dropped (they would freeze otherwise)."""
    # Read before the jobs: a job with gauges by now and not listed active below has ended
    # (one created meanwhile is not in this set, so it cannot be dropped by mistake).
    had_gauges = metrics.job_ids()
    for device in store.devices.list():
        metrics.set_device_state(device.device_id, device.state.value)
    unfinished = store.requests.list(list(OPEN_STATUSES), limit=100_000)
    depth: dict[str, int] = {}
    for req in unfinished:
        depth[req.job_id] = depth.get(req.job_id, 0) + req.samples_total - req.samples_done
    active = store.jobs.list([JobStatus.ACTIVE], limit=10_000)
    for job in active:
        metrics.set_queue_depth(job.job_id, depth.get(job.job_id, 0))
        metrics.set_policy_version(job.job_id, job.policy_version)
        metrics.set_drafter_version(job.job_id, job.drafter_version)
    for job_id in had_gauges - {job.job_id for job in active}:
        metrics.forget_job(job_id)


def drop_abandoned_pushes(pushes: PushService) -> list[str]:
    """Policy pushes no stream has sent into for `push_idle_seconds` are dropped with their
    staging files. Returns their update ids."""
    return pushes.collect()


async def reap_workers(supervisor: Supervisor, watch: StallWatch) -> list[str]:
    """Lease/heartbeat reaper: a worker that exited, or stopped heartbeating, is killed, its
    unfinished samples are re-queued and it is restarted (silence while the daemon itself was
    stalled does not count). Returns the ids found dead."""
    return await supervisor.reap(stalled=watch.look(time.monotonic()))


async def renew_drafter_leases(training: DrafterTraining) -> list[str]:
    """Several nodes: extend the drafter leases of the trainers running here, stop those whose
    lease was lost, read the samples waiting per job."""
    return await training.renew()


async def reap_trainers(training: DrafterTraining, watch: StallWatch) -> list[str]:
    """A drafter trainer that stopped heartbeating (hung) is killed and recorded FAILED, its
    device given back (silence while the daemon itself was stalled does not count). Returns
    the ids of those killed."""
    return await training.reap(stalled=watch.look(time.monotonic()))


@dataclass
class NoticeWatch:
    """What the preemption notice check remembers between runs."""

    path: str
    started_at: float  # wall-clock time the daemon started: an older notice file is stale
    stale_mtime: float | None = None  # the stale file's mtime (ignored while it stays)
    seen_absent: bool = False  # whatever appears after the file was seen gone is a notice
    unreadable: bool = False  # warned that it cannot be read (once, not every 0.5 s)


def check_preemption_notice(watch: NoticeWatch, on_notice: Callable[[], None]) -> bool:
    """The preemption notice file exists: call `on_notice` (it starts the SIGTERM shutdown).

    A file older than the daemon (left by the preemption that stopped a previous one) is
    stale: it is named in one warning and ignored until it is rewritten (its mtime changes)
    or removed and created again; otherwise a restarted daemon would stop at once."""
    try:
        mtime = os.stat(watch.path).st_mtime
    except FileNotFoundError:
        watch.stale_mtime, watch.seen_absent = None, True
        return False
    except OSError as exc:  # unreadable now (EACCES, ESTALE): not "absent", or a stale file
        if not watch.unreadable:  # ... would count as new once readable again
            log.warning(
                "cannot read the preemption notice file: %s", exc, extra={"path": watch.path}
            )
        watch.unreadable = True
        return False
    watch.unreadable = False
    if not watch.seen_absent:
        if watch.stale_mtime is None and mtime < watch.started_at - _NOTICE_MTIME_SLACK_SECONDS:
            watch.stale_mtime = mtime
            log.warning(
                "stale preemption notice file ignored: it predates this daemon; rewrite or "
                "recreate it to give notice",
                extra={"path": watch.path},
            )
        if mtime == watch.stale_mtime:
            return False
    on_notice()
    return True


def gc_drafters(store: Store, keep: int, root: str | Path) -> list[tuple[str, int]]:
    """Retire old drafter versions of every job: keep the newest `keep` evaluated versions
    and every pinned or active one. Candidates (being evaluated) are left alone. Retiring is
    cluster-wide, one node at a time (an advisory lock on PostgreSQL: a node that finds
    another one retiring skips that part). Deleting is each node's own: every node deletes
    the checkpoint directory of each retired version it can read (its own, or on
    `shared_dir`) that lies under `root` (its drafter directory: paths an operator registered
    elsewhere are never deleted), whichever node retired it. Returns the (job id, version)
    pairs this call retired."""
    retired: list[tuple[str, int]] = []
    with store.nodes.cluster_lock("drafter-gc") as mine:
        if mine:
            retired = _retire_drafters(store, keep)
        else:
            log.debug("drafter versions are retired on another node")
    deleted = _delete_retired_checkpoints(store, Path(root).resolve())
    if retired or deleted:
        log.info("drafter versions retired", extra={"versions": len(retired), "deleted": deleted})
    return retired


def _retire_drafters(store: Store, keep: int) -> list[tuple[str, int]]:
    why = f"garbage-collected: not among the newest {keep}, not pinned, not active"
    retired = []
    for job in store.jobs.list(None, 1 << 30):
        versions = [
            v
            for v in store.drafters.list(job.job_id)
            if v.status in (DrafterStatus.PROMOTED, DrafterStatus.REJECTED)
        ]
        newest = {v.version for v in sorted(versions, key=lambda v: v.version)[-keep:]}
        old = [v.version for v in versions if v.version not in newest]
        # The store re-checks pinned / active as it retires: a pin may land after the read
        # above. Only what it retired loses its checkpoint.
        retired += [(job.job_id, v.version) for v in store.drafters.retire(job.job_id, old, why)]
    return retired


def _delete_retired_checkpoints(store: Store, root: Path) -> int:
    """Delete the directories of retired versions this node can read under `root`; returns
    how many it deleted (none when they are gone already)."""
    deleted = 0
    for job in store.jobs.list(None, 1 << 30):
        for v in store.drafters.list(job.job_id):
            if v.status is not DrafterStatus.RETIRED or not v.readable_on(store.node_id):
                continue  # another node's own storage: that node's GC deletes it
            path = Path(v.path).resolve()
            if path.is_dir() and path.is_relative_to(root) and path != root:
                shutil.rmtree(path, ignore_errors=True)
                deleted += 1
    return deleted


def prune_history(store: Store, retention_hours: float) -> tuple[int, int]:
    """Delete requests (with their samples) that ended more than `retention_hours` ago, closed
    sessions as old (with their turns), and events as old: without it the database grows by
    every rollout's tokens and logprobs.
    A retry of a pruned request id is a new request. One node at a time (an advisory lock on
    PostgreSQL): a node that finds another one pruning skips this run."""
    before = datetime.now(UTC) - timedelta(hours=retention_hours)
    with store.nodes.cluster_lock("history-gc") as mine:
        if not mine:
            log.debug("history pruning runs on another node")
            return 0, 0
        requests, events = store.history.prune(before)
        sessions = store.sessions.prune_closed(before)
    if requests or events or sessions:
        log.info(
            "history pruned",
            extra={"requests": requests, "sessions": sessions, "events": events,
                   "retention_hours": retention_hours},
        )  # fmt: skip
    return requests, events


@dataclass
class NodeBeat:
    """The node heartbeat job's callbacks (both called from the scheduler's thread)."""

    address: str
    on_new_epoch: Callable[[], object]  # back after being DOWN: drop the old epoch's work
    on_fenced: Callable[[], None]  # another daemon joined under this node id
    # A drain of this node requested through the database (`tltctl drain --node ID` on any
    # node): (reason, grace seconds). Checked at every heartbeat; idempotent.
    on_drain_requested: Callable[[str, float], None] | None = None


def beat_node(store: Store, settings: Settings, beat: NodeBeat) -> int:
    """Stamp this node's heartbeat (others see it DOWN without one for node_down_seconds);
    a beat after such a silence takes a new epoch, and what the node ran is dropped."""
    before = store.epoch
    try:
        epoch = store.nodes.beat(settings.node_down_seconds, beat.address)
    except Fenced as exc:
        log.error("node fenced: %s", exc)
        beat.on_fenced()
        return before
    if epoch != before:
        beat.on_new_epoch()
    if beat.on_drain_requested is not None and store.dialect == "postgresql":
        requested = store.nodes.requested_drain()
        if requested is not None:
            beat.on_drain_requested(*requested)
    return epoch


async def renew_leases(supervisor: Supervisor) -> set[tuple[str, int]]:
    """Renew the work units this node holds, a third of a lease before it would expire;
    stop those it lost; follow cancels recorded on other nodes."""
    return await supervisor.renew_leases()


@dataclass(frozen=True)
class PeriodicJob:
    id: str
    name: str
    func: Callable[..., object]
    seconds: float  # the interval
    args: tuple
    executor: str = "default"


def periodic_jobs(
    settings: Settings,
    store: Store,
    nvml: Nvml | None,
    supervisor: Supervisor | None = None,
    training: DrafterTraining | None = None,
    on_preemption_notice: Callable[[], None] | None = None,
    started_at: float | None = None,
    pushes: PushService | None = None,
    node: NodeBeat | None = None,
) -> list[PeriodicJob]:
    """Every periodic job, one row each, and when it runs (the parts it needs are there, or
    a setting turns it on)."""
    reap_every = max(0.5, 2 * settings.worker_heartbeat_seconds)
    notice_file = settings.preemption_notice_file
    watch = NoticeWatch(notice_file, time.time() if started_at is None else started_at)
    J = PeriodicJob
    # fmt: off
    table: list[tuple[bool, PeriodicJob]] = [
        (True, J("device-refresh", "device inventory refresh", refresh_devices,
                 settings.device_refresh_seconds, (store, nvml, settings.cpu_slots))),
        # Its own thread: a heartbeat queued behind busy store calls would make the node DOWN.
        (node is not None, J("node-heartbeat", "node heartbeat (epoch fencing)", beat_node,
                             settings.node_heartbeat_seconds, (store, settings, node), "node")),
        (supervisor is not None, J("lease-renewal", "work unit lease renewal", renew_leases,
                                   settings.lease_seconds / 3, (supervisor,))),
        (supervisor is not None, J("worker-reaper", "dead/silent worker reaper", reap_workers,
                                   reap_every, (supervisor, StallWatch(reap_every, "workers")))),
        (training is not None, J("trainer-reaper", "silent drafter trainer reaper", reap_trainers,
                                 reap_every, (training, StallWatch(reap_every, "trainers")))),
        (training is not None and store.dialect == "postgresql",
         J("drafter-lease-renewal", "drafter training lease renewal", renew_drafter_leases,
           settings.drafter_lease_seconds / 3, (training,))),
        (training is not None, J("drafter-gc", "old drafter checkpoints GC", gc_drafters,
                                 settings.drafter_gc_seconds,
                                 (store, settings.drafter_keep_versions, settings.drafters_root))),
        (settings.history_retention_hours > 0,
         J("history-gc", "ended requests, samples and events past the retention GC",
           prune_history, settings.history_gc_seconds, (store, settings.history_retention_hours))),
        (pushes is not None, J("push-gc", "abandoned policy pushes GC", drop_abandoned_pushes,
                               settings.push_gc_seconds, (pushes,))),
        (bool(notice_file) and on_preemption_notice is not None,
         J("preemption-notice", "preemption notice file watch", check_preemption_notice,
           _PREEMPTION_NOTICE_SECONDS, (watch, on_preemption_notice))),
        (bool(settings.metrics_port), J("metrics-roll-up", "metrics roll-up from the store",
                                        roll_up_metrics, _METRICS_ROLL_UP_SECONDS, (store,))),
    ]
    # fmt: on
    return [job for wanted, job in table if wanted]


def build_scheduler(
    settings: Settings,
    store: Store,
    nvml: Nvml | None,
    supervisor: Supervisor | None = None,
    training: DrafterTraining | None = None,
    on_preemption_notice: Callable[[], None] | None = None,
    started_at: float | None = None,
    pushes: PushService | None = None,
    node: NodeBeat | None = None,
) -> AsyncIOScheduler:
    """Every periodic job (`periodic_jobs`) with its trigger. Synchronous bodies (the store
    is) run in the scheduler's thread pool, off the event loop; coroutine bodies (the
    supervisor's) run on the loop. One instance at a time, missed runs coalesced into one.
    `started_at` (wall clock, default now) is when the daemon started: an older preemption
    notice is stale.

    The scheduling tick itself is not here: it is event-driven (see `tltd.supervisor`)."""
    scheduler = AsyncIOScheduler(timezone=UTC, job_defaults={"max_instances": 1, "coalesce": True})
    jobs = periodic_jobs(
        settings, store, nvml, supervisor, training, on_preemption_notice, started_at, pushes, node
    )
    for job in jobs:
        if job.executor != "default":
            scheduler.add_executor(ThreadPoolExecutor(1), job.executor)
        scheduler.add_job(
            job.func,
            IntervalTrigger(seconds=job.seconds),
            args=job.args,
            id=job.id,
            name=job.name,
            executor=job.executor,
        )
    return scheduler
