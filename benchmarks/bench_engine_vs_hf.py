"""This engine (SD off) vs transformers `generate` on the same checkpoint, side by side."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.task.tokenizer import PAD_ID  # noqa: E402
from examples.task.workload import (  # noqa: E402
    MAX_NEW_TOKENS,
    MODEL_DIR,
    STOP_TOKEN_ID,
    rollout_prompts,
)
from tltd.domain import SamplingParams  # noqa: E402
from tltd_workers.engine.engine import Engine, EngineConfig, Request  # noqa: E402
from tltd_workers.engine.transformer import CausalLM, load_model  # noqa: E402


def best_of(repeats: int, fn: Callable[[], int], warmup: bool = True) -> tuple[float, int]:
    """Fastest wall time over repeats (the CPU is shared: the minimum is the least noisy),
    after an untimed warm-up run (allocator, rope tables, lazy imports)."""
    if warmup:
        fn()
    times, tokens = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = fn()
        times.append(time.perf_counter() - t0)
    return min(times), tokens


# -- engine side ---------------------------------------------------------------------------------


def engine_run(
    model: CausalLM,
    prompts: list[list[int]],
    n: int,
    max_new: int,
    temperature: float,
    stop: tuple[int, ...],
    seed: int,
) -> int:
    """Generate with a fresh engine (SD off); returns the number of generated tokens."""
    engine = Engine(
        model,
        EngineConfig(
            max_batch=len(prompts) * n,
            max_seq_len=max(map(len, prompts)) + max_new + 1,
            spec_mode="off",
        ),
    )
    outs = engine.generate(
        Request(
            f"r{i}",
            p,
            SamplingParams(
                n=n,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new,
                stop_token_ids=stop,
                seed=seed + i,
            ),
            prompt_index=i,
        )
        for i, p in enumerate(prompts)
    )
    return sum(len(o.token_ids) for o in outs)


# -- transformers side ---------------------------------------------------------------------------


def hf_run(
    model,
    prompts: list[list[int]],
    n: int,
    max_new: int,
    temperature: float,
    stop: tuple[int, ...],
    seed: int,
    batch_size: int,
) -> int:
    """`generate` on left-padded static batches; returns the tokens up to each row's stop."""
    torch.manual_seed(seed)
    rows = [p for p in prompts for _ in range(n)]
    total = 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in chunk])
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        sampling = (
            {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
            if temperature > 0
            else {"do_sample": False}
        )
        # No stop tokens: force exactly max_new tokens (fixed-length decode measurement).
        lengths = {"min_new_tokens": max_new} if not stop else {}
        with torch.inference_mode():
            gen = model.generate(
                input_ids=ids,
                attention_mask=attn,
                max_new_tokens=max_new,
                eos_token_id=list(stop) or None,
                pad_token_id=PAD_ID,
                **lengths,
                **sampling,
            )
        for row in gen[:, width:].tolist():
            hit = [row.index(s) for s in stop if s in row]
            total += min(hit) + 1 if hit else len(row)
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=MODEL_DIR)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, one repeat")
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument("--hf-batch", type=int, default=0, help="static batch for generate (0: all)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.decode_tokens, args.prompts, args.samples = 16, 2, 2
        args.max_new_tokens, args.repeats = min(args.max_new_tokens, 48), 1
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, local_files_only=True
    ).eval()
    ours = load_model(args.model)
    work = [p for _, p in rollout_prompts(args.prompts, args.seed, args.model)]

    rows: list[tuple[str, str, float, int, float, int]] = []
    print(f"threads={args.threads} repeats={args.repeats} model={args.model}", flush=True)
    for batch in (1, 16):
        prompts = [work[i % len(work)] for i in range(batch)]
        e_s, e_tok = best_of(
            args.repeats,
            lambda p=prompts: engine_run(ours, p, 1, args.decode_tokens, 0.0, (), args.seed),
        )
        h_s, h_tok = best_of(
            args.repeats,
            lambda p=prompts: hf_run(hf, p, 1, args.decode_tokens, 0.0, (), args.seed, len(p)),
        )
        rows.append(
            (f"greedy decode, batch {batch}", f"{args.decode_tokens} tok", e_s, e_tok, h_s, h_tok)
        )
        print(f"  done: batch {batch}", flush=True)

    n_rows = args.prompts * args.samples
    hf_batch = args.hf_batch or n_rows
    stop = (STOP_TOKEN_ID,)
    mnt = args.max_new_tokens
    e_s, e_tok = best_of(
        args.repeats,
        lambda: engine_run(ours, work, args.samples, mnt, 1.0, stop, args.seed),
        warmup=False,  # warmed up by the decode rows
    )
    h_s, h_tok = best_of(
        args.repeats,
        lambda: hf_run(hf, work, args.samples, mnt, 1.0, stop, args.seed, hf_batch),
        warmup=False,
    )
    label = f"long-tail {args.prompts}x{args.samples}, T=1"
    rows.append((label, f"<= {mnt} tok, hf batch {hf_batch}", e_s, e_tok, h_s, h_tok))

    print()
    print(
        f"| {'case':<28} | {'length':<24} | {'engine s':>8} | {'engine tok/s':>12} "
        f"| {'hf s':>8} | {'hf tok/s':>9} | {'tok/s ratio':>11} | {'wall ratio':>10} |"
    )
    print(
        f"|{'-' * 30}|{'-' * 26}|{'-' * 10}:|{'-' * 14}:|{'-' * 10}:|{'-' * 11}:|"
        f"{'-' * 13}:|{'-' * 12}:|"
    )
    for case, length, es, et, hs, ht in rows:
        ratio_tps = (et / es) / (ht / hs)
        print(
            f"| {case:<28} | {length:<24} | {es:8.2f} | {et / es:12.1f} | {hs:8.2f} "
            f"| {ht / hs:9.1f} | {ratio_tps:10.2f}x | {hs / es:9.2f}x |"
        )
    print("\nratios > 1: the engine is faster. tok/s counts generated tokens up to each stop.")
    print(
        "Decode rows: fixed length (no stop token), prefill included. Long-tail row: both "
        "sample at T=1 with their own RNGs, so token counts differ slightly; compare tok/s."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
