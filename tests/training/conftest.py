"""Fixtures for the drafter-training tests: a tiny policy and a real daemon that trains."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Callable, Iterator

import pytest

from tests.api.support import make_settings
from tests.rollout.support import InProcessDaemon


async def until(cond: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    """Wait (on the event loop) until `cond()` holds; TimeoutError naming `what` after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.02)


def training_settings(tmp_path, **overrides):
    """Two CPU slots and small training thresholds, so a round starts right after a batch."""
    values = dict(
        cpu_slots=2,
        worker_max_batch=16,
        worker_max_seq_len=1024,
        worker_heartbeat_seconds=0.2,
        shutdown_grace_seconds=10.0,
        device_refresh_seconds=3600.0,
        training_idle_grace_seconds=0.2,
        training_min_fresh_samples=4,
        training_cadence_seconds=0.5,
        training_held_out_every=3,
    )
    return make_settings(tmp_path, **(values | overrides))


@pytest.fixture(scope="session")
def ckpt_other_config(ckpt2, tmp_path_factory):
    """ckpt2's weights under another config (rms_norm_eps): a policy version a running
    trainer cannot load in place, so the daemon replaces the trainer process."""
    path = tmp_path_factory.mktemp("ckpt3") / "policy"
    shutil.copytree(ckpt2, path)
    config = json.loads((path / "config.json").read_text())
    config["rms_norm_eps"] = config["rms_norm_eps"] * 10
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def start_daemon(sqlite_store, tmp_path) -> Iterator:
    """start_daemon(**settings) -> a started InProcessDaemon (killed after the test)."""
    started = []

    def start(**overrides) -> InProcessDaemon:
        d = InProcessDaemon(training_settings(tmp_path, **overrides), sqlite_store).start()
        started.append(d)
        return d

    yield start
    for d in started:
        d.kill()


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
