"""Smoke runs of the benchmarks (`--quick`) on a tiny random checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import (
    bench_control_plane,
    bench_drift,
    bench_engine_vs_hf,
    bench_history_coverage,
    bench_placement,
    bench_rl_trend,
    bench_spec,
    bench_tail_sweep,
    bench_training_contention,
)
from examples.task.tokenizer import VOCAB_SIZE, save_tokenizer
from tests.engine.helpers import make_checkpoint
from tltd_workers.engine.eagle import EagleDrafter
from tltd_workers.engine.transformer import load_model


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
    for mode in ("off", "ngram", "eagle", "adaptive", "adaptive@32"):
        assert f"| {mode:<11} |" in out
    assert "1.00x" in out  # off against itself
    assert "answer lengths (tokens, 4 samples): p50" in out
    assert "share of SD-off time per running-batch bucket" in out
    assert "per-bucket gain" in out
    assert "| history     |" in out


def test_bench_spec_epochs_quick(
    tiny: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    target, drafter = tiny
    args = ["--quick", "--model", str(target), "--drafter", str(drafter), "--threads", "1"]
    assert bench_spec.main([*args, "--epochs", "2", "--modes", "off,history"]) == 0
    out = capsys.readouterr().out
    assert "=== epoch 1 of 2 ===" in out and "=== epoch 2 of 2 ===" in out
    assert out.count("history mode per bucket") == 2
    assert "history epoch 2:" in out


def test_placement_simulation_uses_the_scheduler_and_predictions_cut_the_queued_tail() -> None:
    """Two workers of 2 samples: a 4,000-token prompt placed last behind short ones is the tail
    without predictions; predicted longest, it starts first."""
    lengths = [[100, 100], [100, 100], [4000, 4000]]
    cfg = bench_placement.SchedulerConfig(max_samples_per_worker=2)
    blind = bench_placement.simulate(lengths, [None] * 3, 2, (10.0, 0.0), cfg)
    aware = bench_placement.simulate(lengths, [100, 100, 4000], 2, (10.0, 0.0), cfg)
    assert len(blind) == len(aware) == 6
    assert blind[-1] == pytest.approx(41.0)  # 100 tokens x 10 ms, then 4,000 more
    assert aware[-1] == pytest.approx(40.0) and aware[-1] < blind[-1]


def test_bench_placement_runs(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--step-ms", "10,0.5", "--repeats", "2", "--prompts", "16", "--max-per-worker", "8"]
    assert bench_placement.main(args) == 0
    out = capsys.readouterr().out
    assert "| no prediction |" in out and "| length-aware |" in out


def test_bench_tail_sweep_quick(
    tiny: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    target, drafter = tiny
    args = ["--quick", "--model", str(target), "--drafter", str(drafter), "--threads", "1"]
    assert bench_tail_sweep.main(args) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "x [" in line]
    assert len(rows) == 2  # care 0 at fixed size 2, care 8 on power-law sizes
    assert "care 0, size 2" in rows[0] and "care 8, power-law sizes" in rows[1]


def test_tail_sweep_plot_is_written(tmp_path: Path) -> None:
    rows = [
        {"point": p, "share": s, "speedup": x, "speedups": [x - 0.1, x, x + 0.1], "p99/p50": r}
        for p, s, x, r in ((((0,), 6), 0.3, 1.2, 4.0), (((4, 8), None), 0.8, 2.1, 15.0))
    ]
    path = tmp_path / "sweep.png"
    bench_tail_sweep.plot(rows, path, gate=32)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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


def test_bench_rl_trend_quick(tiny: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target, _ = tiny
    args = ["--model", str(target), "--steps", "2", "--prompts", "2", "--n", "2",
            "--held-out-prompts", "1", "--max-new-tokens", "8", "--threads", "1",
            "--configs", "demo,sgd0.3"]  # fmt: skip
    assert bench_rl_trend.main(args) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[-2:]}
    assert set(rows) == {"demo", "sgd0.3"}
    for cells in rows.values():
        # a reward per step, trend, SEs, before, after, change, SEs, guesses, mean length
        assert len(cells) == 2 + 8
        assert all(0.0 <= float(c) <= 1.0 for c in cells[:2] + cells[4:6])
        for before_after in cells[8:]:  # "0.50->0.25"
            assert len([float(x) for x in before_after.split("->")]) == 2


def test_paired_change_of_held_out_rewards() -> None:
    mean, se = bench_rl_trend.paired([0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 1.0])
    assert mean == 0.25 and se == pytest.approx(0.25)


def test_bench_control_plane_quick(capsys: pytest.CaptureFixture[str]) -> None:
    """A real daemon on SQLite with the shipped policy, the floors beside it."""
    assert bench_control_plane.main(["--quick"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| sqlite |")]
    load = [r for r in rows if r[1].strip() == "this" and len(r) == 18]
    # The torch engine and the simulated one, at zero cost and asleep for a GPU's step time.
    assert [(r[2].strip(), int(r[3]), int(r[4])) for r in load] == [
        (engine, c, c) for engine in ("torch", "sim0", "simgpu") for c in (1, 4)
    ]
    for r in load:
        rps, sps, p50, p99, cpu, per_sample, _, engine, _, echo, _, sql, failed = (
            float(x) for x in r[5:]
        )
        assert failed == 0
        assert 0 < rps and sps == pytest.approx(rps * int(r[4]), rel=0.01)
        assert 0 < p50 <= p99 and cpu > 0 and per_sample > 0 and echo > 0 and sql > 0
        assert engine > 0 if r[2].strip() != "sim0" else engine == 0
    micro = [r for r in rows if len(r) == 7]  # db, daemon, tokens, prompts, store, stream, total
    assert [(r[1].strip(), int(r[2]), int(r[3])) for r in micro] == [
        ("this", 1, 1),
        ("this", 256, 1),
        ("this", 4096, 1),
        ("this", 256, 512),
    ]
    assert all(float(r[4]) > 0 and float(r[5]) > 0 for r in micro)
    assert "load average at start:" in out


def test_contention_pairs_each_training_window_with_its_neighbour() -> None:
    seq = [("train", 2.0, 1.0), ("stopped", 1.0, 0.0), ("stopped", 4.0, 0.0), ("train", 5.0, 1.0)]
    assert bench_training_contention.paired_ratios(seq) == [2.0, 1.25]
    assert bench_training_contention.paired_ratios(seq[:3]) == [2.0]  # an unpaired window


def test_bench_training_contention_runs_a_real_trainer_beside_the_decode(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The shipped policy decoding while a drafter trainer runs and is stopped. The trainer
    runs at nice 0 here: at the daemon's 19 it gets no CPU while other tests use the cores."""
    args = ["--batches", "1", "--speculative", "off", "--seconds", "3", "--window", "0.25"]
    assert bench_training_contention.main([*args, "--repeats", "1", "--nice", "0"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| off | 1 |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert float(cells[2]) > 0 and float(cells[3]) > 0  # ms/token, stopped and running
    assert int(cells[5]) >= 2  # pairs
    # The trainer really trained in its windows (SIGCONT'd: it took CPU beside the decode).
    assert int(cells[6].rstrip("%")) >= 20
    assert "pooled over the rows" in out


def test_history_replay_accepts_an_answer_seen_last_epoch_and_nothing_else() -> None:
    prompt = list(range(1, 11))
    answer = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 2]
    other = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 2]

    def replay(first: list[int]) -> bench_history_coverage.Tally:
        epochs = [[(0, first)], [(0, answer)]]
        tallies = bench_history_coverage.replay([prompt], epochs, 1, 16, 0.25, lambda t: "rest")
        return tallies["rest"]

    seen = replay(answer)
    assert seen.history_steps >= 1 and seen.accepted == seen.drafted > 0
    assert seen.tokens == len(answer) and seen.steps < len(answer)  # drafts saved steps
    unseen = replay(other)
    assert unseen.accepted == 0 and unseen.steps == len(answer)


def test_recheck_starts_counts_passes_that_start_as_the_first_did() -> None:
    one_pass = ["1000+2000=3000,1000", "3000+2000=5000,0000"]
    same = "\n".join(["care 8", *one_pass, "care 8", "check", *one_pass, "care 8", "answer: 5000"])
    assert bench_history_coverage.recheck_starts(same) == (1, 1)
    moved = same.replace("check\n1000+", "check\n7000+")
    assert bench_history_coverage.recheck_starts(moved) == (1, 0)
    assert bench_history_coverage.recheck_starts("answer: 5000") == (0, 0)


def test_bench_history_coverage_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The shipped policy, two tiny epochs: one table row per epoch and class."""
    args = ["--prompts", "2", "--samples", "2", "--max-new-tokens", "48", "--threads", "1"]
    assert bench_history_coverage.main(args) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in r.split("|")[1:-1]] for r in rows[1:]]
    assert [(c[0], c[2]) for c in cells] == [
        (e, name) for e in ("1", "2") for name in ("rest", "tail", "all")
    ]
    assert all(int(c[3]) >= 0 and c[6].endswith("%") for c in cells)
    assert "re-check passes in the answers" in out and "epoch 2: rest " in out
