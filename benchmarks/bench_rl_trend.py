"""How much the demo's GRPO moves the task reward in a few steps, and whether a step's reward
can show it: the demo's trainer and workload, rollouts from the engine in-process (SD off: the
same sampling law as the daemon's), no daemon.

    python benchmarks/bench_rl_trend.py [--steps 6] [--configs demo,fixed,passes3,lr3e-4]

Each config runs `--steps` RL steps of `--prompts` x `--n` samples at temperature 1 from
`models/tiny-policy`, as `make demo` does (GRPO advantages, one clipped policy-gradient update
per step by `examples/grpo_trainer.py`). Per config the table prints the mean reward per step,
the per-sample regression slope of the reward on the step (the demo's `reward trend`) with its
standard error, and the reward on held-out prompts before and after the run, sampled with the
same seeds both times (paired: the standard error is that of the per-sample differences).

Configs: `demo` new prompts every step, AdamW at lr 1e-4 (the demo's setting); `fixed` the same
prompts every step; `passes3` three updates on each step's batch; `lr3e-4` a 3x larger lr;
`head3e-3` lr 3e-3 on the final norm and the output layer (a trainable temperature), 1e-4
elsewhere; `sgd0.3`, `sgd1` plain SGD at lr 0.3 and 1 (AdamW's first steps move every weight by
the lr whatever its gradient's size; SGD moves them in proportion to it).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.grpo_demo import MODEL, reward_trend  # noqa: E402
from examples.grpo_demo import score as demo_score  # noqa: E402
from examples.grpo_trainer import GRPOTrainer, Scored  # noqa: E402
from examples.task import load_tokenizer  # noqa: E402
from examples.task.workload import MAX_NEW_TOKENS, STOP_TOKEN_ID, rollout_prompts  # noqa: E402
from tltd.domain import SamplingParams  # noqa: E402
from tltd_workers.engine.engine import Engine, EngineConfig, Request  # noqa: E402

HELD_OUT_SEED = 10**5  # prompt seed of the held-out set: no training step draws it
HELD_OUT_SAMPLING_SEED = 4242


@dataclass(frozen=True)
class Config:
    name: str
    lr: float = 1e-4
    fixed_prompts: bool = False
    passes: int = 1
    head_lr: float = 0.0  # > 0: this lr for the final norm and lm_head
    sgd: bool = False  # plain SGD instead of AdamW (whose first steps are sign steps)


CONFIGS = {
    c.name: c
    for c in (
        Config("demo"),
        Config("fixed", fixed_prompts=True),
        Config("passes3", passes=3),
        Config("lr3e-4", lr=3e-4),
        Config("head3e-3", head_lr=3e-3),
        Config("sgd0.3", lr=0.3, sgd=True),
        Config("sgd1", lr=1.0, sgd=True),
    )
}


@dataclass(frozen=True)
class RewardStep:
    """What `reward_trend` reads of a step."""

    step: int
    samples: int
    mean_reward: float
    reward_var: float


def sample(checkpoint: Path, work, seed: int, n: int, max_new_tokens: int) -> list:
    """The samples of one rollout."""
    engine = Engine(checkpoint, EngineConfig(max_batch=64, max_seq_len=2304, spec_mode="off"))
    params = SamplingParams(
        n=n, temperature=1.0, max_new_tokens=max_new_tokens,
        stop_token_ids=(STOP_TOKEN_ID,), seed=seed,
    )  # fmt: skip
    return engine.generate(
        Request(f"p{i}", ids, params, prompt_index=i) for i, (_, ids) in enumerate(work)
    )


def score(work, outs, tok) -> list[Scored]:
    """The demo's scoring, in (prompt, sample) order: held-out rewards pair up by position."""
    return demo_score(outs, [ids for _, ids in work], [p for p, _ in work], tok)


def held_out(checkpoint: Path, args, tok) -> list[float]:
    work = rollout_prompts(args.held_out_prompts, seed=HELD_OUT_SEED, model_dir=args.model)
    outs = sample(checkpoint, work, HELD_OUT_SAMPLING_SEED, args.n, args.max_new_tokens)
    return [s.reward for s in score(work, outs, tok)]


def make_trainer(cfg: Config, model: Path) -> GRPOTrainer:
    trainer = GRPOTrainer(model, lr=cfg.lr, seed=0)
    if cfg.sgd:
        trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=cfg.lr)
    if cfg.head_lr:
        names = ("model.norm.weight", "lm_head.weight")
        named = dict(trainer.model.named_parameters())
        head = [named[k] for k in names]
        rest = [p for k, p in named.items() if k not in names]
        trainer.optimizer = torch.optim.AdamW(
            [{"params": rest, "lr": cfg.lr}, {"params": head, "lr": cfg.head_lr}],
            weight_decay=0.0,
        )
    return trainer


def run(cfg: Config, args, work_dir: Path, tok) -> tuple[list[RewardStep], Path]:
    trainer, checkpoint, steps = make_trainer(cfg, args.model), args.model, []
    for step in range(args.steps):
        seed = step  # the demo's prompt and sampling seed at step `step`
        work = rollout_prompts(
            args.prompts, seed=0 if cfg.fixed_prompts else seed, model_dir=args.model
        )
        t0 = time.perf_counter()
        scored = score(work, sample(checkpoint, work, seed, args.n, args.max_new_tokens), tok)
        for _ in range(cfg.passes):
            trainer.update(scored)
        checkpoint = trainer.save(work_dir / cfg.name / f"step-{step + 1}")
        rewards = [s.reward for s in scored]
        mean = sum(rewards) / len(rewards)
        var = sum((r - mean) ** 2 for r in rewards) / len(rewards)
        steps.append(RewardStep(step, len(rewards), mean, var))
        print(f"  {cfg.name} step {step}: reward {mean:.3f} ({time.perf_counter() - t0:.0f}s)",
              flush=True)  # fmt: skip
    return steps, checkpoint


def paired(before: list[float], after: list[float]) -> tuple[float, float]:
    diffs = [a - b for a, b in zip(after, before, strict=True)]
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean, math.sqrt(var / len(diffs)) or float("nan")


def _ratio(value: float, standard_error: float) -> float:
    """In standard errors; nan when there is no spread (e.g. every reward 0)."""
    return value / standard_error if standard_error else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--held-out-prompts", type=int, default=32)
    ap.add_argument("--configs", default="demo,fixed,passes3,lr3e-4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    args = ap.parse_args(argv)
    configs = [CONFIGS[name] for name in args.configs.split(",")]
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.model)
    print(
        f"workload: {args.prompts} prompts x {args.n} samples per step (the demo's), "
        f"{args.steps} steps; held out: {args.held_out_prompts} x {args.n}",
        flush=True,
    )
    before = held_out(args.model, args, tok)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in configs:
            steps, last = run(cfg, args, Path(tmp), tok)
            slope, se = reward_trend(steps)
            after = held_out(last, args, tok)
            mean_after = sum(after) / len(after)
            rows.append((cfg.name, steps, slope, se, mean_after, paired(before, after)))
    print(f"\n{'config':<10}{'reward per step':<44}{'trend/step':>11}{'(SEs)':>7}"
          f"{'held out before':>17}{'after':>7}{'change':>9}{'(SEs)':>7}")  # fmt: skip
    base = sum(before) / len(before)
    for name, steps, slope, se, after, (delta, dse) in rows:
        per_step = " ".join(f"{s.mean_reward:.2f}" for s in steps)
        print(f"{name:<10}{per_step:<44}{slope:>+11.3f}{_ratio(slope, se):>+7.1f}"
              f"{base:>17.3f}{after:>7.3f}{delta:>+9.3f}{_ratio(delta, dse):>+7.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
