"""Pure scheduling policy: from a node snapshot, decide placement, idleness, training, preemption.

No I/O and no clock: the caller passes `now`, so every decision is reproducible in a table-driven
test. The supervisor (`tltd.supervisor`) turns a `Decision` into process actions.

Which job a worker serves. A worker holds one job's model, and switching it to another job costs
a drain (it finishes what it runs) and a model load, so the rule is "stay unless another job is
owed the worker". Jobs rank by priority, then weighted virtual time (tokens served / weight). A
job whose waiting work does not fit on the workers holding it ("starved") takes as many workers
as that work needs (`max_samples_per_worker` each; workers already switching to it count),
best-ranked starved job first. It may take:
  1. a spare worker: no model yet, or a worker of a job with nothing waiting that has been
     empty for `spare_grace_seconds` (a worker still running its job's samples, or emptied a
     moment ago, is not spare: a trainer between two requests would otherwise lose it, win it
     back a moment later, and each move costs a drain and a load);
  2. a worker of a lower-priority job;
  3. a worker of an equal-priority job Y, when
     a. it does not lead Y in virtual time and still holds fewer workers per weight than Y
        after the move ((mine + 1) / my weight < Y's / Y's weight): workers split by weight;
        the move can never be undone by this same rule, so there is no ping-pong; or
     b. it holds no worker at all and trails Y by `share_quantum_tokens` (per weight): jobs
        time-share a worker they cannot split, a quantum at a time.
Donors: spare workers first, then the worst-ranked job's; among those the emptiest (fewest
running samples, off a training device, least remaining work). A switched worker takes no new
work of its old job; once empty, the supervisor loads the new job. A switch whose job no longer
has any waiting work is called off while the worker still holds its old job.

Where work runs is length-aware. A prompt's samples come with a predicted length (its earlier
answers' mean, `PendingWork.predicted_tokens`), and workers report the predicted tokens still
to decode for what they run. Within a request the prompts predicted longest are placed first,
each sample onto the worker with the least predicted work, so that the long samples spread over
the workers instead of piling up on one (a tail is long partly because one worker got all the
long samples: Seer's longest-first, RhymeRL's length-balanced workers).

A session's turn goes where its KV is. The worker that ran a session's last turn keeps its KV
(`Snapshot.holders`), so the next turn prefills only its new tokens there: the turn goes to
that worker unless it is gone, holds another job or version, or is busier (samples running and
session turns queued for it) than the least loaded worker with room by more than
`sticky_slack_samples`; then, as a first turn does, to the least loaded one (which prefills the
whole sequence). A holder that is full but within the slack is waited for (the turn waits in
its queue, the job's other work goes on): under a binding capacity, a turn moved whenever its
holder is full would re-prefill at nearly every turn. Unless the wait costs more and another
worker has a slot to spare (not owed to turns queued for it): a full holder frees a slot in
`expected_wait_steps` decode steps, a re-prefill of the turn's context costs its length times
the engine's measured prefill cost per token in decode steps
(`RolloutWorkerView.prefill_steps_per_token`), paid by the turn and by each sample running on
the worker it moves to (the prefill stalls them); short contexts move, long ones wait.
`session_placement` picks another rule for benchmarks and ablations: "hash" sends every turn of
a session to one worker by its key (rendezvous hashing over the workers that take its job and
version), whatever their load: a full worker's turns wait for it, as at a router that hashes
(other turns go on); "round_robin" ignores the KV and hands turns to the workers in rotation. A
turn sent away from the worker with its KV is a re-pin, and says why (`repin_reason`). The
first turns of sessions of one prompt (a group) follow the first of them to its worker under
the same rule (`Snapshot.holders` maps the prompt's key too), so that one prefill of the prompt
serves them.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SchedulerConfig:
    idle_grace_seconds: float = 2.0  # a device must be idle this long before training starts on it
    min_fresh_samples: int = 32  # fresh rollout samples a job needs before a training round
    training_cadence_seconds: float = 30.0  # minimum time between training starts for one job
    # A job's drafter trains only while its rollout is in flight here (work waiting or
    # running), and yields when it ends: the trainer uses these devices between rollouts.
    train_during_rollout_only: bool = False
    max_samples_per_worker: int = 64  # the engine's batch capacity
    # How far (tokens per unit of weight) a job with no worker must trail an equal-priority job
    # before it takes that job's worker: the time slice when jobs share too few workers.
    share_quantum_tokens: int = 32768
    # How long a job's empty worker stays its job's while the job has nothing waiting, before
    # another job may take it: the gap between a trainer's requests (a stream's end, the next
    # request's admission) is shorter, a training step between rollouts is longer.
    spare_grace_seconds: float = 1.0
    # A session's turn leaves the worker holding its KV when that one is busier (samples
    # running and turns queued for it) than this beyond the least loaded worker with room (a
    # re-prefill is cheaper than waiting behind a busy worker); the daemon's: `sticky_slack`.
    sticky_slack_samples: int = 4
    session_placement: str = "sticky"  # one of tltd.domain.SESSION_PLACEMENTS


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
    # The job it was switched to ("" = none): it takes no new work, then loads that job.
    switching_to: str = ""
    # What prefilling one more prompt token costs, in decode steps, as its engine measured
    # it (None: not measured): what moving a session's turn here would cost.
    prefill_steps_per_token: float | None = None

    @property
    def switching(self) -> bool:
        return bool(self.switching_to) and self.switching_to != self.job_id


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
    expected_tokens: int  # per sample at most (max_new_tokens)
    enqueued_at: float
    # A request runs on one policy version from start to end: only workers that have loaded
    # this version may take it (None = any version).
    policy_version: int | None = None
    # Predicted tokens per sample: from the prompt's earlier answers, else a prior from the
    # job's (None: no prediction; expected_tokens stands for it).
    predicted_tokens: int | None = None
    cache_key: str = ""  # a session turn's key: its last turn's worker holds its KV
    # A session's first turn's prompt key: where the other sessions of its prompt went.
    share_key: str = ""
    context_tokens: int = 0  # its prompt's length (a session turn's: the whole context)

    @property
    def work(self) -> int:
        """Predicted tokens per sample: what placement balances and orders by."""
        return self.expected_tokens if self.predicted_tokens is None else self.predicted_tokens


@dataclass(frozen=True)
class JobView:
    job_id: str
    weight: float = 1.0
    priority: int = 0
    # Tokens decoded for this job (the fair-share account); a job waking from idle comes in
    # lifted level with the busy ones (`tltd.supervisor.fair_share`), not with credit.
    served_tokens: int = 0
    fresh_samples: int = 0  # finished samples not yet used for drafter training
    buffered_samples: int = 0  # samples its drafter's trainer can train on now, fresh or not
    last_training_at: float | None = None
    # Its last round was preempted before its steps were done: that round resumes on the next
    # idle device without waiting for fresh samples or the cadence (the cadence spaces rounds;
    # in a rollout's short tails one round spans several of them).
    round_cut_short: bool = False
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
    # Session key -> the worker with its KV ("" = lost with it); first prompt key -> worker.
    holders: Mapping[str, str] = field(default_factory=dict)
    turns_handed_out: int = 0  # session turns given to workers so far (the round-robin's place)


@dataclass(frozen=True)
class Assignment:
    request_id: str
    prompt_index: int
    samples: int
    worker_id: str
    repin: str = ""  # a session turn sent away from the worker with its KV: why (repin_reason)


@dataclass(frozen=True)
class Switch:
    """Serve `job_id` next: take no new work of the current job, load `job_id` once empty.
    `job_id` equal to the worker's own job calls off an earlier switch."""

    worker_id: str
    job_id: str


@dataclass(frozen=True)
class Decision:
    assignments: tuple[Assignment, ...] = ()
    switches: tuple[Switch, ...] = ()
    idle_devices: tuple[str, ...] = ()
    start_training: tuple[TrainingView, ...] = ()
    preempt_training: tuple[str, ...] = ()  # device ids whose training must yield now
    reasons: dict[str, str] = field(default_factory=dict)  # device id -> why (for events)


def schedule(snap: Snapshot, cfg: SchedulerConfig = SchedulerConfig()) -> Decision:
    """One scheduling tick: switch workers between jobs, place pending work, preempt training it
    needs, detect idle devices, start training.

    Rollout always wins over drafter training, for any job's work: training yields on a device
    whose rollout worker gets work in the balanced placement, and on devices whose worker is
    switched to a job whose work no worker can take (see the module docstring for switches).
    """
    schedulable = {d.device_id for d in snap.devices if d.schedulable}
    jobs = {j.job_id: j for j in snap.jobs}
    training = {t.device_id for t in snap.training}
    reasons: dict[str, str] = {}

    preempt = [t.device_id for t in snap.training if t.device_id not in schedulable]
    for device_id in preempt:
        reasons[device_id] = "device cordoned, draining or foreign"
    _preempt_outside_rollouts(snap, cfg, preempt, reasons)

    assignments, load, switches, switching = _place_and_switch(
        snap, cfg, schedulable, training, jobs
    )
    worker_device = {w.worker_id: w.device_id for w in snap.workers}
    needed = {worker_device[a.worker_id] for a in assignments} & training
    for t in snap.training:
        if t.device_id in needed and t.device_id not in preempt:
            preempt.append(t.device_id)
            reasons[t.device_id] = "rollout work is waiting"

    reserved = _reserved_by_switches(snap, switches, switching, worker_device)
    for device_id, job_id in reserved.items():
        if device_id in training and device_id not in preempt:
            preempt.append(device_id)
            reasons[device_id] = f"rollout work is waiting (worker switched to job {job_id})"

    # A training device is not idle even when preempted: it is busy yielding this tick.
    busy = training | set(reserved)
    waiting = bool(_unplaced(snap, jobs, assignments))
    idle = _idle_devices(snap, cfg, schedulable, load, busy, waiting)
    starts = _training_starts(snap, cfg, idle, jobs, training - set(preempt))
    for s in starts:
        reasons[s.device_id] = f"idle for >= {cfg.idle_grace_seconds:g}s with fresh data"
    return Decision(
        assignments=tuple(assignments),
        switches=tuple(switches),
        idle_devices=tuple(idle),
        start_training=tuple(starts),
        preempt_training=tuple(preempt),
        reasons=reasons,
    )


def _rolling_out(snap: Snapshot) -> set[str]:
    """Jobs with rollout work waiting or running on this node."""
    running = {w.job_id for w in snap.workers if w.running_samples > 0}
    return running | {p.job_id for p in snap.pending}


def _preempt_outside_rollouts(
    snap: Snapshot, cfg: SchedulerConfig, preempt: list[str], reasons: dict[str, str]
) -> None:
    """With `train_during_rollout_only`, training whose job's rollout has ended yields."""
    if not cfg.train_during_rollout_only:
        return
    rolling_out = _rolling_out(snap)
    for t in snap.training:
        if t.device_id not in preempt and t.job_id not in rolling_out:
            preempt.append(t.device_id)
            reasons[t.device_id] = "the job's rollout ended (training only during rollouts)"


def _place_and_switch(
    snap: Snapshot,
    cfg: SchedulerConfig,
    schedulable: set[str],
    training: set[str],
    jobs: dict[str, JobView],
) -> tuple[list[Assignment], dict[str, tuple[int, int]], list[Switch], set[str]]:
    """Placement, its worker loads, the switches, and the workers switching after them.

    Place as if training had already yielded, so weighted fair share and load balance decide
    alone. A first placement shows which jobs' work does not fit; workers switched to those
    jobs are then left out of the real one (they drain their old job).
    """
    switching = {w.worker_id for w in snap.workers if w.switching}
    assignments, load = _place(snap, cfg, schedulable, training, jobs, switching)
    switches = _switches(snap, cfg, schedulable, training, jobs, assignments)
    if switches:
        switching |= {s.worker_id for s in switches if s.job_id != _job_of(snap, s.worker_id)}
        switching -= {s.worker_id for s in switches if s.job_id == _job_of(snap, s.worker_id)}
        assignments, load = _place(snap, cfg, schedulable, training, jobs, switching)
    return assignments, load, switches, switching


def _reserved_by_switches(
    snap: Snapshot, switches: list[Switch], switching: set[str], worker_device: dict[str, str]
) -> dict[str, str]:
    """Device -> the job its switched worker goes to: that job needs the device, so its
    training yields and it is not idle.

    Only for a job with work waiting: a worker loading a model on its own (fresh, restarted,
    its job ended) with nothing to run must not preempt training or hide an idle device. With
    two such workers on one device, the first by worker id names the job.
    """
    target = {w.worker_id: w.switching_to for w in snap.workers if w.switching}
    target.update({s.worker_id: s.job_id for s in switches})
    waiting_jobs = {p.job_id for p in snap.pending}
    needed_by = {wid for wid in switching if target.get(wid) in waiting_jobs}
    reserved: dict[str, str] = {}
    for wid in sorted(needed_by):
        reserved.setdefault(worker_device[wid], target[wid])
    return reserved


def _job_of(snap: Snapshot, worker_id: str) -> str:
    return next(w.job_id for w in snap.workers if w.worker_id == worker_id)


def _place(
    snap: Snapshot,
    cfg: SchedulerConfig,
    schedulable: set[str],
    training_devices: set[str],
    jobs: dict[str, JobView],
    switching: set[str],
) -> tuple[list[Assignment], dict[str, tuple[int, int]]]:
    """Weighted fair share across jobs, least predicted remaining work across workers.

    Workers on training devices count as free (rollout wins), but on a tie a worker whose
    device is not training is preferred, so training is not preempted for nothing. Workers
    switching to another job take nothing.
    """
    # (running samples, remaining tokens) per eligible worker; mutated as we place.
    load = {
        w.worker_id: (w.running_samples, w.remaining_tokens)
        for w in snap.workers
        if w.ready and w.device_id in schedulable and w.worker_id not in switching
    }
    by_worker = {w.worker_id: w for w in snap.workers}
    # Virtual time per job: tokens served / weight. Higher priority always goes first.
    served = {j: float(v.served_tokens) for j, v in jobs.items()}
    queues = _queues(snap, jobs)
    turn = snap.turns_handed_out  # the next session turn's place in the round robin
    shares: dict[str, str] = {}  # a first prompt's key -> where its sessions go (this tick)
    queued = _queued_at_holders(snap)  # session turns waiting, per worker holding their KV
    assignments: list[Assignment] = []
    while queues:
        job_id = min(
            queues,
            key=lambda j: (-jobs[j].priority, served[j] / max(jobs[j].weight, 1e-9), j),
        )
        work = queues[job_id][0]

        def takes(wid: str, work: PendingWork = work) -> bool:
            w = by_worker[wid]
            return w.job_id in (work.job_id, "") and work.policy_version in (None, w.policy_version)

        if not any(takes(wid) for wid in load):
            # No worker holds its version yet (the planner loads it once the older versions'
            # work is done): it waits without holding up the job's work on a version a worker
            # does hold, or the two would wait for each other.
            _pop(queues, job_id)
            continue
        holder, own = _holders(snap, work, shares)
        per_worker, waits = _spread(
            work, load, takes, by_worker, training_devices, cfg, (holder, turn, queued, own)
        )
        placed = sum(per_worker.values())
        turn += placed if work.cache_key else 0
        served[job_id] += work.work * placed
        assignments += _assignments(snap, work, per_worker, (load, takes), cfg, shares)
        if placed < work.samples and not waits:
            # No room for this prompt (workers of its job and version are full): the job's
            # later prompts wait too, so that a job keeps its FIFO order; other jobs may place.
            del queues[job_id]
            continue
        _pop(queues, job_id)
    return assignments, load


def _queued_at_holders(snap: Snapshot) -> Counter[str]:
    """Per worker, the session turns waiting whose KV it holds (a sticky turn's queue)."""
    queued: Counter[str] = Counter()
    for p in snap.pending:
        holder = snap.holders.get(p.cache_key) if p.cache_key else None
        if holder:
            queued[holder] += p.samples
    return queued


def _holders(
    snap: Snapshot, work: PendingWork, shares: Mapping[str, str]
) -> tuple[str | None, str | None]:
    """Where a session turn's KV is, and where its own session's is: the worker that ran the
    session's last turn ("" when it was lost); for a first turn, where its prompt's other
    sessions went (a group), and None."""
    if not work.cache_key:
        return None, None
    own = snap.holders.get(work.cache_key)
    if own is not None or not work.share_key:
        return own, own
    return shares.get(work.share_key, snap.holders.get(work.share_key)), None


def _assignments(
    snap: Snapshot,
    work: PendingWork,
    per_worker: dict[str, int],
    fit: tuple[dict[str, tuple[int, int]], Callable[[str], bool]],
    cfg: SchedulerConfig,
    shares: dict[str, str],
) -> list[Assignment]:
    """The work's assignments, a re-pinned session turn's with its reason (`repin_reason`,
    given the loads and who `takes` it); a first turn's prompt key notes where it went."""
    own = snap.holders.get(work.cache_key) if work.cache_key else None
    why = repin_reason(own, per_worker, *fit, cfg)
    if work.share_key and per_worker:
        first = snap.holders.get(work.share_key) or next(iter(per_worker))
        shares.setdefault(work.share_key, first)
    return [
        Assignment(work.request_id, work.prompt_index, count, wid, why)
        for wid, count in per_worker.items()
    ]


def repin_reason(
    holder: str | None,
    per_worker: Mapping[str, int],
    load: Mapping[str, tuple[int, int]],
    takes: Callable[[str], bool],
    cfg: SchedulerConfig,
) -> str:
    """Why a session's turn went to another worker than `holder`, which holds its KV: "gone"
    (lost with its KV, stopped, cordoned, draining), "version" (it holds another job or
    policy version), "full" (and its queue over `sticky_slack_samples`, or waiting for it costs
    more than a re-prefill), "overloaded" (over
    `sticky_slack_samples`) or "rule" (hash or round robin placement); "" when it stayed, or
    there was none."""
    if holder is None or not per_worker or holder in per_worker:
        return ""
    if holder not in load:
        return "gone"
    if not takes(holder):
        return "version"
    if cfg.session_placement != "sticky":
        return "rule"
    return "full" if load[holder][0] >= cfg.max_samples_per_worker else "overloaded"


def _queues(snap: Snapshot, jobs: dict[str, JobView]) -> dict[str, list[PendingWork]]:
    """Per job, its waiting prompts: requests in arrival order, and within one, the prompts
    predicted longest first."""
    queues: dict[str, list[PendingWork]] = {}
    for p in sorted(
        snap.pending, key=lambda p: (p.enqueued_at, p.request_id, -p.work, p.prompt_index)
    ):
        if p.job_id in jobs:
            queues.setdefault(p.job_id, []).append(p)
    return queues


def _pop(queues: dict[str, list[PendingWork]], job_id: str) -> None:
    queues[job_id].pop(0)
    if not queues[job_id]:
        del queues[job_id]


def _spread(
    work: PendingWork,
    load: dict[str, tuple[int, int]],
    takes: Callable[[str], bool],
    by_worker: dict[str, RolloutWorkerView],
    training_devices: set[str],
    cfg: SchedulerConfig,
    session: tuple[str | None, int, Counter[str], str | None] = (None, 0, Counter(), None),
) -> tuple[dict[str, int], bool]:
    """Samples of one prompt per worker, one at a time to the worker with the least expected
    remaining work, so the n samples of a prompt spread when that balances the load (long
    tails are the cost); `load` is updated. Fewer than `work.samples` when workers are full,
    or when a session's turn waits for its worker (then True: it waits in that worker's queue
    alone, and the job's later work may be placed). A session's turn goes where
    `session_worker` says, given `session`: the worker holding its KV, the number of turns
    handed out before it, the turns queued for each worker (updated) and the worker holding
    the session's own KV, in whose queue the turn counts until it is placed."""
    per_worker: dict[str, int] = {}
    holder, turn, queued, own = session
    takers = [wid for wid in load if takes(wid)]

    def moving(wid: str) -> float | None:
        """Decode steps that re-prefilling the turn's context on `wid` costs; None: unknown,
        or `wid` has no slot to spare (its free ones are owed to turns queued for it: taking
        one would only make another turn wait instead)."""
        per_token = by_worker[wid].prefill_steps_per_token
        if per_token is None or load[wid][0] + queued.get(wid, 0) >= cfg.max_samples_per_worker:
            return None
        return per_token * work.context_tokens

    for i in range(work.samples):
        candidates = [w for w in takers if load[w][0] < cfg.max_samples_per_worker]
        if not candidates:
            break
        if own:
            queued[own] -= 1  # (the others waiting for its holder, not itself)
        wid = session_worker(
            work.cache_key, holder, turn + i, (candidates, takers), (load, queued, moving), cfg
        )
        if wid == WAITS:
            if own:
                queued[own] += 1
            return per_worker, True
        wid = wid or min(
            candidates,
            key=lambda w: (
                load[w][1],
                load[w][0],
                by_worker[w].device_id in training_devices,
                w,
            ),
        )
        running, tokens = load[wid]
        load[wid] = (running + 1, tokens + work.work)
        per_worker[wid] = per_worker.get(wid, 0) + 1
    return per_worker, False


# `session_worker`'s answer for a turn that waits for its worker, which is full.
WAITS = ""
# Per worker, the decode steps a re-prefill of a turn's context there costs (None: unknown, or
# no slot there to spare).
MoveCost = Callable[[str], float | None]


def session_worker(
    key: str,
    holder: str | None,
    turn: int,
    workers: tuple[list[str], list[str]],
    loads: tuple[Mapping[str, tuple[int, int]], Mapping[str, int], MoveCost],
    cfg: SchedulerConfig,
) -> str | None:
    """The worker for a session's turn under `cfg.session_placement` (`key`: the session's,
    "" for other work; `turn`: turns handed out before this one; `workers`: those with room
    for it, and all that take its job and version; `loads`: per worker its (samples running,
    tokens to decode), the session turns queued for it, and what a re-prefill of the turn's
    context there costs); None: place it as any work; `WAITS`: it waits for a worker that is
    full."""
    candidates, takers = workers
    if not key:
        return None
    if cfg.session_placement == "hash":
        # As a router that hashes: whatever the load, the turn queues at its worker.
        home = hashed(key, takers)
        return home if home in candidates else WAITS
    if cfg.session_placement == "round_robin":
        return rotated(turn, candidates)
    return sticky(holder, workers, loads, cfg.sticky_slack_samples)


def sticky_slack(capacity: int) -> int:
    """`sticky_slack_samples` for workers of `capacity` samples: a quarter of it, at least
    one. Waiting behind k more turns costs about k / capacity of a turn's time; a re-prefill
    of a long context, a good share of one (a quarter is the line taken)."""
    return max(1, capacity // 4)


def hashed(key: str, candidates: list[str]) -> str:
    """Rendezvous (highest random weight) hashing: the candidate scoring highest with `key`,
    so a worker coming or going moves only the keys it wins or held. Load plays no part."""

    def score(wid: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{wid}".encode(), digest_size=8).digest()

    return max(candidates, key=lambda w: (score(w), w))


def rotated(turn: int, candidates: list[str]) -> str:
    """Round robin: the `turn`-th turn handed out goes to the next candidate by id."""
    ordered = sorted(candidates)
    return ordered[turn % len(ordered)]


def sticky(
    holder: str | None,
    workers: tuple[list[str], list[str]],
    loads: tuple[Mapping[str, tuple[int, int]], Mapping[str, int], MoveCost],
    slack: int,
) -> str | None:
    """The worker holding a session's KV while its load (samples running and session turns
    queued for it) is at most `slack` beyond the least loaded worker with room: the turn runs
    there, or waits for it while it is full (`WAITS`), unless the wait is expected to cost
    more decode steps than re-prefilling the context on the least loaded worker, paid by the
    turn and by each sample running there (the prefill stalls them). None: place it as any
    work (its holder is gone, holds another job or version, is overloaded, or is full and
    not worth the wait: a re-pin). `workers`, `loads` as `session_worker`'s."""
    candidates, takers = workers
    load, queued, moving = loads
    if holder is None or holder not in takers:
        return None  # gone, or holding another job or version

    def busy(w: str) -> int:
        return load[w][0] + queued.get(w, 0)

    least = min(candidates, key=lambda w: (busy(w), w))
    if busy(holder) > busy(least) + slack:
        return None
    if holder in candidates:
        return holder
    cost = moving(least)
    if cost is None:
        return WAITS
    # The re-prefill stalls the samples running there as long: each pays it too.
    cost *= 1 + load[least][0]
    return None if expected_wait_steps(*load[holder], queued.get(holder, 0)) > cost else WAITS


def expected_wait_steps(running: int, remaining_tokens: int, ahead: int) -> float:
    """Decode steps until a full worker frees a slot for the turn queued behind `ahead`
    others: with its samples' remaining tokens spread evenly, one finishes every
    2R / (n (n + 1)) steps (R tokens left over n samples)."""
    if running <= 0:
        return 0.0
    return (ahead + 1) * 2.0 * remaining_tokens / (running * (running + 1))


def _unplaced(
    snap: Snapshot, jobs: dict[str, JobView], assignments: list[Assignment]
) -> dict[str, int]:
    """Samples per job that no worker got this tick."""
    placed: dict[tuple[str, int], int] = {}
    for a in assignments:
        key = (a.request_id, a.prompt_index)
        placed[key] = placed.get(key, 0) + a.samples
    unplaced: dict[str, int] = {}
    for p in snap.pending:
        left = p.samples - placed.get((p.request_id, p.prompt_index), 0)
        if left > 0 and p.job_id in jobs:
            unplaced[p.job_id] = unplaced.get(p.job_id, 0) + left
    return unplaced


class _SwitchRule:
    """The switch rule's questions about one tick (the rule is in the module docstring)."""

    def __init__(
        self,
        snap: Snapshot,
        cfg: SchedulerConfig,
        jobs: dict[str, JobView],
        training_devices: set[str],
        called_off: set[str],
        workers: list[RolloutWorkerView],
    ) -> None:
        self.snap, self.cfg, self.jobs = snap, cfg, jobs
        self.training_devices, self.called_off = training_devices, called_off
        self.waiting_jobs = {p.job_id for p in snap.pending}
        self.holders = Counter(self.serves(w) for w in workers)

    def serves(self, w: RolloutWorkerView) -> str:
        """The job a worker serves, or goes to (a switch not called off)."""
        return w.switching_to if w.switching and w.worker_id not in self.called_off else w.job_id

    def vt(self, job_id: str) -> float:
        return self.jobs[job_id].served_tokens / max(self.jobs[job_id].weight, 1e-9)

    def spare(self, w: RolloutWorkerView) -> bool:
        if w.job_id not in self.jobs:
            return True
        if w.job_id in self.waiting_jobs or w.running_samples:
            return False
        since = w.idle_since
        return since is None or self.snap.now - since >= self.cfg.spare_grace_seconds

    def owed(self, x: str, w: RolloutWorkerView) -> bool:
        """May starved job `x` take worker `w`?"""
        if self.spare(w):
            return True
        jx, jy = self.jobs[x], self.jobs[w.job_id]
        if jx.priority != jy.priority:
            return jx.priority > jy.priority
        held = self.holders
        per_weight_after = (held[x] + 1) / max(jx.weight, 1e-9)
        if self.vt(x) <= self.vt(w.job_id) and per_weight_after < held[w.job_id] / max(
            jy.weight, 1e-9
        ):
            return True
        return held[x] == 0 and self.vt(w.job_id) - self.vt(x) >= self.cfg.share_quantum_tokens

    def donor_order(self, w: RolloutWorkerView) -> tuple:
        spare = self.spare(w)
        worst = (0, 0.0) if spare else (self.jobs[w.job_id].priority, -self.vt(w.job_id))
        training = w.device_id in self.training_devices
        return (not spare, *worst, w.running_samples, training, w.remaining_tokens, w.worker_id)


def _switches(
    snap: Snapshot,
    cfg: SchedulerConfig,
    schedulable: set[str],
    training_devices: set[str],
    jobs: dict[str, JobView],
    assignments: list[Assignment],
) -> list[Switch]:
    """Which workers change job (the rule is in the module docstring)."""
    unplaced = _unplaced(snap, jobs, assignments)
    waiting_jobs = {p.job_id for p in snap.pending}
    # Call off a switch whose job has nothing waiting any more, while the worker still holds
    # (and has loaded nothing else than) its old job.
    out = [
        Switch(w.worker_id, w.job_id)
        for w in snap.workers
        if w.switching and w.ready and w.job_id in jobs and w.switching_to not in waiting_jobs
    ]
    if not unplaced:
        return out
    called_off = {s.worker_id for s in out}
    workers = [w for w in snap.workers if w.device_id in schedulable]
    rule = _SwitchRule(snap, cfg, jobs, training_devices, called_off, workers)
    switched: set[str] = set()
    for x in sorted(unplaced, key=lambda j: (-jobs[j].priority, rule.vt(j), j)):
        coming = sum(1 for w in workers if w.switching and rule.serves(w) == x)
        need = -(-unplaced[x] // cfg.max_samples_per_worker) - coming
        while need > 0:
            donors = [
                w
                for w in workers
                if w.worker_id not in switched
                and not (w.switching and w.worker_id not in called_off)
                and rule.serves(w) != x
                # A ready worker with no job takes any job's work as it is; one not ready
                # holds a job's load in flight, unless it has no model at all (starting).
                and (w.ready == bool(w.job_id))
                and rule.owed(x, w)
            ]
            if not donors:
                break
            w = min(donors, key=rule.donor_order)
            switched.add(w.worker_id)
            rule.holders[rule.serves(w)] -= 1
            rule.holders[x] += 1
            out = [s for s in out if s.worker_id != w.worker_id] + [Switch(w.worker_id, x)]
            need -= 1
    return out


def _idle_devices(
    snap: Snapshot,
    cfg: SchedulerConfig,
    schedulable: set[str],
    load: dict[str, tuple[int, int]],
    busy_devices: set[str],
    work_waiting: bool,
) -> list[str]:
    """A device is idle when no worker on it has work, for at least the idle grace period. A
    device with no live worker (starting, or restarting after a crash) is idle only while no
    work waits: its worker is about to be needed."""
    idle = []
    for d in snap.devices:
        if d.device_id not in schedulable or d.device_id in busy_devices:
            continue
        workers = [w for w in snap.workers if w.device_id == d.device_id]
        busy = any(load.get(w.worker_id, (w.running_samples, 0))[0] > 0 for w in workers)
        if busy:
            continue
        since = min((w.idle_since for w in workers if w.idle_since is not None), default=None)
        if not workers and work_waiting:
            continue
        if workers and (since is None or snap.now - since < cfg.idle_grace_seconds):
            continue
        idle.append(d.device_id)
    return idle


def _new_round_due(j: JobView, now: float, cfg: SchedulerConfig) -> bool:
    """Enough fresh samples, and the cadence since the last round's start has passed. With
    `train_during_rollout_only`, the idle devices of the job's own rollout are what training is
    for, and they last seconds: a round that ended there is followed at once by the next one,
    on any fresh sample, or on the samples its trainer holds when none finished meanwhile
    (a tail's last samples run for seconds, and the device would sit idle; the promotion gate
    still decides whether the extra steps are kept). The cadence spaces rounds on devices idle
    between requests."""
    if cfg.train_during_rollout_only:
        return j.fresh_samples > 0 or j.buffered_samples > 0
    if j.fresh_samples < cfg.min_fresh_samples:
        return False
    return j.last_training_at is None or now - j.last_training_at >= cfg.training_cadence_seconds


def _training_starts(
    snap: Snapshot,
    cfg: SchedulerConfig,
    idle: list[str],
    jobs: dict[str, JobView],
    training_devices: set[str],
) -> list[TrainingView]:
    """Start drafter training on idle devices for jobs with enough fresh data, at a cadence."""
    training_jobs = {t.job_id for t in snap.training if t.device_id in training_devices}
    if cfg.train_during_rollout_only:
        jobs = {k: j for k, j in jobs.items() if k in _rolling_out(snap)}
    eligible = sorted(
        (
            j
            for j in jobs.values()
            if j.online_training
            and not j.policy_updating
            and j.job_id not in training_jobs
            and (j.round_cut_short or _new_round_due(j, snap.now, cfg))
        ),
        key=lambda j: (-j.fresh_samples, j.job_id),
    )
    # One training task per job; the most data-rich job gets the first idle device.
    return [TrainingView(d, j.job_id) for d, j in zip(idle, eligible, strict=False)]
