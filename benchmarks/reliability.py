"""Run the reliability suite (tests/reliability) and print its figures as the tables of
docs/reliability.md.

    python benchmarks/reliability.py              # the short variants (what CI runs)
    python benchmarks/reliability.py --long       # the long ones (TLTD_RELIABILITY_LONG=1)
    python benchmarks/reliability.py --from f.json  # only render figures recorded earlier

Each test records its figures; the suite's conftest writes them to the JSON file named by
TLTD_RELIABILITY_REPORT, which this script sets and then reads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_suite(long: bool, report: Path) -> int:
    env = dict(os.environ, TLTD_RELIABILITY_REPORT=str(report), PYTHONPATH=str(ROOT))
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/reliability"]
    if long:
        env["TLTD_RELIABILITY_LONG"] = "1"
        args += ["-m", "long"]  # the marker: `-k long` also matches "..._long_lock_..."
    return subprocess.call(args, cwd=ROOT, env=env)


def render(figures: dict) -> str:
    out: list[str] = []
    fuzz = {k: v for k, v in figures.items() if k.startswith("test_every_rpc")}
    if fuzz:
        statuses = sorted({s for v in fuzz.values() for s in v["by_status"]})
        out.append("| RPC | cases | " + " | ".join(statuses) + " |")
        out.append("|---|---:|" + "---:|" * len(statuses))
        total = {s: 0 for s in statuses}
        for name, v in sorted(fuzz.items(), key=lambda kv: kv[0]):
            rpc = name.split("-", 1)[1].rstrip("]")
            cells = [str(v["by_status"].get(s, 0)) for s in statuses]
            for s in statuses:
                total[s] += v["by_status"].get(s, 0)
            out.append(f"| {rpc} | {v['cases']} | " + " | ".join(cells) + " |")
        n = sum(v["cases"] for v in fuzz.values())
        out.append(f"| **all** | **{n}** | " + " | ".join(str(total[s]) for s in statuses) + " |")
        out.append("")
    for name, v in sorted(figures.items()):
        if not name.startswith("test_every_rpc"):
            out.append(f"- `{name}`: " + json.dumps(v, sort_keys=True))
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--long", action="store_true", help="the long variants")
    p.add_argument("--from", dest="source", type=Path, help="render this JSON, run nothing")
    p.add_argument("--report", type=Path, help="where to keep the figures (JSON)")
    a = p.parse_args()
    code = 0
    if a.source:
        report = a.source
    else:
        report = a.report or Path(tempfile.mkdtemp()) / "reliability.json"
        report.unlink(missing_ok=True)
        code = run_suite(a.long, report)
    print(render(json.loads(report.read_text())))
    return code


if __name__ == "__main__":
    sys.exit(main())
