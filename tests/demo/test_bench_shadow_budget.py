"""`benchmarks/bench_shadow_budget.py --quick`: the demo's TLT run alone, with the shadow
accepted length of both drafters measured at several chain lengths on a chosen step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_shadow_budget  # noqa: E402


@pytest.mark.slow
def test_quick_run_measures_both_drafters_at_each_k(capsys):
    assert bench_shadow_budget.main(["--quick", "--steps", "2", "--at", "1", "--ks", "2,4"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[:2] for line in out.splitlines() if line.startswith("tlt ")] == [
        ["tlt", "0"],
        ["tlt", "1"],
    ]
    rows = [line for line in out.splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    # The drafter version in service when the step's rollout began (the one scored as used).
    version = int(cells[2])
    chains = []
    for k, cell in zip((2, 4), cells[3:], strict=True):
        used, _, frozen, ratio = cell.split()
        # 1 (nothing accepted) <= accepted length <= k + 1 (every draft accepted).
        assert 1.0 <= float(used) <= k + 1 and 1.0 <= float(frozen) <= k + 1
        assert float(ratio.strip("()x")) == pytest.approx(float(used) / float(frozen), abs=0.01)
        if version <= 1:  # the frozen drafter is the one in service (Run.drafter_path)
            assert used == frozen
        chains.append((float(used), float(frozen)))
    # Chains of 4 drafts accept at least what chains of 2 do (the same chains, cut later).
    assert chains[1][0] >= chains[0][0] and chains[1][1] >= chains[0][1]
