"""Fixtures for the HTTP tests: one real daemon per module (workers load a model once)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.http_api.support import HttpDaemon, make_text_checkpoint, start_http_daemon

JOB = "http-job"


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("text-model") / "policy")


@pytest.fixture(scope="module")
def http_daemon(tmp_path_factory, text_model) -> Iterator[HttpDaemon]:
    """SQLite, one CPU slot, SD off (seeded samples reproduce exactly), HTTP on port 0, with
    job JOB created over gRPC and its worker warm."""
    d = start_http_daemon(tmp_path_factory.mktemp("http-daemon"), text_model, JOB, 512)
    try:
        yield d
    finally:
        d.kill()
        d.store.close()
