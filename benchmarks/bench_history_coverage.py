"""Where the history drafter can draft: its proposals replayed on a rollout's own samples,
per class of sample length, free of the machine's timing noise.

`bench_spec.py --epochs 2` times the history arm inside the engine, and on a shared CPU its
wall-time ratios move by tens of per cent from run to run. This benchmark asks the question
under them without a clock: how many of a sample's decode steps could take a history draft,
and how much of it would be accepted. It rolls the workload out `--epochs` times with
speculative decoding off (the same prompts, new seeds per epoch, as `bench_spec.py` does), then
replays each epoch's samples through `HistoryDrafter` as the engine feeds it: a prompt's
earlier epochs are loaded first, its samples start together and advance in lockstep, one
decode step each per tick, so the live siblings' text is in the history as far as it has been
decoded. At each step a sample's walk proposes up to `--k` tokens (the engine's history arm
drafts only walks of >= HISTORY_MIN_DRAFT tokens; shorter ones go to EAGLE); the proposal is
compared with the sample's own next tokens (a deterministic draft token is accepted with the
target's probability of it, which is the chance the sampled token equals it, so matching the
sample measures acceptance without bias), and the sample advances by the matched drafts + 1.

Per epoch and per class (the longest 10% of samples, which make a step's tail, and the rest):
the share of decode steps with a history draft, accepted and drafted tokens per such step,
their ratio (the share of verified draft positions that pay), tokens per step, and the
samples' reward (a wrong answer is a sample whose text left its prompt's usual path). Below the
table, per epoch and class: the answers' re-check passes, and how many start as the answer's
first pass did (the task's reference re-checks all do: a re-check that starts elsewhere is new
text, which no suffix structure over earlier text can draft).

    python benchmarks/bench_history_coverage.py [--epochs 2] [--care 4,8] [--min-support 0.25,0.5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.task.reasoning import CHECK_MARKER, reward  # noqa: E402
from examples.task.tokenizer import decode, load_tokenizer  # noqa: E402
from examples.task.workload import (  # noqa: E402
    MAX_NEW_TOKENS,
    MODEL_DIR,
    STOP_TOKEN_ID,
    WORKLOAD_CARE,
    rollout_prompts,
)
from tltd.domain import SamplingParams  # noqa: E402
from tltd_workers.engine.engine import Engine, EngineConfig, Request  # noqa: E402
from tltd_workers.engine.history import DEFAULT_MIN_SUPPORT, HistoryDrafter  # noqa: E402
from tltd_workers.engine.speculation import HISTORY_MIN_DRAFT  # noqa: E402
from tltd_workers.engine.transformer import load_model  # noqa: E402

TAIL_SHARE = 0.10  # the longest samples of an epoch that form its tail


@dataclass
class Tally:
    """One class of samples in one replay."""

    samples: int = 0
    tokens: int = 0
    steps: int = 0
    history_steps: int = 0
    accepted: int = 0
    drafted: int = 0
    rewards: list[float] = field(default_factory=list)


def recheck_starts(text: str) -> tuple[int, int]:
    """An answer's re-check passes, and how many of them start with its first pass's first
    line (as the task's reference answers do: a re-check redoes the computation from the
    prompt). A guess has neither."""
    lines = text.split("\n")
    starts = [lines[i + 1] for i, line in enumerate(lines[:-1]) if line == CHECK_MARKER]
    first = lines[1] if len(lines) > 1 else None
    return len(starts), sum(start == first for start in starts)


def roll_out(
    prompts: list[list[int]], samples: int, epochs: int, seed: int, max_new_tokens: int
) -> list[list[tuple[int, list[int]]]]:
    """Per epoch: (prompt index, token ids) of every sample, speculative decoding off."""
    model = load_model(MODEL_DIR)
    engine = Engine(
        model,
        EngineConfig(
            max_batch=len(prompts) * samples,
            max_seq_len=max(map(len, prompts)) + max_new_tokens + 1,
            spec_mode="off",
        ),
    )
    out = []
    for epoch in range(epochs):
        requests = [
            Request(
                f"e{epoch}-{i}",
                p,
                SamplingParams(
                    n=samples,
                    temperature=1.0,
                    max_new_tokens=max_new_tokens,
                    stop_token_ids=(STOP_TOKEN_ID,),
                    seed=seed + 1_000_003 * epoch + i,
                ),  # fmt: skip
                prompt_index=i,
            )
            for i, p in enumerate(prompts)
        ]
        out.append([(o.prompt_index, list(o.token_ids)) for o in engine.generate(requests)])
    return out


def replay(
    prompts: list[list[int]],
    epochs: list[list[tuple[int, list[int]]]],
    epoch: int,
    k: int,
    min_support: float,
    classify,
) -> dict[str, Tally]:
    """History drafts replayed on `epoch`'s samples (module doc); tallies per class."""
    drafter = HistoryDrafter(min_support=min_support)
    tallies: dict[str, Tally] = defaultdict(Tally)
    by_prompt: dict[int, list[list[int]]] = defaultdict(list)
    for pi, toks in epochs[epoch]:
        by_prompt[pi].append(toks)
    for pi, samples in sorted(by_prompt.items()):
        past = [
            (f"{e}-{j}", toks)
            for e in range(epoch)
            for j, (p, toks) in enumerate(epochs[e])
            if p == pi
        ]
        key = drafter.open(prompts[pi], past)
        answers = [drafter.start(key) for _ in samples]
        pos = [0] * len(samples)
        live = set(range(len(samples)))
        for toks in samples:
            t = tallies[classify(toks)]
            t.samples += 1
            t.tokens += len(toks)
        while live:
            moves = {}
            for j in sorted(live):
                toks = samples[j]
                draft = drafter.propose(key, answers[j], k)
                if len(draft) < min(HISTORY_MIN_DRAFT, k):
                    draft = []
                m = 0
                while m < len(draft) and pos[j] + m < len(toks) and draft[m] == toks[pos[j] + m]:
                    m += 1
                t = tallies[classify(toks)]
                t.steps += 1
                if draft:
                    t.history_steps += 1
                    t.accepted += m
                    t.drafted += len(draft)
                moves[j] = toks[pos[j] : pos[j] + m + 1]
            for j, emitted in moves.items():
                drafter.extend(key, answers[j], emitted)
                pos[j] += len(emitted)
                if pos[j] >= len(samples[j]):
                    live.discard(j)
                    drafter.finish(key, answers[j])
    return tallies


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--care", default=",".join(map(str, WORKLOAD_CARE)))
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--k", type=int, default=16, help="the longest history draft")
    ap.add_argument("--min-support", default=str(DEFAULT_MIN_SUPPORT), help="comma separated")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    care = [int(c) for c in args.care.split(",")]
    work = rollout_prompts(args.prompts, care=care if len(care) > 1 else care[0])
    problems, prompts = [p for p, _ in work], [ids for _, ids in work]
    t0 = time.perf_counter()
    epochs = roll_out(prompts, args.samples, args.epochs, args.seed, args.max_new_tokens)
    tok = load_tokenizer(MODEL_DIR)
    print(
        f"workload: {args.prompts} prompts x {args.samples} samples, care {args.care}, "
        f"temperature 1, {args.epochs} epochs rolled out with SD off in "
        f"{time.perf_counter() - t0:.0f}s; history walks of up to {args.k} tokens, drafted "
        f"when >= {HISTORY_MIN_DRAFT}; tail = the longest {TAIL_SHARE:.0%} of an epoch's samples"
    )
    print(
        "\n| epoch | min support | class | samples | mean length | reward | history share of "
        "steps | accepted / history step | drafted / history step | accepted / drafted "
        "| tokens / step |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rechecks = []
    for epoch in range(args.epochs):
        lengths = sorted(len(t) for _, t in epochs[epoch])
        cut = lengths[int((1 - TAIL_SHARE) * len(lengths))]
        scores = {id(t): reward(problems[p], decode(tok, t)) for p, t in epochs[epoch]}

        def classify(toks: list[int], cut: int = cut) -> str:
            return "tail" if len(toks) >= cut else "rest"

        passes: dict[str, list[int]] = {"rest": [0, 0], "tail": [0, 0]}
        for _, toks in epochs[epoch]:
            n, same = recheck_starts(decode(tok, toks))
            passes[classify(toks)][0] += n
            passes[classify(toks)][1] += same
        rechecks.append(
            f"epoch {epoch + 1}: "
            + ", ".join(
                f"{c} {n} ({same} start as the first pass did)" for c, (n, same) in passes.items()
            )
        )
        for support in (float(x) for x in args.min_support.split(",")):
            tallies = replay(prompts, epochs, epoch, args.k, support, classify)
            for _, toks in epochs[epoch]:
                tallies[classify(toks)].rewards.append(scores[id(toks)])
            total = Tally()
            for t in tallies.values():
                for name in ("samples", "tokens", "steps", "history_steps", "accepted", "drafted"):
                    setattr(total, name, getattr(total, name) + getattr(t, name))
                total.rewards += t.rewards
            for name, t in (("rest", tallies["rest"]), ("tail", tallies["tail"]), ("all", total)):
                hs = max(t.history_steps, 1)
                print(
                    f"| {epoch + 1} | {support:g} | {name} | {t.samples} | "
                    f"{t.tokens / max(t.samples, 1):.0f} | "
                    f"{statistics.fmean(t.rewards) if t.rewards else 0.0:.2f} | "
                    f"{t.history_steps / max(t.steps, 1):.0%} | {t.accepted / hs:.2f} | "
                    f"{t.drafted / hs:.2f} | {t.accepted / max(t.drafted, 1):.0%} | "
                    f"{t.tokens / max(t.steps, 1):.2f} |"
                )
    print("\nre-check passes in the answers, per class:")
    for line in rechecks:
        print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
