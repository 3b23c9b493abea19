"""Speculative decoding on the long-tail rollout workload: off / n-gram / EAGLE / adaptive."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tltd.domain import SamplingParams  # noqa: E402
from workers.engine.bandit import Strategy  # noqa: E402
from workers.engine.eagle import EagleDrafter  # noqa: E402
from workers.engine.engine import Engine, EngineConfig, Request  # noqa: E402
from workers.engine.model import CausalLM, load_model  # noqa: E402
from workers.task.reasoning import reward  # noqa: E402
from workers.task.tokenizer import decode, load_tokenizer  # noqa: E402
from workers.task.workload import (  # noqa: E402
    MAX_NEW_TOKENS,
    MODEL_DIR,
    STOP_TOKEN_ID,
    rollout_prompts,
)

DEFAULT_DRAFTER = Path(__file__).resolve().parents[1] / "models" / "tiny-policy-eagle"
KS = (2, 4, 6)
MODES: dict[str, tuple[str, ...]] = {
    "off": (),
    "ngram": ("ngram",),
    "eagle": ("eagle",),
    "adaptive": ("ngram", "eagle"),
    # Adaptive at every batch size: the engine's plain arm (measured plain throughput per
    # bucket), not a fixed threshold, decides where speculation pays (TLT's 32 is for GPUs).
    "adaptive+": ("ngram", "eagle"),
}


@dataclass
class Result:
    mode: str
    seconds: float
    tokens: int
    reward: float
    summary: dict
    bandit: dict


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _requests(work: list, args: argparse.Namespace, tag: str, seed: int) -> list[Request]:
    return [
        Request(
            f"{tag}{i}",
            p,
            SamplingParams(
                n=args.samples,
                temperature=args.temperature,
                max_new_tokens=args.max_new_tokens,
                stop_token_ids=(STOP_TOKEN_ID,),
                seed=seed + i,
            ),
            prompt_index=i,
        )
        for i, (_, p) in enumerate(work)
    ]


def run_mode(
    mode: str,
    model: CausalLM,
    drafter: EagleDrafter | None,
    work: list,
    warm: list,
    args: argparse.Namespace,
) -> Result:
    """The workload through a fresh engine in one SD mode, after the `warm` warm-up passes.

    The warm-up runs other prompts through the same engine, untimed: in a daemon the bandit
    lives across many rollout batches, so its exploration of untried arms (one step per arm
    per bucket) is not a cost of every batch. Stats are reset before the timed pass.
    """
    drafters = MODES[mode]
    strategies = tuple(Strategy(d, k) for d in drafters for k in args.ks)
    every = [work, *warm]
    threshold = args.threshold
    if mode == "adaptive+":
        threshold = max(len(w) for w in every) * args.samples
    engine = Engine(
        model,
        EngineConfig(
            max_batch=max(len(w) for w in every) * args.samples,
            max_seq_len=max(len(p) for w in every for _, p in w) + args.max_new_tokens + 1,
            spec_mode="adaptive" if drafters else "off",
            strategies=strategies or EngineConfig().strategies,
            batch_threshold=threshold,
            draft_confidence=args.confidence,
            # One bandit bucket per power of two up to the threshold.
            buckets=tuple(1 << i for i in range(max(1, threshold).bit_length())),
            seed=args.seed,
            dtype=DTYPES[args.dtype],
        ),
    )
    if "eagle" in drafters:
        assert drafter is not None
        engine.set_drafter(drafter, version=1)
    for j, w in enumerate(warm):
        engine.generate(_requests(w, args, f"warm{j}-", 10_000 * (j + 1)))
    engine.stats.reset()
    t0 = time.perf_counter()
    outs = engine.generate(_requests(work, args, "w", args.seed))
    seconds = time.perf_counter() - t0
    tok = load_tokenizer(args.model)
    rewards = [reward(work[o.prompt_index][0], decode(tok, o.token_ids)) for o in outs]
    return Result(
        mode,
        seconds,
        sum(len(o.token_ids) for o in outs),
        sum(rewards) / len(rewards),
        engine.stats.summary(),
        engine.strategy_snapshot() if drafters else {},
    )


def _fmt(x: float | None, spec: str) -> str:
    width = spec.split(".")[0]
    return "-".rjust(int(width) if width else 0) if x is None else format(x, spec)


def print_table(results: dict[str, Result]) -> None:
    base = results["off"]
    print(
        "| mode      | wall s | tokens | tok/s  | wall vs off | tok/s vs off | mean acc len "
        "| SD steps | prefill s | plain s | draft s | verify s | other s | reward |"
    )
    print(
        "|-----------|-------:|-------:|-------:|------------:|-------------:|-------------:"
        "|---------:|----------:|--------:|--------:|---------:|--------:|-------:|"
    )
    for r in results.values():
        s = r.summary
        sec = s["seconds"]
        share, mal = s["sd_step_share"], s["mean_accepted_length"]
        phases = sec.get("prefill", 0.0), sec["plain_decode"], sec["draft"], sec["verify"]
        other = r.seconds - sum(phases)
        print(
            f"| {r.mode:<9} | {r.seconds:6.1f} | {r.tokens:6d} | {r.tokens / r.seconds:6.1f} "
            f"| {base.seconds / r.seconds:10.2f}x "
            f"| {(r.tokens / r.seconds) / (base.tokens / base.seconds):11.2f}x "
            f"| {_fmt(mal, '12.2f')} "
            f"| {_fmt(share and 100 * share, '7.0f')}% "
            f"| {phases[0]:9.1f} | {phases[1]:7.1f} | {phases[2]:7.1f} | {phases[3]:8.1f} "
            f"| {other:7.1f} | {r.reward:6.3f} |"
        )
    for r in results.values():
        if not r.bandit:
            continue
        print(f"\n{r.mode}: steps per batch bucket and arm (count, median reward tok/s)")
        for bucket, per in r.bandit.items():
            used = {
                name: v
                for name, v in per.items()
                if v["count"]  # type: ignore[index]
            }
            if used:
                cells = ", ".join(
                    f"{name} {v['count']} ({_fmt(v['median_reward'], '.0f')})"
                    for name, v in used.items()
                )
                plain = per.get("plain", {}).get("median_reward")
                best = max(
                    (v["median_reward"] for n, v in used.items() if n != "plain"), default=None
                )
                gain = f"  [best SD / plain {best / plain:.2f}x]" if plain and best else ""
                print(f"  <= {bucket:3d}: {cells}{gain}")
        per_strategy = r.summary["per_strategy"]
        cells = ", ".join(
            f"{name} {_fmt(v['mean_accepted_length'], '.2f')}" for name, v in per_strategy.items()
        )
        print(f"  mean accepted length per strategy: {cells}")


def step_costs(
    model: CausalLM,
    drafter: EagleDrafter | None,
    prompt: list[int],
    batches: tuple[int, ...],
    k: int,
    tokens: int,
    temperature: float,
) -> None:
    """Per-step cost of plain decoding vs one SD step (draft + verify) at fixed batch sizes.

    Break-even = (draft + verify) / plain: the tokens an SD step must gain per row to pay.
    No stop token, `tokens` new tokens per row (one prompt, n = batch samples).
    """
    drafters = ["ngram"] + (["eagle"] if drafter is not None else [])
    print(f"\nstep costs (ms/step, T={temperature}, k={k}; break-even = SD step / plain step):")
    head = "| batch | plain ms |" + "".join(
        f" {d} draft | {d} verify | {d} break-even | {d} acc len |" for d in drafters
    )
    print(head)
    print("|" + "---:|" * (head.count("|") - 1))
    for b in batches:
        cells = []
        plain_ms = None
        for mode in ["off", *drafters]:
            engine = Engine(
                model,
                EngineConfig(
                    max_batch=b,
                    max_seq_len=len(prompt) + tokens + k + 2,
                    spec_mode="off" if mode == "off" else "fixed",
                    strategies=(Strategy(mode if mode != "off" else "ngram", k),),
                    batch_threshold=b,
                    dtype=next(model.parameters()).dtype,
                ),
            )
            if mode == "eagle":
                engine.set_drafter(drafter, version=1)
            sp = SamplingParams(n=b, temperature=temperature, max_new_tokens=tokens, seed=0)
            engine.generate([Request("c", prompt, sp)])
            st = engine.stats
            if mode == "off":
                plain_ms = 1000 * st.plain_seconds / max(st.plain_steps, 1)
                continue
            n = max(st.spec_totals.steps, 1)
            draft_ms, verify_ms = 1000 * st.draft_seconds / n, 1000 * st.verify_seconds / n
            assert plain_ms is not None
            acc = st.summary()["mean_accepted_length"] or 0.0
            be = (draft_ms + verify_ms) / plain_ms
            cells.append(f" {draft_ms:.1f} | {verify_ms:.1f} | {be:.2f} | {acc:.2f} |")
        print(f"| {b} | {plain_ms:.1f} |" + "".join(cells), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=MODEL_DIR)
    ap.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny workload")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threshold", type=int, default=32, help="speculate at running batch <= N")
    ap.add_argument(
        "--ks",
        type=lambda v: tuple(int(x) for x in v.split(",")),
        default=KS,
        help="draft lengths the bandit chooses from, e.g. 2,4,6",
    )
    ap.add_argument(
        "--confidence",
        type=float,
        default=EngineConfig().draft_confidence,
        help="EAGLE: verify drafts while their cumulative confidence >= this",
    )
    ap.add_argument("--modes", default=",".join(MODES), help=f"some of {','.join(MODES)}")
    ap.add_argument(
        "--warmup", type=int, default=1, help="untimed passes (other prompts) per engine first"
    )
    ap.add_argument("--repeats", type=int, default=1, help="modes interleaved; best wall kept")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="engine weights and activations"
    )
    ap.add_argument("--no-costs", dest="costs", action="store_false", help="skip step costs")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.samples, args.max_new_tokens = 2, 2, min(args.max_new_tokens, 48)
    modes = [m for m in args.modes.split(",") if m]
    if "off" not in modes:
        modes.insert(0, "off")
    torch.set_num_threads(args.threads)

    model = load_model(args.model, DTYPES[args.dtype])
    drafter = None
    if args.drafter.is_dir():
        drafter = EagleDrafter.from_pretrained(args.drafter, model)
    elif any("eagle" in MODES[m] for m in modes):
        print(f"no drafter at {args.drafter}: skipping the EAGLE modes", flush=True)
        modes = [m for m in modes if "eagle" not in MODES[m]]
    work = rollout_prompts(args.prompts, args.seed, args.model)
    print(
        f"workload: {args.prompts} prompts x {args.samples} samples, T={args.temperature}, "
        f"max_new_tokens {args.max_new_tokens}, SD at batch <= {args.threshold}, "
        f"threads {args.threads}, {args.dtype}",
        flush=True,
    )
    warm = [
        rollout_prompts(args.prompts, args.seed + 1 + j, args.model) for j in range(args.warmup)
    ]
    results: dict[str, Result] = {}
    for rep in range(args.repeats):
        for mode in modes:
            r = run_mode(mode, model, drafter, work, warm, args)
            print(f"  [{rep + 1}/{args.repeats}] {mode}: {r.seconds:.1f}s", flush=True)
            if mode not in results or r.seconds < results[mode].seconds:
                results[mode] = r
    print()
    print_table(results)
    print(
        "\nSD steps: share of decode steps that speculated. Phases come from the engine's "
        "stats (other = wall - phases: scheduling, bookkeeping, n-gram index updates)."
    )
    if args.costs:
        longest = max(work, key=lambda w: len(w[0].solution))[1]
        batches = (1, 4) if args.quick else (1, 4, 16, 64)
        for temperature in (0.0, args.temperature):
            step_costs(model, drafter, longest, batches, 4, 16 if args.quick else 96, temperature)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
