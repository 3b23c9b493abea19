"""`benchmarks/bench_async.py --quick`: asynchronous GRPO runs side by side through a real
daemon (synchronous eta 0, eta 2, each with and without a token budget, and eta 2 with
decoupled PPO)."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_bench_async_quick_prints_each_run(capsys):
    from benchmarks import bench_async

    assert bench_async.main(
        ["--quick", "--etas", "0,2", "--budgets", "0,48", "--decoupled", "2"]
    ) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[0].strip(): line.split("|") for line in out.splitlines()
            if line.startswith("eta ")}  # fmt: skip
    assert set(rows) == {
        "eta 0", "eta 0 budget 48", "eta 2", "eta 2 budget 48", "eta 2 decoupled"
    }  # fmt: skip
    assert rows["eta 0"][2].strip() == "1.00x"
    # eta 0 is synchronous: no token older than the policy it updates.
    assert rows["eta 0"][3].split("/")[1].strip() == "0"
    for row in rows.values():
        assert float(row[1]) > 0 and "+-" in row[-1]
