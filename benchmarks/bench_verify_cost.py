"""What one speculative step costs against one plain step, per batch size and dtype.

Speculative decoding pays when verifying k + 1 tokens per row costs little more than decoding
one (the memory-bound regime of GPUs). This measures, on the project's policy and drafter,
at a context length typical of the long tail:

    decode  one target forward, 1 new token per row (a plain step)
    verify  one target forward, k + 1 new tokens per row (verification of a k-token chain)
    draft   one EAGLE drafter step (the chain costs k of them)

and the per-step speedup that SD can reach at most with an accepted length a (tokens emitted
per row per SD step, bonus included) measured elsewhere and passed as `--accepted` (the GPU
check passes bench_spec's on the same device): a * decode / (verify + k * draft), and with a
free drafter: a * decode / verify. Without `--accepted` the table shows the bound per accepted
token, decode / (verify + k * draft). Sampling and bookkeeping are left out, so real steps
are slower than these bounds. On CUDA each row also records the CUDA time of one decode
(`decode_cuda_ms`, CUDA events): the GPU did the work when it is > 0.

On a GPU (`--device cuda`), `--shape qwen2-0.5b` adds a randomly initialised model of that
shape (built on the device, nothing downloaded) with a random EAGLE drafter: the regime the
project's small policy stands in for. `--json PATH` writes the rows for scripts/gpu_check.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.task.workload import MODEL_DIR  # noqa: E402
from tltd_workers.engine.eagle import EagleDrafter  # noqa: E402
from tltd_workers.engine.transformer import (  # noqa: E402
    Batch,
    CausalLM,
    ModelConfig,
    load_model,
)

DEFAULT_DRAFTER = Path(__file__).resolve().parents[1] / "models" / "tiny-policy-eagle"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Random-initialised shapes for GPU runs (Qwen2.5-0.5B's and Qwen2.5-1.5B's dimensions).
SHAPES = {
    "qwen2-0.5b": ModelConfig(151936, 896, 4864, 24, 14, 2, 64, qkv_bias=True,
                              tie_word_embeddings=True, max_position_embeddings=4096),
    "qwen2-1.5b": ModelConfig(151936, 1536, 8960, 28, 12, 2, 128, qkv_bias=True,
                              tie_word_embeddings=True, max_position_embeddings=4096),
    "tiny": ModelConfig(1024, 64, 128, 2, 4, 2, 16, max_position_embeddings=4096),  # dry runs
}  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously: time them, not their launch
        torch.cuda.synchronize(device)


def _best_ms(fn, repeats: int, device: torch.device) -> float:
    """Best of 5 rounds of `repeats` calls (ms per call): the least disturbed estimate."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / repeats)
    return 1000 * best


def _cuda_ms(fn, device: torch.device) -> float:
    """CUDA time of one call, by events on the device's stream (0 off CUDA)."""
    if device.type != "cuda":
        return 0.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    return float(start.elapsed_time(end))


def forward_ms(
    model: CausalLM, b: int, width: int, context: int, repeats: int
) -> tuple[float, float]:
    """One target forward of `width` new tokens for each of b rows holding `context` tokens:
    (best wall ms per call, CUDA ms of one call)."""
    cache = model.new_cache(b, context + width + 1)
    dev = cache.k.device
    lens = [context - (i % 7) for i in range(b)]  # ragged, as in a real running batch
    tokens = torch.randint(3, model.config.vocab_size, (b, width), device=dev)

    def run() -> None:
        batch = Batch.make(lens, None, width, 0, cache.trash, dev)
        model(tokens, cache, batch, last_only=width == 1)

    with torch.inference_mode():
        return _best_ms(run, repeats, dev), _cuda_ms(run, dev)


def draft_step_ms(drafter: EagleDrafter, b: int, context: int, repeats: int) -> float:
    """One drafter step (one new position per row) against its own KV cache."""
    cache = drafter.new_cache(b, context + 2)
    dev = cache.k.device
    lens = [context - (i % 7) for i in range(b)]
    h = torch.randn(b, 1, drafter.config.hidden_size, dtype=cache.k.dtype, device=dev)
    tok = torch.randint(3, drafter.config.vocab_size, (b, 1), device=dev)

    def run() -> None:
        batch = Batch.make(lens, [1] * b, 1, 0, cache.trash, dev)
        drafter.logits(drafter._step(h, tok, batch, cache))

    with torch.inference_mode():
        return _best_ms(run, repeats, dev)


def print_header(args, where: str) -> None:
    """The run's settings and the table's header (SD bound columns only with a measured a)."""
    a = args.accepted
    print(
        f"context {args.context} tokens, k={args.k}, accepted length a={a or 'not given'}, "
        f"threads {args.threads}, "
        f"device {args.device} ({where})",
        flush=True,
    )
    print(
        "\n| model | dtype | batch | decode ms | decode / batch-1 decode | verify ms "
        "| verify / decode | draft step ms | draft / decode | "
        + ("SD bound | SD bound, free drafter |" if a else "bound / a | bound / a, free drafter |")
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def measure_row(model: CausalLM, drafter: EagleDrafter, b: int, args) -> dict:
    """decode / verify / draft ms at batch b, the bound per accepted token, and the SD bounds
    at `args.accepted` (None without it)."""
    k, a = args.k, args.accepted
    dec, dec_cuda = forward_ms(model, b, 1, args.context, args.repeats)
    ver, _ = forward_ms(model, b, k + 1, args.context, args.repeats)
    dra = draft_step_ms(drafter, b, args.context, args.repeats)
    per = dec / (ver + k * dra)
    return dict(batch=b, decode_ms=dec, verify_ms=ver, draft_ms=dra, decode_cuda_ms=dec_cuda,
                bound_per_accepted_token=per, sd_bound=a and a * per,
                sd_bound_free_drafter=a and a * dec / ver)  # fmt: skip


def random_model(shape: str, dtype: torch.dtype, device: str) -> tuple[CausalLM, EagleDrafter]:
    """A policy of a named shape with random weights, built on the device, and a drafter."""
    with torch.device(device):
        model = CausalLM(SHAPES[shape])
    model = model.to(dtype=dtype).eval()
    return model, EagleDrafter.random_init(model, seed=0)


def models(args, name: str):
    """(label, policy, drafter) for each model measured in dtype `name`."""
    dtype = DTYPES[name]
    if not args.no_shipped:
        model = load_model(args.model, dtype, args.device)
        yield "shipped", model, EagleDrafter.from_pretrained(args.drafter, model)
    for shape in filter(None, args.shape.split(",")):
        yield (shape, *random_model(shape, dtype, args.device))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=MODEL_DIR)
    ap.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    ap.add_argument("--batches", default="1,4,16,32,64")
    ap.add_argument("--k", type=int, default=4, help="draft length")
    ap.add_argument(
        "--accepted",
        type=float,
        help="measured tokens per row per SD step (bench_spec's mean acc len); without it the "
        "table shows the bound per accepted token",
    )
    ap.add_argument("--context", type=int, default=500, help="tokens already in each row")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    ap.add_argument("--shape", default="", help=f"also random models of these shapes: {SHAPES}")
    ap.add_argument("--no-shipped", action="store_true", help="leave the shipped policy out")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(x) for x in args.batches.split(",")]
    k, a = args.k, args.accepted
    where = torch.cuda.get_device_name(args.device) if args.device != "cpu" else "cpu"
    print_header(args, where)
    rows = []
    for name in args.dtypes.split(","):
        for label, model, drafter in models(args, name):
            first = None
            for b in batches:
                row = measure_row(model, drafter, b, args)
                rows.append(row | dict(model=label, dtype=name))
                dec, ver, dra = row["decode_ms"], row["verify_ms"], row["draft_ms"]
                first = first or dec
                bound = (a or 1.0) * row["bound_per_accepted_token"]
                free = (a or 1.0) * dec / ver
                print(
                    f"| {label} | {name} | {b} | {dec:.2f} | {dec / first:.2f}x | {ver:.2f} "
                    f"| {ver / dec:.2f}x | {dra:.2f} | {dra / dec:.3f} | {bound:.2f}x "
                    f"| {free:.2f}x |",
                    flush=True,
                )
            del model, drafter
    if args.json:
        meta = dict(device=args.device, device_name=where, context=args.context, k=k, accepted=a)
        args.json.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    print(
        "\nSD bound = a * decode / (verify + k * draft): the most one SD step can gain over "
        "plain steps (sampling, bookkeeping and rejected chains only lower it); "
        + (f"a = {a}, measured (--accepted)." if a else "no measured a given: bound / a shown.")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
