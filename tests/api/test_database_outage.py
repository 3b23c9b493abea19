"""A database that is locked or down: every RPC that needs it answers UNAVAILABLE naming the
database (a status a trainer retries), never INTERNAL, and the same call succeeds once the
database is back. Real SQLite (a lock held by another connection) and a real PostgreSQL
server (stopped and started), over gRPC and the HTTP door (503)."""

from __future__ import annotations

import sqlite3

import grpc
import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from tests.api.support import DaemonThread, fails, make_settings, seed_devices
from tests.ci import skip_unless_ci
from tests.http_api.support import ApiOnlyHttp
from tests.reliability import pg_cluster
from tltd.errors import ResourceExhausted, Unavailable, database_error
from tltd.store import Store, database
from tltd.store.migrate import upgrade

C = grpc.StatusCode


def test_a_sqlite_lock_past_the_busy_timeout_is_unavailable(tmp_path, model_dir, monkeypatch):
    # The daemon's own busy timeout, shortened so that the test does not wait 10 s for it.
    monkeypatch.setattr(database, "SQLITE_BUSY_TIMEOUT_MS", 300)
    path = tmp_path / "tltd.db"
    upgrade(f"sqlite:///{path}")
    store = Store(f"sqlite:///{path}")
    seed_devices(store)
    d = DaemonThread(make_settings(tmp_path), store).start()
    try:
        with d.client() as c:
            hog = sqlite3.connect(path, isolation_level=None)
            hog.execute("BEGIN IMMEDIATE")  # another process's write transaction
            try:
                with fails(C.UNAVAILABLE, "database unavailable", "locked"):
                    c.create_job(str(model_dir), job_id="job")
                # Reads go on beside a writer (WAL).
                assert c.list_jobs() == []
            finally:
                hog.execute("COMMIT")
                hog.close()
            c.create_job(str(model_dir), job_id="job")  # the same call, retried
            assert c.get_job("job").job_id == "job"
    finally:
        d.stop()
        store.close()


@pytest.mark.postgres
def test_postgresql_down_is_unavailable_and_served_again_once_up(tmp_path, model_dir):
    why = pg_cluster.available()
    if why:
        skip_unless_ci(why)
    cluster = pg_cluster.PgCluster()
    store = d = http = None
    try:
        upgrade(cluster.url)
        store = Store(cluster.url)
        seed_devices(store)
        d = DaemonThread(make_settings(tmp_path), store).start()
        # The HTTP door over the same services maps errors in its own place.
        http = ApiOnlyHttp(make_settings(tmp_path, http_enabled=True, http_port=0), store).start()
        with d.client() as c:
            c.create_job(str(model_dir), job_id="job")
            cluster.stop()
            with fails(C.UNAVAILABLE, "database unavailable"):
                c.get_job("job")
            with fails(C.UNAVAILABLE, "database unavailable"):
                c.create_job(str(model_dir), job_id="other")
            down = httpx.get(f"{http.url}/v1/models", timeout=30)
            assert down.status_code == 503, down.text
            assert "database unavailable" in down.json()["error"]["message"]
            assert c.health() == "SERVING"  # the daemon itself is up
            cluster.start()
            assert c.get_job("job").job_id == "job"
            c.create_job(str(model_dir), job_id="other")
            up = httpx.get(f"{http.url}/v1/models", timeout=30)
            assert up.status_code == 200
            assert {m["id"] for m in up.json()["data"]} == {"job", "other"}
    finally:
        if http is not None:
            http.stop()
        if d is not None:
            d.stop()
        if store is not None:
            store.close()
        cluster.close()


def test_only_failures_of_the_database_itself_are_retryable(tmp_path):
    """A bad statement stays an internal error (a bug to fix, not a call to retry); a full
    disk is RESOURCE_EXHAUSTED."""
    url = f"sqlite:///{tmp_path / 'x.db'}"
    engine = database.make_engine(url)
    try:
        with pytest.raises(DBAPIError) as bad, engine.connect() as conn:
            conn.execute(text("SELECT * FROM no_such_table"))
        assert database_error(bad.value) is None
        assert database_error(ValueError("x")) is None
        full = sqlite3.OperationalError("database or disk is full")
        full.sqlite_errorcode = 13  # SQLITE_FULL, as sqlite3 sets it
        err = database_error(DBAPIError("INSERT", {}, full))
        assert isinstance(err, ResourceExhausted) and "disk full" in str(err)
        locked = sqlite3.OperationalError("database is locked")
        locked.sqlite_errorcode = 5  # SQLITE_BUSY
        assert isinstance(database_error(DBAPIError("x", {}, locked)), Unavailable)
    finally:
        engine.dispose()
