"""How much the demo's GRPO moves the task reward in a few steps, and whether a step's reward
can show it: the demo's trainer and workload, rollouts from the engine in-process (SD off: the
same sampling law as the daemon's), no daemon.

    python benchmarks/bench_rl_trend.py [--steps 6] [--configs demo,lr1e-4,passes2] [--model DIR]
    python benchmarks/bench_rl_trend.py --steps 8 --configs demo --seeds 0,1,2,3

`--seeds` repeats each config with other sampling seeds (the demo's `--seed`): runs that
differ only in their draws, as the demo's TLT and SD-off runs do (speculative decoding is
lossless in law, not in draws), and the table's last lines say how far apart their final
policies score.

Settings are compared on the task's validation split (`--split validation`, the default;
`examples/task/dataset.py`): disjoint from the training set and from the held-out set the demo
reports, so the demo's held-out result is not scored on the prompts that chose its settings.
`--split held-out` scores the demo's held-out set instead (to reproduce a demo figure, not to
choose a setting).

Each config runs `--steps` RL steps of `--prompts` x `--n` samples at temperature 1 from
`models/tiny-policy`, as `make demo` does: the prompts come from the task's fixed training set
iterated in shuffled epochs (`examples/task/dataset.py`, `--train-prompts` of them), GRPO
advantages, clipped policy-gradient updates by `examples/grpo_trainer.py`. Per config the
table prints the mean reward per step, the per-sample regression slope of the reward on the
step (the demo's `reward trend`) with its standard error, and the reward on the split's
prompts before and after the run, sampled with the same seeds both times (paired; the standard
error is taken over prompts, of their mean per-sample differences: a prompt's samples are not
independent of each other).

Configs: `demo` the demo's setting (DEMO_LR, DEMO_PASSES, DEMO_KL); `lr1e-4` one AdamW step
at lr 1e-4; `fixed` the same prompts every step; `passes2` two clipped updates per batch at lr 3e-4;
`passes3` three updates on each step's batch; `lr3e-4` a 3x larger lr;
`head3e-3` lr 3e-3 on the final norm and the output layer (a trainable temperature), 1e-4
elsewhere; `sgd0.3`, `sgd1` plain SGD at lr 0.3 and 1 (AdamW's first steps move every weight by
the lr whatever its gradient's size; SGD moves them in proportion to it); `tok1e-4`,
`tok3e-4`, `tok3e-4p2` DAPO's token-level loss (every token of the batch weighs the same,
instead of each sample's tokens averaged) at lr 1e-4, 3e-4, and 3e-4 with two passes;
`lr2e-4`; `kl0.1`, `kl0.5` lr 3e-4 with GRPO's KL penalty towards the initial policy at
coefficient 0.1 and 0.5; `lr5e-4kl0.1` lr 5e-4 with KL 0.1.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.demo_report import reward_trend  # noqa: E402
from examples.grpo_demo import DEMO_KL, DEMO_LR, DEMO_PASSES, MODEL  # noqa: E402
from examples.grpo_demo import score as demo_score  # noqa: E402
from examples.grpo_trainer import GRPOTrainer, Scored  # noqa: E402
from examples.heldout import HeldOutScore, held_out_score, paired  # noqa: E402
from examples.task import load_tokenizer  # noqa: E402
from examples.task.dataset import build_dataset  # noqa: E402
from examples.task.workload import MAX_NEW_TOKENS, STOP_TOKEN_ID  # noqa: E402
from tltd.domain import SamplingParams  # noqa: E402
from tltd_workers.engine.engine import Engine, EngineConfig, Request  # noqa: E402


@dataclass(frozen=True)
class Config:
    name: str
    lr: float = 1e-4
    fixed_prompts: bool = False
    passes: int = 1
    head_lr: float = 0.0  # > 0: this lr for the final norm and lm_head
    sgd: bool = False  # plain SGD instead of AdamW (whose first steps are sign steps)
    token_level: bool = False  # DAPO's token-level loss instead of GRPO's per-sample mean
    kl: float = 0.0  # GRPO's KL penalty towards the initial policy (its coefficient)


CONFIGS = {
    c.name: c
    for c in (
        Config("demo", lr=DEMO_LR, passes=DEMO_PASSES, kl=DEMO_KL),
        Config("lr1e-4"),
        Config("fixed", fixed_prompts=True),
        Config("passes2", lr=3e-4, passes=2),
        Config("passes3", passes=3),
        Config("lr3e-4", lr=3e-4),
        Config("head3e-3", head_lr=3e-3),
        Config("sgd0.3", lr=0.3, sgd=True),
        Config("sgd1", lr=1.0, sgd=True),
        Config("tok1e-4", token_level=True),
        Config("tok3e-4", lr=3e-4, token_level=True),
        Config("tok3e-4p2", lr=3e-4, passes=2, token_level=True),
        Config("lr2e-4", lr=2e-4),
        Config("kl0.1", lr=3e-4, kl=0.1),
        Config("kl0.5", lr=3e-4, kl=0.5),
        Config("lr5e-4kl0.1", lr=5e-4, kl=0.1),
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


def held_out(checkpoint: Path, args) -> HeldOutScore:
    """The score on `--split`: the validation split (choosing settings) or the held-out set."""
    items = args.dataset.validation if args.split == "validation" else args.dataset.held_out
    return held_out_score(checkpoint, items, args.held_out_n or args.n, args.max_new_tokens)


def make_trainer(cfg: Config, model: Path) -> GRPOTrainer:
    trainer = GRPOTrainer(model, lr=cfg.lr, seed=0, token_level=cfg.token_level, kl_coef=cfg.kl)
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


def run(
    cfg: Config, args, work_dir: Path, tok, sampling_seed: int = 0
) -> tuple[list[RewardStep], Path]:
    trainer, checkpoint, steps = make_trainer(cfg, args.model), args.model, []
    name = cfg.name if sampling_seed == 0 else f"{cfg.name}-s{sampling_seed}"
    for step in range(args.steps):
        seed = sampling_seed * 1000 + step  # the demo's sampling seed at step `step`
        work = args.dataset.batch(0 if cfg.fixed_prompts else step)
        t0 = time.perf_counter()
        scored = score(work, sample(checkpoint, work, seed, args.n, args.max_new_tokens), tok)
        for _ in range(cfg.passes):
            trainer.update(scored)
        checkpoint = trainer.save(work_dir / name / f"step-{step + 1}")
        rewards = [s.reward for s in scored]
        mean = sum(rewards) / len(rewards)
        var = sum((r - mean) ** 2 for r in rewards) / len(rewards)
        steps.append(RewardStep(step, len(rewards), mean, var))
        print(f"  {name} step {step}: reward {mean:.3f} ({time.perf_counter() - t0:.0f}s)",
              flush=True)  # fmt: skip
    return steps, checkpoint


def _ratio(value: float, standard_error: float) -> float:
    """In standard errors; nan when there is no spread (e.g. every reward 0)."""
    return value / standard_error if standard_error else float("nan")


def print_table(rows: list, finals: dict, before: HeldOutScore, split: str) -> None:
    """Per config: reward per step, trend, and the change on the scored split; then how far
    apart runs of one config that differ only in their sampling seeds end."""
    print(f"\n{'config':<10}{'reward per step':<36}{'trend/step':>11}{'(SEs)':>7}"
          f"{split + ' before':>17}{'after':>7}{'change':>9}{'(SEs)':>7}"
          f"{'guesses':>13}{'mean len':>14}")  # fmt: skip
    for name, steps, slope, se, after, (delta, dse) in rows:
        per_step = " ".join(f"{s.mean_reward:.2f}" for s in steps)
        guesses = f"{before.guess_share:.2f}->{after.guess_share:.2f}"
        lengths = f"{before.mean_length:.0f}->{after.mean_length:.0f}"
        print(f"{name:<10}{per_step:<36}{slope:>+11.3f}{_ratio(slope, se):>+7.1f}"
              f"{before.mean:>17.3f}{after.mean:>7.3f}{delta:>+9.3f}{_ratio(delta, dse):>+7.1f}"
              f"{guesses:>13}{lengths:>14}")  # fmt: skip
    # Runs of one config that differ only in their sampling seeds: how far apart their final
    # policies score, in the paired standard errors the demo's "TLT - off at the end" uses.
    for name, runs in finals.items():
        for i, (sa, ra) in enumerate(runs):
            for sb, rb in runs[i + 1 :]:
                delta, dse = paired(rb, ra, before.prompts)
                print(f"{name}: seed {sa} - seed {sb} at the end: {delta:+.3f} +- {dse:.3f} "
                      f"({_ratio(delta, dse):+.1f} standard errors)")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--train-prompts", type=int, default=32)
    ap.add_argument("--held-out-prompts", type=int, default=32, help="size of either split")
    ap.add_argument("--held-out-n", type=int, help="samples per scored prompt (default --n)")
    ap.add_argument(
        "--split", choices=("validation", "held-out"), default="validation",
        help="the prompts the runs are scored on: the validation split chooses settings",
    )  # fmt: skip
    ap.add_argument("--configs", default="demo,lr1e-4")
    ap.add_argument(
        "--seeds", default="0",
        help="sampling seeds per config (the demo's --seed): runs that differ only in their "
        "draws, as a TLT run and an SD-off run do",
    )  # fmt: skip
    # One thread: on a shared 2-core machine two intra-op threads mostly wait on each other
    # (scripts/train_policy.py); a held-out pass took 13 min with two, under others' load.
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = [CONFIGS[name] for name in args.configs.split(",")]
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.model)
    args.dataset = build_dataset(
        args.prompts, args.train_prompts, args.held_out_prompts, model_dir=args.model,
        validation_size=args.held_out_prompts,
    )  # fmt: skip
    print(
        f"workload: {args.prompts} prompts x {args.n} samples per step (the demo's), "
        f"{args.steps} steps; scored on the {args.split} split: {args.held_out_prompts} x "
        f"{args.held_out_n or args.n}",
        flush=True,
    )
    t0 = time.perf_counter()
    before = held_out(args.model, args)
    print(
        f"  {args.split} before: reward {before.mean:.3f}, guesses {before.guess_share:.2f} "
        f"(reward {before.guess_mean:.3f}; worked {before.worked_mean:.3f}), "
        f"mean length {before.mean_length:.0f} ({time.perf_counter() - t0:.0f}s)",
        flush=True,
    )
    rows = []
    finals: dict[str, list[tuple[int, list[float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in configs:
            for seed in (int(x) for x in args.seeds.split(",")):
                steps, last = run(cfg, args, Path(tmp), tok, seed)
                slope, se = reward_trend(steps)
                after = held_out(last, args)
                name = cfg.name if seed == 0 else f"{cfg.name}-s{seed}"
                print(
                    f"  {name} {args.split} after: reward {after.mean:.3f}, guesses "
                    f"{after.guess_share:.2f} (reward {after.guess_mean:.3f}; worked "
                    f"{after.worked_mean:.3f}), mean length {after.mean_length:.0f}",
                    flush=True,
                )
                change = paired(before.rewards, after.rewards, before.prompts)
                rows.append((name, steps, slope, se, after, change))
                finals.setdefault(cfg.name, []).append((seed, after.rewards))
    print_table(rows, finals, before, args.split)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
