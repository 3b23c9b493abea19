"""The shadow accepted length over a longer training budget, at several chain lengths.

`make demo` trains 8 GRPO steps per mode and compares, on each step's samples, the drafter the
step used with the frozen initial drafter (the shadow accepted length, docs/sd-statistics.md)
through chains of k = 4 drafts. A chain gains at most k + 1 tokens, and the frozen drafter
already accepts 3.9-4.1 of those 5, so a k = 4 chain leaves little room to show a drafter
falling behind. This benchmark runs the demo's TLT mode alone (the same daemon settings,
dataset, GRPO trainer and online drafter training) for `--steps` steps and, at the `--at`
steps, measures both drafters on the same samples with chains of each of `--ks`: how far the
frozen drafter falls behind as the policy trains, and how much of it each k shows.

The workload is the demo's (16 prompts x n=8 a step from a 32-prompt training set in shuffled
epochs, temperature 1, the shipped policy and its offline drafter); each step's row is the
demo's.

    python benchmarks/bench_shadow_budget.py [--steps 32] [--at 0,7,15,31] [--ks 4,8,16]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples import grpo_demo as demo  # noqa: E402
from tltd_clients import RolloutSample  # noqa: E402


class BudgetRun(demo.Run):
    """The demo's TLT run, with the shadow measured at several k on the chosen steps."""

    def __init__(self, *args, at: set[int], ks: tuple[int, ...], **kwargs) -> None:
        super().__init__("tlt", *args, **kwargs)
        if self.shadow is None:
            raise SystemExit("no drafter: the shadow measure compares two drafters")
        self.at, self.ks = at, ks
        # step -> (drafter version in service at the step's start, [(k, used, frozen)])
        self.sweeps: dict[int, tuple[int, list[tuple[int, float, float]]]] = {}

    def measure_shadow(
        self, samples: list[RolloutSample], prompts, version: int
    ) -> tuple[float, float]:
        """`version`: the drafter in service when the step's rollout began (the demo's)."""
        step = len(self.rows)  # the step being run: its row is appended after this
        if step not in self.at:
            return super().measure_shadow(samples, prompts, version)
        assert self.shadow is not None
        weights = {k: v.detach() for k, v in self.trainer.model.state_dict().items()}
        ks = tuple(dict.fromkeys((self.shadow.k, *self.ks)))  # the demo's k first, once
        got = self.shadow.measure_at(weights, samples, prompts, self.drafter_path(version), ks)
        by_k = dict(zip(ks, got, strict=True))
        self.sweeps[step] = (version, [(k, *by_k[k]) for k in self.ks])
        return by_k[self.shadow.k]  # the step's row: the demo's measure


def print_report(run: BudgetRun) -> None:
    ratios = [round(r.shadow[0] / r.shadow[1], 3) if r.shadow[1] else 0.0 for r in run.rows]
    assert run.shadow is not None
    print(f"\nshadow used / frozen per step at k = {run.shadow.k}: {ratios}")
    print(f"drafter version in service at each step's start (scored as used): "
          f"{[r.shadow_version for r in run.rows]}")  # fmt: skip
    print(f"training reward per step: {[round(r.mean_reward, 2) for r in run.rows]}")
    head = " | ".join(f"k={k}: used / frozen" for k in run.ks)
    print(f"\n| step | epoch | drafter | {head} |")
    print("|---:|---:|---:|" + "---|" * len(run.ks))
    for step, (version, cells) in sorted(run.sweeps.items()):
        epoch = run.rows[step].epoch
        text = " | ".join(f"{u:.2f} / {f:.2f} ({u / f:.3f}x)" for _, u, f in cells)
        print(f"| {step} | {epoch:.1f} | {version} | {text} |")
    print("\nA chain of k drafts gains at most k + 1 tokens (docs/sd-statistics.md).")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--at", default="0,7,15,31", help="steps measured at every k")
    ap.add_argument("--ks", default="4,8,16", help="chain lengths")
    ap.add_argument("--model", type=Path, default=demo.MODEL)
    ap.add_argument("--drafter", default=None, help="the initial drafter (default: the demo's)")
    ap.add_argument("--quick", action="store_true", help="the demo's 2-step smoke workload")
    args = ap.parse_args(argv)
    cfg = replace(demo.QUICK if args.quick else demo.DemoConfig(), steps=args.steps)
    at = {int(x) for x in args.at.split(",") if x}
    ks = tuple(int(x) for x in args.ks.split(","))
    model = args.model.resolve()
    drafter = demo._initial_drafter(args.drafter, model)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    random.seed(cfg.seed)
    print(f"{cfg.steps} GRPO steps (TLT mode), {cfg.prompts} prompts x n={cfg.n}; the shadow "
          f"at k = {', '.join(map(str, ks))} on steps {sorted(at)}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tltd-shadow-budget-") as tmp:
        daemon = demo.Daemon(Path(tmp), cfg.cpu_slots)
        try:
            dataset = demo.build_dataset(
                cfg.prompts, cfg.train_prompts, cfg.held_out_prompts, model_dir=model
            )
            run = BudgetRun(cfg, daemon, dataset, model, drafter, at=at, ks=ks)
            try:
                print(demo.HEADER, flush=True)
                run.warm_up()
                for step in range(cfg.steps):
                    run.step(step)
            finally:
                run.close()
            print_report(run)
        finally:
            status = daemon.stop()
    return 0 if status == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
