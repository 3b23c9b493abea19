"""The lossless accept rule of speculative decoding, for a batch of draft chains.

The rule is *coupled* to plain decoding: at every verified position it computes the token
plain decoding would emit there (the argmax for greedy rows; for sampled rows the draw from
the target's processed distribution with the uniform plain decoding uses at that token
position), keeps a row's drafts while they equal those tokens, and emits the token at the
first position where they differ (or after the last draft). By induction over positions,
every emitted token is the token plain decoding emits given the same prefix and uniform, so
a seeded sample is the same token for token with speculation on or off, whatever the drafts,
and its law is the target's. Drafts only decide how many of those tokens one forward pass
verifies.

A draft x chosen without looking at the position's uniform is kept with probability p(x),
as under the standard rule with a deterministic proposal (Leviathan et al. 2023). A draft
drawn from a drafter's q by inverse CDF with the *same* uniform (EAGLE's sampled drafts) is
kept when both draws land on the same token: with probability sum over tokens of the
overlap of their CDF intervals, which is 1 when q = p and falls as the two laws part.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tltd_workers.engine.sampling import sample_from


def plain_tokens(p: Tensor, greedy: Tensor, u_sample: Tensor, target_argmax: Tensor) -> Tensor:
    """The token plain decoding emits at each position: p [B, K+1, V], greedy [B], u_sample
    [B, K+1], target_argmax [B, K+1] (the argmax of the logprobs, as plain decoding takes it)
    -> [B, K+1]."""
    b, width, v = p.shape
    drawn = sample_from(p.reshape(b * width, v), u_sample.reshape(b * width)).view(b, width)
    return torch.where(greedy[:, None], target_argmax, drawn)


def accept_drafts(
    p: Tensor,
    draft: Tensor,
    draft_len: Tensor,
    greedy: Tensor,
    u_sample: Tensor,
    target_argmax: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Decide how many drafted tokens each row keeps and the token that follows them.

    p         [B, K+1, V] the target's processed distribution at each verified position
              (position i predicts the token after draft[:, :i]); for greedy rows only its
              argmax matters (the argmax of the logits).
    draft     [B, K] drafted tokens (padded past draft_len), draft_len [B] in [0, K].
    greedy    [B] bool; u_sample [B, K+1] the uniform plain decoding draws each position's
              token with.
    target_argmax [B, K+1] the greedy token at each position taken from the logprobs, as plain
              decoding takes it (exp can round two near-equal logprobs to one probability and
              p.argmax then picks the lower id); default p.argmax.
    Returns (n_accepted [B], next_token [B]): the row emits draft[:n] + [next_token], which is
    what plain decoding emits (module docstring).
    """
    b, k = draft.shape
    argmax = p.argmax(dim=-1) if target_argmax is None else target_argmax
    plain = plain_tokens(p, greedy, u_sample, argmax)
    if k == 0:  # nothing drafted: plain decoding at the only position
        return torch.zeros(b, dtype=torch.long, device=draft.device), plain[:, 0]
    ok = draft == plain[:, :k]
    ok &= torch.arange(k, device=draft.device)[None, :] < draft_len[:, None]
    n = ok.long().cumprod(dim=-1).sum(dim=-1)  # leading accepted drafts, [B]
    return n, plain[torch.arange(b, device=draft.device), n]
