"""An error after a stream's headers were sent arrives as its last event, mapped as a
non-streaming call's would be: a database that is locked or down is the caller's to retry
(UNAVAILABLE, 503), not an internal error."""

from __future__ import annotations

import sqlite3

import httpx
import pytest
from sqlalchemy.exc import OperationalError

from tests.http_api.conftest import JOB
from tests.http_api.support import sse_events

STREAMS = {
    "/generate": {
        "input_ids": [[1, 5, 6]],
        "stream": True,
        "sampling_params": {"max_new_tokens": 3},
    },
    "/v1/completions": {"model": JOB, "prompt": [[1, 5, 6]], "stream": True, "max_tokens": 3},
}


@pytest.mark.parametrize("path", sorted(STREAMS))
def test_a_database_error_inside_a_stream_is_a_retryable_error_event(
    http_daemon, monkeypatch, path
):
    def locked(req, *args):
        orig = sqlite3.OperationalError("database is locked")
        orig.sqlite_errorcode = 5  # SQLITE_BUSY, as sqlite3 sets it
        raise OperationalError("INSERT INTO requests", {}, orig)

    # Storing the request is the stream's first step, after its headers went out.
    monkeypatch.setattr(http_daemon.store.requests, "admit", locked)
    with httpx.Client(base_url=http_daemon.url, timeout=60) as c:
        with c.stream("POST", path, json=STREAMS[path]) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
        monkeypatch.undo()
        assert c.get("/health").status_code == 200  # the daemon keeps serving
    assert len(events) == 1, events
    error = events[0]["error"]
    assert error["code"] == "unavailable" and "database unavailable" in error["message"]
