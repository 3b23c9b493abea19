"""PROJECTION, not a measurement: TLT's SD and end-to-end gains on H100 / H200 (gpu_model.py).

    python benchmarks/project_gpu.py [--alpha 0.75] [--mfu 0.4]

Prints, every figure labelled a projection: the model against EAGLE-3's published H100
anchors; per device x policy shape the SD gain per running batch (the arm the engine's own
`predict` picks, chains of 2-8 drafts accepted with per-position probability alpha, the
drafter's LM head included); and the rollout speedup, the rollout's share of an RL step and
the end-to-end speedup of a synchronous GRPO step (`Rollout`'s long-tailed lengths, the update
at a stated MFU) and of an asynchronous one (no tail waited for; off-policy tokens), with
bands over alpha 0.6-0.85, MFU 0.3-0.5 and overheads x0.5-2.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_model import (  # noqa: E402
    ANCHOR_K,
    ANCHORS,
    DEVICES,
    SHAPES,
    Device,
    Rollout,
    Shape,
    anchor_gain,
    rollout_seconds,
    sd_gain,
    untailed_seconds,
    update_seconds,
)

KS = (2, 4, 6, 8)
BATCHES = (1, 4, 16, 32, 64)
ALPHAS, MFUS, OVERHEADS = (0.6, 0.75, 0.85), (0.3, 0.4, 0.5), (0.5, 1.0, 2.0)


def print_anchors() -> None:
    print("model vs EAGLE-3's published H100 figures (SGLang, Llama-3.1-8B, MT-bench; "
          f"chain of {ANCHOR_K} drafts) -- projection")  # fmt: skip
    print("| batch | published gain | projected gain | error | accepted length | fitted |")
    print("|---:|---:|---:|---:|---:|---|")
    for a in ANCHORS:
        g = anchor_gain(a)
        fit = "accepted length fitted here" if a.fitted else "predicted"
        print(f"| {a.batch} | {a.gain:.2f}x | {g:.2f}x | {100 * (g / a.gain - 1):+.1f}% "
              f"| {a.accepted} | {fit} |")  # fmt: skip


def step_row(dev: Device, shape: Shape, alpha: float) -> str:
    cells = []
    for b in BATCHES:
        arm, gain = sd_gain(dev, shape, b, 2048, alpha, KS)
        cells.append(f"{gain:.2f}x {arm}")
    return f"| {dev.name} | {shape.name} | " + " | ".join(cells) + " |"


def e2e(dev: Device, shape: Shape, rollout: Rollout, alpha: float, mfu: float) -> tuple:
    """(rollout speedup, rollout share of the SD-off step, end-to-end speedup, and that of an
    asynchronous step with SD: no tail waited for, the update as long as before)."""
    off = rollout_seconds(dev, shape, rollout, None, KS)
    on = rollout_seconds(dev, shape, rollout, alpha, KS)
    untailed = untailed_seconds(dev, shape, rollout, alpha, KS)
    tokens = sum(rollout.lengths()) + rollout.prompt * rollout.rows
    upd = update_seconds(shape, tokens, mfu, dev)
    return off / on, off / (off + upd), (off + upd) / (on + upd), (off + upd) / (untailed + upd)


def e2e_row(dev: Device, shape: Shape, rollout: Rollout, alpha: float, mfu: float) -> str:
    nominal = e2e(dev, shape, rollout, alpha, mfu)
    bands = [e2e(dev.scaled(o), shape, rollout, a, m)
             for a, m, o in itertools.product(ALPHAS, MFUS, OVERHEADS)]  # fmt: skip
    cells = []
    for i, fmt in enumerate(("{:.2f}x", "{:.0%}", "{:.2f}x", "{:.2f}x")):
        lo, hi = min(x[i] for x in bands), max(x[i] for x in bands)
        cells.append(f"{fmt.format(nominal[i])} [{fmt.format(lo)}-{fmt.format(hi)}]")
    return f"| {dev.name} | {shape.name} | " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alpha", type=float, default=0.75, help="per-position acceptance")
    ap.add_argument("--mfu", type=float, default=0.4, help="the update's MFU")
    args = ap.parse_args(argv)
    rollout = Rollout()
    print("PROJECTION (benchmarks/gpu_model.py: a roofline model, no GPU measured)\n")
    print_anchors()
    print(f"\nprojected SD gain per running batch (tokens/s over plain; best arm by the engine's "
          f"predict; alpha {args.alpha}, context 2048) -- projection")  # fmt: skip
    print("| device | policy | " + " | ".join(f"batch {b}" for b in BATCHES) + " |")
    print("|---|---|" + "---:|" * len(BATCHES))
    for dev, shape in itertools.product(DEVICES.values(), SHAPES.values()):
        print(step_row(dev, shape, args.alpha))
    L = sorted(rollout.lengths())
    print(f"\nprojected synchronous GRPO step: {rollout.rows} samples a device, answers median "
          f"{L[len(L) // 2]} tokens, p99/p50 {rollout.tail:g}, max {L[-1]}; update at MFU "
          f"{args.mfu:g}; nominal [band over alpha {ALPHAS}, MFU {MFUS}, overheads x"
          f"{OVERHEADS}] -- projection")  # fmt: skip
    print("| device | policy | rollout speedup | rollout share of step (SD off) "
          "| end-to-end speedup | asynchronous end-to-end (off-policy tokens) |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|")
    for dev, shape in itertools.product(DEVICES.values(), SHAPES.values()):
        print(e2e_row(dev, shape, rollout, args.alpha, args.mfu))
    print("\nAsynchronous: partial rollouts keep every device's batch full (no sample waits "
          "for the tail; unfinished ones go on in the next step), with SD where it pays at that "
          "batch; the update as long as in the synchronous step (on devices of its own, or "
          "between rollouts). Its tokens are up to a few policy versions old: off-policy, and "
          "the trainer must correct for them (docs/rollouts.md).")  # fmt: skip
    print("\nAll figures above are projections of a roofline model with fitted overheads "
          "(docs/performance.md, 'GPU projection'); drafter training is assumed to run on "
          "idle devices at no cost to the step, as in TLT.")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
