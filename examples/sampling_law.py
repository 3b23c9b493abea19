"""The sampling law on a run's own rollouts: is every token the daemon sampled drawn from the
policy that sampled it?

For each output token x_t, given its prefix, the randomized probability integral transform

    u_t = P(token < x_t) + v_t * P(x_t),   v_t ~ U(0, 1) independent,

is uniform on (0, 1), and the u_t of a sequence are independent, exactly when every token was
drawn from the conditional law P (Diebold, Gunther and Tay 1998; the tokens are ordered by
id). P is the policy's softmax at temperature 1 (the demo samples without top-k or top-p),
computed here by the trainer's own transformers model with the weights that sampled the step.
A Kolmogorov-Smirnov test of the pooled u_t against U(0, 1) then checks the whole sequence law,
not only a token's marginal: speculative decoding that accepted a draft too often, verified it
against stale weights, or resampled a rejection from the wrong residual would move it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LawCheck:
    tokens: int
    statistic: float  # KS distance between the u_t's empirical CDF and U(0, 1)
    pvalue: float


def ks_uniform(values: Sequence[float]) -> LawCheck:
    """Kolmogorov-Smirnov test of `values` against U(0, 1)."""
    from scipy.stats import kstest

    if not values:
        return LawCheck(0, float("nan"), float("nan"))
    res = kstest(list(values), "uniform")
    return LawCheck(len(values), float(res.statistic), float(res.pvalue))


@torch.inference_mode()
def pit_values(
    model,
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    generator: torch.Generator,
    pad_id: int = 0,
    max_batch_tokens: int = 8192,
) -> list[float]:
    """The randomized PIT of every output token of (prompt ids, output ids) pairs under a
    transformers causal LM at temperature 1."""
    out: list[float] = []
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
            probs = torch.softmax(logits[r, len(p) - 1 : len(p) - 1 + len(o)], dim=-1)
            x = torch.tensor(list(o))[:, None]
            below = (torch.cumsum(probs, dim=-1) - probs).gather(-1, x)[:, 0]
            at = probs.gather(-1, x)[:, 0]
            v = torch.rand(len(o), generator=generator, dtype=torch.float64)
            out.extend((below + v * at).clamp(0.0, 1.0).tolist())
    return out
