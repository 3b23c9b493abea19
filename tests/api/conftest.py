"""Fixtures for the API tests: a daemon on SQLite and PostgreSQL, one with auth, model dirs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api.support import (
    ADMIN_TOKEN,
    TRAINER_TOKEN,
    DaemonThread,
    make_settings,
    seed_devices,
    write_model_dir,
)
from tltd_clients.client import TltClient


@pytest.fixture
def model_dir(tmp_path) -> Path:
    return write_model_dir(tmp_path / "model")


@pytest.fixture
def daemon(store, tmp_path) -> Iterator[DaemonThread]:
    """Auth off (loopback, no tokens), on SQLite and PostgreSQL (the `store` fixture)."""
    seed_devices(store)
    d = DaemonThread(make_settings(tmp_path), store).start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def client(daemon) -> Iterator[TltClient]:
    with daemon.client() as c:
        yield c


@pytest.fixture
def auth_daemon(sqlite_store, tmp_path) -> Iterator[DaemonThread]:
    tokens = {ADMIN_TOKEN: "admin", TRAINER_TOKEN: "trainer"}
    seed_devices(sqlite_store)
    d = DaemonThread(make_settings(tmp_path, tokens=tokens), sqlite_store).start()
    try:
        yield d
    finally:
        d.stop()
