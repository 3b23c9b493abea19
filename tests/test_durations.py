"""The suite's file order: longest recorded file first, a file's tests kept together in their
order, an unrecorded file counted as the median one; a recording run merges its figures."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tests import durations


@dataclass
class _Item:
    nodeid: str


@dataclass
class _Report:
    nodeid: str
    duration: float


def test_files_go_longest_first_and_keep_their_tests_in_order(tmp_path, monkeypatch) -> None:
    recorded = {"tests/a.py": 1.0, "tests/b.py": 30.0, "tests/c.py": 5.0}
    monkeypatch.setattr(durations, "FILE", tmp_path / "durations.json")
    durations.FILE.write_text(json.dumps(recorded))
    names = ["tests/a.py::t1", "tests/new.py::t1", "tests/b.py::t1", "tests/a.py::t2",
             "tests/c.py::t1", "tests/b.py::t2", "tests/new.py::t2"]  # fmt: skip
    items = [_Item(n) for n in names]
    durations.order(items)
    # b (30 s); new (unrecorded: the median, 5 s) and c (5 s) in collection order; a (1 s).
    assert [i.nodeid for i in items] == [
        "tests/b.py::t1", "tests/b.py::t2", "tests/new.py::t1", "tests/new.py::t2",
        "tests/c.py::t1", "tests/a.py::t1", "tests/a.py::t2",
    ]  # fmt: skip


def test_a_recording_run_sums_each_files_phases_and_keeps_the_others(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(durations, "FILE", tmp_path / "durations.json")
    durations.FILE.write_text(json.dumps({"tests/a.py": 1.0, "tests/old.py": 7.0}))
    rec = durations.Recorder()
    for nodeid, seconds in [("tests/a.py::t", 0.5), ("tests/a.py::t", 2.0), ("tests/b.py::t", 3.0)]:
        rec.pytest_runtest_logreport(_Report(nodeid, seconds))
    rec.pytest_sessionfinish()
    assert json.loads(durations.FILE.read_text()) == {
        "tests/a.py": 2.5, "tests/b.py": 3.0, "tests/old.py": 7.0
    }  # fmt: skip
