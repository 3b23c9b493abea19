"""Prefix cache: a finished keyed sample's KV kept between requests (a session's turns), so a
later request with the same key prefills only the tokens past what was kept.

A sample of a request with a `cache_key` (n = 1) leaves its KV here when it finishes: the
positions whose KV was computed (the last sampled token usually has none yet), copied out of
its slot. A later request with the same key takes the entry back: the positions its prompt
shares with the kept tokens (at most all but its last token, whose logits draw the first new
token) are copied into its leader slot and the prefill runs over the rest only. Causal
attention makes the KV of a position a function of the tokens up to it and of the weights, so
this is the same computation as a full prefill up to floating-point order.

A session's first prompt can be shared: a group of sessions opened on one prompt sends each
first turn with the prompt's `share_key`. The first of them to be prefilled leaves the prompt's
KV here under that key at once (not taken back, as a session's own entry is); the others
restore it and prefill the last prompt token only. The engine holds a prompt back one step
when another with its share key is prefilled in the same step (`sharing`).

Bounded by bytes, least recently kept dropped first. New weights drop everything (`new_weights`):
KV computed by other weights is never reused, and a sample whose KV mixes two versions (a
policy loaded while it ran) is not kept. With an EAGLE drafter set the engine needs every
prompt position's hidden state: an entry then keeps those of its positions too (the sample's
`history`, which a drafter makes it keep), the restored ones join the prefill's, and the drafter
reads the whole prompt again (one layer, not the target's). An entry without them is not
reused then. Requests that return hidden states or prompt logprobs prefill in full.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tltd_workers.engine.kv_cache import KVCache
from tltd_workers.engine.rows import Group, Seq


@dataclass
class PrefixEntry:
    """The KV of `tokens` (position by position), as [layers, kv_heads, len, head_dim], and the
    target's hidden state at each of them [len, H] when they were kept (None: not)."""

    tokens: tuple[int, ...]
    k: Tensor
    v: Tensor
    hidden: Tensor | None = None

    @property
    def nbytes(self) -> int:
        extra = self.hidden.nbytes if self.hidden is not None else 0
        return self.k.nbytes + self.v.nbytes + extra


@dataclass
class PrefixStats:
    """Cumulative counters (keyed prompts only for hits and misses; prefilled tokens count
    every prompt position a prefill forward ran over)."""

    hits: int = 0  # keyed prompts that reused kept KV
    misses: int = 0  # keyed prompts that prefilled in full (nothing kept, evicted, mismatch)
    reused_tokens: int = 0  # prompt positions restored instead of computed
    prefilled_tokens: int = 0  # prompt positions computed by prefill forwards
    kept: int = 0  # entries stored
    evicted: int = 0  # entries dropped for the byte budget (or new weights)

    def summary(self, held_bytes: int, entries: int) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "reused_tokens": self.reused_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "kept": self.kept,
            "evicted": self.evicted,
            "held_bytes": held_bytes,
            "entries": entries,
        }


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """Kept KV per cache key, within `budget_bytes` (0: nothing is kept)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = max(0, budget_bytes)
        self.entries: OrderedDict[str, PrefixEntry] = OrderedDict()
        self.held_bytes = 0
        self.epoch = 0  # bumped by new weights: a group prefilled in another epoch is not kept
        self.stats = PrefixStats()

    def summary(self) -> dict[str, int]:
        return self.stats.summary(self.held_bytes, len(self.entries))

    def new_weights(self) -> None:
        """Other weights are loaded: nothing kept so far may be reused."""
        self.stats.evicted += len(self.entries)
        self.entries.clear()
        self.held_bytes = 0
        self.epoch += 1

    def admit(
        self, groups: Sequence[Group], b0: int, cache: KVCache, hidden: bool
    ) -> tuple[list[int], list[Tensor | None]]:
        """Before the groups' prefill into leader slots b0 + i: per group the positions whose
        KV was restored into its slot (0: a full prefill) and, with `hidden` (the prefill must
        give every prompt position's hidden state), the restored positions' hidden states."""
        reused: list[int] = []
        restored: list[Tensor | None] = []
        for i, g in enumerate(groups):
            g.kv_epoch = self.epoch
            m, h = 0, None
            if g.cache_key and self._may_reuse(g):
                m, h = self._restore(g, cache, b0 + i, hidden)
                if not m:
                    m, h = self._restore_shared(g, cache, b0 + i, hidden)
                if m:
                    self.stats.hits += 1
                    self.stats.reused_tokens += m
                else:
                    self.stats.misses += 1
            reused.append(m)
            restored.append(h)
            g.reused = m
            self.stats.prefilled_tokens += len(g.context) - m
        return reused, restored

    def sharing(self, share_key: str) -> bool:
        """Whether a prompt with this share key would reuse KV that a prompt prefilled now
        keeps (nothing kept under the key yet, and the cache is on)."""
        return self.budget_bytes > 0 and share_key not in self.entries

    def share(
        self, groups: Sequence[Group], b0: int, cache: KVCache, hidden: Tensor | None
    ) -> None:
        """After the groups' prefill into leader slots b0 + i: keep each shared first prompt's
        KV (and its hidden states [group, position, H], when the prefill gave them) under its
        share key, unless kept already."""
        for i, g in enumerate(groups):
            if not g.share_key or not self._may_reuse(g) or g.share_key in self.entries:
                continue
            n = len(g.context)
            k, v = cache.k[:, b0 + i, :, :n].clone(), cache.v[:, b0 + i, :, :n].clone()
            h = hidden[i, :n].clone() if hidden is not None else None
            self._put(g.share_key, PrefixEntry(tuple(g.context), k, v, h))

    @staticmethod
    def _may_reuse(g: Group) -> bool:
        return not g.return_hidden and g.sampling.prompt_logprobs is None and g.restore is None

    def _restore(
        self, g: Group, cache: KVCache, slot: int, hidden: bool
    ) -> tuple[int, Tensor | None]:
        """Copy the shared positions of the key's entry into `slot`: how many (0: none), and
        their hidden states with `hidden` (an entry without them is left kept, unused)."""
        entry = self.entries.get(g.cache_key)
        if entry is None or (hidden and entry.hidden is None):
            return 0, None
        del self.entries[g.cache_key]
        self.held_bytes -= entry.nbytes
        return _copy(entry, g.context, cache, slot, hidden)

    def _restore_shared(
        self, g: Group, cache: KVCache, slot: int, hidden: bool
    ) -> tuple[int, Tensor | None]:
        """Copy the shared positions of the share key's entry into `slot`, leaving it kept for
        the others: how many (0: none), and their hidden states with `hidden`."""
        entry = self.entries.get(g.share_key) if g.share_key else None
        if entry is None or (hidden and entry.hidden is None):
            return 0, None
        self.entries.move_to_end(g.share_key)
        return _copy(entry, g.context, cache, slot, hidden)

    def keep(self, s: Seq, cache: KVCache, slot: int) -> None:
        """A finished sample leaves the KV of its computed positions here, when it is a keyed
        sample alone in its group (a session turn) and every position came from the weights
        loaded now."""
        g = s.group
        # Another epoch: new weights were loaded after its prefill, so its KV mixes two sets.
        if not g.cache_key or g.sampling.n != 1 or g.kv_epoch != self.epoch:
            return
        seq = g.prompt + s.tokens  # a resumed sample's tokens include those it resumed from
        n = min(cache.lens[slot], len(seq))
        if n <= 0:
            return
        entry = PrefixEntry(
            tuple(seq[:n]),
            cache.k[:, slot, :, :n].clone(),
            cache.v[:, slot, :, :n].clone(),
            _kept_hidden(s, n),
        )
        self._put(g.cache_key, entry)

    def _put(self, key: str, entry: PrefixEntry) -> None:
        """Keep `entry` under `key` (replacing what was), dropping the least recent entries
        for the budget."""
        old = self.entries.pop(key, None)
        if old is not None:
            self.held_bytes -= old.nbytes
        if entry.nbytes > self.budget_bytes:
            return
        while self.entries and self.held_bytes + entry.nbytes > self.budget_bytes:
            _, dropped = self.entries.popitem(last=False)
            self.held_bytes -= dropped.nbytes
            self.stats.evicted += 1
        self.entries[key] = entry
        self.held_bytes += entry.nbytes
        self.stats.kept += 1


def _kept_hidden(s: Seq, n: int) -> Tensor | None:
    """The hidden states of a finished sample's first n positions, where it kept them all (its
    `history`: the prompt's at prefill, then one a position fed); None otherwise."""
    if not s.history:
        return None
    h = torch.cat(s.history)
    return h[:n].clone() if h.shape[0] >= n else None


def _copy(
    entry: PrefixEntry, context: Sequence[int], cache: KVCache, slot: int, hidden: bool
) -> tuple[int, Tensor | None]:
    """Copy the positions `context` shares with the entry (at most all but its last token,
    whose logits draw the first new token) into `slot`: how many, and with `hidden` their
    hidden states."""
    m = min(shared_prefix(entry.tokens, context), len(context) - 1)
    if m <= 0:
        return 0, None
    cache.k[:, slot, :, :m] = entry.k[:, :, :m]
    cache.v[:, slot, :, :m] = entry.v[:, :, :m]
    return m, entry.hidden[:m] if hidden and entry.hidden is not None else None
