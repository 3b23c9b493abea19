"""What the engine reads of the settings a rollout worker is sent: the worker hands it the
daemon's `tltd.contract.rollout_messages.EngineSpec`, which the engine does not import."""

from __future__ import annotations

from typing import Protocol


class EngineSpec(Protocol):
    """The settings `EngineConfig.from_spec` reads."""

    max_batch: int
    max_seq_len: int
    spec_mode: str
    gate: str
    batch_threshold: int
    draft_lengths: tuple[int, ...]
    drafter: str
    device: str
    seed: int
    prefix_cache_bytes: int
    cost_budget_s: float
