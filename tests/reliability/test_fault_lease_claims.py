"""A work-unit claim that meets a database error: the unit is leased to this node in the store
but never became live here. It must not stay leased forever; its lease lapses and it is
claimed again, and the request completes with every sample once.

Two ways a PostgreSQL restart leaves such a unit (both seen in `test_fault_postgres_restart`):
the claim statement commits but its answer is lost with the connection, or the claim lands
and reading its request right after fails. A third: a request admitted on a node alone leases
its units to that node in its own transaction (`store.requests.admit`), and that commit's
answer is lost; the caller's retry attaches to it. The fault is injected at the store call (a real
driver error, as the restart raises it); everything else is real: the daemon in-process with
real worker processes, SQLite and PostgreSQL.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import exc as sa_exc
from sqlalchemy import select

from tests.api.support import make_settings, sampling
from tests.rollout.support import InProcessDaemon
from tltd.store.tables import WorkUnitRow
from tltd_clients.errors import UnavailableError

LEASE = 1.5  # seconds (renewed every 0.5 s): the lapse the fix relies on stays short
PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]
N = 2


def _connection_lost() -> sa_exc.OperationalError:
    return sa_exc.OperationalError(
        "SELECT ...", {}, psycopg.OperationalError("server closed the connection unexpectedly")
    )


@pytest.fixture
def daemon(store, tmp_path) -> Iterator[InProcessDaemon]:
    settings = make_settings(
        tmp_path,
        cpu_slots=1,
        worker_max_batch=8,
        worker_max_seq_len=128,
        worker_heartbeat_seconds=0.2,
        device_refresh_seconds=3600.0,
        drafter_training=False,
        lease_seconds=LEASE,
    )
    d = InProcessDaemon(settings, store).start()
    try:
        yield d
    finally:
        d.kill()  # its listener too, before its database is dropped


class _FailOnce:
    """Wraps a store method: the first call after `arm()` raises the driver's lost-connection
    error; with `call_first`, only after the real call ran and returned something (a claim
    that committed). Other calls pass through."""

    def __init__(self, real, *, call_first: bool) -> None:
        self.real, self.call_first = real, call_first
        self.armed = threading.Event()
        self.fired = threading.Event()
        self._lock = threading.Lock()

    def arm(self) -> None:
        self.armed.set()

    def __call__(self, *args, **kw):
        with self._lock:
            if not self.armed.is_set() or self.fired.is_set():
                return self.real(*args, **kw)
            if self.call_first:
                result = self.real(*args, **kw)
                if not result:
                    return result  # nothing claimed by this call: wait for one that does
            self.fired.set()  # (a claim committed: its units are leased to this node)
        raise _connection_lost()


def _attempts(store, request_id: str) -> list[int]:
    with store._tx(write=False) as s:
        rows = s.execute(
            select(WorkUnitRow.attempts)
            .where(WorkUnitRow.request_id == request_id)
            .order_by(WorkUnitRow.prompt_index)
        ).all()
    return [r[0] for r in rows]


@pytest.mark.parametrize(
    "repository, method, call_first",
    [
        ("leases", "claim_units", True),  # the claim committed, its answer lost with the connection
        ("leases", "claimed_state", False),  # the claim landed; reading the claimed request failed
        ("requests", "admit", True),  # the request and its units' lease committed, answer lost
    ],
    ids=["claim-answer-lost", "claimed-request-unreadable", "admission-answer-lost"],
)
def test_a_claim_that_meets_a_database_error_is_claimed_again(
    daemon, ckpt, monkeypatch, repository, method, call_first
):
    repo = getattr(daemon.store, repository)
    fault = _FailOnce(getattr(repo, method), call_first=call_first)
    monkeypatch.setattr(repo, method, fault)
    if method != "admit":  # the units are claimed at a tick, as with other nodes up
        monkeypatch.setattr(daemon.supervisor.leases, "admission_capacity", lambda draining: 0)
    rid = f"lease-{method}"
    with daemon.client() as c:
        c.create_job(str(ckpt), job_id="job")
        daemon.wait_workers_ready(1, timeout=120)
        fault.arm()

        def generate() -> list:
            return list(
                c.generate(
                    "job", PROMPTS, sampling=sampling(n=N, max_new_tokens=6), request_id=rid,
                    timeout=30 * LEASE,
                )
            )  # fmt: skip

        if method == "admit":  # the caller is told UNAVAILABLE and retries
            with pytest.raises(UnavailableError, match="database unavailable"):
                generate()
        # Without the lapse the unit stays leased here, renewed forever, and this times out.
        got = generate()
        stored = c.get_request(rid).request
    assert fault.fired.is_set(), "the fault was not hit"
    keys = sorted((s.prompt_index, s.sample_index) for s in got)
    assert keys == [(p, i) for p in range(len(PROMPTS)) for i in range(N)]  # each once
    assert not any(s.partial for s in got)
    assert stored.samples_done == len(PROMPTS) * N
    assert stored.status_reason == f"all {len(PROMPTS) * N} samples finished"
    # The unit that met the error was claimed again, after its lease lapsed (a third time
    # when a renewal, late on a loaded machine, let the 1.5 s lease lapse once more: still
    # each sample once, above).
    assert max(_attempts(daemon.store, rid)) >= 2
