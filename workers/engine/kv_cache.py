"""Preallocated KV cache: per layer K and V of shape slots x kv_heads x (max_len + 1) x head_dim."""

from __future__ import annotations

import torch


class KVCache:
    """Fixed-size KV storage for `slots` sequences of up to `max_len` tokens.

    The engine keeps the running sequences compacted in slots [0, B), so attention reads the
    view `k[layer, :B, :, :kv_len]` instead of gathering rows. The layout is head-major, as
    attention takes it: each head's positions are contiguous. With positions outside the heads
    (slot x position x head) the CPU attention kernel took 2.6x as long over the transposed
    view (batch 64, 600 positions, one thread: a plain decode step 125 -> 79 ms; verify passes
    cost about the same in both). `lens[s]` is the number of valid positions of slot s;
    everything past it is stale and masked out, which makes rolling back rejected draft tokens
    a matter of shortening the slot. Column `max_len` is a trash column: padded (not real)
    positions of a ragged batch write there and nothing ever reads it.
    """

    def __init__(
        self,
        n_layers: int,
        slots: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (n_layers, slots, n_kv_heads, max_len + 1, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.slots = slots
        self.max_len = max_len
        self.trash = max_len
        self.lens = [0] * slots

    def move(self, src: int, dst: int) -> None:
        """Move a sequence to another slot (compaction after a sequence leaves)."""
        n = self.lens[src]
        if src != dst:
            self.k[:, dst, :, :n] = self.k[:, src, :, :n]
            self.v[:, dst, :, :n] = self.v[:, src, :, :n]
            self.lens[dst] = n
        self.lens[src] = 0

    def fork(self, src: int, dst_start: int, dst_end: int) -> None:
        """Copy slot src's prefix into slots [dst_start, dst_end) (n samples, one prefill)."""
        n = self.lens[src]
        if dst_end <= dst_start:
            return
        self.k[:, dst_start:dst_end, :, :n] = self.k[:, src : src + 1, :, :n]
        self.v[:, dst_start:dst_end, :, :n] = self.v[:, src : src + 1, :, :n]
        for s in range(dst_start, dst_end):
            self.lens[s] = n

    def reset(self) -> None:
        self.lens = [0] * self.slots
