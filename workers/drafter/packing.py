"""Sequence packing for drafter training: several samples in one row, no attention across them.

Positions restart at 0 for each sample and the attention mask is block-diagonal causal, so a
packed row computes exactly what each sample would compute alone (tests/drafter prove it).

A sample longer than a row is split into windows (`windows`) that together train every response
position once, each window led by up to `row_len // 4` earlier positions as attention context
(in the loss only where no earlier window trained them). Positions restart at 0 per window too:
the drafter's only position dependence is RoPE, whose attention scores depend on position
differences only, so a window computes what the engine computes at those absolute positions
with the keys before the window left out (the truncated context is the one approximation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tltd_workers.drafter.objective import EagleExample


@dataclass(frozen=True)
class PackedBatch:
    hidden_in: torch.Tensor  # [B, L, H]
    next_ids: torch.Tensor  # [B, L]
    hidden_target: torch.Tensor  # [B, L, H]
    loss_mask: torch.Tensor  # [B, L] bool (False on padding)
    positions: torch.Tensor  # [B, L] restart at 0 per sample
    segments: torch.Tensor  # [B, L] sample index within the row, -1 = padding
    attn_mask: torch.Tensor  # [B, 1, L, L] bool, True = may attend


def pack(examples: Sequence[EagleExample], row_len: int) -> PackedBatch:
    """First-fit pack examples into rows; one longer than row_len goes in as its `windows`."""
    rows: list[list[EagleExample]] = []
    used: list[int] = []
    for ex in (w for e in examples for w in windows(e, row_len)):
        n = ex.next_ids.shape[0]
        for r, u in enumerate(used):
            if u + n <= row_len:
                rows[r].append(ex)
                used[r] += n
                break
        else:
            rows.append([ex])
            used.append(n)
    H = examples[0].hidden_in.shape[-1]
    dtype = examples[0].hidden_in.dtype
    dev = examples[0].hidden_in.device  # the trainer's device: the batch is built there
    B = len(rows)
    out = PackedBatch(
        hidden_in=torch.zeros(B, row_len, H, dtype=dtype, device=dev),
        next_ids=torch.zeros(B, row_len, dtype=torch.int64, device=dev),
        hidden_target=torch.zeros(B, row_len, H, dtype=dtype, device=dev),
        loss_mask=torch.zeros(B, row_len, dtype=torch.bool, device=dev),
        positions=torch.zeros(B, row_len, dtype=torch.int64, device=dev),
        segments=torch.full((B, row_len), -1, dtype=torch.int64, device=dev),
        attn_mask=torch.zeros(B, 1, row_len, row_len, dtype=torch.bool, device=dev),
    )
    for b, row in enumerate(rows):
        start = 0
        for seg, ex in enumerate(row):
            n = ex.next_ids.shape[0]
            sl = slice(start, start + n)
            out.hidden_in[b, sl] = ex.hidden_in
            out.next_ids[b, sl] = ex.next_ids
            out.hidden_target[b, sl] = ex.hidden_target
            out.loss_mask[b, sl] = ex.loss_mask
            out.positions[b, sl] = torch.arange(n, device=dev)
            out.segments[b, sl] = seg
            start += n
    same = out.segments.unsqueeze(-1) == out.segments.unsqueeze(-2)
    causal = torch.ones(row_len, row_len, dtype=torch.bool, device=dev).tril()
    valid = (out.segments >= 0).unsqueeze(-1)
    mask = same & causal & valid
    # Padding rows attend to themselves only, so softmax never sees an all-masked row.
    mask |= torch.eye(row_len, dtype=torch.bool, device=dev)
    out.attn_mask[:, 0] = mask
    return out


def context_len(row_len: int) -> int:
    """Context positions (no loss of their own) in front of each window of a long sample."""
    return row_len // 4


def windows(ex: EagleExample, row_len: int) -> list[EagleExample]:
    """`ex` if it fits in a row; else windows of <= row_len positions that put every loss
    position of `ex` in exactly one window's loss, each window starting up to
    `context_len(row_len)` positions before its first loss position (prompt positions in
    front of the first loss position are dropped beyond that). No loss position: no window."""
    n = ex.next_ids.shape[0]
    if n <= row_len:
        return [ex]
    trained = ex.loss_mask.nonzero()
    if trained.numel() == 0:
        return []
    out = []
    a = int(trained[0])  # first loss position no window has covered yet
    while a < n:
        s = max(0, a - context_len(row_len))
        e = min(n, s + row_len)
        mask = ex.loss_mask[s:e].clone()
        mask[: a - s] = False  # context: trained by the previous window, or prompt
        out.append(EagleExample(ex.hidden_in[s:e], ex.next_ids[s:e], ex.hidden_target[s:e], mask))
        a = e
    return out
