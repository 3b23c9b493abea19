"""Drafter trainer: packing boundaries, masking, frozen weights, cursor, resume state."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.drafter.helpers import (
    fill_buffer,
    load_target,
    make_target_dir,
    new_drafter,
    rollout_samples,
)
from tltd_workers.drafter.buffer import TrainingBuffer
from tltd_workers.drafter.forward import drafter_features, target_hidden
from tltd_workers.drafter.objective import align, eagle_loss
from tltd_workers.drafter.packing import pack
from tltd_workers.drafter.trainer import (
    Stop,
    Trainer,
    TrainerConfig,
    latest_checkpoint,
    load_state,
    save_state,
)
from tltd_workers.engine.transformer import Batch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # module scope: it must precede the module-scoped model fixtures
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(make_target_dir(tmp_path_factory.mktemp("target")))


@pytest.fixture(scope="module")
def samples(target):
    return rollout_samples(target, 12, seed=1)


def _alone(drafter, ex):
    L, dev = ex.next_ids.shape[0], ex.hidden_in.device
    causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()[None, None]
    return drafter_features(
        drafter, ex.hidden_in[None], ex.next_ids[None], torch.arange(L, device=dev)[None], causal
    )[0]


def test_packed_row_gives_each_sample_its_alone_outputs(target):
    """The proof that no attention crosses samples and positions restart."""
    drafter = new_drafter(target, seed=3)
    g = torch.Generator().manual_seed(0)
    exs = []
    for T, rs in ((9, 3), (6, 2), (11, 4), (5, 1)):
        ids = torch.randint(0, target.config.vocab_size, (T,), generator=g)
        exs.append(align(ids, target_hidden(target, [ids])[0], rs))
    batch = pack(exs, row_len=16)
    assert batch.segments.shape[0] < len(exs), "some samples must share a row"
    out = drafter_features(
        drafter, batch.hidden_in, batch.next_ids, batch.positions, batch.attn_mask
    )
    seen = 0
    for b in range(batch.segments.shape[0]):
        for seg in range(int(batch.segments[b].max()) + 1):
            sel = batch.segments[b] == seg
            ex = next(
                e
                for e in exs
                if e.next_ids.shape[0] == int(sel.sum())
                and torch.equal(e.next_ids, batch.next_ids[b, sel])
            )
            torch.testing.assert_close(out[b, sel], _alone(drafter, ex), atol=1e-5, rtol=1e-5)
            seen += 1
    assert seen == len(exs)
    # A mask that lets samples see each other changes the outputs: the check above can fail.
    leaky = torch.ones_like(batch.attn_mask).tril(0) | batch.attn_mask
    assert not torch.allclose(
        out,
        drafter_features(drafter, batch.hidden_in, batch.next_ids, batch.positions, leaky),
        atol=1e-4,
    )


def test_training_forward_equals_the_engines_cached_inference_path(target):
    drafter = new_drafter(target, seed=4)
    ids = torch.randint(0, target.config.vocab_size, (10,))
    ex = align(ids, target_hidden(target, [ids])[0], 2)
    T = ex.next_ids.shape[0]
    cache = drafter.new_cache(1, T)
    batch = Batch.make([0], None, T, 0, cache.trash, cache.k.device)
    with torch.no_grad():
        x = drafter.fc(torch.cat([ex.hidden_in, target.embed_tokens(ex.next_ids)], -1))[None]
        cos, sin = target.rope(cache.max_len).tables(batch.positions)
        ref = drafter.layer(x, batch, cos, sin, cache.k[0], cache.v[0])[0]
    torch.testing.assert_close(_alone(drafter, ex).detach(), ref, atol=1e-5, rtol=1e-5)


def test_a_window_computes_what_its_absolute_positions_compute(target):
    """Windows restart their positions at 0: RoPE makes that the same as the window's true
    positions in the sample (what the engine's cache uses), the keys before it left out."""
    drafter = new_drafter(target, seed=5)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, target.config.vocab_size, (40,), generator=g)
    ex = align(ids, target_hidden(target, [ids])[0], 3)
    a, n = 23, 12
    h, x = ex.hidden_in[a : a + n][None], ex.next_ids[a : a + n][None]
    dev = h.device
    causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()[None, None]
    restarted = drafter_features(drafter, h, x, torch.arange(n, device=dev)[None], causal)
    absolute = drafter_features(drafter, h, x, torch.arange(a, a + n, device=dev)[None], causal)
    torch.testing.assert_close(restarted, absolute, atol=1e-5, rtol=1e-5)


def _trainer(target, samples, *, seed=0, keep_hidden=True, cfg=None, hidden_dtype=torch.float32):
    buf = TrainingBuffer(1 << 24, keep_hidden=keep_hidden, hidden_dtype=hidden_dtype)
    fill_buffer(buf, target, samples)
    return Trainer(
        new_drafter(target, seed=seed),
        buf,
        cfg
        or TrainerConfig(items_per_micro=2, micro_per_step=2, warmup_steps=2, lr=3e-3, row_len=64),
    )


def test_loss_covers_response_positions_only(target, samples):
    tokens, _ = samples[0]
    T = len(tokens)
    for rs in (1, T - 2):
        tr = _trainer(
            target, [(tokens, rs)], cfg=TrainerConfig(items_per_micro=1, micro_per_step=1, lr=0.0)
        )
        init = {n: p.detach().clone() for n, p in tr.params.items()}
        res = tr.train_step()
        assert res.positions == T - rs  # t >= rs - 1 over the T - 1 drafter positions
        # The same loss by hand over exactly those positions.
        with torch.no_grad():
            for n, p in tr.params.items():
                p.copy_(init[n])
            ids = torch.tensor(tokens)
            ex = align(ids, target_hidden(target, [ids])[0], rs)
            pred = _alone(tr.drafter, ex)[rs - 1 :]
            tgt = ex.hidden_target[rs - 1 :]
            loss, _ = eagle_loss(
                pred,
                tgt,
                target.logits(pred),
                target.logits(tgt),
                torch.ones(pred.shape[0], dtype=torch.bool, device=pred.device),
            )
        assert res.loss == pytest.approx(float(loss), rel=1e-5)


@pytest.mark.parametrize("keep_hidden", [True, False])
def test_long_prompts_and_the_late_part_of_long_responses_are_trained(target, keep_hidden):
    """Samples longer than a row train in windows: a prompt longer than the row still trains
    its response, and a long response trains up to its last token."""
    g = torch.Generator().manual_seed(7)
    vocab = target.config.vocab_size
    cfg = TrainerConfig(items_per_micro=1, micro_per_step=1, lr=0.0, row_len=16)
    for T, rs in ((50, 30), (60, 2)):  # prompt > row_len; response of 58 positions
        ids = torch.randint(0, vocab, (T,), generator=g).tolist()
        res = _trainer(target, [(ids, rs)], keep_hidden=keep_hidden, cfg=cfg).train_step()
        assert res.positions == T - rs and res.loss > 0
        # Another last token changes the loss: the sample's final position is in it.
        other = ids[:-1] + [(ids[-1] + 1) % vocab]
        res2 = _trainer(target, [(other, rs)], keep_hidden=keep_hidden, cfg=cfg).train_step()
        assert res2.positions == res.positions and res2.loss != pytest.approx(res.loss)


def test_shared_weights_frozen_and_absent_from_checkpoints(target, samples, tmp_path):
    before = {k: v.clone() for k, v in target.state_dict().items()}
    tr = _trainer(target, samples)
    init = {n: p.detach().clone() for n, p in tr.params.items()}
    assert set(n.split(".")[0] for n in tr.params) == {"fc", "layer"}
    losses = [tr.train_step().loss for _ in range(6)]
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), f"target weight {k} changed"
    assert any(not torch.equal(p, init[n]) for n, p in tr.params.items()), "nothing trained"
    assert losses[-1] < losses[0]
    ckpt = save_state(tr.state(), tmp_path)
    assert latest_checkpoint(tmp_path) == ckpt
    for f in ("model.safetensors", "optimizer.safetensors"):
        names = load_file(str(ckpt / f)).keys()
        assert not [n for n in names if "embed" in n or "lm_head" in n], f
    assert set(load_file(str(ckpt / "model.safetensors"))) == set(tr.params)


def test_cursor_trains_every_item_of_an_epoch_exactly_once(target, samples):
    tr = _trainer(target, samples[:10])  # 10 items, 4 per step: steps of 4, 4, 2 per epoch
    seen: list[tuple[int, ...]] = []
    for _ in range(6):
        seen.append(tr.train_step().item_ids)
    assert [len(s) for s in seen] == [4, 4, 2, 4, 4, 2]
    ids = sorted(i for tr_ids in seen[:3] for i in tr_ids)
    assert ids == sorted(it.item_id for it in tr.buffer.items())
    assert sorted(i for s in seen[3:] for i in s) == ids
    assert seen[:3] != seen[3:], "each epoch gets a new order"
    assert _trainer(target, []).train_step() is Stop.NO_DATA


def test_recomputed_hidden_trains_like_cached_hidden(target, samples):
    cached = _trainer(target, samples[:6], keep_hidden=True)
    chunked = TrainerConfig(
        items_per_micro=2, micro_per_step=2, warmup_steps=2, lr=3e-3, row_len=64, prefill_chunk=5
    )  # several KV-cached prefill chunks
    recomputed = _trainer(target, samples[:6], keep_hidden=False, cfg=chunked)
    assert all(it.hidden is None for it in recomputed.buffer.items())
    for _ in range(3):
        a, b = cached.train_step(), recomputed.train_step()
        assert a.item_ids == b.item_ids
        assert a.loss == pytest.approx(b.loss, rel=1e-4)
    for n, p in cached.params.items():
        torch.testing.assert_close(p, recomputed.params[n], atol=1e-5, rtol=1e-4)


def test_preempted_mid_step_and_resumed_from_a_checkpoint_is_exact(target, samples, tmp_path):
    ref = _trainer(target, samples)
    ref_ids = [ref.train_step().item_ids for _ in range(8)]

    tr = _trainer(target, samples)
    calls = {"n": 0}
    fire = set(range(3, 60, 7))  # k preemptions at varied points: between and inside micros

    def stop_sometimes():
        calls["n"] += 1
        return calls["n"] in fire

    got: list[tuple[int, ...]] = []
    while len(got) < 8:
        res = tr.train_step(stop_sometimes)
        if res is Stop.PREEMPTED:
            # Restart from disk, as a fresh process would (new drafter, new optimizer).
            state = load_state(save_state(tr.state(), tmp_path))
            tr = _trainer(target, samples, seed=99)
            tr.restore(state)
            continue
        got.append(res.item_ids)
    assert calls["n"] > 60  # all preemptions happened
    assert got == ref_ids
    for n, p in ref.params.items():
        torch.testing.assert_close(tr.params[n], p, atol=1e-6, rtol=1e-5)
