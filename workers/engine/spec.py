"""The lossless accept/reject rule of speculative decoding, for a batch of draft chains."""

from __future__ import annotations

import torch
from torch import Tensor

from tltd_workers.engine.sampling import sample_from


def accept_drafts(
    p: Tensor,
    draft: Tensor,
    draft_len: Tensor,
    q: Tensor | None,
    greedy: Tensor,
    u_accept: Tensor,
    u_sample: Tensor,
    target_argmax: Tensor | None = None,
    q_rows: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Decide how many drafted tokens each row keeps and draw the token that follows them.

    p         [B, K+1, V] the target's processed distribution at each verified position
              (position i predicts the token after draft[:, :i]); for greedy rows only its
              argmax matters (the argmax of the logits).
    draft     [B, K] drafted tokens (padded past draft_len), draft_len [B] in [0, K].
    q         [B, Kq, V] (Kq <= K) the drafter's processed distribution each draft was sampled
              from, or None when proposals are deterministic (q = one-hot of the draft, e.g.
              n-grams).
    q_rows    [B] bool: the rows whose drafts were sampled from q (their draft_len <= Kq); the
              others are deterministic. None: every row, when q is given.
    greedy    [B] bool, u_accept [B, K], u_sample [B, K+1]: uniforms in [0, 1).
    target_argmax [B, K+1] the greedy token at each position taken from the logprobs, as plain
              decoding takes it (exp can round two near-equal logprobs to one probability and
              p.argmax then picks the lower id); default p.argmax.
    Returns (n_accepted [B], next_token [B]): the row emits draft[:n] + [next_token].

    Math (Leviathan et al. 2023; Chen et al. 2023). Draft x ~ q is kept with probability
    min(1, p(x) / q(x)), i.e. when u * q(x) < p(x). The first rejected position draws from the
    residual r = normalize(max(0, p - q)); if every draft is kept, a bonus token is drawn from
    p at the position after the last draft. Then P(emit y) = q(y) min(1, p(y)/q(y)) +
    (1 - sum_x min(q(x), p(x))) r(y) = min(q(y), p(y)) + max(0, p(y) - q(y)) = p(y): each
    emitted token is distributed exactly as the target would sample it.
    With q one-hot at x: accept with probability p(x); residual max(0, p - onehot(x)) is p
    with x removed, renormalised — the same formula.
    Greedy rows keep drafts while they equal the target argmax and emit the argmax at the
    first mismatch (or after the last draft), which reproduces greedy decoding token for token.
    """
    b, k = draft.shape
    if k == 0:  # nothing drafted: plain sampling from p at the only position
        top = p[:, 0].argmax(dim=-1) if target_argmax is None else target_argmax[:, 0]
        nxt = torch.where(greedy, top, sample_from(p[:, 0], u_sample[:, 0]))
        return torch.zeros(b, dtype=torch.long, device=draft.device), nxt
    p_drafted = p[:, :k].gather(-1, draft[..., None])[..., 0]  # p_i(x_i), [B, K]
    use_q = None  # [B, 1] bool: rows proposed from q
    q_drafted: Tensor | float = 1.0
    if q is not None:
        kq = q.shape[1]
        use_q = (q_rows if q_rows is not None else torch.ones_like(greedy))[:, None]
        q_drafted = torch.ones_like(p_drafted)
        q_drafted[:, :kq] = torch.where(use_q, q.gather(-1, draft[:, :kq, None])[..., 0], 1.0)
    argmax = p.argmax(dim=-1) if target_argmax is None else target_argmax  # [B, K+1]
    ok = torch.where(greedy[:, None], draft == argmax[:, :k], u_accept * q_drafted < p_drafted)
    ok &= torch.arange(k, device=draft.device)[None, :] < draft_len[:, None]
    n = ok.long().cumprod(dim=-1).sum(dim=-1)  # leading accepted drafts, [B]
    sampled = _residual_draw(p, draft, draft_len, n, q, use_q, u_sample)
    rows = torch.arange(b, device=draft.device)
    nxt = torch.where(greedy, argmax[rows, n], sampled)
    return n, nxt


def _residual_draw(
    p: Tensor,
    draft: Tensor,
    draft_len: Tensor,
    n: Tensor,
    q: Tensor | None,
    use_q: Tensor | None,
    u_sample: Tensor,
) -> Tensor:
    """The sampled token after each row's n kept drafts [B]: drawn from the residual
    normalize(max(0, p - q)) at position n where draft n was rejected, from p (the bonus
    token) where every draft was kept (accept_drafts states why this is p's law)."""
    b, k = draft.shape
    rows = torch.arange(b, device=draft.device)
    # Distribution of the next token: p at position n, minus q there if draft n was rejected.
    p_n = p[rows, n]
    rejected = n < draft_len
    at = n.clamp(max=k - 1)  # only read where rejected, i.e. where n < draft_len <= K
    q_n = torch.zeros_like(p_n)
    q_n[rows, draft[rows, at]] = 1.0  # deterministic proposals: one-hot at the draft
    if q is not None and use_q is not None:
        q_n = torch.where(use_q, q[rows, at.clamp(max=q.shape[1] - 1)], q_n)
    residual = torch.where(rejected[:, None], (p_n - q_n).clamp(min=0.0), p_n)
    # p == q up to rounding makes the residual vanish; such a rejection has probability ~0,
    # and p itself is the right fallback.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p_n, residual)
    return sample_from(residual, u_sample[rows, n])
