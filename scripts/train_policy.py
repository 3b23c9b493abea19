"""Train (or evaluate) the tiny Qwen2-shaped policy on the count-up task; saves HF format."""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# Runnable as `python scripts/train_policy.py` from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.task.reasoning import (  # noqa: E402
    CARE_LEVELS,
    DIGITS_REVERSED,
    GUESS_RATE,
    LINE_STYLES,
    TASK_STYLE,
    Problem,
    format_prompt,
    generate_problem,
    make_dataset,
    make_problem,
    reward,
)
from examples.task.tokenizer import (  # noqa: E402
    BOS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB,
    VOCAB_SIZE,
    decode,
    encode_answer,
    encode_prompt,
    load_tokenizer,
    save_tokenizer,
)
from examples.task.workload import model_style  # noqa: E402

NEWLINE_ID = VOCAB.index("\n")
SPACE_ID, E_ID = VOCAB.index(" "), VOCAB.index("e")
MAX_NEW_TOKENS = 2048  # the rollout cap of the task's workload (examples/task/workload.py)
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "models" / "tiny-policy"


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 1200
    batch_tokens: int = 4096
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    pool: int = 4096
    # Loss weight of the first token of each answer line, i.e. the continue-or-stop decision
    # (one token per line, easily drowned by the digits); 1.0 is the plain token-mean loss.
    decision_weight: float = 1.0
    # Loss weight of the final "answer: N" line (copying the last total into it).
    final_weight: float = 1.0
    # Loss weight of the digit of each "care N" line: one token in hundreds, easily drowned,
    # and copying it from the prompt is what makes the re-check rate follow the prompt's care.
    care_weight: float = 1.0
    # Care levels (re-check rate in tenths) and guess rate of the reference solutions
    # (examples/task/reasoning.py). A first stage at low care learns the arithmetic on short,
    # cheap sequences (attention over 2k tokens costs several times more per token); the last
    # stage trains on every level.
    max_care: int = max(CARE_LEVELS)
    min_care: int = 0
    guess_rate: float = GUESS_RATE
    # Layout of the reference solutions' lines (examples/task/reasoning.py LINE_STYLES).
    style: str = TASK_STYLE


# Deep and narrow, so that on a CPU a decode step is bound by per-layer overhead and KV-cache
# reads rather than by matmul FLOPs: verifying k+1 tokens then costs little more than one
# token, and a one-layer drafter is ~1/16 of a step, as on a GPU serving a large policy
# (benchmarks/bench_verify_cost.py prints the curve).
LAYERS, HIDDEN, MLP = 16, 128, 384
# Prompt (~35 tokens) + the rollout cap of 2048 new tokens, with room to spare.
MAX_POSITIONS = 2304


def build_model(seed: int) -> torch.nn.Module:
    """A ~3M-parameter Qwen2-shaped causal LM (GQA 4 query / 2 KV heads, untied head)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=MLP,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        # Untied so that lm_head.weight is its own tensor in the checkpoint: drafters that
        # borrow the target's frozen head read it by name.
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def encode_example(tok, problem: Problem) -> tuple[list[int], int]:
    """Token ids of prompt + answer, and the index where the answer starts. An answer longer
    than the positions is cut there (no <eos>): the policy learns to keep re-checking, and so
    runs into max_new_tokens on the samples that re-check that often, as reasoning RL's do."""
    prompt = encode_prompt(tok, format_prompt(problem))
    return (prompt + encode_answer(tok, problem.solution))[:MAX_POSITIONS], len(prompt)


def batches(tok, cfg: TrainConfig, rng: random.Random):
    """Endless token-budget batches: a pool of problems is sorted by length and cut into
    batches of at most `batch_tokens` padded tokens, so short and long answers never share
    a batch (little padding), then the batches are shuffled."""
    care = range(cfg.min_care, cfg.max_care + 1)
    while True:
        examples = [
            encode_example(tok, generate_problem(rng, None, cfg.style, care, cfg.guess_rate))
            for _ in range(cfg.pool)
        ]
        examples.sort(key=lambda e: len(e[0]))
        cut, current = [], []
        for ex in examples:
            # Sorted ascending, so the newest example sets the padded width.
            if current and len(ex[0]) * (len(current) + 1) > cfg.batch_tokens:
                cut.append(current)
                current = []
            current.append(ex)
        if current:
            cut.append(current)
        rng.shuffle(cut)
        for group in cut:
            width = max(len(ids) for ids, _ in group)
            ids = torch.full((len(group), width), PAD_ID, dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.bool)
            final = torch.zeros((len(group), width), dtype=torch.bool)
            for row, (seq, start) in enumerate(group):
                ids[row, : len(seq)] = torch.tensor(seq)
                # Position p predicts token p+1: the loss covers answer tokens (and <eos>).
                mask[row, start - 1 : len(seq) - 1] = True
                # Positions predicting the final "answer: N" line (after its newline), when
                # the answer was not cut.
                if seq[-1] == EOS_ID:
                    last_newline = len(seq) - 1 - seq[::-1].index(NEWLINE_ID)
                    final[row, last_newline : len(seq) - 1] = True
            yield ids, mask, final


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def train(
    cfg: TrainConfig, out: Path, snapshot_every: int = 0, init_from: Path | None = None
) -> dict:
    """Train (from scratch, or on from `init_from`) with AdamW + warmup/cosine; returns a
    summary for the model card."""
    save_tokenizer(out)
    tok = load_tokenizer(out)
    if init_from is None:
        model = build_model(cfg.seed)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(init_from, local_files_only=True)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params:,}", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    data = batches(tok, cfg, random.Random(cfg.seed))
    start, seen, ema = time.time(), 0, None
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        ids, mask, final = next(data)
        # Right padding only, so the plain causal mask is correct for every real token.
        logits = model(input_ids=ids).logits[:, :-1]
        targets = ids[:, 1:]
        sel = mask[:, :-1]
        if cfg.decision_weight == cfg.final_weight == cfg.care_weight == 1.0:
            loss = F.cross_entropy(logits[sel], targets[sel])
        else:
            per_token = F.cross_entropy(logits[sel], targets[sel], reduction="none")
            decision = (ids[:, :-1][sel] == NEWLINE_ID).float()
            weight = 1.0 + (cfg.decision_weight - 1.0) * decision
            weight = weight * (1.0 + (cfg.final_weight - 1.0) * final[:, :-1][sel].float())
            # Positions after "care " (a space after an "e" occurs nowhere else in answers).
            inputs = ids[:, :-1]
            after_care = (inputs == SPACE_ID) & F.pad(inputs[:, :-1] == E_ID, (1, 0))
            weight = weight * (1.0 + (cfg.care_weight - 1.0) * after_care[sel].float())
            loss = (per_token * weight).sum() / weight.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        seen += int(mask.sum())
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if snapshot_every and step and step % snapshot_every == 0:
            # Intermediate checkpoints only help pick --steps; the schedule is not shortened.
            model.save_pretrained(out / "snapshots" / f"step-{step}")
        if step % 25 == 0 or step == cfg.steps - 1:
            elapsed = time.time() - start
            print(
                f"step {step:5d} loss {ema:.4f} lr {lr_at(step, cfg):.2e} "
                f"answer-tokens {seen:,} elapsed {elapsed:.0f}s",
                flush=True,
            )
    elapsed = time.time() - start
    model.eval()
    model.generation_config.do_sample = True
    model.generation_config.temperature = 1.0
    model.generation_config.top_k = 0
    model.generation_config.top_p = 1.0
    model.generation_config.max_new_tokens = MAX_NEW_TOKENS
    model.save_pretrained(out, safe_serialization=True)
    return {
        "params": n_params,
        "train_seconds": round(elapsed, 1),
        "final_loss_ema": round(ema or 0.0, 4),
        "answer_tokens_seen": seen,
        "config": cfg.__dict__,
        "init_from": None if init_from is None else str(init_from),
        "previous": _previous_summary(init_from),
    }


def _previous_summary(init_from: Path | None) -> dict | None:
    path = None if init_from is None else init_from / "training_summary.json"
    return json.loads(path.read_text()) if path is not None and path.exists() else None


@torch.no_grad()
def generate(
    model,
    tok,
    problems: list[Problem],
    *,
    sample: bool,
    max_new_tokens: int,
    seed: int,
    batch_size: int = 64,
) -> list[list[int]]:
    """Completions (token ids, <eos> included when produced) with transformers' generate."""
    torch.manual_seed(seed)
    outputs: list[list[int]] = []
    for i in range(0, len(problems), batch_size):
        prompts = [encode_prompt(tok, format_prompt(p)) for p in problems[i : i + batch_size]]
        width = max(map(len, prompts))
        # Left padding, so every prompt ends where generation starts.
        ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        kwargs = (
            {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
            if sample
            else {"do_sample": False}
        )
        gen = model.generate(
            input_ids=ids,
            attention_mask=attn,
            max_new_tokens=max_new_tokens,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
            **kwargs,
        )
        for row in gen[:, width:].tolist():
            outputs.append(row[: row.index(EOS_ID) + 1] if EOS_ID in row else row)
    return outputs


def percentile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def evaluate(path: Path, n: int, max_new_tokens: int, seed: int, style: str = TASK_STYLE) -> dict:
    """Greedy and T=1 sampled accuracy per problem size, and the completion-length tail."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = load_tokenizer(path)
    sets = {
        "small (1-3 steps)": [
            p for k in (1, 2, 3) for p in make_dataset(n // 3, seed + k, k, style=style)
        ],
        "natural (long-tailed sizes)": make_dataset(n, seed + 100, style=style),
        "large (16-24 steps)": [
            p
            for k in (16, 20, 24)
            for p in make_dataset(max(2, n // 15), seed + 200 + k, k, style=style)
        ],
    }
    report: dict = {"max_new_tokens": max_new_tokens}
    for name, problems in sets.items():
        for mode in ("greedy", "sampled"):
            t0 = time.time()
            outs = generate(
                model,
                tok,
                problems,
                sample=mode == "sampled",
                max_new_tokens=max_new_tokens,
                seed=seed,
            )
            lengths = [len(o) for o in outs]
            acc = sum(reward(p, decode(tok, o)) for p, o in zip(problems, outs, strict=True))
            row = {
                "n": len(problems),
                "accuracy": round(acc / len(problems), 3),
                "p50": percentile(lengths, 0.5),
                "p90": percentile(lengths, 0.9),
                "p99": percentile(lengths, 0.99),
                "max": max(lengths),
                "hit_limit": round(sum(EOS_ID not in o for o in outs) / len(outs), 3),
                "seconds": round(time.time() - t0, 1),
            }
            report[f"{name} / {mode}"] = row
            print(
                f"{name:28s} {mode:8s} " + " ".join(f"{k}={v}" for k, v in row.items()), flush=True
            )
    example = make_dataset(1, seed + 999, 3, style=style)[0]
    out = generate(model, tok, [example], sample=False, max_new_tokens=128, seed=seed)[0]
    print("example prompt:", repr(format_prompt(example)), "greedy:", repr(decode(tok, out)))
    return report


MODEL_CARD = """# tiny-policy

A {params:,}-parameter Qwen2-shaped causal LM (hidden 128, 16 layers, 4 query heads / 2 KV heads
(GQA), MLP 384, untied lm_head, vocab {vocab} characters, RoPE, max {positions} positions), trained
from scratch by `scripts/train_policy.py` on the project's synthetic count-up task
(`examples/task/reasoning.py`). Weights: fp32 safetensors, {size_mb:.1f} MB.

Deep and narrow on purpose: on a CPU its decode step is bound by per-layer overhead and KV-cache
reads rather than by matmul FLOPs, so verifying k+1 tokens costs little more than one and a
one-layer EAGLE drafter costs ~1/16 of a step, as on a GPU serving a large policy
(`benchmarks/bench_verify_cost.py`). It is deliberately **only partly good** at the task, so
that RL has something to improve.

## Task and format

Add `step` to `start`, `count` times; the answer is the final total. {style_note} Prompt
`<bos>{prompt}\\n`; the answer restates the care, then is one fixed-width line per step
(total, step, new total, steps left) and a line restating the care; then, with probability
care / 10 each time, `check` and the whole computation again, then the result, ended by
`<eos>`:

```
{example}
```

The care line sits right before the re-check decision it sets: a policy of this size trained
without it re-checked at the same rate (~0.65) whatever the prompt's care, because it never
learnt to look the digit up in the prompt thousands of tokens back.

{guess_share} of the reference answers are a bare guess (`{guess}` at once), which a policy
this small mostly gets wrong: RL learns to stop guessing. The count (1-24) follows a
truncated power law (exponent 1.25); re-checks make lengths long-tailed *per sample* (the same
prompt: 60 tokens once, 1,500 the next). Re-checks are not capped: reference answers at care 7
have p50 ~141, p90 ~774, p99 ~2,730 characters (= tokens), and 1.9% are longer than the
rollouts' 2,048-token cap (training cuts them at the {positions} positions, without `<eos>`), so
the policy runs into the cap on a few percent of samples, as reasoning policies do. Reward: 1.0
when the completion ends with exactly one `answer: N` line and N is right, else 0.0.

## Loading

`transformers.AutoModelForCausalLM.from_pretrained(path)`; the tokenizer with
`examples.task.load_tokenizer(path)` (a `tokenizers.Tokenizer`) or
`transformers.PreTrainedTokenizerFast.from_pretrained(path)`. Not `AutoTokenizer`:
transformers 5 maps model_type `qwen2` to its `Qwen2Tokenizer`, which drops spaces and
newlines from this character vocabulary. Ids: `<pad>` 0, `<bos>` 1, `<eos>` 2 (stop token),
`<unk>` 3. Prompts are `<bos>` + prompt text.

## Training

`python scripts/train_policy.py` (deterministic for a seed and thread count): AdamW (betas
0.9/0.95, weight decay 0.1, linear warmup then cosine to 10% of the peak lr), batches of at
most {batch_tokens} padded tokens bucketed by length, loss on answer tokens only, fresh problems
from the task distribution with care drawn uniformly from the stage's range, 1 thread
on a shared 2-core CPU (torch {torch}). Stages, first to last (a later stage starts from the
previous one's weights with `--init-from`; tokens are answer tokens seen, loss the final EMA
of the training loss):

| stage | seed | steps | warmup | peak lr | care | tokens | loss | min |
|---|---|---|---|---|---|---|---|---|
{stages}

## Evaluation

`python scripts/train_policy.py --eval` (transformers `generate`, max_new_tokens {mnt}, care 7;
"sampled" is temperature 1, no top-k/top-p; lengths are generated tokens including `<eos>`;
hit_limit is the fraction that never produced `<eos>`). Greedy decoding takes the likelier
branch at every decision (guess or work it out, re-check or answer) and the likeliest digit, so
its rows show what the policy computes without the guesses, re-checks and slips that sampling
draws (a policy that re-checks with probability above one half at every decision re-checks
forever and runs into the cap); RL rollouts sample at temperature 1.

| set | mode | n | accuracy | p50 | p90 | p99 | max | hit_limit |
|---|---|---|---|---|---|---|---|---|
{rows}
"""


def _steps(stage: dict) -> str:
    """A stage's steps; "200 of 300" for one stopped before the end of its lr schedule (the
    summary of its snapshot records `stopped_at_step`)."""
    steps = stage["config"]["steps"]
    stopped = stage.get("stopped_at_step")
    return f"{stopped} of {steps}" if stopped else str(steps)


def write_card(out: Path, summary: dict, report: dict) -> None:
    rows = []
    for key, row in report.items():
        if not isinstance(row, dict):
            continue
        name, mode = key.split(" / ")
        rows.append(
            f"| {name} | {mode} | {row['n']} | {row['accuracy']:.2f} | {row['p50']} | "
            f"{row['p90']} | {row['p99']} | {row['max']} | {row['hit_limit']:.2f} |"
        )
    stages, stage = [], summary
    while stage is not None:
        c = stage["config"]
        stages.append(
            f"| {{n}} | {c['seed']} | {_steps(stage)} | {c.get('warmup', 100)} | {c['lr']} | "
            f"{c.get('min_care', 0)}-{c.get('max_care', '-')} | "
            f"{stage['answer_tokens_seen']:,} | {stage['final_loss_ema']} | "
            f"{stage['train_seconds'] / 60:.1f} |"
        )
        stage = stage.get("previous")
    stages = [row.format(n=i + 1) for i, row in enumerate(reversed(stages))]
    cfg = summary["config"]
    style = cfg.get("style", "sum")
    example = make_problem(17, 38, 3, style=style, checks=1, care=7)
    little = style in DIGITS_REVERSED
    text = MODEL_CARD.format(
        style_note=(
            f"Style `{style}`: every number, the prompt's and the answer's, is written "
            "least-significant digit first (131 is `1310`)."
            if little
            else f"Style `{style}`: numbers are written the usual way."
        ),
        prompt=example.prompt.rstrip("\n"),
        example=example.solution,
        guess=make_problem(17, 38, 3, style=style, guess=True).solution,
        guess_share=f"A share {cfg.get('guess_rate', GUESS_RATE):.2f}",
        params=summary["params"],
        vocab=VOCAB_SIZE,
        positions=MAX_POSITIONS,
        batch_tokens=cfg["batch_tokens"],
        torch=torch.__version__.split("+")[0],
        mnt=report["max_new_tokens"],
        size_mb=(out / "model.safetensors").stat().st_size / 1e6,
        rows="\n".join(rows),
        stages="\n".join(stages),
    )
    (out / "README.md").write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--batch-tokens", type=int, default=TrainConfig.batch_tokens)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--warmup", type=int, default=TrainConfig.warmup)
    parser.add_argument("--decision-weight", type=float, default=TrainConfig.decision_weight)
    parser.add_argument("--final-weight", type=float, default=TrainConfig.final_weight)
    parser.add_argument("--care-weight", type=float, default=TrainConfig.care_weight)
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--max-care", type=int, default=TrainConfig.max_care)
    parser.add_argument("--min-care", type=int, default=TrainConfig.min_care)
    parser.add_argument("--guess-rate", type=float, default=TrainConfig.guess_rate)
    parser.add_argument(
        "--style", choices=sorted(LINE_STYLES), default=TrainConfig.style,
        help="line layout of the reference solutions (reasoning.py LINE_STYLES)",
    )  # fmt: skip
    # One thread: on the shared 2-core machine two intra-op threads mostly wait on each other
    # (a step took ~8 s with two threads vs ~1 s with one here, under varying load), and the
    # float summation order, hence the exact checkpoint, depends on the thread count.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--snapshot-every", type=int, default=0)
    parser.add_argument("--init-from", type=Path, help="continue training a saved model")
    parser.add_argument("--eval", action="store_true", help="only evaluate the model in --out")
    parser.add_argument("--no-eval", action="store_true", help="train without the final eval")
    parser.add_argument("--eval-n", type=int, default=150)
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.init_from is not None and args.init_from.resolve() == args.out.resolve():
        parser.error("--init-from must differ from --out (--out is emptied before training)")

    summary_path = args.out / "training_summary.json"
    if not args.eval:
        cfg = TrainConfig(
            seed=args.seed,
            steps=args.steps,
            batch_tokens=args.batch_tokens,
            lr=args.lr,
            warmup=args.warmup,
            decision_weight=args.decision_weight,
            final_weight=args.final_weight,
            care_weight=args.care_weight,
            max_care=args.max_care,
            min_care=args.min_care,
            guess_rate=args.guess_rate,
            style=args.style,
        )
        if args.out.exists():
            shutil.rmtree(args.out)
        summary = train(cfg, args.out, args.snapshot_every, args.init_from)
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")
        if args.no_eval:
            return
    summary = json.loads(summary_path.read_text())
    style = model_style(args.out)  # the style the model was trained on
    report = evaluate(args.out, args.eval_n, args.max_new_tokens, seed=1234, style=style)
    (args.out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    write_card(args.out, summary, report)


if __name__ == "__main__":
    main()
