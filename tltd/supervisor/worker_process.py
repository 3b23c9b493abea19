"""One rollout worker process: its handle, its spawn, and the two pipe threads that serve it.

Two threads per worker (one reads its pipe and stores what it reports, one writes commands) keep
a slow or hung worker from ever blocking the daemon's event loop. What they read is handed to
the loop with `call_soon_threadsafe`; `generation` tells messages of a replaced process apart.
"""

from __future__ import annotations

import asyncio
import logging
import queue as threading_queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from tltd.domain import Backend, Device, Sample, WorkerState
from tltd.settings import Settings
from workers.rollout import protocol as msg

if TYPE_CHECKING:
    from tltd.store import Store

log = logging.getLogger(__name__)

# on_message(slot, generation, message, stored): stored is None when a Finished sample could
# not be persisted (then it is not streamed but run again), else what `add_sample` returned.
OnMessage = Callable[["WorkerSlot", int, msg.FromWorker, "bool | None"], None]
OnExit = Callable[["WorkerSlot", int], None]


@dataclass
class WorkerSlot:
    """One device's rollout worker: the process, its pipe and what the daemon knows of it."""

    worker_id: str
    device: Device
    backend: Backend = Backend.TORCH  # the engine its process runs; a switch respawns it
    generation: int = 0  # increments per spawn; messages of an older process are ignored
    proc: Any = None  # multiprocessing Process
    outbox: threading_queue.Queue | None = None
    state: WorkerState = WorkerState.STOPPED
    reason: str = ""
    fatal: str = ""  # the fatal error the process reported before it exits
    ready: bool = False  # the process said Ready at least once
    loading: bool = True  # a spawn or Load* is in flight (no work until Ready)
    since: float = 0.0  # monotonic: spawn or last load command
    last_heartbeat: float = 0.0
    heartbeat: msg.Heartbeat | None = None
    job_id: str = ""
    target_job: str = ""  # the job a LoadModel in flight is loading
    next_job: str = ""  # the job the scheduler switched it to (loaded once it is empty)
    # The job whose policy weights a LoadModel/LoadPolicy in flight loads ("" = none): while
    # set, that job's policy update is being applied and its drafter training must not start.
    policy_load: str = ""
    # (job, version, drafter) of the LoadModel/LoadPolicy/SetDrafter in flight: a process that
    # dies before its Ready failed that load (an OOM kill, a native crash, a hung load killed).
    load_in_flight: tuple[str, int, bool] | None = None
    policy_version: int = 0
    drafter_version: int = 0
    seq: int = 0
    unacked: dict[int, int] = field(default_factory=dict)  # AddWork.seq -> expected tokens
    idle_since: float | None = None
    dead_at: float | None = None  # monotonic time the process was found dead
    failures: int = 0  # deaths in a row, until a model loads (restart backoff)
    exiting: bool = False  # marked dead, its process not yet joined and recorded
    vacated: bool = False  # stopped on purpose (foreign device): not restarted
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    stored_state: tuple[WorkerState, str] | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.dead_at is None

    def send(self, m: msg.ToWorker) -> None:
        if self.outbox is not None and self.alive:
            self.outbox.put(m)


def spawn(
    slot: WorkerSlot,
    ctx: Any,
    settings: Settings,
    store: Store,
    loop: asyncio.AbstractEventLoop,
    on_message: OnMessage,
    on_exit: OnExit,
) -> None:
    """Start a fresh process for `slot` (forgetting what the old one held) and its threads."""
    target, daemon = worker_entry(slot.backend)
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=target,
        args=(child, settings.worker_threads, settings.worker_heartbeat_seconds),
        name=slot.worker_id,
        daemon=daemon,
    )
    proc.start()
    child.close()
    slot.generation += 1
    slot.proc, slot.outbox = proc, threading_queue.Queue()
    slot.ready, slot.loading, slot.since = False, True, time.monotonic()
    slot.dead_at, slot.vacated, slot.heartbeat = None, False, None
    slot.job_id, slot.policy_version, slot.drafter_version = "", 0, 0
    slot.target_job = slot.policy_load = ""
    slot.load_in_flight, slot.fatal = None, ""
    slot.unacked.clear()
    slot.idle_since = None
    slot.last_heartbeat = time.monotonic()
    threading.Thread(
        target=_read_pipe,
        args=(slot, slot.generation, parent, store, loop, on_message, on_exit),
        name=f"{slot.worker_id}-rx",
        daemon=True,
    ).start()
    threading.Thread(
        target=write_pipe,
        args=(slot.outbox, parent),
        name=f"{slot.worker_id}-tx",
        daemon=True,
    ).start()


def worker_entry(backend: Backend) -> tuple[Callable[..., None], bool]:
    """The process target of a backend's rollout worker, and whether the process may be
    daemonic: SGLang's engine starts its own scheduler processes, which a daemonic process
    may not have (they die with it through SGLang's parent-death signal instead)."""
    if backend is Backend.SGLANG:
        from workers.rollout.sglang_worker import main as sglang_main

        return sglang_main, False
    from workers.rollout.worker import main as torch_main

    return torch_main, True


def _read_pipe(
    slot: WorkerSlot,
    gen: int,
    conn: Connection,
    store: Store,
    loop: asyncio.AbstractEventLoop,
    on_message: OnMessage,
    on_exit: OnExit,
) -> None:
    """Reader thread: samples are stored here, before the loop streams them."""
    last_beat = 0.0
    while True:
        try:
            m = conn.recv()
        except (EOFError, OSError):
            break
        except Exception:  # an unpicklable message: treat the worker as broken
            log.exception("bad message from worker", extra={"worker_id": slot.worker_id})
            break
        stored: bool | None = None
        if isinstance(m, msg.Finished):
            try:
                stored = store.add_sample(m.sample)
                if not stored:
                    m = msg.Finished(_stored_copy(store, m.sample))
            except Exception:
                log.exception("cannot store sample", extra={"worker_id": slot.worker_id})
        elif isinstance(m, msg.Heartbeat) and time.monotonic() - last_beat >= 2.0:
            last_beat = time.monotonic()
            try:
                store.heartbeat_worker(slot.worker_id)
            except Exception:  # e.g. "database is locked": this thread must keep reading
                log.warning(
                    "cannot record heartbeat", extra={"worker_id": slot.worker_id}, exc_info=True
                )
        _post(loop, on_message, slot, gen, m, stored)
    conn.close()
    _post(loop, on_exit, slot, gen)


def _stored_copy(store: Store, sample: Sample) -> Sample:
    """The copy the store already holds of a sample that ran twice (e.g. its first result
    reached the store but not the loop): what the trainer sees must be what is stored."""
    key = (sample.prompt_index, sample.sample_index)
    for s in store.list_samples(sample.request_id):
        if (s.prompt_index, s.sample_index) == key:
            return s
    return sample


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    if not loop.is_closed():
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop closed while we were reading


def write_pipe(outbox: threading_queue.Queue, conn: Connection) -> None:
    """Writer thread: a worker busy in a long step never blocks the event loop."""
    while True:
        m = outbox.get()
        if m is None:
            return
        try:
            conn.send(m)
        except (OSError, ValueError):
            return  # the worker is gone; the reader notices
