"""What one speculative step costs against one plain step, per batch size and dtype.

Speculative decoding pays when verifying k + 1 tokens per row costs little more than decoding
one (the memory-bound regime of GPUs). This measures, on the project's policy and drafter,
at a context length typical of the long tail:

    decode  one target forward, 1 new token per row (a plain step)
    verify  one target forward, k + 1 new tokens per row (verification of a k-token chain)
    draft   one EAGLE drafter step (the chain costs k of them)

and the per-step speedup that SD can reach at most with a given accepted length a (tokens
emitted per row per SD step, bonus included): a * decode / (verify + k * draft), and with a
free drafter: a * decode / verify. Sampling and bookkeeping are left out, so real steps are
slower than these bounds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.task.workload import MODEL_DIR  # noqa: E402
from tltd_workers.engine.eagle import EagleDrafter  # noqa: E402
from tltd_workers.engine.transformer import Batch, CausalLM, load_model  # noqa: E402

DEFAULT_DRAFTER = Path(__file__).resolve().parents[1] / "models" / "tiny-policy-eagle"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _best_ms(fn, repeats: int) -> float:
    """Best of 5 rounds of `repeats` calls (ms per call): the least disturbed estimate."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - t0) / repeats)
    return 1000 * best


def forward_ms(model: CausalLM, b: int, width: int, context: int, repeats: int) -> float:
    """One target forward of `width` new tokens for each of b rows holding `context` tokens."""
    cache = model.new_cache(b, context + width + 1)
    lens = [context - (i % 7) for i in range(b)]  # ragged, as in a real running batch
    tokens = torch.randint(3, model.config.vocab_size, (b, width))

    def run() -> None:
        batch = Batch.make(lens, None, width, 0, cache.trash, "cpu")
        model(tokens, cache, batch, last_only=width == 1)

    return _best_ms(run, repeats)


def draft_step_ms(drafter: EagleDrafter, b: int, context: int, repeats: int) -> float:
    """One drafter step (one new position per row) against its own KV cache."""
    cache = drafter.new_cache(b, context + 2)
    lens = [context - (i % 7) for i in range(b)]
    h = torch.randn(b, 1, drafter.config.hidden_size, dtype=cache.k.dtype)
    tok = torch.randint(3, drafter.config.vocab_size, (b, 1))

    def run() -> None:
        batch = Batch.make(lens, [1] * b, 1, 0, cache.trash, "cpu")
        drafter.logits(drafter._step(h, tok, batch, cache))

    with torch.inference_mode():
        return _best_ms(run, repeats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=MODEL_DIR)
    ap.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    ap.add_argument("--batches", default="1,4,16,32,64")
    ap.add_argument("--k", type=int, default=4, help="draft length")
    ap.add_argument(
        "--accepted",
        type=float,
        default=4.0,
        help="tokens per row per SD step (EAGLE k=4 at T=1 on the shipped policy: ~4)",
    )
    ap.add_argument("--context", type=int, default=500, help="tokens already in each row")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(x) for x in args.batches.split(",")]
    k, a = args.k, args.accepted
    print(
        f"context {args.context} tokens, k={k}, accepted length a={a}, threads {args.threads}",
        flush=True,
    )
    print(
        "\n| dtype | batch | decode ms | decode / batch-1 decode | verify ms | verify / decode "
        "| draft step ms | draft / decode | SD bound | SD bound, free drafter |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.dtypes.split(","):
        model = load_model(args.model, DTYPES[name])
        drafter = EagleDrafter.from_pretrained(args.drafter, model)
        first = None
        for b in batches:
            dec = forward_ms(model, b, 1, args.context, args.repeats)
            first = first or dec
            ver = forward_ms(model, b, k + 1, args.context, args.repeats)
            dra = draft_step_ms(drafter, b, args.context, args.repeats)
            bound, free = a * dec / (ver + k * dra), a * dec / ver
            print(
                f"| {name} | {b} | {dec:.2f} | {dec / first:.2f}x | {ver:.2f} | {ver / dec:.2f}x "
                f"| {dra:.2f} | {dra / dec:.3f} | {bound:.2f}x | {free:.2f}x |",
                flush=True,
            )
    print(
        "\nSD bound = a * decode / (verify + k * draft): the most one SD step can gain over "
        "plain steps (sampling, bookkeeping and rejected chains only lower it)."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
