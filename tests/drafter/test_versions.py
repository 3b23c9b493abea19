"""Held-out acceptance, a measured version recorded (promote / reject) in the real Store, SGLang
export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tests.drafter.helpers import (
    fill_buffer,
    load_target,
    make_target_dir,
    new_drafter,
    publish,
    rollout_samples,
)
from tltd.contract.checkpoint import LEGACY_INPUT_NORM, IncompatibleDrafterCheckpoint
from tltd.domain import DrafterStatus, Job
from tltd_workers.drafter.buffer import TrainingBuffer
from tltd_workers.drafter.forward import chain_accepted_lengths, drafter_features, target_hidden
from tltd_workers.drafter.trainer import Trainer, TrainerConfig, load_state, save_state
from tltd_workers.drafter.versions import HeldOut, export_sglang, mean_accepted_length
from tltd_workers.engine.eagle import EagleDrafter


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
    # On the host whatever `--device` says: these are exactness checks against references
    # (a step-by-step decode, SGLang's forward) that build their inputs there.
    return load_target(target_dir, device="cpu")


@pytest.fixture(scope="module")
def trained(target):
    """A drafter trained on the target's greedy rollouts (module-scoped: trained once)."""
    buf = TrainingBuffer(1 << 24)
    fill_buffer(buf, target, rollout_samples(target, 24, new_tokens=16, seed=11))
    tr = Trainer(
        new_drafter(target, seed=1),
        buf,
        TrainerConfig(items_per_micro=4, micro_per_step=2, lr=1e-2, warmup_steps=5),
    )
    for _ in range(90):
        tr.train_step()
    return tr


@pytest.fixture(scope="module")
def held_out(target):
    return [
        HeldOut(torch.tensor(t), rs) for t, rs in rollout_samples(target, 6, new_tokens=16, seed=99)
    ]


def _naive(drafter, hidden, ids, rs, k):
    """Each start on its own: true prefix + its chain as one causal sequence."""
    T = ids.numel()
    out = []
    for s in range(max(rs - 1, 0), min(hidden.shape[0], T - 1, T - 2)):
        hs, xs = list(hidden[: s + 1]), list(ids[1 : s + 2])
        drafts = []
        for _ in range(k):
            L = len(hs)
            f = drafter_features(
                drafter,
                torch.stack(hs)[None],
                torch.stack(xs)[None],
                torch.arange(L)[None],
                torch.ones(L, L, dtype=torch.bool).tril()[None, None],
            )[0, -1]
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


def test_publish_promotes_better_and_rejects_worse(
    store, target, target_dir, trained, held_out, tmp_path
):
    store.jobs.create(Job(job_id="j1", model_path=str(target_dir)))
    v1 = publish(
        store,
        "j1",
        trained.drafter,
        held_out,
        policy_version=0,
        train_steps=trained.step,
        loss=trained.last_loss,
        out_dir=tmp_path,
    )
    assert v1.status is DrafterStatus.PROMOTED and v1.acceptance_length > 1.0
    assert store.drafters.active_version("j1") == v1.version
    assert set(load_file(f"{v1.path}/model.safetensors")) == set(trained.params)

    worse = new_drafter(target, seed=7)
    v2 = publish(
        store, "j1", worse, held_out, policy_version=1, train_steps=0, loss=9.9, out_dir=tmp_path
    )
    assert v2.status is DrafterStatus.REJECTED
    assert v2.acceptance_length < v1.acceptance_length
    assert store.drafters.active_version("j1") == v1.version, "a worse drafter is never active"
    rows = {d.version: d for d in store.drafters.list("j1")}
    assert rows[v2.version].policy_version == 1 and rows[v1.version].train_steps == trained.step
    # The same drafter again is no improvement over itself: rejected too.
    v3 = publish(
        store,
        "j1",
        trained.drafter,
        held_out,
        policy_version=1,
        train_steps=trained.step,
        loss=trained.last_loss,
        out_dir=tmp_path,
    )
    assert v3.status is DrafterStatus.REJECTED


def _llama_target_dir(path):
    """A tiny random Llama (no qkv bias, untied lm_head) saved with transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=40,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        )
    ).save_pretrained(path)
    return path


class _SGLangEagleReference(nn.Module):
    """SGLang's EAGLE draft model (llama_eagle.py / qwen2_eagle.py, after EAGLE's cnets.py),
    rebuilt from its documented behaviour with transformers' decoder layer, never our code:

    x = fc(cat(embed_tokens(ids), hidden)); layer 0 with input_layernorm = identity;
    out = hidden + residual (no final norm); logits = the target's lm_head(out).
    Weights are read like SGLang's loader: every checkpoint name gets "model." in front, names
    with "lm_head" are skipped; strict, so a missing or extra tensor fails the load.
    """

    def __init__(self, export_dir, target_dir):
        super().__init__()
        from transformers import AutoConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

        cfg_json = json.loads((export_dir / "config.json").read_text())
        arch = cfg_json["architectures"][0]
        self.cfg = AutoConfig.for_model(
            **{k: v for k, v in cfg_json.items() if k not in ("architectures", "torch_dtype")}
        )
        self.cfg._attn_implementation = "sdpa"
        layer_cls = {
            "Qwen2ForCausalLMEagle": Qwen2DecoderLayer,
            "LlamaForCausalLMEagle": LlamaDecoderLayer,
        }[arch]
        H, V = self.cfg.hidden_size, self.cfg.vocab_size
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(V, H)
        self.model.fc = nn.Linear(2 * H, H)
        self.model.layers = nn.ModuleList([layer_cls(self.cfg, 0)])
        self.model.layers[0].input_layernorm = nn.Identity()  # SGLang: `lambda x: x`
        weights = {
            "model." + k: v
            for k, v in load_file(str(export_dir / "model.safetensors")).items()
            if "lm_head" not in k
        }
        self.load_state_dict(weights, strict=True)
        target_sd = load_file(str(target_dir / "model.safetensors"))
        # SGLang's EAGLE worker hands the draft model the target's lm_head.
        self.lm_head = target_sd.get("lm_head.weight", target_sd["model.embed_tokens.weight"])

    def forward(self, ids, hidden, positions):
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        x = self.model.fc(torch.cat([self.model.embed_tokens(ids), hidden], dim=-1))
        rope = LlamaRotaryEmbedding(self.cfg)(x, positions)
        out = self.model.layers[0](
            x, attention_mask=None, position_ids=positions, position_embeddings=rope
        )
        out = out[0] if isinstance(out, tuple) else out
        return out @ self.lm_head.T


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_sglang_export_is_exact(family, target_dir, tmp_path):
    """The exported checkpoint, run by a reference of SGLang's EAGLE forward, gives the draft
    logits of our drafter (trained, so no weight is at its init value)."""
    if family == "llama":
        tdir = _llama_target_dir(tmp_path / "llama")
    else:
        tdir = target_dir
    tgt = load_target(tdir, device="cpu")
    buf = TrainingBuffer(1 << 24)
    fill_buffer(buf, tgt, rollout_samples(tgt, 8, new_tokens=12, seed=2))
    tr = Trainer(
        new_drafter(tgt, seed=1),
        buf,
        TrainerConfig(items_per_micro=4, micro_per_step=2, lr=1e-2, warmup_steps=1),
    )
    for _ in range(6):
        tr.train_step()
    drafter = tr.drafter.eval()
    with torch.no_grad():  # make every norm weight differ from 1 so that a dropped norm shows
        drafter.layer.post_attention_layernorm.weight.mul_(1.5)
    assert drafter.layer.input_layernorm is None
    drafter.save_pretrained(tmp_path / "ours")
    assert "layer.input_layernorm.weight" not in load_file(
        str(tmp_path / "ours" / "model.safetensors")
    )
    res = export_sglang(tmp_path / "ours", tdir, tmp_path / "sglang")
    assert res.notes == ()
    cfg = json.loads((tmp_path / "sglang" / "config.json").read_text())
    arch = {"qwen2": "Qwen2ForCausalLMEagle", "llama": "LlamaForCausalLMEagle"}[family]
    assert cfg["architectures"] == [arch] and cfg["num_hidden_layers"] == 1
    sd = load_file(str(tmp_path / "sglang" / "model.safetensors"))
    assert not [n for n in sd if "lm_head" in n or "input_layernorm" in n]
    assert ("layers.0.self_attn.q_proj.bias" in sd) == (family == "qwen2")

    ref = _SGLangEagleReference(tmp_path / "sglang", tdir).eval()
    ids = torch.tensor(rollout_samples(tgt, 1, new_tokens=20, seed=4)[0][0])
    h = target_hidden(tgt, [ids])[0][:-1]
    nxt = ids[1:]
    L = nxt.numel()
    pos = torch.arange(L)[None]
    with torch.no_grad():
        theirs = ref(nxt[None], h[None], pos)
        causal = torch.ones(L, L, dtype=torch.bool).tril()[None, None]
        ours = drafter.logits(drafter_features(drafter, h[None], nxt[None], pos, causal))
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    assert (theirs.argmax(-1) == ours.argmax(-1)).all()


def _legacy_checkpoint(drafter, path):
    """A drafter checkpoint as written before the layer lost its input norm."""
    drafter.save_pretrained(path)
    sd = load_file(str(path / "model.safetensors"))
    sd[LEGACY_INPUT_NORM] = torch.ones(drafter.config.hidden_size)
    save_file(sd, str(path / "model.safetensors"))
    return path


def test_old_checkpoints_with_an_input_norm_fail_clearly(target, target_dir, trained, tmp_path):
    old = _legacy_checkpoint(trained.drafter, tmp_path / "old")
    with pytest.raises(IncompatibleDrafterCheckpoint, match="input_layernorm.*Refit"):
        EagleDrafter.from_pretrained(old, target)
    with pytest.raises(IncompatibleDrafterCheckpoint, match="input_layernorm"):
        export_sglang(old, target_dir, tmp_path / "sglang")
    assert not (tmp_path / "sglang").exists()
    # A trainer checkpoint (resume path) from before the change is refused the same way.
    ckpt = save_state(trained.state(), tmp_path / "ckpts")
    sd = load_file(str(ckpt / "model.safetensors"))
    sd[LEGACY_INPUT_NORM] = torch.ones(trained.drafter.config.hidden_size)
    save_file(sd, str(ckpt / "model.safetensors"))
    with pytest.raises(IncompatibleDrafterCheckpoint, match="input_layernorm"):
        load_state(ckpt)


def test_online_versions_must_beat_the_initial_drafter(
    store, target, target_dir, trained, held_out, tmp_path
):
    from tltd.domain import SpeculativeConfig
    from tltd.services.jobs import JobService, NewJob
    from tltd.settings import Settings

    trained.drafter.save_pretrained(tmp_path / "fitted")
    jobs = JobService(store, Settings(data_dir=str(tmp_path / "data")))
    spec = SpeculativeConfig(batch_threshold=0, initial_drafter_path=str(tmp_path / "fitted"))
    job, _ = jobs.create(NewJob(job_id="j1", model_path=str(target_dir), speculative=spec))
    assert job.drafter_version == 1 and store.drafters.active_version("j1") == 1
    initial = store.drafters.get("j1", 1)
    assert initial.status is DrafterStatus.PROMOTED and initial.policy_version == 0
    # What a rollout worker and a fresh online trainer load: the initial drafter's weights.
    loaded = EagleDrafter.from_pretrained(initial.path, target)
    for name, t in loaded.state_dict().items():
        torch.testing.assert_close(t, trained.drafter.state_dict()[name])

    worse = new_drafter(target, seed=7)
    v2 = publish(
        store, "j1", worse, held_out, policy_version=1, train_steps=0, loss=9.9, out_dir=tmp_path
    )
    assert v2.version == 2 and v2.status is DrafterStatus.REJECTED
    assert store.drafters.active_version("j1") == 1, "the initial drafter stays active"
