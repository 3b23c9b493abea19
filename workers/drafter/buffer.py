"""A byte-bounded buffer of finished rollout samples for drafter training.

Each item holds the token ids of one sample (prompt + response), where the response starts, the
policy version that produced it, the rollout step it came from, and optionally the target's
last-layer hidden states. Hidden states cost 2*H bytes per token in bf16 (512 B for the project's
H=256 policy, 8 KiB for a 4096-wide model), so caching them is cheap for small models and
prohibitive for large ones: `keep_hidden` decides per buffer, and items without hidden states
are recomputed with one target prefill on the idle device before training (prefill is cheap).

Drop policy when full: the item of the oldest policy version goes first (it trains the drafter
towards a policy that no longer exists), ties broken by insertion order (oldest first).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TrainItem:
    token_ids: torch.Tensor  # int64 [T]: prompt + response
    response_start: int  # first response position; the loss only covers response tokens
    policy_version: int
    step: int  # rollout step (trainer iteration) the sample came from
    hidden: torch.Tensor | None = None  # [T, H] target last-layer hidden states, or None
    item_id: int = field(default=-1)

    @property
    def nbytes(self) -> int:
        size = self.token_ids.numel() * self.token_ids.element_size()
        if self.hidden is not None:
            size += self.hidden.numel() * self.hidden.element_size()
        return size

    @property
    def response_tokens(self) -> int:
        return int(self.token_ids.numel()) - self.response_start


class TrainingBuffer:
    """Bounded in bytes; items get increasing ids so a trainer can record exactly what it used."""

    def __init__(
        self,
        capacity_bytes: int,
        keep_hidden: bool = True,
        hidden_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be > 0")
        self.capacity_bytes = capacity_bytes
        self.keep_hidden = keep_hidden
        self.hidden_dtype = hidden_dtype
        self._items: dict[int, TrainItem] = {}
        self._bytes = 0
        self._ids = itertools.count()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def add(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        response_start: int,
        policy_version: int,
        step: int,
        hidden: torch.Tensor | None = None,
    ) -> TrainItem | None:
        """Add one finished sample; returns the stored item, or None if it has no response."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64).flatten()
        if not 0 <= response_start < ids.numel():
            return None
        if hidden is not None and self.keep_hidden:
            if hidden.shape[0] != ids.numel():
                raise ValueError(f"hidden has {hidden.shape[0]} rows for {ids.numel()} tokens")
            hidden = hidden.detach().to(self.hidden_dtype).contiguous()
        else:
            hidden = None
        item = TrainItem(ids, response_start, policy_version, step, hidden, next(self._ids))
        if item.nbytes > self.capacity_bytes:
            self.dropped += 1
            return None
        self._items[item.item_id] = item
        self._bytes += item.nbytes
        self._evict()
        return item if item.item_id in self._items else None

    def add_output(
        self,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        step: int,
        policy_version: int,
        hidden: torch.Tensor | None = None,
    ) -> TrainItem | None:
        """Add one finished rollout sample as the engine returns it.

        The engine's hidden states cover every token it was fed: len(prompt) + len(output) - 1
        rows (the last token is never fed). The last token is dropped to match: no drafter
        position could be trained on it anyway, since its target feature does not exist.
        """
        ids = [*prompt_ids, *output_ids]
        if hidden is not None:
            if hidden.shape[0] != len(ids) - 1:
                raise ValueError(f"hidden has {hidden.shape[0]} rows for {len(ids)} tokens")
            ids = ids[:-1]
        return self.add(ids, len(prompt_ids), policy_version, step, hidden)

    def _evict(self) -> None:
        while self._bytes > self.capacity_bytes:
            victim = min(self._items.values(), key=lambda i: (i.policy_version, i.item_id))
            del self._items[victim.item_id]
            self._bytes -= victim.nbytes
            self.dropped += 1

    def get(self, item_id: int) -> TrainItem | None:
        return self._items.get(item_id)

    def items(self) -> list[TrainItem]:
        return list(self._items.values())

    def epoch_order(self, current_step: int, seed: int, prev_share: float = 0.5) -> list[int]:
        """A deterministic training order mixing the previous step's and the current step's data.

        TLT's "one-step offset": while step s is still rolling out, the finished samples of step s
        are biased to the short ones (long ones are still decoding), so they are mixed with step
        s-1's samples, whose long tails are complete. `prev_share` of the order (interleaved) comes
        from older steps, the rest from the current step; each item appears exactly once.
        """
        rng = random.Random(seed)
        current = [i for i, it in self._items.items() if it.step >= current_step]
        older = [i for i, it in self._items.items() if it.step < current_step]
        rng.shuffle(current)
        rng.shuffle(older)
        return list(_interleave(older, current, prev_share))


def _interleave(older: list[int], current: list[int], prev_share: float) -> Iterator[int]:
    """Merge two lists so that about `prev_share` of any prefix comes from `older`."""
    i = j = 0
    while i < len(older) or j < len(current):
        # Take from `older` while its share of what was emitted so far is below prev_share.
        if j >= len(current) or (i < len(older) and i < prev_share * (i + j + 1)):
            yield older[i]
            i += 1
        else:
            yield current[j]
            j += 1
