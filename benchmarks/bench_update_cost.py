"""What GRPO's KL penalty costs the demo's update: the same real batches, with and without it.

The demo's trainer (`examples/grpo_trainer.py`) updates the shipped policy on the samples of
the demo's first `--steps` steps (16 prompts x 8 at temperature 1, SD off, the demo's seeds,
rolled out in-process). Each repeat builds a fresh trainer per setting, so both start from the
same weights, and times its updates on those batches; the settings alternate within a repeat,
so the machine's drift reaches both. With a penalty the trainer also runs the initial weights
forward on every batch (the reference logprobs); without one it does not.

    python benchmarks/bench_update_cost.py [--steps 3] [--repeats 3] [--kl 0.1] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_rl_trend import sample, score  # noqa: E402
from examples.grpo_demo import DEMO_LR, MODEL  # noqa: E402
from examples.grpo_trainer import GRPOTrainer  # noqa: E402
from examples.task import load_tokenizer  # noqa: E402
from examples.task.dataset import build_dataset  # noqa: E402
from examples.task.workload import MAX_NEW_TOKENS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="the demo steps whose batches are used")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kl", type=float, default=0.1, help="the penalty's coefficient")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the demo's update)")
    args = ap.parse_args(argv)

    tok = load_tokenizer(MODEL)
    dataset = build_dataset(16, 32, 32, model_dir=MODEL)
    batches = []
    for step in range(args.steps):
        work = dataset.batch(step)
        batches.append(score(work, sample(MODEL, work, step, 8, MAX_NEW_TOKENS), tok))
    tokens = sum(len(s.token_ids) for b in batches for s in b)
    torch.set_num_threads(args.threads)

    times: dict[float, list[float]] = {args.kl: [], 0.0: []}
    for rep in range(args.repeats):
        for kl in times:
            trainer = GRPOTrainer(MODEL, lr=DEMO_LR, seed=0, kl_coef=kl)
            t0 = time.perf_counter()
            for batch in batches:
                trainer.update(batch)
            times[kl].append(time.perf_counter() - t0)
            print(f"  repeat {rep} KL {kl:g}: {times[kl][-1]:.2f}s", flush=True)

    print(f"\n{args.steps} batches of the demo ({tokens} output tokens), {args.threads} threads, "
          f"medians of {args.repeats}")  # fmt: skip
    print("| update | s (median) | min-max | with penalty / this |")
    print("|---|---:|---:|---:|")
    base = statistics.median(times[args.kl])
    for kl, t in times.items():
        name = f"KL penalty {kl:g}" if kl else "no penalty"
        med = statistics.median(t)
        print(f"| {name} | {med:.2f} | {min(t):.2f}-{max(t):.2f} | {base / med:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
