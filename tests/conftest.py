"""Shared fixtures: real databases (a SQLite file, a fresh PostgreSQL database), a migrated Store.

- `sqlite_url`: URL of a SQLite file in the test's tmp dir (no tables yet).
- `pg_url`: URL of a freshly created, uniquely named PostgreSQL database (no tables yet),
  dropped after the test. Server from env `TLTD_TEST_PG_URL` (default
  postgresql://postgres@127.0.0.1:5432/test). Unreachable server or no psycopg: the test
  fails when env `CI` is "true"/"1", otherwise it is skipped.
- `db_url`: parametrized over "sqlite" and "postgresql" (the PG case is marked `postgres`):
  a fresh, empty database on each backend (use it to test migrations or a daemon that
  migrates at start).
- `migrated_sqlite_url`, `migrated_pg_copy`, `migrated_db_url` (both): a new database at the
  schema's head, copied from one migrated once per test process.
- `store`: parametrized the same way: a `tltd.store.Store` on a migrated, empty database;
  closed afterwards. `store.url` reopens the same database. On PostgreSQL one migrated
  database is shared by the session and emptied before each test, because
  creating and dropping a database per test costs about a second.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from sqlalchemy import text

from tests import durations, torch_device
from tests.ci import skip_unless_ci
from tltd.store import Store
from tltd.store.database import make_engine, scratch_postgres
from tltd.store.migrate import upgrade
from tltd.store.tables import Base


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        help="torch device of the engine, SD and drafter tests (cpu, cuda, cuda:N)",
    )


def pytest_configure(config) -> None:
    device = config.getoption("--device")
    if device != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError(f"--device {device}: torch sees no CUDA device")
    torch_device.select(device)
    if os.environ.get("TLTD_RECORD_DURATIONS") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(durations.Recorder(), "tltd-durations")


def pytest_collection_modifyitems(items) -> None:
    durations.order(items)


@pytest.fixture(autouse=True)
def _cuda_allocations(request):
    """On a CUDA `--device`, record how many allocations the test made there (a JUnit property,
    `cuda_allocations`): the GPU check counts a test as run on CUDA only when it is > 0."""
    device = torch_device.torch_device()
    if not device.startswith("cuda"):
        yield
        return
    import torch

    def allocations() -> int:
        return int(torch.cuda.memory_stats(device).get("allocation.all.allocated", 0))

    before = allocations()
    yield
    request.node.user_properties.append(("cuda_allocations", allocations() - before))


PG_ADMIN_URL = os.environ.get("TLTD_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


@contextmanager
def _fresh_pg_database(template: str = "") -> Iterator[str]:
    """Create a uniquely named database on the test server (a copy of `template`, when
    given); drop it afterwards."""
    try:
        import psycopg
    except ImportError as exc:  # importorskip would skip under CI too
        skip_unless_ci(f"psycopg not installed: {exc}")
    with ExitStack() as stack:
        try:
            url = stack.enter_context(scratch_postgres(PG_ADMIN_URL, "tltd_test", template))
        except psycopg.OperationalError as exc:
            skip_unless_ci(f"PostgreSQL not reachable at {PG_ADMIN_URL}: {str(exc).strip()}")
        yield url


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Torch in the test process (reference runs, in-process engines) on one thread: with
    its default of one thread per core it competes with the daemons' workers for the same
    cores, and under load its spinning threads made a reference run 40x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'tltd.db'}"


@pytest.fixture
def pg_url() -> Iterator[str]:
    with _fresh_pg_database() as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request) -> str:
    """A fresh, empty database URL on each backend."""
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


# Migrated once per test process and copied for each test whose subject is not the migration:
# a copy takes ~2 ms (SQLite) or ~0.4 s (PostgreSQL), migrating ~1 s or ~3 s on this VM, and
# a few hundred tests start on a migrated database. The migration tests and the daemons'
# migrate-at-start tests keep `sqlite_url`, `pg_url` and `db_url` (empty databases).
@pytest.fixture(scope="session")
def _sqlite_template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("schema") / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def _pg_template() -> Iterator[str]:
    with _fresh_pg_database() as url:
        upgrade(url)
        yield url


@pytest.fixture
def migrated_sqlite_url(tmp_path, _sqlite_template) -> str:
    """A SQLite file at the schema's head (a copy of the process's migrated template)."""
    path = tmp_path / "tltd.db"
    shutil.copyfile(_sqlite_template, path)
    return f"sqlite:///{path}"


@pytest.fixture
def migrated_pg_copy(_pg_template) -> Iterator[str]:
    """A new PostgreSQL database at the schema's head, dropped afterwards."""
    with _fresh_pg_database(template=_pg_template) as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def migrated_db_url(request) -> str:
    """A new database at the schema's head, on each backend, for daemons that share nothing."""
    if request.param == "sqlite":
        return request.getfixturevalue("migrated_sqlite_url")
    return request.getfixturevalue("migrated_pg_copy")


@pytest.fixture(scope="session")
def migrated_pg_url(_pg_template) -> Iterator[str]:
    """One migrated PostgreSQL database for the whole session (see `store`)."""
    with _fresh_pg_database(template=_pg_template) as url:
        yield url


def _empty_all_tables(url: str) -> None:
    # DELETE, not TRUNCATE: on a handful of rows it is ~10x faster (no new relation files).
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            # Fail fast instead of hanging if a previous test leaked an open transaction.
            conn.execute(text("SET LOCAL lock_timeout = '5s'"))
            for table in reversed(Base.metadata.sorted_tables):
                conn.execute(table.delete())
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store(request) -> Iterator[Store]:
    """A Store on a migrated, empty database, on SQLite and on PostgreSQL."""
    if request.param == "sqlite":
        url = request.getfixturevalue("migrated_sqlite_url")
    else:
        url = request.getfixturevalue("migrated_pg_url")
        _empty_all_tables(url)
    s = Store(url)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def sqlite_store(migrated_sqlite_url) -> Iterator[Store]:
    """A migrated SQLite store, where the database is not what is under test."""
    s = Store(migrated_sqlite_url)
    yield s
    s.close()


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """A tiny random Qwen2-shaped HF checkpoint: the rollout and training tests' policy."""
    from tests.rollout.support import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "policy")


@pytest.fixture(scope="session")
def ckpt2(tmp_path_factory):
    """Same shape, other weights: a new policy version."""
    from tests.rollout.support import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt2") / "policy", seed=1)


@pytest.fixture
def pg_store(migrated_pg_url) -> Iterator[Store]:
    """A Store on the session's migrated PostgreSQL database, emptied first (several nodes
    share one database only on PostgreSQL)."""
    _empty_all_tables(migrated_pg_url)
    s = Store(migrated_pg_url)
    try:
        yield s
    finally:
        s.close()
