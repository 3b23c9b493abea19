"""A node that cannot read the active drafter version (on another node's own storage, or its
directory missing here) runs the newest promoted version it can read, on real store rows
(SQLite and PostgreSQL) and real directories; it says why once."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from tests.rollout.test_model_planner import _Clock, _slot
from tltd.contract import rollout_messages as msg
from tltd.domain import DrafterStatus, DrafterVersion, Job
from tltd.settings import Settings
from tltd.store import Store
from tltd.supervisor.model_planner import ModelPlanner
from tltd.supervisor.worker_process import Phase

JOB_ID = "job"
PLANNER_LOG = "tltd.supervisor.model_planner"


def _version(
    store: Store,
    path: Path,
    node_id: str,
    *,
    shared: bool = False,
    status: DrafterStatus = DrafterStatus.PROMOTED,
    make_dir: bool = True,
) -> int:
    if make_dir:
        path.mkdir(parents=True)
    dv = DrafterVersion(JOB_ID, 0, 0, str(path), status=status, node_id=node_id, shared=shared)
    return store.drafters.add(dv).version


def _sync(planner: ModelPlanner, store: Store, handle) -> msg.SetDrafter | None:
    """One planner pass over the job as stored; the worker's Ready applied to `handle`."""
    job = store.jobs.get(JOB_ID)
    asyncio.run(planner._sync_drafter(handle, job))
    if handle.outbox.empty():
        return None
    sent = handle.outbox.get_nowait()
    handle.phase, handle.drafter_version = Phase.READY, sent.version
    return sent


def test_a_node_runs_the_newest_drafter_it_can_read(store: Store, tmp_path, caplog) -> None:
    store.jobs.create(Job(JOB_ID, "/m"))
    here = Store(store.url, node_id="b")  # the planner's node
    clock = _Clock()
    planner = ModelPlanner(here, Settings(), clock=clock)
    handle = _slot()
    b_dir, shared, a_dir = tmp_path / "b-data", tmp_path / "shared", tmp_path / "a-data"
    try:
        v1 = _version(store, b_dir / "v1", "b")  # trained here
        v2 = _version(store, shared / "v2", "a", shared=True)  # on the shared dir
        _version(store, b_dir / "v3", "b", status=DrafterStatus.REJECTED)  # never run
        v4 = _version(store, a_dir / "v4", "a")  # on node a's own storage: the active one
        assert store.jobs.get(JOB_ID).drafter_version == v4

        with caplog.at_level(logging.WARNING, logger=PLANNER_LOG):
            assert _sync(planner, store, handle) == msg.SetDrafter(str(shared / "v2"), v2)
            assert _sync(planner, store, handle) is None  # holds v2: nothing to do
            clock.now += 31  # the active version is looked at again: still unreadable here
            assert _sync(planner, store, handle) is None
        # The planner's records only: caplog also gets what other loggers say meanwhile (an
        # earlier test's event loop, collected now, logs its pending tasks on asyncio's).
        told = [r.getMessage() for r in caplog.records if r.name == PLANNER_LOG]
        assert told == [
            "active drafter version 4 not readable on this node (on node a's own storage): "
            "running version 2"
        ]

        # The shared copy gone from this node (the mount lost): the version trained here.
        (shared / "v2").rename(tmp_path / "v2-moved")
        clock.now += 31
        assert _sync(planner, store, handle) == msg.SetDrafter(str(b_dir / "v1"), v1)

        # A version promoted on shared storage whose directory is not there yet on this node:
        # it is not run until it is; then it is.
        v5 = _version(store, shared / "v5", "a", shared=True, make_dir=False)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=PLANNER_LOG):
            assert _sync(planner, store, handle) is None  # still on v1
        assert f"no directory {shared / 'v5'} on this node" in caplog.text
        (shared / "v5").mkdir()
        clock.now += 31
        assert _sync(planner, store, handle) == msg.SetDrafter(str(shared / "v5"), v5)
    finally:
        here.close()


def test_with_no_readable_version_the_job_runs_without_a_learned_drafter(
    store: Store, tmp_path, caplog
) -> None:
    store.jobs.create(Job(JOB_ID, "/m"))
    here = Store(store.url, node_id="b")
    planner = ModelPlanner(here, Settings(), clock=_Clock())
    handle = _slot()
    try:
        _version(store, tmp_path / "a-data" / "v1", "a")
        with caplog.at_level(logging.WARNING, logger=PLANNER_LOG):
            assert _sync(planner, store, handle) is None  # nothing loaded: plain or n-gram
        assert "running without a learned drafter" in caplog.text

        handle.drafter_version = 1  # a worker that held a version this node cannot read
        assert _sync(planner, store, handle) == msg.SetDrafter("", 0)
    finally:
        here.close()
