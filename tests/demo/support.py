"""Helpers for the demo tests: one `examples/grpo_demo.py --quick` run as a subprocess."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class DemoRun:
    model: Path
    work: Path
    out: str  # its stdout


def run_demo(model: Path, work: Path, *flags: str) -> DemoRun:
    """`grpo_demo.py --quick` on `model` with its work dir `work`; it must exit with 0."""
    proc = subprocess.run(
        [sys.executable, "examples/grpo_demo.py", "--quick", "--model", str(model),
         "--work-dir", str(work), "--max-new-tokens", "24", *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return DemoRun(model, work, proc.stdout)
