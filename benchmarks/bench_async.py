"""Asynchronous GRPO through a real `tltd serve`: the staleness bound eta side by side, and, for
eta >= 2, the same run with decoupled PPO in place of the clipped ratio to the behaviour
logprobs, so a reader sees what each off-policy correction does.

    python benchmarks/bench_async.py            # eta 0, 1, 2, 4 x budget 0, 512 (+ 2, 4
                                                # decoupled), 8 steps
    python benchmarks/bench_async.py --quick    # 2 tiny steps per run, a smoke test

Every run is the demo's asynchronous TLT run (examples/async_grpo.py) on the demo's task,
policy and drafter, from the same initial weights and prompts: bounded requests
(`bound_groups` = the step's 16 prompts, `carried`), the job's `max_staleness` = eta, requests
sent max(1, eta) steps ahead (eta 0: the next one only after the update is pushed, i.e.
synchronous), the clipped ratio p / p_behaviour (the daemon's logprob of the version that
sampled each token), or "decoupled": decoupled PPO, importance weights truncated at 2. Per
run: mean step time (wall time between consecutive updates) and its ratio to eta 0's, token
staleness (versions behind the policy updated), the share of samples whose tokens span two
versions, groups trained on and carried, the updates' clipped-token share, and the held-out
reward after the same number of steps (paired with the initial policy's, standard error over
prompts). Off-policy tokens are never hidden: the staleness columns say how many there were.
"budget B":
the same run with a token budget per sample per step (`StepBound.max_tokens` = B): a sample
that reaches it pauses, its tokens stored, and the next steps' requests resume it (the long
tail spreads over steps; its group trains when complete, a few versions later).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.async_grpo import AsyncRun  # noqa: E402
from examples.grpo_demo import DRAFTER, MODEL, QUICK, Daemon, DemoConfig, evaluate  # noqa: E402
from examples.heldout import HeldOutScore, paired  # noqa: E402
from examples.task.dataset import build_dataset  # noqa: E402

ETAS = (0, 1, 2, 4)
BUDGETS = (0, 512)  # tokens per sample per step (0: none); answers run up to 2,048
DECOUPLED = (2, 4)


@dataclass(frozen=True)
class Result:
    label: str
    eta: int
    budget: int
    decoupled: bool
    step_s: float
    staleness_mean: float
    staleness_max: int
    partial: float
    carried: int
    groups: int  # trained on, over the run (a budget's paused groups come later or never)
    clipped: float
    score: HeldOutScore


def one_run(
    cfg: DemoConfig, daemon: Daemon, dataset, eta: int, budget: int, decoupled: bool
) -> Result:
    label = f"eta {eta}" + (f" budget {budget}" if budget else "")
    label += " decoupled" if decoupled else ""
    job = "bench-async-" + label.replace(" ", "-")
    ahead = max(1, eta) if eta else 0
    run = AsyncRun(cfg, daemon.target, dataset, MODEL, DRAFTER, max_staleness=eta,
                   lookahead=ahead, decoupled=decoupled, job_id=job,
                   token_budget=budget)  # fmt: skip
    try:
        rows = run.run()
        final = run.trainer.save(daemon.data_dir / f"final-{job}")
    finally:
        run.close()
    steps = max(1, len(rows))
    score = evaluate(daemon, final, dataset, cfg, label, DRAFTER)
    return Result(
        label, eta, budget, decoupled,
        step_s=sum(r.step_s for r in rows) / steps,
        staleness_mean=sum(r.staleness_mean for r in rows) / steps,
        staleness_max=max((r.staleness_max for r in rows), default=0),
        partial=sum(r.partial for r in rows) / steps,
        carried=sum(r.carried for r in rows),
        groups=sum(r.groups for r in rows),
        clipped=sum(s.clipped_fraction for s in run.stats) / max(1, len(run.stats)),
        score=score,
    )  # fmt: skip


def print_table(results: list[Result], initial: HeldOutScore) -> None:
    base = next((r.step_s for r in results if r.eta == 0 and not r.budget), 0.0)
    print(
        "\nrun                      | step s | vs eta 0 | staleness mean/max | partial | groups | "
        "carried | clipped | held out (change +- se over prompts)"
    )
    for r in results:
        delta, se = paired(initial.rewards, r.score.rewards, initial.prompts or None)
        ratio = base / r.step_s if r.step_s and base else 0.0
        print(
            f"{r.label:<24} | {r.step_s:6.1f} | {ratio:7.2f}x | {r.staleness_mean:9.2f} / "
            f"{r.staleness_max:<4d} | {100 * r.partial:6.1f}% | {r.groups:6d} | {r.carried:7d} | "
            f"{100 * r.clipped:6.2f}% | {r.score.mean:.3f} ({delta:+.3f} +- {se:.3f})"
        )
    print(
        "(one run each, on this machine's 2 cores: daemon, drafter training and trainer share "
        "them; a step's time is the wall time between consecutive updates)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 tiny steps per run")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--etas", default=",".join(map(str, ETAS)))
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    parser.add_argument("--decoupled", default=",".join(map(str, DECOUPLED)))
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else DemoConfig()
    if args.steps:
        cfg = replace(cfg, steps=args.steps)
    etas = [int(x) for x in args.etas.split(",") if x]
    raw = [int(x) for x in args.decoupled.split(",") if x]
    budgets = [int(x) for x in args.budgets.split(",") if x]
    dataset = build_dataset(cfg.prompts, cfg.train_prompts, cfg.held_out_prompts, model_dir=MODEL)
    with tempfile.TemporaryDirectory(prefix="tltd-bench-async-") as tmp:
        daemon = Daemon(Path(tmp), cfg.cpu_slots)
        try:
            t0 = time.perf_counter()
            initial = evaluate(daemon, MODEL, dataset, cfg, "initial policy", DRAFTER)
            plan = [(e, b, False) for e in etas for b in budgets] + [(e, 0, True) for e in raw]
            results = [one_run(cfg, daemon, dataset, e, b, c) for e, b, c in plan]
            print_table(results, initial)
            print(f"({time.perf_counter() - t0:.0f} s in all)")
        finally:
            daemon.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
