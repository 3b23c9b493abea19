"""The daemon's lifecycle, top to bottom: settings -> migrate -> store -> devices -> supervisor ->
server -> periodic -> wait for SIGTERM/SIGINT -> drain -> ordered graceful shutdown."""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from apscheduler.schedulers.asyncio import AsyncIOScheduler
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from tltd.api.server import build_server
from tltd.devices import Nvml, PynvmlBackend
from tltd.drafter_training import DrafterTraining
from tltd.errors import ConfigError
from tltd.metrics import MetricsServer, start_metrics_server
from tltd.periodic import NodeBeat, build_scheduler, refresh_devices, roll_up_metrics
from tltd.scheduler import SchedulerConfig, sticky_slack
from tltd.services import NodeState, build_services
from tltd.settings import Settings
from tltd.store import Store
from tltd.store.migrate import upgrade
from tltd.store.notifications import NODE, Listener
from tltd.supervisor import Supervisor

if TYPE_CHECKING:
    from tltd.http.server import HttpServer

log = logging.getLogger(__name__)

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def serve(
    settings: Settings, port_file: str | None = None, http_port_file: str | None = None
) -> int:
    """Run until SIGTERM/SIGINT, then shut down in order; returns the process exit status."""
    url = settings.resolved_database_url
    if not settings.database_url:
        Path(settings.data_dir).mkdir(parents=True, exist_ok=True)
    try:
        upgrade(url)
    except SQLAlchemyError as exc:
        # An unreachable or unwritable database is a configuration problem: say so, exit 2.
        shown = make_url(url).render_as_string(hide_password=True)
        raise ConfigError(f"cannot open database {shown}: {exc.__class__.__name__}: {exc}") from exc
    store = Store(url, node_id=settings.resolved_node_id)
    try:
        return await _serve_with_store(settings, store, port_file, http_port_file)
    finally:
        _kill_leftover_workers()
        store.close()  # last: everything above that uses the store has stopped


async def _serve_with_store(
    settings: Settings, store: Store, port_file: str | None, http_port_file: str | None
) -> int:
    daemon = Daemon(settings, store, PynvmlBackend())
    # Signals are caught before serving so that a SIGTERM during start-up is not lost.
    stop = daemon.stop_requested  # set by a signal or a preemption notice file
    loop = asyncio.get_running_loop()
    for sig in _SIGNALS:
        loop.add_signal_handler(sig, _on_signal, sig, stop)
    await daemon.start()
    # Everything allocated so far (the imported modules, the services) lives as long as the
    # daemon: out of the collector's reach, a full collection does not walk it again and
    # again (one costs tens of ms with torch imported, and a push triggers many).
    gc.freeze()
    # The HTTP port file first: a reader polling for the gRPC one then finds both.
    if http_port_file and daemon.http is not None:
        _write_atomically(http_port_file, f"{daemon.http.port}\n")
    if port_file:
        _write_atomically(port_file, f"{daemon.api.port}\n")
    await stop.wait()
    await daemon.shutdown()
    for sig in _SIGNALS:
        loop.remove_signal_handler(sig)
    log.info("tltd stopped")
    return 0


class Daemon:
    """The running parts in start order; `shutdown` stops them in reverse, draining first."""

    def __init__(self, settings: Settings, store: Store, nvml: Nvml | None) -> None:
        self.settings = settings
        self.store = store
        self.nvml = nvml
        self.node = NodeState()
        # Drafter training on idle devices, for jobs with speculative.online_training.
        self.training = DrafterTraining(store, settings) if settings.drafter_training else None
        self.supervisor = Supervisor(
            store, settings, training=self.training, scheduler_config=scheduler_config(settings)
        )
        if self.training is not None:
            self.training.on_change = self.supervisor.kick
        self.services = build_services(store, settings, self.node, self.supervisor)
        self.api = build_server(settings, self.services)
        # The HTTP door: a second transport over the same services (docs/http.md), imported
        # only when on (its web stack is ~0.3 s of a daemon's start).
        self.http: HttpServer | None = None
        if settings.http_enabled:
            from tltd.http.server import build_http_server

            self.http = build_http_server(settings, self.services)
        self.scheduler: AsyncIOScheduler | None = None
        self.listener: Listener | None = None
        self.metrics: MetricsServer | None = None
        self.stop_requested = asyncio.Event()  # what `serve` waits for before `shutdown`
        self.started_at = time.time()  # wall clock: a preemption notice file older is stale

    async def start(self) -> None:
        settings, loop = self.settings, asyncio.get_running_loop()
        # First: the epoch fences every write below that depends on what this node owns.
        await asyncio.to_thread(self.store.nodes.join, settings.address, settings.node_down_seconds)
        devices = await asyncio.to_thread(
            refresh_devices, self.store, self.nvml, settings.cpu_slots
        )
        self.metrics = await asyncio.to_thread(_start_metrics, settings, self.store)
        # A drafter evaluation a crash interrupted left its version a candidate: never pinned,
        # never collected, unless rejected.
        await asyncio.to_thread(
            self.store.drafters.reject_candidates, "evaluation interrupted by a restart"
        )
        await self.supervisor.start()  # re-queues what a crashed daemon left open
        # Pushes a previous run was receiving cannot resume: their progress was in its memory.
        await asyncio.to_thread(self.services.pushes.clean_start)
        if self.store.dialect == "postgresql":  # other nodes' samples, cancels and new work
            self.listener = Listener(
                self.store.url,
                lambda ch, rid, own: loop.call_soon_threadsafe(self._on_notify, ch, rid, own),
                self.store.db.own_backends,
            ).start()
        # `tltctl drain --node`: stop admitting and drain the workers, keep serving reads.
        self.node.on_draining(lambda: loop.call_soon_threadsafe(self._drain_node))
        await self.api.start()
        if self.http is not None:
            await self.http.start()
        self.scheduler = build_scheduler(
            settings,
            self.store,
            self.nvml,
            self.supervisor,
            self.training,
            on_preemption_notice=lambda: loop.call_soon_threadsafe(self._preemption_notice),
            started_at=self.started_at,
            pushes=self.services.pushes,
            node=NodeBeat(
                self.api.address,
                on_new_epoch=lambda: asyncio.run_coroutine_threadsafe(
                    self.supervisor.on_new_epoch(), loop
                ),
                on_fenced=lambda: loop.call_soon_threadsafe(self._fenced),
                on_drain_requested=self._drain_requested,
            ),
        )
        self.scheduler.start()
        log.info(
            "tltd serving",
            extra={
                "address": self.api.address,
                "http": self.http.url if self.http is not None else "off",
                "database": self.store.dialect,
                "devices": len(devices),
                "auth": "on" if settings.tokens else "off",
                "tls": bool(settings.tls_cert),
            },
        )

    def _drain_node(self) -> None:
        """A drained node finishes its rollouts and trains no more (trainers checkpoint)."""
        grace = self.node.drain_grace_seconds or self.settings.drain_grace_seconds
        why = f"node drained: {self.node.draining_reason}"
        self.supervisor.start_drain(grace, why)
        if self.training is not None:
            self.training.close(why)  # a SIGTERM later lowers its deadline to the shutdown's

    def _on_notify(self, channel: str, payload: str, own: bool = False) -> None:
        """A notification from another node, or one this node sent (`own`) (event loop)."""
        if channel == NODE:
            if payload == self.store.node_id:  # an operator's request for this node
                asyncio.ensure_future(asyncio.to_thread(self._check_requests))
            return
        self.supervisor.on_notify(channel, payload, own)

    def _check_requests(self) -> None:
        requested = self.store.nodes.requested_drain()
        if requested is not None:
            self._drain_requested(*requested)

    def _drain_requested(self, reason: str, grace_seconds: float) -> None:
        """A drain of this node asked through the database (any thread): as `tltctl drain
        --node` on this node."""
        if not self.node.draining:
            log.warning("node drain requested through the database", extra={"reason": reason})
        self.node.start_draining(reason, grace_seconds or None)

    def _fenced(self) -> None:
        """Another daemon joined under this node id: this one stops (two processes must never
        hold one node's work)."""
        if not self.stop_requested.is_set():
            log.error("another daemon joined as node %s: stopping", self.store.node_id)
            self.stop_requested.set()

    def _preemption_notice(self) -> None:
        """The preemption notice file appeared: the same shutdown as SIGTERM."""
        if not self.stop_requested.is_set():
            log.warning("preemption notice", extra={"path": self.settings.preemption_notice_file})
            self.stop_requested.set()

    async def shutdown(self) -> None:
        """Stop admitting, give work most of the grace, return the rest as partial samples,
        close the API, stop periodic jobs, stop the workers. One deadline (the grace's end)
        bounds every wait, also that of a node drain under way; what is left then is killed."""
        grace = self.settings.shutdown_grace_seconds
        deadline = time.monotonic() + grace
        log.info("shutting down", extra={"grace_seconds": grace})
        work_seconds = max(0.0, grace - min(5.0, 0.25 * grace))
        # Before the node listener's drain; shortens a node drain already under way.
        drain = self.supervisor.start_drain(work_seconds, end=deadline)
        self.node.start_draining("daemon shutting down")  # new Generate -> UNAVAILABLE
        # Training yields to the drain at once; each trainer checkpoints before it exits.
        if self.training is not None:
            stopping = self.training.close(deadline=deadline)
        else:
            stopping = asyncio.sleep(0)
        for what, result in zip(
            ("drain", "drafter training stop"),
            await asyncio.gather(drain, stopping, return_exceptions=True),
            strict=True,
        ):
            if isinstance(result, BaseException):  # the workers must still be stopped below
                log.error("shutdown: the %s failed", what, exc_info=result)
        left = max(0.5, deadline - time.monotonic())
        stopping_http = self.http.stop(left) if self.http is not None else asyncio.sleep(0)
        # health NOT_SERVING, then the (ended) streams close; both doors at once
        await asyncio.gather(self.api.stop(left), stopping_http)
        if self.scheduler is not None:
            self.scheduler.shutdown(wait=True)  # a device refresh in flight finishes first
        await self.supervisor.stop(deadline)
        if self.listener is not None:
            await asyncio.to_thread(self.listener.stop)
        try:
            await asyncio.to_thread(self.store.nodes.leave)
        except Exception:  # the database may be what failed; the node then shows DOWN
            log.warning("cannot record the node as left", exc_info=True)
        if self.metrics is not None:
            self.metrics.stop()


def _start_metrics(settings: Settings, store: Store) -> MetricsServer | None:
    """The Prometheus endpoint (settings.metrics_port, 0 = off); a taken port fails start-up."""
    if not settings.metrics_port:
        return None
    roll_up_metrics(store)  # the first scrape already sees every device
    try:
        server = start_metrics_server(settings.metrics_port, settings.host)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on port {settings.metrics_port}: {exc}") from exc
    log.info("metrics endpoint", extra={"url": f"http://{settings.host}:{server.port}/metrics"})
    return server


def scheduler_config(settings: Settings) -> SchedulerConfig:
    """The scheduling policy's knobs, from the settings."""
    return SchedulerConfig(
        idle_grace_seconds=settings.training_idle_grace_seconds,
        min_fresh_samples=settings.training_min_fresh_samples,
        training_cadence_seconds=settings.training_cadence_seconds,
        train_during_rollout_only=settings.training_window == "rollout",
        max_samples_per_worker=settings.worker_max_batch,
        sticky_slack_samples=sticky_slack(settings.worker_max_batch),
        session_placement=settings.session_placement,
    )


def _kill_leftover_workers() -> None:
    """Kill worker processes still there (only after a failed start or shutdown): they ignore
    SIGTERM (`tltd_workers.signals`), so multiprocessing's exit handler, which terminates and then
    joins them, would wait for them for ever."""
    for proc in mp.active_children():
        proc.kill()
        proc.join(5.0)


def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
    if stop.is_set():
        log.warning("already shutting down", extra={"signal": sig.name})
        return
    log.info("signal received", extra={"signal": sig.name})
    stop.set()


def _write_atomically(path: str, text: str) -> None:
    # A reader polling for the file must never see it half-written.
    tmp = f"{path}.{os.getpid()}.tmp"
    Path(tmp).write_text(text)
    os.replace(tmp, path)
