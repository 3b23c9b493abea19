"""Smoke runs of the benchmarks (`--quick`) on a tiny random checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import bench_drift, bench_engine_vs_hf, bench_spec
from tests.engine.helpers import make_checkpoint
from workers.engine.eagle import EagleDrafter
from workers.engine.model import load_model
from workers.task.tokenizer import VOCAB_SIZE, save_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("bench")
    target = make_checkpoint(root / "target", vocab=VOCAB_SIZE, hidden=32, layers=1, tie=False)
    save_tokenizer(target)
    drafter = root / "eagle"
    EagleDrafter.random_init(load_model(target)).save_pretrained(drafter)
    return target, drafter


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_bench_spec_quick(tiny: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target, drafter = tiny
    args = ["--quick", "--model", str(target), "--drafter", str(drafter), "--threads", "1"]
    assert bench_spec.main(args) == 0
    out = capsys.readouterr().out
    for mode in ("off", "ngram", "eagle", "adaptive", "adaptive+"):
        assert f"| {mode:<9} |" in out
    assert "1.00x" in out  # off against itself


def test_bench_engine_vs_hf_quick(
    tiny: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    target, _ = tiny
    assert bench_engine_vs_hf.main(["--quick", "--model", str(target), "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "greedy decode, batch 1" in out and "greedy decode, batch 16" in out
    assert "long-tail 2x2" in out


def test_bench_drift_quick(tiny: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target, drafter = tiny
    args = ["--quick", "--model", str(target), "--drafter", str(drafter), "--threads", "1"]
    assert bench_drift.main(args) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "x |" in line]
    assert len(rows) == 3  # step 0 and the two updates
    assert "idle device time harvested" in out and "online / frozen" in out
