"""The sampling law on a run's own rollouts: is every token the daemon sampled drawn from the
policy that sampled it?

Two tests of every output token x_t of every sample, given its prefix, under the policy's
softmax P_t (temperature 1 in the demo, no top-k or top-p), computed by the trainer's own
transformers model with the weights that sampled the step:

- the randomized probability integral transform u_t = P_t(token < x_t) + v_t * P_t(x_t), v_t ~
  U(0, 1) drawn apart (tokens ordered by id), is U(0, 1), and the u_t of a sequence are
  independent, exactly when every token was drawn from P_t (Diebold, Gunther and Tay 1998): a
  Kolmogorov-Smirnov test of the pooled u_t against U(0, 1) looks at the whole law, at every
  position at once;
- the surprise score: log P_t(x_t) has mean -H(P_t) and variance Var_t under P_t, so
  z = sum(log P_t(x_t) + H(P_t)) / sqrt(sum Var_t) is N(0, 1) (a martingale central limit): it
  sees a law too sharp or too flat (drafts accepted too often, a wrong temperature) far sooner
  than the KS test does.

Speculative decoding that accepted a draft too often, verified it against stale weights, or
emitted a wrong token after a rejection moves one or both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class TokenLaw:
    """Per output token: the randomized PIT, and the surprise score's two sums."""

    pit: list[float] = field(default_factory=list)
    surprise: float = 0.0  # sum of log P(x) + H(P)
    variance: float = 0.0  # sum of Var[log P(X)], X ~ P

    def __iadd__(self, other: TokenLaw) -> TokenLaw:
        self.pit += other.pit
        self.surprise += other.surprise
        self.variance += other.variance
        return self


@dataclass(frozen=True)
class LawCheck:
    tokens: int
    ks: float  # KS distance between the u_t's empirical CDF and U(0, 1)
    ks_pvalue: float
    z: float  # the surprise score, N(0, 1) under the law
    z_pvalue: float  # two-sided


def check(law: TokenLaw) -> LawCheck:
    """Both tests of the tokens gathered in `law`."""
    from scipy.stats import kstest

    if not law.pit:
        return LawCheck(0, math.nan, math.nan, math.nan, math.nan)
    res = kstest(law.pit, "uniform")
    z = law.surprise / math.sqrt(law.variance) if law.variance > 0 else 0.0
    return LawCheck(len(law.pit), float(res.statistic), float(res.pvalue), z,
                    math.erfc(abs(z) / math.sqrt(2)))  # fmt: skip


@torch.inference_mode()
def token_law(
    model,
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    generator: torch.Generator,
    pad_id: int = 0,
    max_batch_tokens: int = 8192,
    temperature: float = 1.0,
) -> TokenLaw:
    """Both tests' values for every output token of (prompt ids, output ids) pairs under a
    transformers causal LM's softmax at `temperature`."""
    law = TokenLaw()
    order = sorted(range(len(sequences)), key=lambda i: sum(map(len, sequences[i])))
    batches: list[list[int]] = [[]]
    for i in order:
        width = sum(map(len, sequences[i]))
        if batches[-1] and width * (len(batches[-1]) + 1) > max_batch_tokens:
            batches.append([])
        batches[-1].append(i)
    for batch in batches:
        rows = [sequences[i] for i in batch if len(sequences[i][1])]
        if not rows:
            continue
        width = max(len(p) + len(o) for p, o in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for r, (p, o) in enumerate(rows):
            ids[r, : len(p) + len(o)] = torch.tensor(list(p) + list(o))
            attn[r, : len(p) + len(o)] = 1
        logits = model(input_ids=ids, attention_mask=attn).logits.double()
        for r, (p, o) in enumerate(rows):
            # Position i predicts token i + 1: output token j is predicted at p + j - 1.
            logp = torch.log_softmax(logits[r, len(p) - 1 : len(p) - 1 + len(o)] / temperature, -1)
            probs = logp.exp()
            x = torch.tensor(list(o))[:, None]
            below = (torch.cumsum(probs, dim=-1) - probs).gather(-1, x)[:, 0]
            at = probs.gather(-1, x)[:, 0]
            v = torch.rand(len(o), generator=generator, dtype=torch.float64)
            law.pit += (below + v * at).clamp(0.0, 1.0).tolist()
            plogp = torch.where(probs > 0, probs * logp, torch.zeros_like(probs))
            entropy = -plogp.sum(-1)
            second = torch.where(probs > 0, probs * logp * logp, torch.zeros_like(probs)).sum(-1)
            law.surprise += float((logp.gather(-1, x)[:, 0] + entropy).sum())
            law.variance += float((second - entropy * entropy).clamp(min=0.0).sum())
    return law
