"""Helpers for the HTTP tests: a model with a tokenizer, a real daemon serving HTTP on port 0,
an API-only daemon (no workers) for auth and TLS, and server-sent events."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

from tests.rollout.support import InProcessDaemon, make_checkpoint


def make_text_checkpoint(path: Path) -> Path:
    """A random tiny Qwen2 with the task's character tokenizer (54 ids; <eos> = 2)."""
    from examples.task.tokenizer import VOCAB_SIZE, save_tokenizer

    make_checkpoint(path, vocab=VOCAB_SIZE)
    save_tokenizer(path)
    return path


class HttpDaemon(InProcessDaemon):
    """The real daemon (workers, gRPC and HTTP on port 0) on a loop in a thread."""

    @property
    def url(self) -> str:
        return self.daemon.http.url

    def kill(self) -> None:
        if self.daemon is not None and self.daemon.http is not None:
            self.call(self.daemon.http.stop(0))
        super().kill()


def start_http_daemon(tmp: Path, model: Path, job_id: str, seq_len: int, **job) -> HttpDaemon:
    """A real daemon on a fresh SQLite file, one CPU slot, SD off (seeded samples reproduce
    exactly), HTTP on port 0, with `job_id` created over gRPC (`job`: create_job's extra
    arguments) and its worker warm."""
    from tests.api.support import make_settings
    from tltd.store import Store
    from tltd.store.migrate import upgrade
    from tltd_clients import RolloutClient

    url = f"sqlite:///{tmp / 'tltd.db'}"
    upgrade(url)
    settings = make_settings(
        tmp, cpu_slots=1, worker_max_batch=16, worker_max_seq_len=seq_len,
        worker_heartbeat_seconds=0.2, shutdown_grace_seconds=10.0,
        device_refresh_seconds=3600.0, drafter_training=False, http_enabled=True, http_port=0,
    )  # fmt: skip
    d = HttpDaemon(settings, Store(url)).start()
    try:
        with RolloutClient(d.target) as c:
            c.create_job(model, job_id=job_id, speculative="off", online_training=False, **job)
            c.generate([[1, 5, 6]], n=1, temperature=0.0, max_new_tokens=2)  # warm
    except BaseException:
        d.kill()
        raise
    return d


class ApiOnlyHttp:
    """The HTTP server exactly as the daemon builds it over services without workers (a
    rollout answers 501): auth, TLS and the read endpoints need no model."""

    def __init__(self, settings, store) -> None:
        from tltd.services import build_services

        self.services = build_services(store, settings)
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.http = None

    def start(self) -> ApiOnlyHttp:
        from tltd.http.server import build_http_server

        self._thread.start()

        async def start():
            self.http = build_http_server(self.settings, self.services)
            await self.http.start()

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)
        return self

    @property
    def url(self) -> str:
        return self.http.url

    def stop(self) -> None:
        if self.http is not None:
            asyncio.run_coroutine_threadsafe(self.http.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()


def sse_events(lines) -> list:
    """The JSON payloads of a server-sent event stream, up to [DONE] (which must come)."""
    events = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            return events
        events.append(json.loads(data))
    raise AssertionError(f"stream ended without [DONE] after {len(events)} events")


def wait_running(store, rid: str, timeout: float = 30.0) -> None:
    """Until a worker has begun request `rid` (its tokens are being produced)."""
    from tltd.domain import RequestStatus
    from tltd.errors import NotFound

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if store.requests.get(rid).status is RequestStatus.RUNNING:
                return
        except NotFound:
            pass  # not stored yet
        time.sleep(0.02)
    raise AssertionError(f"request {rid} did not start running")


def wait_held(http, count: int = 1, timeout: float = 60.0) -> None:
    """Until `count` new requests of the job wait at this node's admission (held by a pause:
    refused, not stored), as `/server_info` reports them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if http.get("/server_info").json()["tltd"]["held_requests"] >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"{count} requests were not held at admission within {timeout} s")
