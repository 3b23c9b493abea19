"""Preemption latency of the drafter-training worker: request -> "device free", p50/p99.

A real spawned worker trains an EAGLE drafter for a Qwen2-shaped random policy (H=256, 8
layers, as the project's small policy) and is preempted many times at random moments; the
latency is measured in the parent from sending "preempt" to receiving "device_free" (the
checkpoint write that follows is off the training thread and not part of it). Two data paths
side by side: hidden states cached in the buffer, and recomputed by a target prefill (longer
micro-steps). Target: p99 < 200 ms on CPU.

    python benchmarks/bench_preemption.py [--preemptions 60] [--threads 1] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tltd.contract.drafter_messages import (  # noqa: E402
    Checkpointed,
    TrainerSpec,  # noqa: E402
    TrainingSample,
)
from tltd.drafter_training.process import TrainerProcess  # noqa: E402
from tltd_workers.drafter.forward import target_hidden  # noqa: E402
from tltd_workers.drafter.trainer import TrainerConfig  # noqa: E402
from tltd_workers.engine.transformer import load_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hidden_recompute import make_policy  # noqa: E402


def samples(model_dir: Path, n: int, length: int, with_hidden: bool) -> list[TrainingSample]:
    target = load_model(model_dir)
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        ids = torch.randint(0, target.config.vocab_size, (length,), generator=g)
        h = target_hidden(target, [ids])[0] if with_hidden else None
        out.append(TrainingSample(tuple(ids.tolist()), 32, 0, step=i % 2, hidden=h))
    return out


def run(
    model_dir: Path, keep_hidden: bool, n: int, threads: int, tmp: Path, device: str = "cpu"
) -> dict:
    cfg = TrainerConfig(items_per_micro=1, micro_per_step=4, row_len=256)
    spec = TrainerSpec(
        model_path=str(model_dir),
        checkpoint_dir=str(tmp / f"ckpt-{keep_hidden}"),
        trainer=cfg,
        keep_hidden=keep_hidden,
        threads=threads,
        device=device,
    )
    w = TrainerProcess(spec)
    rng = random.Random(0)
    lat: list[float] = []
    try:
        w.start()
        w.add(samples(model_dir, 32, 256, keep_hidden))
        for _ in range(n):
            w.train(None)
            time.sleep(rng.uniform(0.1, 0.8))  # preempt at a random point of a step
            lat.append(w.preempt())
            w.wait_for(Checkpointed)
        w.stop()
    finally:
        w.kill()
    steps = [s.seconds for s in w.steps] or [float("nan")]
    return {
        "hidden": "cached" if keep_hidden else "recomputed",
        "steps": len(steps),
        "step_ms": 1000 * statistics.median(steps),
        "micro_ms": 1000 * statistics.median(steps) / cfg.micro_per_step,
        "p50": 1000 * statistics.median(lat),
        "p99": 1000 * sorted(lat)[min(len(lat) - 1, int(0.99 * len(lat)))],
        "max": 1000 * max(lat),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preemptions", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="where the trainer trains: cpu, cuda, cuda:N")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model_dir = make_policy(tmp / "policy", hidden=256, layers=8, vocab=8192)
        rows = [
            run(model_dir, keep, args.preemptions, args.threads, tmp, args.device)
            for keep in (True, False)
        ]
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "rows": rows}, indent=1))
    load = os.getloadavg()
    print(
        f"preemption latency, {args.preemptions} preemptions per row, trainer on {args.device}, "
        f"torch threads={args.threads}, CPU x{os.cpu_count()}, "
        f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
    )
    print(
        f"{'hidden':<11}{'steps':>6}{'step ms':>9}{'micro ms':>10}"
        f"{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}{'p99/micro':>10}"
    )
    for r in rows:
        print(
            f"{r['hidden']:<11}{r['steps']:>6}{r['step_ms']:>9.1f}{r['micro_ms']:>10.1f}"
            f"{r['p50']:>8.1f}{r['p99']:>8.1f}{r['max']:>8.1f}{r['p99'] / r['micro_ms']:>10.2f}"
        )
    worst = max(r["p99"] for r in rows)
    print(f"target p99 < 200 ms: {'PASS' if worst < 200 else 'FAIL'} (worst p99 {worst:.1f} ms)")


if __name__ == "__main__":
    main()
