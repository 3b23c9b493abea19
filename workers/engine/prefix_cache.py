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
policy loaded while it ran) is not kept. Requests that need the prompt's hidden states (an
EAGLE drafter set, returned hidden states, prompt logprobs) prefill in full.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from tltd_workers.engine.kv_cache import KVCache
from tltd_workers.engine.rows import Group, Seq


@dataclass
class PrefixEntry:
    """The KV of `tokens` (position by position), as [layers, kv_heads, len, head_dim]."""

    tokens: tuple[int, ...]
    k: Tensor
    v: Tensor

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


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

    def admit(self, groups: Sequence[Group], b0: int, cache: KVCache, hidden: bool) -> list[int]:
        """Before the groups' prefill into leader slots b0 + i: per group the positions whose
        KV was restored into its slot (0: a full prefill). `hidden`: the prefill must return
        the prompts' hidden states, so none reuses."""
        reused: list[int] = []
        for i, g in enumerate(groups):
            g.kv_epoch = self.epoch
            m = 0
            if g.cache_key and not hidden and self._may_reuse(g):
                m = self._restore(g, cache, b0 + i) or self._restore_shared(g, cache, b0 + i)
                if m:
                    self.stats.hits += 1
                    self.stats.reused_tokens += m
                else:
                    self.stats.misses += 1
            reused.append(m)
            g.reused = m
            self.stats.prefilled_tokens += len(g.context) - m
        return reused

    def sharing(self, share_key: str) -> bool:
        """Whether a prompt with this share key would reuse KV that a prompt prefilled now
        keeps (nothing kept under the key yet, and the cache is on)."""
        return self.budget_bytes > 0 and share_key not in self.entries

    def share(self, groups: Sequence[Group], b0: int, cache: KVCache, hidden: bool) -> None:
        """After the groups' prefill into leader slots b0 + i: keep each shared first prompt's
        KV under its share key, unless kept already."""
        for i, g in enumerate(groups):
            if not g.share_key or hidden or not self._may_reuse(g) or g.share_key in self.entries:
                continue
            n = len(g.context)
            k, v = cache.k[:, b0 + i, :, :n].clone(), cache.v[:, b0 + i, :, :n].clone()
            self._put(g.share_key, PrefixEntry(tuple(g.context), k, v))

    @staticmethod
    def _may_reuse(g: Group) -> bool:
        return not g.return_hidden and g.sampling.prompt_logprobs is None and g.restore is None

    def _restore(self, g: Group, cache: KVCache, slot: int) -> int:
        """Copy the shared positions of the key's entry into `slot`; how many (0: none)."""
        entry = self.entries.pop(g.cache_key, None)
        if entry is None:
            return 0
        self.held_bytes -= entry.nbytes
        return _copy(entry, g.context, cache, slot)

    def _restore_shared(self, g: Group, cache: KVCache, slot: int) -> int:
        """Copy the shared positions of the share key's entry into `slot`, leaving it kept for
        the others; how many (0: none)."""
        entry = self.entries.get(g.share_key) if g.share_key else None
        if entry is None:
            return 0
        self.entries.move_to_end(g.share_key)
        return _copy(entry, g.context, cache, slot)

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
            tuple(seq[:n]), cache.k[:, slot, :, :n].clone(), cache.v[:, slot, :, :n].clone()
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


def _copy(entry: PrefixEntry, context: Sequence[int], cache: KVCache, slot: int) -> int:
    """Copy the positions `context` shares with the entry (at most all but its last token,
    whose logits draw the first new token) into `slot`; how many."""
    m = min(shared_prefix(entry.tokens, context), len(context) - 1)
    if m <= 0:
        return 0
    cache.k[:, slot, :, :m] = entry.k[:, :, :m]
    cache.v[:, slot, :, :m] = entry.v[:, :, :m]
    return m
