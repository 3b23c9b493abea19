"""The drafter training buffer: byte bound, drop policy, one-step-offset order."""

from __future__ import annotations

import pytest
import torch

from tltd_workers.drafter.buffer import TrainingBuffer


def _add(buf: TrainingBuffer, n_tokens: int, version: int, step: int, hidden: int = 0):
    h = torch.zeros(n_tokens, hidden) if hidden else None
    return buf.add(
        list(range(n_tokens)), response_start=2, policy_version=version, step=step, hidden=h
    )


def test_byte_bound_drops_oldest_policy_version_first():
    buf = TrainingBuffer(capacity_bytes=3 * 10 * 8)  # three 10-token items (int64)
    a = _add(buf, 10, version=2, step=0)
    b = _add(buf, 10, version=1, step=1)  # older policy, inserted later
    c = _add(buf, 10, version=2, step=1)
    assert len(buf) == 3 and buf.nbytes == 240
    d = _add(buf, 10, version=3, step=2)
    kept = {it.item_id for it in buf.items()}
    assert b.item_id not in kept, "the oldest policy version is dropped first"
    assert {a.item_id, c.item_id, d.item_id} == kept
    assert buf.nbytes <= buf.capacity_bytes and buf.dropped == 1


def test_hidden_states_are_counted_and_stored_in_bf16():
    buf = TrainingBuffer(capacity_bytes=10_000)
    item = _add(buf, 10, version=0, step=0, hidden=16)
    assert item.hidden.dtype == torch.bfloat16
    assert item.nbytes == 10 * 8 + 10 * 16 * 2
    no_hidden = TrainingBuffer(capacity_bytes=10_000, keep_hidden=False)
    assert _add(no_hidden, 10, version=0, step=0, hidden=16).hidden is None


def test_items_without_response_or_too_large_are_refused():
    buf = TrainingBuffer(capacity_bytes=100)
    assert buf.add([1, 2], response_start=2, policy_version=0, step=0) is None
    assert buf.add(list(range(50)), response_start=1, policy_version=0, step=0) is None
    assert len(buf) == 0


def test_epoch_order_mixes_previous_and_current_step_exactly_once():
    buf = TrainingBuffer(capacity_bytes=1 << 20)
    old = [_add(buf, 6, version=0, step=0).item_id for _ in range(10)]
    new = [_add(buf, 6, version=1, step=1).item_id for _ in range(10)]
    order = buf.epoch_order(current_step=1, seed=7, prev_share=0.5)
    assert sorted(order) == sorted(old + new)  # each item exactly once
    first_half = order[:10]
    assert 4 <= sum(i in old for i in first_half) <= 6  # interleaved, not old-then-new
    assert order == buf.epoch_order(current_step=1, seed=7, prev_share=0.5)  # deterministic
    assert order != buf.epoch_order(current_step=1, seed=8, prev_share=0.5)


def test_add_output_aligns_engine_hidden_states_by_dropping_the_unfed_last_token():
    buf = TrainingBuffer(capacity_bytes=1 << 20, hidden_dtype=torch.float32)
    h = torch.arange(6.0).unsqueeze(-1)  # prompt 3 + output 4 tokens: 6 fed positions
    item = buf.add_output([1, 2, 3], [4, 5, 6, 7], step=2, policy_version=1, hidden=h)
    assert item.token_ids.tolist() == [1, 2, 3, 4, 5, 6] and item.response_start == 3
    assert torch.equal(item.hidden, h)
    ids_only = buf.add_output([1, 2, 3], [4, 5], step=2, policy_version=1)
    assert ids_only.token_ids.tolist() == [1, 2, 3, 4, 5] and ids_only.hidden is None
    with pytest.raises(ValueError, match="rows"):
        buf.add_output([1, 2, 3], [4, 5], step=2, policy_version=1, hidden=h)
