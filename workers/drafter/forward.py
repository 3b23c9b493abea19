"""Drafter training forward (explicit mask + positions), target prefill, and chain acceptance.

Training on packed rows runs the engine's `EagleDrafter.forward` with a block-diagonal mask and
positions that restart per sample; tests/drafter prove a packed row equals each sample alone and
equals the engine's cached inference path, so what is trained is what decodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tltd_workers.engine.eagle import EagleDrafter
from tltd_workers.engine.transformer import Batch, CausalLM


def drafter_features(
    drafter: EagleDrafter, hidden: Tensor, next_ids: Tensor, positions: Tensor, attn_mask: Tensor
) -> Tensor:
    """hidden [B, L, H] (h_t), next_ids [B, L] (x_{t+1}) -> predicted h_{t+1} [B, L, H].

    `positions` [B, L] are the RoPE positions, `attn_mask` [B, 1, L, L] (True = may attend):
    the engine's `EagleDrafter.forward` training path with an explicit mask.
    """
    return drafter(hidden, next_ids, positions, attn_mask)


@torch.inference_mode()
def _prefill(target: CausalLM, seqs: Sequence[Tensor]) -> list[Tensor]:
    p = next(target.parameters())
    lens = [int(s.numel()) for s in seqs]
    width = max(lens)
    cache = target.new_cache(len(seqs), width)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long, device=p.device)
    for i, s in enumerate(seqs):
        tokens[i, : lens[i]] = s.to(p.device)
    batch = Batch.make([0] * len(seqs), lens, width, 0, cache.trash, p.device)
    # last_only: the vocabulary projection of every position would be wasted work here.
    _, h = target(tokens, cache, batch, last_only=True, return_hidden=True)
    assert h is not None
    return [h[i, : lens[i]] for i in range(len(seqs))]


def _chunked_prefill(target: CausalLM, seq: Tensor, chunk: int, stop) -> Tensor | None:
    """One sequence, `chunk` tokens per forward against its KV cache; None if `stop()`."""
    p = next(target.parameters())
    T = int(seq.numel())
    cache = target.new_cache(1, T)
    tokens = seq.to(p.device)[None]
    parts = []
    for a in range(0, T, chunk):
        if stop():
            return None
        w = min(chunk, T - a)
        batch = Batch.make([a], None, w, 0, cache.trash, p.device)
        with torch.inference_mode():
            _, h = target(tokens[:, a : a + w], cache, batch, last_only=True, return_hidden=True)
        cache.lens[0] = a + w
        assert h is not None
        parts.append(h[0].clone())
    return torch.cat(parts)


def target_hidden(
    target: CausalLM, seqs: Sequence[Tensor], chunk: int = 0, stop=None
) -> list[Tensor]:
    """The target's final-norm hidden states [T_i, H] of each sequence.

    This is the `keep_hidden=False` path: the buffer stores token ids only and the idle device
    recomputes the features right before training on them. chunk=0: one batched prefill of all
    sequences; chunk > 0: per sequence, `chunk` tokens per forward with `stop()` checked in
    between (raises InterruptedError), so a preemption never waits for a whole long prefill.
    """
    if chunk <= 0:
        # clone() outside inference mode: the result must be usable as a saved autograd input.
        return [h.clone() for h in _prefill(target, seqs)]
    out = []
    for s in seqs:
        h = _chunked_prefill(target, s, chunk, stop or (lambda: False))
        if h is None:
            raise InterruptedError("prefill stopped")
        out.append(h)
    return out


@torch.no_grad()
def _chain_mask(true_pos: Tensor, starts: Tensor, depth: int) -> Tensor:
    """Attention mask of a chain walk's row [true pairs; chain depths 1..depth per start]: a
    true entry sees the true prefix; a chain entry sees the true prefix up to its start and
    its own chain's entries up to its depth."""
    n, s_count, dev = int(true_pos.numel()), int(starts.numel()), true_pos.device
    # Key/query metadata: start index of each entry (true part: its own position).
    owner = torch.cat([true_pos] + [starts] * depth)
    level = torch.cat(
        [torch.zeros(n, dtype=torch.long, device=dev)]
        + [torch.full((s_count,), d + 1, device=dev) for d in range(depth)]
    )
    is_true = level == 0
    q_owner, k_owner = owner[:, None], owner[None, :]
    return (is_true[None, :] & (k_owner <= q_owner)) | (
        ~is_true[:, None]
        & ~is_true[None, :]
        & (k_owner == q_owner)
        & (level[None, :] <= level[:, None])
    )


def chain_accepted_lengths(
    drafter: EagleDrafter, hidden: Tensor, token_ids: Tensor, response_start: int, k: int
) -> Tensor:
    """Tokens gained per speculative step if the drafter greedily chains k drafts from each
    response position of one held-out sample, verified against the sample's own tokens.

    hidden [N, H] holds the target features h_0..h_{N-1} (N <= T: rollout output may lack the
    last one), token_ids [T]. Start s (s >= response_start - 1) mirrors one decode step: the
    drafter has read the true pairs (h_t, x_{t+1}) for t <= s, drafts d_1 from its output at s,
    then feeds its own (f_j, d_j) at position s + j for j < k. The step gains 1 (the target's own
    token) plus the number of leading drafts equal to x_{s+1+j}. Returns one value per start.
    All depths are computed in one masked forward per depth: row = [true pairs; chain depth
    2..j for every start], each chain entry seeing the true prefix up to its start and its own
    chain only.
    """
    T = int(token_ids.numel())
    n = min(int(hidden.shape[0]), T - 1)  # true positions with a known next token
    starts = torch.arange(max(response_start - 1, 0), min(n, T - 2))
    s_count = int(starts.numel())
    if s_count == 0 or k < 1:
        return torch.zeros(0)
    dev = hidden.device
    ids = token_ids.to(dev)
    true_h, true_x = hidden[:n], ids[1 : n + 1]
    true_pos = torch.arange(n, device=dev)
    starts = starts.to(dev)
    # Position p of the true part: starts index; chain entry (depth j, start s) at s + j - 1.
    feats = drafter_features(
        drafter,
        true_h[None],
        true_x[None],
        true_pos[None],
        torch.ones(n, n, dtype=torch.bool, device=dev).tril()[None, None],
    )[0]
    last = feats[starts]  # f_1 of every start
    drafts = [drafter.logits(last).argmax(-1)]
    chain_h: list[Tensor] = []
    chain_x: list[Tensor] = []
    for _ in range(2, k + 1):
        chain_h.append(last)
        chain_x.append(drafts[-1])
        depth = len(chain_h)  # chain entries per start so far (depths 2..j)
        L = n + depth * s_count
        h_in = torch.cat([true_h, *chain_h])
        x_in = torch.cat([true_x, *chain_x])
        pos = torch.cat([true_pos] + [starts + d + 1 for d in range(depth)])
        mask = _chain_mask(true_pos, starts, depth)
        out = drafter_features(drafter, h_in[None], x_in[None], pos[None], mask[None, None])[0]
        last = out[L - s_count :]
        drafts.append(drafter.logits(last).argmax(-1))
    d = torch.stack(drafts, dim=1)  # [S, k]: d_j guesses x_{s+1+j}
    tgt_idx = starts[:, None] + 1 + torch.arange(1, k + 1, device=dev)[None, :]
    valid = tgt_idx < T
    target = ids[tgt_idx.clamp(max=T - 1)]
    match = (d == target) & valid
    return 1.0 + match.long().cumprod(dim=1).sum(dim=1).float().cpu()
