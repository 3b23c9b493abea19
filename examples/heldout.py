"""Held-out reward of a policy: a split's prompts sampled with fixed seeds, by the engine
in-process with speculative decoding off or by a daemon job (the demo's speculates with a frozen
drafter: the accept rule gives a seeded sample the same tokens with SD on or off), so that two
policies' scores pair up sample by sample; their difference's standard error is taken over
prompts, whose samples are not independent of each other."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from examples.task import decode, load_tokenizer, reward
from examples.task.dataset import HELD_OUT_SAMPLING_SEED, Item
from examples.task.reasoning import ANSWER_MARKER
from examples.task.workload import STOP_TOKEN_ID
from tltd.domain import SamplingParams
from tltd_workers.engine.engine import Engine, EngineConfig, Request


@dataclass(frozen=True)
class HeldOutScore:
    """Per sample, in (prompt, sample) order: reward, answer length (tokens), whether the
    answer was a bare guess (the answer line first, nothing worked out), and its prompt."""

    rewards: list[float]
    lengths: list[int]
    guesses: list[bool]
    prompts: list[int] = field(default_factory=list)  # the prompt index of each sample

    @property
    def mean(self) -> float:
        return sum(self.rewards) / max(1, len(self.rewards))

    @property
    def guess_share(self) -> float:
        return sum(self.guesses) / max(1, len(self.guesses))

    @property
    def mean_length(self) -> float:
        return sum(self.lengths) / max(1, len(self.lengths))

    @property
    def worked_mean(self) -> float:
        """Reward of the answers that were worked out (not bare guesses): what unlearning a
        guess gains, less what a guess scores."""
        worked = [r for r, g in zip(self.rewards, self.guesses, strict=True) if not g]
        return sum(worked) / max(1, len(worked))

    @property
    def guess_mean(self) -> float:
        """Reward of the bare guesses."""
        guessed = [r for r, g in zip(self.rewards, self.guesses, strict=True) if g]
        return sum(guessed) / max(1, len(guessed))


def held_out_score(
    checkpoint: Path, items: list[Item], n: int, max_new_tokens: int,
    seed: int = HELD_OUT_SAMPLING_SEED,
) -> HeldOutScore:  # fmt: skip
    """Sample `n` answers per held-out prompt at temperature 1 with `seed` in-process, and
    score them."""
    engine = Engine(checkpoint, EngineConfig(max_batch=64, max_seq_len=2304, spec_mode="off"))
    params = SamplingParams(
        n=n, temperature=1.0, max_new_tokens=max_new_tokens,
        stop_token_ids=(STOP_TOKEN_ID,), seed=seed,
    )  # fmt: skip
    outs = engine.generate(
        Request(f"h{i}", ids, params, prompt_index=i) for i, (_, ids) in enumerate(items)
    )
    return score_samples(items, outs, load_tokenizer(checkpoint))


def score_samples(items: list[Item], samples, tok) -> HeldOutScore:
    """Score samples (anything with prompt_index, sample_index, token_ids: the engine's or the
    daemon's) in (prompt, sample) order, so that two scores pair up by position."""
    outs = sorted(samples, key=lambda s: (s.prompt_index, s.sample_index))
    texts = [decode(tok, s.token_ids) for s in outs]
    return HeldOutScore(
        rewards=[reward(items[s.prompt_index][0], t) for s, t in zip(outs, texts, strict=True)],
        lengths=[len(s.token_ids) for s in outs],
        guesses=[t.lstrip().startswith(ANSWER_MARKER) for t in texts],
        prompts=[s.prompt_index for s in outs],
    )


def paired(
    before: Sequence[float], after: Sequence[float], clusters: Sequence[int] | None = None
) -> tuple[float, float]:
    """Mean of the per-sample differences after - before, and its standard error over
    `clusters` (each sample's prompt): the differences are averaged per prompt and the standard
    error is that of the per-prompt means, since samples of one prompt are correlated (a
    prompt the policy learnt moves all of its samples). Without clusters, every sample is its
    own cluster. With equal cluster sizes the mean is the per-sample mean."""
    diffs = [a - b for a, b in zip(after, before, strict=True)]
    keys = list(range(len(diffs))) if clusters is None else list(clusters)
    if len(keys) != len(diffs):
        raise ValueError(f"clusters: {len(keys)} labels for {len(diffs)} samples")
    groups: dict[int, list[float]] = {}
    for key, d in zip(keys, diffs, strict=True):
        groups.setdefault(key, []).append(d)
    means = [sum(g) / len(g) for g in groups.values()]
    if not means:
        return math.nan, math.nan
    mean = sum(means) / len(means)
    var = sum((m - mean) ** 2 for m in means) / max(1, len(means) - 1)
    return mean, math.sqrt(var / len(means))
