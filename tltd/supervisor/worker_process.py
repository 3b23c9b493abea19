"""One rollout worker process: its handle (phase, load in flight) and its spawn.

Its pipe is served by `tltd.supervisor.worker_pipe` (a reader thread that stores the samples it
reports, a writer thread); `generation` tells messages of a replaced process apart.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import queue as threading_queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import groupby
from typing import TYPE_CHECKING, Any

from tltd import worker_code
from tltd.contract import rollout_messages as msg
from tltd.contract.broadcast import SGLANG_TP_SIZE
from tltd.contract.processes import with_environment
from tltd.domain import ENDED_STATUSES, Backend, Device, Sample, WorkerState
from tltd.errors import Fenced, TltError
from tltd.memory_cgroup import MemoryCgroups, WorkerGroup
from tltd.metrics import METRICS
from tltd.settings import Settings
from tltd.store.leases import UnitEnd
from tltd.supervisor.worker_pipe import HeartbeatStamp, serve_pipe

if TYPE_CHECKING:
    from tltd.store import Store

log = logging.getLogger(__name__)

# on_message(handle, generation, message, stored, end): stored is None when a Finished sample
# could not be persisted (then it is not streamed but run again), else what `SampleBatches.add` said
# of it; end is its unit's end when the sample's transaction recorded it (`SampleBatches.store`).
OnMessage = Callable[["WorkerHandle", int, msg.FromWorker, "bool | None", "UnitEnd | None"], None]
OnExit = Callable[["WorkerHandle", int], None]


class Phase(enum.Enum):
    """Where a rollout worker is in its life; `TRANSITIONS` says which step may follow which."""

    NEW = "new"  # no process started yet
    STARTING = "starting"  # spawned; no Ready yet
    LOADING = "loading"  # a LoadModel/LoadPolicy/SetDrafter in flight (no work until Ready)
    READY = "ready"  # serving its model
    EXITING = "exiting"  # out of service; its process not yet joined and recorded
    DEAD = "dead"  # gone; restarted after the backoff
    VACATED = "vacated"  # stopped on purpose (device foreign or unavailable): no backoff


ALIVE = (Phase.STARTING, Phase.LOADING, Phase.READY)
TRANSITIONS: dict[Phase, tuple[Phase, ...]] = {
    Phase.NEW: (Phase.STARTING,),
    Phase.STARTING: (Phase.READY, Phase.EXITING, Phase.DEAD),
    Phase.LOADING: (Phase.READY, Phase.EXITING, Phase.DEAD),
    Phase.READY: (Phase.LOADING, Phase.READY, Phase.EXITING, Phase.DEAD),
    # DEAD from EXITING: a shutdown joins the process itself (the burial task is cancelled).
    Phase.EXITING: (Phase.DEAD, Phase.VACATED),
    Phase.DEAD: (Phase.STARTING, Phase.DEAD),
    Phase.VACATED: (Phase.STARTING, Phase.DEAD),
}


class LoadKind(enum.Enum):
    MODEL = "model"  # LoadModel: a job's engine and policy weights
    POLICY = "policy"  # LoadPolicy: another policy version of the job it holds
    DRAFTER = "drafter"  # SetDrafter: a learned drafter hot-swapped in (version 0: none)


@dataclass(frozen=True)
class Load:
    """The load in flight: a process that dies before its Ready failed it (an OOM kill, a
    native crash, a hung load killed)."""

    kind: LoadKind
    job_id: str
    version: int

    @property
    def policy_weights(self) -> bool:
        """Loads the job's policy: its policy update is being applied, its drafter training
        must not start."""
        return self.kind is not LoadKind.DRAFTER

    @property
    def can_fail(self) -> bool:
        """Unloading the drafter (version 0) is no load that could be held back."""
        return not (self.kind is LoadKind.DRAFTER and self.version == 0)


@dataclass
class WorkerHandle:
    """One device's rollout worker: the process, its pipe and what the daemon knows of it."""

    worker_id: str
    device: Device
    backend: Backend = Backend.TORCH  # the engine its process runs; a switch respawns it
    phase: Phase = Phase.NEW
    load: Load | None = None  # set while phase is LOADING (and until burial if it died then)
    generation: int = 0  # increments per spawn; messages of an older process are ignored
    proc: Any = None  # multiprocessing Process
    outbox: threading_queue.Queue | None = None
    state: WorkerState = WorkerState.STOPPED
    reason: str = ""
    fatal: str = ""  # the fatal error the process reported before it exits
    since: float = 0.0  # monotonic: spawn or last load command
    last_heartbeat: float = 0.0
    heartbeat: msg.Heartbeat | None = None
    job_id: str = ""
    next_job: str = ""  # the job the scheduler switched it to (loaded once it is empty)
    policy_version: int = 0
    policy_source: str = ""  # "broadcast": its policy weights came from a joined broadcast
    # SGLang: the version directory of the broadcast its engine joined (until the load that
    # follows, or the broadcast's failure): it holds its samples until that version loads.
    broadcast_path: str = ""
    drafter_version: int = 0
    frozen: bool = False  # sent Freeze(True) (its job is paused keep), not yet thawed
    seq: int = 0
    unacked: dict[int, int] = field(default_factory=dict)  # AddWork.seq -> expected tokens
    idle_since: float | None = None
    dead_at: float | None = None  # monotonic time it was taken out of service
    failures: int = 0  # deaths in a row, until a model loads (restart backoff)
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    stored_state: tuple[WorkerState, str] | None = None
    memory_group: WorkerGroup | None = None  # its process's memory cgroup (a limit is set)

    def to(self, phase: Phase) -> None:
        """The one place a worker's phase changes."""
        if phase not in TRANSITIONS[self.phase]:
            raise AssertionError(f"{self.worker_id}: {self.phase.value} -> {phase.value}")
        self.phase = phase

    def start_load(self, load: Load) -> None:
        self.to(Phase.LOADING)
        self.load, self.since = load, time.monotonic()

    @property
    def alive(self) -> bool:
        return self.phase in ALIVE

    @property
    def answered(self) -> bool:
        """Alive and said Ready at least once (it may be loading again)."""
        return self.phase in (Phase.LOADING, Phase.READY)

    @property
    def loading_job(self) -> str:
        """The job a LoadModel in flight switches it to ("" when none)."""
        return self.load.job_id if self.load and self.load.kind is LoadKind.MODEL else ""

    @property
    def policy_load(self) -> str:
        """The job whose policy weights a live worker loads now ("" when none)."""
        if self.phase is Phase.LOADING and self.load and self.load.policy_weights:
            return self.load.job_id
        return ""

    def send(self, m: msg.ToWorker) -> None:
        if self.outbox is not None and self.alive:
            self.outbox.put(m)


def spawn(
    handle: WorkerHandle,
    ctx: Any,
    settings: Settings,
    store: Store,
    loop: asyncio.AbstractEventLoop,
    on_message: OnMessage,
    on_exit: OnExit,
    cgroups: MemoryCgroups | None = None,
) -> None:
    """Start a fresh process for `handle` (forgetting what the old one held) and its threads;
    with `cgroups`, in a memory cgroup of its own with the limit, before it loads anything."""
    target, daemon = worker_code.rollout_entry(handle.backend)
    parent, child = ctx.Pipe()
    args: tuple[Any, ...] = (child, settings.worker_threads, settings.worker_heartbeat_seconds)
    if handle.backend is Backend.SGLANG:
        args += (settings.sglang_engine_factory,)
    elif handle.backend is Backend.SIM:
        args += (settings.sim_engine,)
    else:
        args += (settings.engine_trace_dir,)
    target, args = with_environment(target, *args)
    proc = ctx.Process(target=target, args=args, name=handle.worker_id, daemon=daemon)
    proc.start()
    child.close()
    handle.memory_group = None
    if cgroups is not None:
        try:
            handle.memory_group = cgroups.place(handle.worker_id, proc.pid)
        except OSError:
            log.exception(
                "cannot put the rollout worker in its memory cgroup: it runs without the limit",
                extra={"worker_id": handle.worker_id},
            )
    handle.to(Phase.STARTING)
    handle.generation += 1
    handle.proc = proc
    handle.since, handle.dead_at, handle.heartbeat = time.monotonic(), None, None
    handle.job_id, handle.policy_version, handle.drafter_version = "", 0, 0
    handle.load, handle.fatal, handle.frozen = None, "", False
    handle.unacked.clear()
    handle.idle_since = None
    handle.last_heartbeat = time.monotonic()
    gen = handle.generation
    stamp = HeartbeatStamp(store, handle.worker_id)
    handle.outbox = serve_pipe(
        handle.worker_id,
        parent,
        loop,
        receive=lambda ms: store_reported(store, stamp, ms, handle.worker_id),
        deliver=lambda got: on_message(handle, gen, *got),
        closed=lambda: on_exit(handle, gen),
    )


def broadcast_ranks(backend: Backend) -> int:
    """How many ranks a worker of `backend` takes in a policy broadcast: a torch worker one,
    an SGLang engine one per tensor-parallel GPU."""
    if backend is Backend.SGLANG:
        return SGLANG_TP_SIZE
    return 1


def store_reported(
    store: Store, stamp: HeartbeatStamp, messages: list[msg.FromWorker], worker_id: str = ""
) -> list[tuple[msg.FromWorker, bool | None, UnitEnd | None]]:
    """Reader thread: samples are stored here, before the loop streams them; the samples of
    messages that arrived together in one transaction (`store.sample_batches.store`), with the ends
    of the units they complete (and the start of a request `worker_id` ran, when the node's
    own write of it has not landed yet). Checkpoints are stored apart and not handed on."""
    saved = [m.sample for m in messages if isinstance(m, msg.SampleCheckpoint)]
    if saved:
        messages = [m for m in messages if not isinstance(m, msg.SampleCheckpoint)]
        save_checkpoints(store, saved)
    finished = [m for m in messages if isinstance(m, msg.Finished)]
    outcomes: dict[int, bool | None] = {}
    ends: dict[tuple[str, int], UnitEnd] = {}
    if finished:
        started = time.perf_counter()
        try:
            samples = [m.sample for m in finished]
            batch = store.sample_batches.store(samples, end_units=True, worker_id=worker_id)
            results: list = batch.outcomes
            ends = batch.ends
        except Exception as exc:  # none of them stored: each runs again
            log.exception("cannot store samples", extra={"samples": len(finished)})
            results = [exc] * len(finished)
        METRICS.observe_sample_writes(time.perf_counter() - started, len(finished))
        for m, result in zip(finished, results, strict=True):
            outcomes[id(m)] = _stored(m.sample, result)
    out = []
    for m in messages:
        stored, end = outcomes.get(id(m)), None
        if isinstance(m, msg.Finished) and stored is False:
            m = msg.Finished(_stored_copy(store, m.sample))
        elif isinstance(m, msg.Finished) and stored:
            end = ends.get((m.sample.request_id, m.sample.prompt_index))
        elif isinstance(m, msg.Heartbeat):
            stamp()
        out.append((m, stored, end))
    return _request_ends_last(out)


def save_checkpoints(store: Store, samples: list[Sample]) -> None:
    """Reader thread: running samples' tokens so far. Not stored (the database is out): after
    a loss those samples run again from their seeds, as without checkpoints."""
    try:
        METRICS.sample_checkpoints.inc(store.checkpoints.save(samples))
    except Exception:
        log.warning("cannot store sample checkpoints", exc_info=True)


_Reported = tuple[msg.FromWorker, bool | None, UnitEnd | None]


def _request_ends_last(out: list[_Reported]) -> list[_Reported]:
    """Within each run of samples, those of a unit whose end ended its request go last: the
    request's other units of the batch are then recorded here first, and its streams here
    end on the final event without reading the store back. Other messages keep their place."""
    if not any(_ends_request(x) for x in out):
        return out
    ordered: list[_Reported] = []
    for samples, group in groupby(out, key=lambda x: isinstance(x[0], msg.Finished)):
        run = list(group)
        ordered += sorted(run, key=_ends_request) if samples else run  # sorted is stable
    return ordered


def _ends_request(item: _Reported) -> bool:
    end = item[2]
    return end is not None and end.status in ENDED_STATUSES


def _stored(sample: Sample, result: object) -> bool | None:
    """`SampleBatches.add`'s word on one sample as the loop takes it: None = not persisted."""
    if isinstance(result, bool):
        return result
    rid = sample.request_id
    if isinstance(result, Fenced):  # the unit's lease was lost: its new owner runs the sample
        log.warning("sample not stored: %s", result, extra={"request_id": rid})
    elif isinstance(result, TltError):
        log.error("sample refused by the store: %s", result, extra={"request_id": rid})
    return None


def _stored_copy(store: Store, sample: Sample) -> Sample:
    """The copy the store already holds of a sample that ran twice (e.g. its first result
    reached the store but not the loop): what the trainer sees must be what is stored."""
    key = (sample.prompt_index, sample.sample_index)
    for s in store.samples.list(sample.request_id):
        if (s.prompt_index, s.sample_index) == key:
            return s
    return sample
