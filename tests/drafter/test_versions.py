"""Held-out acceptance, publish (promote / reject) through the real Store, SGLang export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.drafter.helpers import (
    fill_buffer,
    load_target,
    make_target_dir,
    new_drafter,
    rollout_samples,
)
from tltd.domain import DrafterStatus, Job
from workers.drafter.buffer import TrainingBuffer
from workers.drafter.forward import chain_accepted_lengths, drafter_features, target_hidden
from workers.drafter.trainer import Trainer, TrainerConfig
from workers.drafter.versions import HeldOut, export_sglang, mean_accepted_length, publish


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # module scope: it must precede the module-scoped model fixtures
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_target_dir(tmp_path_factory.mktemp("target"), seed=5)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(target_dir)


@pytest.fixture(scope="module")
def trained(target):
    """A drafter trained on the target's greedy rollouts (module-scoped: trained once)."""
    buf = TrainingBuffer(1 << 24)
    fill_buffer(buf, target, rollout_samples(target, 24, new_tokens=16, seed=11))
    tr = Trainer(new_drafter(target, seed=1), buf,
                 TrainerConfig(items_per_micro=4, micro_per_step=2, lr=1e-2, warmup_steps=5))
    for _ in range(90):
        tr.train_step()
    return tr


@pytest.fixture(scope="module")
def held_out(target):
    return [HeldOut(torch.tensor(t), rs) for t, rs in
            rollout_samples(target, 6, new_tokens=16, seed=99)]


def _naive(drafter, hidden, ids, rs, k):
    """Each start on its own: true prefix + its chain as one causal sequence."""
    T = ids.numel()
    out = []
    for s in range(max(rs - 1, 0), min(hidden.shape[0], T - 1, T - 2)):
        hs, xs = list(hidden[: s + 1]), list(ids[1 : s + 2])
        drafts = []
        for _ in range(k):
            L = len(hs)
            f = drafter_features(drafter, torch.stack(hs)[None], torch.stack(xs)[None],
                                 torch.arange(L)[None],
                                 torch.ones(L, L, dtype=torch.bool).tril()[None, None])[0, -1]
            d = drafter.logits(f).argmax()
            drafts.append(int(d))
            hs.append(f)
            xs.append(d)
        acc = 1
        for j, d in enumerate(drafts, start=1):
            if s + 1 + j >= T or d != int(ids[s + 1 + j]):
                break
            acc += 1
        out.append(float(acc))
    return torch.tensor(out)


@torch.no_grad()
def test_chain_acceptance_matches_a_step_by_step_decode(target, trained):
    ids = torch.tensor(rollout_samples(target, 1, new_tokens=14, seed=3)[0][0])
    h = target_hidden(target, [ids])[0]
    for k in (1, 3):
        fast = chain_accepted_lengths(trained.drafter, h, ids, 4, k)
        torch.testing.assert_close(fast, _naive(trained.drafter, h, ids, 4, k))
        assert fast.min() >= 1 and fast.max() <= k + 1
    # Rollout output lacks the last feature, which no chain needs: same values.
    short = chain_accepted_lengths(trained.drafter, h[:-1], ids, 4, 3)
    torch.testing.assert_close(short, chain_accepted_lengths(trained.drafter, h, ids, 4, 3))


def test_training_raises_held_out_acceptance(target, trained, held_out):
    fresh = mean_accepted_length(new_drafter(target, seed=1), held_out, k=4)
    learned = mean_accepted_length(trained.drafter, held_out, k=4)
    assert learned > fresh + 0.3, (fresh, learned)


def test_publish_promotes_better_and_rejects_worse(store, target, target_dir, trained, held_out,
                                                   tmp_path):
    store.create_job(Job(job_id="j1", model_path=str(target_dir)))
    v1 = publish(store, "j1", trained.drafter, held_out, policy_version=0,
                 train_steps=trained.step, loss=trained.last_loss, out_dir=tmp_path)
    assert v1.status is DrafterStatus.PROMOTED and v1.acceptance_length > 1.0
    assert store.active_drafter_version("j1") == v1.version
    assert set(load_file(f"{v1.path}/model.safetensors")) == set(trained.params)

    worse = new_drafter(target, seed=7)
    v2 = publish(store, "j1", worse, held_out, policy_version=1, train_steps=0, loss=9.9,
                 out_dir=tmp_path)
    assert v2.status is DrafterStatus.REJECTED
    assert v2.acceptance_length < v1.acceptance_length
    assert store.active_drafter_version("j1") == v1.version, "a worse drafter is never active"
    rows = {d.version: d for d in store.list_drafters("j1")}
    assert rows[v2.version].policy_version == 1 and rows[v1.version].train_steps == trained.step
    # The same drafter again is no improvement over itself: rejected too.
    v3 = publish(store, "j1", trained.drafter, held_out, policy_version=1,
                 train_steps=trained.step, loss=trained.last_loss, out_dir=tmp_path)
    assert v3.status is DrafterStatus.REJECTED


def test_sglang_export_names_and_math(target, target_dir, trained, tmp_path):
    """The exported tensors, loaded by name into HF's own Qwen2 decoder layer (the names
    SGLang's Qwen2ForCausalLMEagle loads) and run with fc over [embed; hidden], reproduce the
    drafter's features. SGLang's EAGLE layer 0 runs no input norm while the engine's drafter
    has one, so the export says it is inexact; the reference below gets that one weight from
    our checkpoint to check every other tensor exactly."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    drafter = trained.drafter
    drafter.save_pretrained(tmp_path / "ours")
    res = export_sglang(tmp_path / "ours", target_dir, tmp_path / "sglang")
    assert not res.exact and "input_layernorm" in res.notes[0]
    cfg = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLMEagle"] and cfg["num_hidden_layers"] == 1
    sd = load_file(str(tmp_path / "sglang" / "model.safetensors"))
    assert "fc.weight" in sd and "layers.0.self_attn.q_proj.weight" in sd
    assert not [n for n in sd if "lm_head" in n or "input_layernorm" in n]

    hf_cfg = Qwen2Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    hf_cfg._attn_implementation = "sdpa"
    layer = Qwen2DecoderLayer(hf_cfg, 0)
    missing, unexpected = layer.load_state_dict(
        {k.removeprefix("layers.0."): v for k, v in sd.items() if k.startswith("layers.0.")},
        strict=False)
    assert missing == ["input_layernorm.weight"] and not unexpected
    with torch.no_grad():
        layer.input_layernorm.weight.copy_(drafter.layer.input_layernorm.weight)
    fc = nn.Linear(2 * hf_cfg.hidden_size, hf_cfg.hidden_size)
    fc.load_state_dict({"weight": sd["fc.weight"], "bias": sd["fc.bias"]})

    ids = torch.tensor(rollout_samples(target, 1, seed=4)[0][0])
    h = target_hidden(target, [ids])[0][:-1]
    nxt = ids[1:]
    L = nxt.numel()
    with torch.no_grad():
        x = fc(torch.cat([sd["embed_tokens.weight"][nxt], h], dim=-1))[None]
        pos = torch.arange(L)[None]
        theirs = layer(x, attention_mask=None, position_ids=pos,
                       position_embeddings=Qwen2RotaryEmbedding(hf_cfg)(x, pos))
        theirs = theirs[0] if isinstance(theirs, tuple) else theirs
        ours = drafter_features(drafter, h[None], nxt[None], pos,
                                torch.ones(L, L, dtype=torch.bool).tril()[None, None])
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
