"""Fixtures for the HTTP tests: one real daemon per module (workers load a model once)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.api.support import make_settings
from tests.http_api.support import HttpDaemon, make_text_checkpoint
from tltd.store import Store
from tltd.store.migrate import upgrade
from tltd_clients import RolloutClient

JOB = "http-job"


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("text-model") / "policy")


@pytest.fixture(scope="module")
def http_daemon(tmp_path_factory, text_model) -> Iterator[HttpDaemon]:
    """SQLite, one CPU slot, SD off (seeded samples reproduce exactly), HTTP on port 0, with
    job JOB created over gRPC and its worker warm."""
    tmp = tmp_path_factory.mktemp("http-daemon")
    url = f"sqlite:///{tmp / 'tltd.db'}"
    upgrade(url)
    store = Store(url)
    settings = make_settings(
        tmp,
        cpu_slots=1,
        worker_max_batch=16,
        worker_max_seq_len=512,
        worker_heartbeat_seconds=0.2,
        shutdown_grace_seconds=10.0,
        device_refresh_seconds=3600.0,
        drafter_training=False,
        http_enabled=True,
        http_port=0,
    )
    d = HttpDaemon(settings, store).start()
    try:
        with RolloutClient(d.target) as c:
            c.create_job(text_model, job_id=JOB, speculative="off", online_training=False)
            c.generate([[1, 5, 6]], n=1, temperature=0.0, max_new_tokens=2)  # warm
        yield d
    finally:
        d.kill()
        store.close()
