"""Test files longest first, so the two test processes (`--dist loadfile`) end together.

xdist hands whole files to whichever process is free, in collection order: a long file that
happens to come last leaves one process working alone at the end. Collected longest first
(by `durations.json`: each file's seconds, setup + call + teardown of its tests, from a run
on this 2-core VM), the processes take work as in longest-processing-time scheduling. A file
not recorded yet counts as the median file. `TLTD_RECORD_DURATIONS=1 make test` records the
run's figures into `durations.json` (files of that run replace theirs, others are kept).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

FILE = Path(__file__).with_name("durations.json")


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(FILE.read_text()).items()}
    except (OSError, ValueError):
        return {}


def order(items: list[pytest.Item]) -> None:
    """Sort `items` by their file's recorded seconds, longest first; a file's own tests keep
    their order (module fixtures are set up once per file)."""
    seconds = load()
    default = statistics.median(seconds.values()) if seconds else 0.0
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(_file(item.nodeid), i)

    def key(item: pytest.Item) -> tuple[float, int]:
        f = _file(item.nodeid)
        return (-seconds.get(f, default), first_seen[f])

    items.sort(key=key)  # stable: a file's tests keep their order


class Recorder:
    """Sums each file's reported seconds (in the controlling process, which gets every
    worker's reports) and writes them at the end of the run."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        f = _file(report.nodeid)
        self.seconds[f] = self.seconds.get(f, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        if not self.seconds:
            return
        merged = {**load(), **{k: round(v, 2) for k, v in self.seconds.items()}}
        FILE.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
