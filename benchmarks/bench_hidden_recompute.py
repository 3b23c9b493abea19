"""Cache target hidden states in the drafter buffer, or recompute them by prefill? Side by side.

For a Qwen2-shaped random policy, the same items are trained once with cached bf16 hidden
states and once with hidden states recomputed by a (chunked) target prefill on the training
device; the table shows buffer bytes per token and the optimizer-step time of each path.

    python benchmarks/bench_hidden_recompute.py [--threads 1] [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tltd_workers.drafter.buffer import TrainingBuffer  # noqa: E402
from tltd_workers.drafter.forward import target_hidden  # noqa: E402
from tltd_workers.drafter.trainer import Trainer, TrainerConfig  # noqa: E402
from tltd_workers.engine.eagle import EagleDrafter  # noqa: E402
from tltd_workers.engine.transformer import load_model  # noqa: E402


def make_policy(path: Path, hidden: int, layers: int, vocab: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def measure(model_dir: Path, keep: bool, steps: int, n_items: int, length: int) -> dict:
    target = load_model(model_dir)
    buf = TrainingBuffer(1 << 30, keep_hidden=keep)
    g = torch.Generator().manual_seed(0)
    for _ in range(n_items):
        ids = torch.randint(0, target.config.vocab_size, (length,), generator=g)
        h = target_hidden(target, [ids])[0] if keep else None
        buf.add(ids, 16, policy_version=0, step=0, hidden=h)
    tokens = sum(it.token_ids.numel() for it in buf.items())
    cfg = TrainerConfig(items_per_micro=2, micro_per_step=2, row_len=length)
    tr = Trainer(EagleDrafter.random_init(target), buf, cfg)
    tr.train_step()  # warm-up
    times = [tr.train_step().seconds for _ in range(steps)]
    return {"bytes_per_token": buf.nbytes / tokens, "step_s": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [(256, 8, 8192), (512, 8, 8192)]
    load = os.getloadavg()
    print(
        f"hidden cache vs recompute, items of 256 tokens, 4 items/step, "
        f"threads={args.threads}, load average {load[0]:.1f}"
    )
    print(
        f"{'H':>5}{'layers':>7}{'cached B/tok':>14}{'ids-only B/tok':>16}"
        f"{'cached step s':>15}{'recompute step s':>18}{'slowdown':>10}"
    )
    with tempfile.TemporaryDirectory() as d:
        for hidden, layers, vocab in shapes:
            model_dir = make_policy(Path(d) / f"p{hidden}", hidden, layers, vocab)
            c = measure(model_dir, True, args.steps, 16, 256)
            r = measure(model_dir, False, args.steps, 16, 256)
            print(
                f"{hidden:>5}{layers:>7}{c['bytes_per_token']:>14.0f}"
                f"{r['bytes_per_token']:>16.0f}{c['step_s']:>15.3f}{r['step_s']:>18.3f}"
                f"{r['step_s'] / c['step_s']:>10.2f}"
            )


if __name__ == "__main__":
    main()
