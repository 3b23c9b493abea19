"""Drift: frozen version-0 drafter vs the online drafter trained only in rollouts' idle windows.

Policy: the project's small policy `models/tiny-policy` (count-up task, `examples/task/`).
Policy updates: U real fine-tuning steps of that policy (each `--policy-steps` AdamW steps of
supervised next-token training on answer tokens, after a 10-step warm-up) towards a shifted data
mix of the task: fresh problems from `examples.task.reasoning.generate_problem`, a share
min(1, u / ramp) of them written in another answer layout (`LINE_STYLES`; default "marks": the
same fixed-width lines with other separators, `0017*0038>0055.0002` for `0017+0038=0055,0002`;
"spaced" also widens the lines) and the rest in the task's own layout; updates after the ramp
keep fine-tuning on the new layout alone. The policy's greedy answers really move: they switch
layout within a few updates (the table prints the share of rollouts in the new layout) and its
hidden states keep changing with its weights.

Version 0 is the drafter fitted on the initial policy (`models/tiny-policy-eagle`, made by
`scripts/fit_drafter.py`); the frozen drafter keeps it, the online drafter starts from it. At
every RL step u:

1. rollout: the current policy decodes greedily (fresh long-tailed task prompts, `<eos>` or
   `--max-new-tokens`) on D emulated devices (shards run one after another here, each timed);
   the step lasts as long as the slowest shard and every other device is idle for the
   difference;
2. measure: mean accepted length at k (greedy k-chains, the engine's SD rule at temperature 0,
   `tltd_workers.drafter.versions.mean_accepted_length`) of (a) the frozen drafter and (b) the
   online drafter, on this step's fresh rollouts, which neither drafter has seen;
3. harvest: the online drafter trains (`tltd_workers.drafter.trainer.Trainer`, the buffer's
   one-step-offset order) for exactly the idle device-seconds of this step, stopping mid-step
   when the window closes. Only data that exists during the window is in the buffer: the
   finished shards of this step plus everything from earlier steps; the slowest shard's samples
   (the long tail, still decoding during the window) are added after it, for the next step;
4. policy update (the trainer's step), loaded into the engine in place; both drafters read the
   current policy's embeddings and lm_head, as in SGLang.

Prints one row per step, the idle device-seconds harvested, and the final ratio online / frozen
(TLT reports +42%; the issue asks for >= +30%).

    python benchmarks/bench_drift.py --threads 1 [--updates 10] [--devices 4] [--style marks]
        [--ramp 5] [--quick]

Measured (benchmarks/RESULTS.md): with "spaced" and a ramp over all 10 updates the policy only
switched layout at update 8 and lost coherence (loss ~0.58, rollouts running to the token
limit), so both drafters fell to ~1.1-1.2 and the final ratio was 1.11x; "marks" is a shift the
policy learns within a few updates while staying coherent, which is the drift TLT targets.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from examples.task.reasoning import (  # noqa: E402
    DIGITS_REVERSED,
    LINE_STYLES,
    format_prompt,
    generate_problem,
    size_at_quantile,
)
from examples.task.tokenizer import (  # noqa: E402
    EOS_ID,
    PAD_ID,
    decode,
    encode_answer,
    encode_prompt,
    load_tokenizer,
)
from examples.task.workload import model_style  # noqa: E402
from tltd.domain import SamplingParams  # noqa: E402
from tltd_workers.drafter.buffer import TrainingBuffer  # noqa: E402
from tltd_workers.drafter.trainer import Stop, Trainer, TrainerConfig  # noqa: E402
from tltd_workers.drafter.versions import HeldOut, mean_accepted_length  # noqa: E402
from tltd_workers.engine.datatypes import EngineConfig, Request  # noqa: E402
from tltd_workers.engine.eagle import EagleDrafter  # noqa: E402
from tltd_workers.engine.engine import Engine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "models" / "tiny-policy"
DEFAULT_DRAFTER = ROOT / "models" / "tiny-policy-eagle"


def layout_re(style: str) -> re.Pattern[str]:
    """Matches a line start written in `style` (its first separator between two numbers)."""
    fmt = LINE_STYLES[style]
    sep = fmt[len("{total:04d}") : fmt.index("{step:04d}")]
    return re.compile(r"\d{4}" + re.escape(sep) + r"\d{4}")


def finetune(
    model,
    opt,
    sched,
    tok,
    rng: random.Random,
    steps: int,
    share_new: float,
    batch: int,
    style: str,
    base: str,
) -> float:
    """`steps` AdamW steps of next-token cross-entropy on answer tokens of fresh task problems,
    a share `share_new` of them in the new layout (`style`), the rest in the policy's own
    (`base`); batches of similar lengths (less padding). The problems are all worked out: a bare
    guess is written the same in every layout, so it carries none of the drift, and fine-tuning
    on guesses would teach a policy that guesses on half its answers to guess greedily."""
    model.train()
    losses = []
    pool = []
    for _ in range(steps * batch):
        layout = style if rng.random() < share_new else base
        p = generate_problem(rng, style=layout, guess_rate=0.0)
        prompt = encode_prompt(tok, format_prompt(p))
        pool.append((prompt + encode_answer(tok, p.solution), len(prompt)))
    pool.sort(key=lambda e: len(e[0]))
    groups = [pool[i : i + batch] for i in range(0, len(pool), batch)]
    rng.shuffle(groups)
    for group in groups:
        width = max(len(ids) for ids, _ in group)
        ids = torch.full((len(group), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.bool)
        for r, (seq, start) in enumerate(group):
            ids[r, : len(seq)] = torch.tensor(seq)
            mask[r, start - 1 : len(seq) - 1] = True  # position p predicts token p + 1
        logits = model(input_ids=ids).logits[:, :-1]
        loss = F.cross_entropy(logits[mask[:, :-1]], ids[:, 1:][mask[:, :-1]])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    model.eval()
    return sum(losses) / max(len(losses), 1)


def step_prompts(tok, n: int, seed: int, style: str) -> list[list[int]]:
    """n fresh task prompts whose sizes are the size distribution's quantiles (every step has
    the long tail), in random order; seeds differ from the fine-tuning data's."""
    rng = random.Random(seed)
    sizes = [size_at_quantile((i + 0.5) / n) for i in range(n)]
    rng.shuffle(sizes)
    problems = [generate_problem(rng, k, style=style) for k in sizes]
    return [encode_prompt(tok, format_prompt(p)) for p in problems]


def rollout(
    engine: Engine,
    tok,
    prompts: list[list[int]],
    devices: int,
    max_new: int,
    new_layout_re: re.Pattern[str],
) -> tuple[list[list[HeldOut]], list[float], float]:
    """Greedy rollouts, `devices` shards run one after another and timed; returns the samples
    per shard, each shard's seconds, and the share of samples in the new layout."""
    shards: list[list[HeldOut]] = []
    times = []
    per = len(prompts) // devices
    new_layout = 0
    for d in range(devices):
        reqs = [
            Request(
                f"d{d}-{i}",
                p,
                SamplingParams(
                    n=1, temperature=0.0, max_new_tokens=max_new, stop_token_ids=(EOS_ID,)
                ),
                return_hidden_states=True,
            )
            for i, p in enumerate(prompts[d * per : (d + 1) * per])
        ]
        t0 = time.perf_counter()
        outs = engine.generate(reqs)
        times.append(time.perf_counter() - t0)
        by_id = {r.request_id: r for r in reqs}
        shard = []
        for o in outs:
            prompt = list(by_id[o.request_id].prompt_ids)
            shard.append(HeldOut(torch.tensor(prompt + o.token_ids), len(prompt), o.hidden_states))
            new_layout += bool(new_layout_re.search(decode(tok, o.token_ids)))
        shards.append(shard)
    return shards, times, new_layout / max(1, sum(len(s) for s in shards))


def add(buf: TrainingBuffer, samples: list[HeldOut], step: int, version: int) -> None:
    for s in samples:
        buf.add_output(
            s.token_ids[: s.response_start].tolist(),
            s.token_ids[s.response_start :].tolist(),
            step,
            version,
            s.hidden,
        )


def train_for(trainer: Trainer, seconds: float) -> int:
    """Optimizer steps applied within `seconds` (a step running at the deadline is stopped)."""
    deadline = time.perf_counter() + seconds
    steps = 0
    while time.perf_counter() < deadline:
        res = trainer.train_step(lambda: time.perf_counter() >= deadline)
        if isinstance(res, Stop):
            break
        steps += 1
    return steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER, help="version 0")
    ap.add_argument("--updates", type=int, default=10)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--per-device", type=int, default=8)
    ap.add_argument(
        "--style",
        choices=sorted(set(LINE_STYLES) - {"sum", "reversed"}),
        help="answer layout of the shifted data mix (default: 'marks' in the policy's digit order)",
    )
    ap.add_argument(
        "--ramp",
        type=int,
        default=5,
        help="updates over which the new layout's share rises to 1 (0: all)",
    )
    ap.add_argument("--policy-steps", type=int, default=20, help="AdamW steps per update")
    ap.add_argument("--policy-batch", type=int, default=8)
    ap.add_argument("--policy-lr", type=float, default=1e-3)
    ap.add_argument("--drafter-lr", type=float, default=1e-3)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 updates, tiny sizes")
    args = ap.parse_args(argv)
    base = model_style(args.model)  # the policy's own style: its prompts, the mix's rest
    reversed_order = base in DIGITS_REVERSED
    args.style = args.style or ("reversed-marks" if reversed_order else "marks")
    if (args.style in DIGITS_REVERSED) != reversed_order:
        ap.error(f"--style: {args.style!r} writes numbers in another order than the policy's")
    if args.quick:
        args.updates, args.devices, args.per_device = 2, 2, 2
        args.policy_steps, args.max_new_tokens, args.ramp = 2, 48, 2
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(args.model)
    rng = random.Random(args.seed)
    policy = AutoModelForCausalLM.from_pretrained(
        args.model, local_files_only=True, dtype=torch.float32
    )
    opt = torch.optim.AdamW(
        policy.parameters(), lr=args.policy_lr, betas=(0.9, 0.95), weight_decay=0.0
    )
    # A short warm-up: full-size first Adam steps would knock the trained policy over.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 10))
    n = args.devices * args.per_device
    ramp = args.ramp or args.updates
    new_re = layout_re(args.style)
    engine = Engine(
        str(args.model),
        EngineConfig(spec_mode="off", max_batch=max(n, 8), max_seq_len=64 + args.max_new_tokens),
    )
    target = engine.model
    frozen = EagleDrafter.from_pretrained(args.drafter, target)
    online_drafter = EagleDrafter.from_pretrained(args.drafter, target)
    buf = TrainingBuffer(64 << 20)
    online = Trainer(
        online_drafter,
        buf,
        TrainerConfig(
            items_per_micro=4,
            micro_per_step=2,
            lr=args.drafter_lr,
            warmup_steps=5,
            row_len=640,
            seed=args.seed,
        ),
    )

    load = os.getloadavg()[0]
    print(
        f"drift: {args.model.name} through {args.updates} updates of {args.policy_steps} "
        f"AdamW steps (lr {args.policy_lr:g}, {args.policy_batch} problems each) towards the "
        f"'{args.style}' answer layout (share min(1, u/{ramp})); "
        f"version 0 = {args.drafter.name}; "
        f"{args.devices} emulated devices x {args.per_device} greedy task rollouts per step; "
        f"k={args.k}; threads {args.threads}; load average {load:.1f}"
    )
    print(
        "| step | share new (data) | new layout (rollouts) | policy loss | frozen | online "
        "| online/frozen | step s | idle dev-s | idle % | drafter steps | buffer tokens |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    total_idle = total_dev = 0.0
    ratio = acc_f = acc_o = 0.0
    ploss = float("nan")
    for u in range(args.updates + 1):
        share = min(1.0, u / ramp)
        prompts = step_prompts(tok, n, seed=10_000 * (args.seed + 1) + u, style=base)
        shards, times, new_frac = rollout(
            engine, tok, prompts, args.devices, args.max_new_tokens, new_re
        )
        fresh = [s for shard in shards for s in shard]
        online.drafter.eval()
        acc_f = mean_accepted_length(frozen, fresh, args.k)
        acc_o = mean_accepted_length(online.drafter, fresh, args.k)
        online.drafter.train()
        ratio = acc_o / acc_f
        wall = max(times)
        idle = sum(wall - t for t in times)
        total_idle += idle
        total_dev += wall * args.devices
        slowest = max(range(args.devices), key=lambda d: times[d])
        # One-step offset: during the idle window the slowest shard (the long tail) is still
        # decoding, so only the other shards' samples of this step are there to train on.
        for d in range(args.devices):
            if d != slowest:
                add(buf, shards[d], u + 1, u)
        tokens_before = sum(it.response_tokens for it in buf.items())
        steps = train_for(online, idle)
        add(buf, shards[slowest], u + 1, u)
        print(
            f"| {u} | {share:.2f} | {new_frac:.2f} | {ploss:.3f} | {acc_f:.2f} | {acc_o:.2f} "
            f"| {ratio:.2f}x | {wall:.2f} | {idle:.2f} | {100 * idle / (wall * args.devices):.0f}"
            f" | {steps} | {tokens_before} |",
            flush=True,
        )
        if u < args.updates:
            ploss = finetune(
                policy,
                opt,
                sched,
                tok,
                rng,
                args.policy_steps,
                min(1.0, (u + 1) / ramp),
                args.policy_batch,
                args.style,
                base,
            )
            engine.load_policy(
                {k: v.detach() for k, v in policy.state_dict().items()}, version=u + 1
            )
    print(
        f"idle device time harvested for drafter training: {total_idle:.1f} s of "
        f"{total_dev:.1f} device-s ({100 * total_idle / max(total_dev, 1e-9):.1f}%); "
        f"{online.step} drafter optimizer steps"
    )
    print(
        f"final accepted length: frozen {acc_f:.2f}, online {acc_o:.2f}, online / frozen "
        f"{ratio:.2f}x ({'PASS' if ratio >= 1.3 else 'FAIL'}: >= 1.30 required); "
        f"runtime {time.perf_counter() - t_start:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
