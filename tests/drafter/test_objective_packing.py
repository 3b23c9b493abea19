"""EAGLE objective alignment/masking and packing boundaries."""

from __future__ import annotations

import pytest
import torch

from tltd_workers.drafter.objective import align, eagle_loss
from tltd_workers.drafter.packing import context_len, pack, windows


def _example(T: int, rs: int, H: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return align(torch.randint(0, 10, (T,), generator=g), torch.randn(T, H, generator=g), rs)


def test_align_shifts_by_one_and_masks_from_last_prompt_position():
    ids = torch.tensor([5, 6, 7, 8, 9])
    hidden = torch.arange(5.0).unsqueeze(-1).repeat(1, 2)
    ex = align(ids, hidden, response_start=3)
    assert ex.next_ids.tolist() == [6, 7, 8, 9]
    assert ex.hidden_in[:, 0].tolist() == [0, 1, 2, 3]
    assert ex.hidden_target[:, 0].tolist() == [1, 2, 3, 4]
    # h_2 (last prompt feature) + x_3 (first response token) is the first drafter call.
    assert ex.loss_mask.tolist() == [False, False, True, True]


def test_loss_ignores_masked_positions():
    N, H, V = 6, 4, 7
    g = torch.Generator().manual_seed(1)
    pred_h, tgt_h = torch.randn(N, H, generator=g), torch.randn(N, H, generator=g)
    pred_l, tgt_l = torch.randn(N, V, generator=g), torch.randn(N, V, generator=g)
    mask = torch.tensor([False, False, True, True, True, False])
    loss, parts = eagle_loss(pred_h, tgt_h, pred_l, tgt_l, mask)
    pred_h2, pred_l2 = pred_h.clone(), pred_l.clone()
    pred_h2[~mask] += 100.0
    pred_l2[~mask] -= 50.0
    loss2, _ = eagle_loss(pred_h2, tgt_h, pred_l2, tgt_l, mask)
    assert torch.allclose(loss, loss2)
    pred_h2[2] += 1.0
    assert not torch.allclose(loss, eagle_loss(pred_h2, tgt_h, pred_l, tgt_l, mask)[0])
    assert parts["positions"] == 3.0


def test_loss_is_zero_reg_when_features_match_and_ce_is_entropy():
    N, H, V = 3, 4, 5
    h = torch.randn(N, H)
    logits = torch.randn(N, V)
    loss, parts = eagle_loss(h, h, logits, logits, torch.ones(N, dtype=torch.bool))
    entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
    assert parts["reg"] == 0.0
    assert torch.allclose(loss, 0.1 * entropy, atol=1e-6)
    assert parts["top1"] == 1.0


def test_packing_restarts_positions_and_blocks_cross_sample_attention():
    a, b, c = _example(5, 2, seed=1), _example(4, 1, seed=2), _example(7, 3, seed=3)
    batch = pack([a, b, c], row_len=8)
    # a (4 positions) + b (3) share a row; c (6) needs its own.
    assert batch.segments.tolist() == [[0, 0, 0, 0, 1, 1, 1, -1], [0, 0, 0, 0, 0, 0, -1, -1]]
    assert batch.positions[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    m = batch.attn_mask[0, 0]
    assert not m[4, :4].any(), "b must not see a"
    assert m[4, 4] and m[6, 4:7].all() and not m[5, 6]
    assert m[3, :4].all() and not m[0, 1]  # causal inside a sample
    assert torch.equal(batch.loss_mask[0, :4], a.loss_mask)
    assert not batch.loss_mask[:, -1].any()  # padding never counts
    assert torch.equal(batch.hidden_in[1, :6], c.hidden_in)


def _offset(ex, w) -> int:
    """Where window w starts in ex (its inputs are a contiguous slice of ex's)."""
    n = w.next_ids.shape[0]
    [s] = [
        s
        for s in range(ex.next_ids.shape[0] - n + 1)
        if torch.equal(ex.hidden_in[s : s + n], w.hidden_in)
    ]
    assert torch.equal(ex.next_ids[s : s + n], w.next_ids)
    assert torch.equal(ex.hidden_target[s : s + n], w.hidden_target)
    return s


@pytest.mark.parametrize(("T", "rs"), [(40, 3), (30, 20), (9, 1), (33, 33 - 8)])
def test_windows_put_every_response_position_in_exactly_one_loss(T, rs):
    """Long prompts (rs > row_len) and the late part of long responses are all trained."""
    row_len = 8
    ex = _example(T, rs)
    ws = windows(ex, row_len)
    trained = []
    for w in ws:
        n = w.next_ids.shape[0]
        assert n <= row_len and w.loss_mask.any()
        s = _offset(ex, w)
        first = int(w.loss_mask.nonzero()[0])
        assert first <= context_len(row_len) or s == 0  # context in front, never more
        assert w.loss_mask[first:].all()  # loss from there on, all of it
        trained += range(s + first, s + n)
    assert trained == ex.loss_mask.nonzero().flatten().tolist()
    if T - 1 <= row_len:
        assert ws == [ex]  # a sample that fits is left whole


def test_packing_windows_overlong_samples_and_keeps_the_row_invariants():
    long, short = _example(40, 3, seed=1), _example(4, 1, seed=2)
    batch = pack([long, short], row_len=8)
    assert batch.next_ids.shape[1] == 8
    assert int(batch.loss_mask.sum()) == int(long.loss_mask.sum() + short.loss_mask.sum())
    B = batch.segments.shape[0]
    assert B == len(windows(long, 8))  # the short sample fits beside the last window
    for b in range(B):
        segs = batch.segments[b]
        m = batch.attn_mask[b, 0]
        for seg in range(int(segs.max()) + 1):
            sel = (segs == seg).nonzero().flatten()
            assert batch.positions[b, sel].tolist() == list(range(len(sel)))  # restart
            inside = m[sel][:, sel]
            assert torch.equal(inside, torch.ones_like(inside).tril())  # causal within
            assert not m[sel][:, segs != seg].any()  # nothing outside
        assert not batch.loss_mask[b, segs < 0].any()  # padding never counts
