"""How TLT's speedup depends on the tail: adaptive SD vs off as the length tail gets heavier.

Each point is a workload: a care level (the policy re-checks its work with probability
care / 10, per sample) on bench_spec's prompts, whose sizes follow the task's power law
(`--points 7`; `4/8` alternates care 4 and 8 over the prompts, the rollout workload), or on
prompts of one fixed size (`7@6`: 6 steps each, no prompt-level tail), which gives the light
tails (p99/p50 ~1-4). Each runs with SD off and adaptive, interleaved
`--repeats` times. Each row prints the length distribution, the share of SD-off decode time
spent at running batch <= `--gate`, and the speedup (median [min-max]). The plot (PNG) puts the
speedup against that share, so a user can read off what to expect from their own rollouts'
length distribution.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_spec import (  # noqa: E402
    DEFAULT_DRAFTER,
    DTYPES,
    KS,
    length_stats,
    run_mode,
    time_share,
)
from examples.task.workload import MAX_NEW_TOKENS, MODEL_DIR, rollout_prompts  # noqa: E402
from tltd_workers.engine.datatypes import HISTORY_DRAFT_LENGTHS  # noqa: E402
from tltd_workers.engine.eagle import EagleDrafter  # noqa: E402
from tltd_workers.engine.engine import EngineConfig  # noqa: E402
from tltd_workers.engine.transformer import load_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def plot(rows: list[dict], path: Path, gate: int) -> None:
    """Speedup against the SD-off time share at batch <= gate, one point per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [100 * r["share"] for r in rows]
    ys = [r["speedup"] for r in rows]
    lo = [r["speedup"] - min(r["speedups"]) for r in rows]
    hi = [max(r["speedups"]) - r["speedup"] for r in rows]
    ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3)  # points: care is not the x axis
    for r, x, y in zip(rows, xs, ys, strict=True):
        ax.annotate(f"{point_label(r['point'])}\np99/p50 {r['p99/p50']:.0f}", (x, y),
                    textcoords="offset points", xytext=(6, -14), fontsize=7)  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel(f"share of SD-off decode time at running batch <= {gate} (%)")
    ax.set_ylabel("rollout speedup, adaptive SD vs off")
    ax.set_title("TLT speedup vs tail heaviness (CPU analog, median of repeats)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


MIX_KEYS = ("sd", "eagle", "acc")


def run_mix(run) -> dict[str, float]:
    """What the adaptive run chose: its share of row steps that verified a draft, EAGLE's share
    of those, and the mean accepted length (tokens gained per SD step)."""
    summary = run.summary
    per = summary["per_strategy"]
    drafts = sum(t["draft_rows"] for t in per.values())
    eagle = sum(t["draft_rows"] for name, t in per.items() if name.startswith("eagle"))
    return {
        "sd": summary["sd_step_share"] or 0.0,
        "eagle": eagle / drafts if drafts else 0.0,
        "acc": summary["mean_accepted_length"] or 0.0,
    }


def parse_points(spec: str) -> list[tuple[tuple[int, ...], int | None]]:
    """ "0,3@6,4/8" -> [((0,), None), ((3,), 6), ((4, 8), None)]: the care levels (several
    alternate over the prompts, as in the rollout workload), and a fixed size or None."""
    points = []
    for item in spec.split(","):
        care, _, size = item.strip().partition("@")
        points.append((tuple(int(c) for c in care.split("/")), int(size) if size else None))
    return points


def point_label(point: tuple[tuple[int, ...], int | None]) -> str:
    care, size = point
    levels = "/".join(map(str, care))
    return f"care {levels}, " + (f"size {size}" if size else "power-law sizes")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=MODEL_DIR)
    ap.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    ap.add_argument(
        "--points",
        default="0@4,5@4,0,2,4,4/8,6,8",
        help="workloads: care (re-check rate in tenths; 4/8 alternates levels over the "
        "prompts) on power-law sizes, or care@size",
    )
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--warm-prompts", type=int, help="prompts per warm pass (default: half)")
    ap.add_argument("--gate", type=int, default=32, help="batch size the time share is taken at")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "tail_sweep.png")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny workload, no plot")
    args = ap.parse_args(argv)
    # The fields bench_spec.run_mode reads.
    args.temperature, args.ks, args.threshold, args.dtype = 1.0, KS, 32, "float32"
    args.device = "cpu"
    args.confidence = EngineConfig().draft_confidence
    args.epochs, args.history_ks, args.trace = 1, HISTORY_DRAFT_LENGTHS, None
    if args.quick:
        args.prompts, args.samples, args.max_new_tokens, args.repeats = 2, 2, 48, 1
        args.points, args.plot = "0@2,8", None
    torch.set_num_threads(args.threads)
    model = load_model(args.model, DTYPES[args.dtype])
    drafter = EagleDrafter.from_pretrained(args.drafter, model)
    warm_n = args.warm_prompts or max(1, args.prompts // 2)
    print(
        f"workload: {args.prompts} prompts x {args.samples} samples, T=1, max_new_tokens "
        f"{args.max_new_tokens}; warm-up {args.warmup} x {warm_n} prompts; "
        f"{args.repeats} interleaved repeats; threads {args.threads}",
        flush=True,
    )
    rows = []
    for point in parse_points(args.points):
        care, size = point
        work = rollout_prompts(args.prompts, args.seed, args.model, care, size)
        warm = [rollout_prompts(warm_n, args.seed + 1 + j, args.model, care, size)
                for j in range(args.warmup)]  # fmt: skip
        off, ada = [], []
        for _ in range(args.repeats):
            off.extend(run_mode("off", model, drafter, work, warm, args))
            ada.extend(run_mode("adaptive", model, drafter, work, warm, args))
        speedups = [o.seconds / a.seconds for o, a in zip(off, ada, strict=True)]
        s = length_stats(off[0].outputs)
        row = {
            "point": point, **s, "share": statistics.median(time_share(o, args.gate) for o in off),
            "speedup": statistics.median(speedups), "speedups": speedups,
            "off_s": statistics.median(o.seconds for o in off),
            **{k: statistics.median(run_mix(a)[k] for a in ada) for k in MIX_KEYS},
        }  # fmt: skip
        rows.append(row)
        print(
            f"  {point_label(point)}: p50 {s['p50']} p99 {s['p99']} max {s['max']} p99/p50 "
            f"{s['p99/p50']:.1f}, off {row['off_s']:.1f}s, time at batch <= {args.gate} "
            f"{100 * row['share']:.0f}%, speedup {row['speedup']:.2f}x (adaptive: SD steps "
            f"{100 * row['sd']:.0f}%, EAGLE {100 * row['eagle']:.0f}% of them, acc len "
            f"{row['acc']:.2f})",
            flush=True,
        )
    print(
        f"\n| workload | p50 | p99 | max | p99/p50 | capped | off s | SD-off time at batch <= "
        f"{args.gate} | adaptive speedup (median [min-max]) | SD steps | EAGLE share | acc len |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        spread = f"{r['speedup']:.2f}x [{min(r['speedups']):.2f}-{max(r['speedups']):.2f}]"
        print(
            f"| {point_label(r['point'])} | {r['p50']} | {r['p99']} | {r['max']} "
            f"| {r['p99/p50']:.1f} "
            f"| {100 * r['capped']:.1f}% | {r['off_s']:.1f} | {100 * r['share']:.0f}% | {spread} "
            f"| {100 * r['sd']:.0f}% | {100 * r['eagle']:.0f}% | {r['acc']:.2f} |"
        )
    if args.plot is not None:
        plot(rows, args.plot, args.gate)
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
