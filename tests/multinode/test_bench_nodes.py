"""`benchmarks/bench_nodes.py --quick`: two real simulated nodes on one PostgreSQL, one killed
mid-run; every sample and turn back exactly once, a takeover timed, the projection printed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import PG_ADMIN_URL

ROOT = Path(__file__).resolve().parents[2]


def test_bench_nodes_quick_loses_nothing_and_projects(pg_url: str, tmp_path: Path) -> None:
    # pg_url: the server is reachable (else skipped, or failed under CI); the benchmark makes
    # a database of its own on it.
    out_json = tmp_path / "figures.json"
    env = dict(os.environ, TLTD_TEST_PG_URL=PG_ADMIN_URL)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(ROOT)) if p)
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_nodes.py", "--quick", "--json", str(out_json),
         "--work-dir", str(tmp_path / "work")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = json.loads(out_json.read_text())
    assert run["nodes"] == 2
    assert run["samples"] == run["samples_asked"] > 0
    assert run["requests"] > 0 and run["turns"] > 0
    assert run["lost"] == 0 and run["duplicated"] == 0 and run["failed"] == []
    takeover = run["takeover"]
    assert takeover["held"] > 0 and 0 < takeover["seconds"] < 60
    assert run["xacts"] > 0 and run["pg_cpu"] > 0 and run["claim_ms"]
    line = re.search(r"projected nodes per PostgreSQL: (\d+) \(bottleneck: (.+)\)", proc.stdout)
    assert line, proc.stdout[-3000:]
    assert int(line.group(1)) == int(run["projection"]["nodes"])
    assert line.group(2).strip()
