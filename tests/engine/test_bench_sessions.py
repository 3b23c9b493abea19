"""`benchmarks/bench_sessions.py --quick` on the project's own policy: the table's claims hold
(every turn's tokens identical with and without reuse, fewer positions prefilled with it), SD
off and with the shipped EAGLE drafter drafting inside the turns."""

from __future__ import annotations

import re

import pytest

from benchmarks import bench_sessions


def _rows(out: str) -> dict[tuple[int, str], list[str]]:
    """The table's rows by (turns, arm): their cells."""
    rows: dict[tuple[int, str], list[str]] = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) == 10 and cells[0].isdigit():
            rows[(int(cells[0]), cells[1])] = cells
    return rows


@pytest.mark.parametrize("spec", ["off", "eagle"])
def test_bench_sessions_quick_table(capsys, spec):
    assert bench_sessions.main(["--quick", "--spec", spec]) == 0  # 1: some turn's tokens differ
    out = capsys.readouterr().out
    assert out.startswith("workload: 2 sessions")
    rows = _rows(out)
    assert sorted({t for t, _ in rows}) == [4, 8, 12]  # 12: as many as the context holds
    for turns in (4, 8, 12):
        reuse, stateless = rows[(turns, "reuse")], rows[(turns, "stateless")]
        assert reuse[9] == "yes"
        prefilled, reused, full = int(reuse[2]), int(reuse[3]), int(stateless[2])
        assert 0 < prefilled < full and prefilled + reused == full and int(stateless[3]) == 0
        assert reuse[4] == f"{100 * (1 - prefilled / full):4.1f}%"
        # Every turn after the first reused all but the last sampled token of the turn before.
        assert reused == sum(2 * (8 + t * (4 + 3) - 3 - 1) for t in range(1, turns))
    drafts = re.search(r"reuse (\d+) / (\d+), stateless (\d+) / (\d+)", out)
    if spec == "eagle":  # the same drafts, accepted alike, with and without reuse
        assert drafts is not None and int(drafts[1]) > 0
        assert drafts.groups()[:2] == drafts.groups()[2:]
    else:
        assert drafts is None


def test_bench_sessions_on_the_agentic_task(capsys):
    """The calculator task's sessions (a problem of turns - 1 steps, a tool call a turn): every
    session runs its turns, the same tokens with and without reuse, fewer positions prefilled."""
    argv = ["--task", "calculator", "--sessions", "2", "--turns", "3,6"]
    assert bench_sessions.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("workload: 2 sessions of the agentic task")
    rows = _rows(out)
    assert sorted({t for t, _ in rows}) == [3, 6]
    for turns in (3, 6):
        reuse, stateless = rows[(turns, "reuse")], rows[(turns, "stateless")]
        assert reuse[9] == "yes"
        prefilled, reused, full = int(reuse[2]), int(reuse[3]), int(stateless[2])
        assert 0 < prefilled < full and prefilled + reused == full
    assert "turns done per session: 3: [3]; 6: [6]" in out  # a calculator call per step
