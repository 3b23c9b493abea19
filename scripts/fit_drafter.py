"""Fit an EAGLE drafter offline on the tiny policy's own rollouts (for tests and benchmarks)."""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

# Runnable as `python scripts/fit_drafter.py` from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.task.workload import MAX_NEW_TOKENS, STOP_TOKEN_ID, rollout_prompts  # noqa: E402
from tltd.domain import SamplingParams  # noqa: E402
from tltd_workers.drafter.objective import eagle_loss as objective_loss  # noqa: E402
from tltd_workers.engine.bandit import Strategy  # noqa: E402
from tltd_workers.engine.eagle import EagleDrafter  # noqa: E402
from tltd_workers.engine.engine import Engine, EngineConfig, Request  # noqa: E402
from tltd_workers.engine.transformer import CausalLM, load_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "models" / "tiny-policy"
DEFAULT_OUT = ROOT / "models" / "tiny-policy-eagle"


@dataclass(frozen=True)
class Example:
    """One rollout sample: tokens (prompt + response), the target's hidden state at every
    position but the last, and where the response starts."""

    tokens: Tensor  # [T] int64
    hidden: Tensor  # [T - 1, H]
    prompt_len: int


def rollout(
    model: CausalLM,
    prompts: list[list[int]],
    samples: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> list[Example]:
    """Roll the policy out with SD off, keeping the target's hidden states."""
    engine = Engine(
        model,
        EngineConfig(
            max_batch=max(samples, 64 // samples * samples),
            max_seq_len=max(len(p) for p in prompts) + max_new_tokens + 1,
            spec_mode="off",
        ),
    )
    requests = [
        Request(
            f"fit-{i}",
            p,
            SamplingParams(
                n=samples,
                temperature=temperature,
                max_new_tokens=max_new_tokens,
                stop_token_ids=(STOP_TOKEN_ID,),
                seed=seed + i,
            ),
            prompt_index=i,
            return_hidden_states=True,
        )
        for i, p in enumerate(prompts)
    ]
    out = engine.generate(requests)
    examples = []
    for o in out:
        prompt = prompts[o.prompt_index]
        assert o.hidden_states is not None
        tokens = torch.tensor(prompt + o.token_ids, dtype=torch.long)
        # A clone outside inference mode: autograd may not save inference tensors.
        examples.append(Example(tokens, o.hidden_states.clone(), len(prompt)))
    return examples


def collate(examples: list[Example]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Right-padded drafter inputs, targets and loss mask for a batch of examples.

    Position t of the drafter consumes (h_t, x_{t+1}) and must predict h_{t+1}, the state
    from which the target predicts x_{t+2}. Only predictions of states that predict a response
    token count (h_{t+1} with t + 1 >= prompt_len - 1). Right padding is harmless under
    causal attention: real positions never see it and padded ones are masked out.
    """
    width = max(len(e.hidden) - 1 for e in examples)
    h_dim = examples[0].hidden.shape[-1]
    b = len(examples)
    hidden = torch.zeros(b, width, h_dim)
    next_tok = torch.zeros(b, width, dtype=torch.long)
    target = torch.zeros(b, width, h_dim)
    mask = torch.zeros(b, width, dtype=torch.bool)
    for i, e in enumerate(examples):
        n = len(e.hidden) - 1  # pairs (h_t, x_{t+1}) -> h_{t+1} for t in [0, n)
        hidden[i, :n] = e.hidden[:-1]
        next_tok[i, :n] = e.tokens[1 : n + 1]
        target[i, :n] = e.hidden[1:]
        mask[i, max(e.prompt_len - 2, 0) : n] = True
    return hidden, next_tok, target, mask


def eagle_loss(
    drafter: EagleDrafter, hidden: Tensor, next_tok: Tensor, target: Tensor, mask: Tensor
) -> tuple[Tensor, dict[str, float]]:
    """The online trainer's EAGLE objective (workers/drafter/objective.py) on one batch."""
    pred = drafter(hidden, next_tok)[mask]  # [N, H]
    tgt = target[mask]
    with torch.no_grad():
        target_logits = drafter.logits(tgt)
    keep = torch.ones(pred.shape[0], dtype=torch.bool)
    return objective_loss(pred, tgt, drafter.logits(pred), target_logits, keep)


def train(
    drafter: EagleDrafter,
    examples: list[Example],
    steps: int,
    batch_size: int,
    lr: float,
    noise: float,
    seed: int,
) -> dict[str, float]:
    """AdamW over shuffled mini-batches; returns the metrics of the last ~10% of steps."""
    drafter.target.requires_grad_(False)  # embeddings and lm_head are the target's, frozen
    drafter.train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)

    def lr_factor(step: int) -> float:  # linear warm-up, then cosine down to 10%
        if step < warmup:
            return (step + 1) / warmup
        done = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(done, 1.0)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    # Batches of similar lengths waste less compute on padding.
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].tokens))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    tail: list[dict[str, float]] = []
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        hidden, next_tok, target, mask = collate([examples[i] for i in rng.choice(batches)])
        if noise > 0:
            # EAGLE's feature noise: at inference the drafter's later steps consume its own
            # (imperfect) predictions, so it should not rely on exact target features.
            hidden = hidden + (torch.rand(hidden.shape, generator=gen) - 0.5) * 2 * noise
        loss, m = eagle_loss(drafter, hidden, next_tok, target, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        sched.step()
        m["loss"] = loss.item()
        if step > steps * 0.9:
            tail.append(m)
        if step == 1 or step % 20 == 0 or step == steps:
            print(
                f"step {step:4d}/{steps}  loss {m['loss']:.4f}  smoothl1 {m['reg']:.4f}  "
                f"ce {m['ce']:.3f}  top1 {m['top1']:.3f}  {time.perf_counter() - t0:6.1f}s",
                flush=True,
            )
    drafter.eval()
    return {k: sum(m[k] for m in tail) / len(tail) for k in tail[0]}


def measure_acceptance(
    model: CausalLM,
    drafter: EagleDrafter | None,
    prompts: list[list[int]],
    samples: int,
    k: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> dict[str, object]:
    """Mean accepted length of fixed-k SD with the EAGLE drafter (or n-gram when None)."""
    strategy = Strategy("eagle" if drafter is not None else "ngram", k)
    engine = Engine(
        model,
        EngineConfig(
            max_batch=len(prompts) * samples,
            max_seq_len=max(len(p) for p in prompts) + max_new_tokens + 1,
            spec_mode="fixed",
            strategies=(strategy,),
            batch_threshold=len(prompts) * samples,
        ),
    )
    if drafter is not None:
        engine.set_drafter(drafter, version=1)
    engine.generate(
        Request(
            f"eval-{i}",
            p,
            SamplingParams(
                n=samples,
                temperature=temperature,
                max_new_tokens=max_new_tokens,
                stop_token_ids=(STOP_TOKEN_ID,),
                seed=seed + i,
            ),
            prompt_index=i,
        )
        for i, p in enumerate(prompts)
    )
    s = engine.stats.summary()
    return {
        "strategy": strategy.name,
        "mean_accepted_length": s["mean_accepted_length"],
        "acceptance_rate": s["acceptance_rate"],
    }


def _display_path(path: Path) -> str:
    """Repository-relative when inside the repository (the saved fit.json is committed)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--prompts", type=int, default=128, help="training prompts")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--noise", type=float, default=0.05, help="uniform feature noise amplitude")
    ap.add_argument("--eval-prompts", type=int, default=8, help="0: skip the acceptance check")
    ap.add_argument("--eval-k", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    # One thread by default: on a shared 2-core machine two threads contend badly.
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    t0 = time.perf_counter()
    model = load_model(args.model)
    # Training prompts come from seeds the benchmarks (rollout_prompts(seed=0)) do not use.
    train_prompts = [p for _, p in rollout_prompts(args.prompts, 1000 + args.seed, args.model)]
    print(f"rolling out {args.prompts} prompts x {args.samples} samples (SD off)...", flush=True)
    examples = rollout(
        model, train_prompts, args.samples, args.max_new_tokens, args.temperature, args.seed
    )
    n_resp = sum(len(e.tokens) - e.prompt_len for e in examples)
    print(
        f"  {len(examples)} samples, {n_resp} response tokens in {time.perf_counter() - t0:.1f}s",
        flush=True,
    )

    drafter = EagleDrafter.random_init(model, seed=args.seed)
    n_params = sum(p.numel() for p in drafter.parameters())
    print(f"training EAGLE drafter ({n_params / 1e6:.2f}M trainable params)...", flush=True)
    t1 = time.perf_counter()
    final = train(drafter, examples, args.steps, args.batch_size, args.lr, args.noise, args.seed)
    train_s = time.perf_counter() - t1

    info: dict[str, object] = {
        "target": _display_path(args.model),
        "rollout": {
            "prompts": args.prompts,
            "samples": args.samples,
            "temperature": args.temperature,
            "response_tokens": n_resp,
        },
        "train": {
            "steps": args.steps,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "noise": args.noise,
            "seconds": round(train_s, 1),
            "final": {k: round(v, 4) for k, v in final.items()},
        },
    }
    if args.eval_prompts:
        eval_prompts = [
            p for _, p in rollout_prompts(args.eval_prompts, 2000 + args.seed, args.model)
        ]
        for d in (drafter, None):
            acc = measure_acceptance(
                model,
                d,
                eval_prompts,
                2,
                args.eval_k,
                args.max_new_tokens,
                args.temperature,
                args.seed,
            )
            # None when the budget was too short for any speculative step.
            length, rate = acc["mean_accepted_length"], acc["acceptance_rate"]
            print(
                f"held-out {acc['strategy']}: mean accepted length "
                f"{'n/a' if length is None else f'{length:.2f}'}, "
                f"acceptance rate {'n/a' if rate is None else f'{rate:.2f}'}",
                flush=True,
            )
            info.setdefault("eval", []).append(acc)  # type: ignore[union-attr]

    drafter.save_pretrained(args.out)
    (args.out / "fit.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"saved to {args.out} ({time.perf_counter() - t0:.0f}s total)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
