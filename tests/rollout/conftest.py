"""Fixtures for the rollout tests: a tiny checkpoint and a real daemon with real workers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.api.support import make_settings
from tests.rollout.support import InProcessDaemon


@pytest.fixture
def settings(tmp_path):
    return make_settings(
        tmp_path,
        cpu_slots=2,
        worker_max_batch=16,
        worker_max_seq_len=1024,
        worker_heartbeat_seconds=0.2,
        shutdown_grace_seconds=10.0,
        device_refresh_seconds=3600.0,
    )


@pytest.fixture
def daemon(store, settings) -> Iterator[InProcessDaemon]:
    """On SQLite and PostgreSQL."""
    d = InProcessDaemon(settings, store).start()
    try:
        yield d
    finally:
        d.kill()


@pytest.fixture
def sqlite_daemon(sqlite_store, settings) -> Iterator[InProcessDaemon]:
    d = InProcessDaemon(settings, sqlite_store).start()
    try:
        yield d
    finally:
        d.kill()


@pytest.fixture(autouse=True)
def _one_thread():
    """The engine run in the test process for comparison: one thread (2 shared CI cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
