"""Fixtures for the reliability suite: its size (a short variant in CI, a long one by hand)
and the figures each test records for docs/reliability.md.

- `size`: "short" always runs; "long" is marked `slow` and `long` and runs only with
  TLTD_RELIABILITY_LONG=1 (`TLTD_RELIABILITY_LONG=1 pytest tests/reliability -m long`: a
  marker, because `-k long` also matches test names such as "..._a_long_lock_...").
- `sqlite_serve`: one `tltd serve` process (SQLite, 2 CPU workers) shared by the tests of
  the session that need a daemon but not its own (each uses its own job): starting one costs
  the worker spawns and their start-up timing.
- `figures`: a dict per test; everything recorded is printed in the terminal summary and,
  with TLTD_RELIABILITY_REPORT=<file.json>, merged into that file (benchmarks/reliability.py
  runs the suite that way and prints the tables of docs/reliability.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

LONG = os.environ.get("TLTD_RELIABILITY_LONG", "").strip().lower() in ("1", "true", "yes")

_FIGURES: dict[str, dict] = {}


@pytest.fixture(
    params=[
        "short",
        pytest.param(
            "long",
            marks=[
                pytest.mark.slow,
                pytest.mark.long,
                pytest.mark.skipif(not LONG, reason="long variant: set TLTD_RELIABILITY_LONG=1"),
            ],
        ),
    ]
)
def size(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def sqlite_serve(tmp_path_factory):
    from tests.rollout.support import ServeProcess

    tmp = tmp_path_factory.mktemp("serve")
    d = ServeProcess(
        tmp, f"sqlite:///{tmp / 'tltd.db'}", worker_max_batch=8, worker_max_seq_len=256,
        start_timeout=180, drafter_training="false",
    )  # fmt: skip
    try:
        yield d
    finally:
        d.kill()


@pytest.fixture
def figures(request) -> dict:
    key = request.node.nodeid.split("::", 1)[-1]
    _FIGURES[key] = {}
    return _FIGURES[key]


def pytest_terminal_summary(terminalreporter) -> None:
    recorded = {k: v for k, v in _FIGURES.items() if v}
    if not recorded:
        return
    terminalreporter.section("reliability figures")
    for name, values in recorded.items():
        terminalreporter.write_line(f"{name}: {json.dumps(values, sort_keys=True)}")
    out = os.environ.get("TLTD_RELIABILITY_REPORT")
    if out:
        path = Path(out)
        merged = json.loads(path.read_text()) if path.exists() else {}
        merged.update(recorded)
        path.write_text(json.dumps(merged, indent=2, sort_keys=True))
