"""EAGLE drafter: persistence, training path = inference path, hot swap; policy reload."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file

from tests.engine.helpers import make_checkpoint
from tltd.domain import SamplingParams
from tltd_workers.engine.bandit import Strategy
from tltd_workers.engine.eagle import EagleDrafter
from tltd_workers.engine.engine import Engine, EngineConfig, Request
from tltd_workers.engine.transformer import Batch, load_model, read_state_dict

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7, 8], [9, 10, 11, 12, 9, 10]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(
        tmp_path_factory.mktemp("m") / "m", "llama", vocab=32, seed=2, logit_scale=2.0, tie=False
    )


def test_save_and_load_keep_only_the_drafters_own_weights(ckpt, tmp_path):
    model = load_model(ckpt)
    drafter = EagleDrafter.random_init(model, seed=3)
    drafter.save_pretrained(tmp_path / "d")
    saved = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert saved and all(k.startswith(("fc.", "layer.")) for k in saved)
    assert not any("embed" in k or "lm_head" in k for k in saved)
    again = EagleDrafter.from_pretrained(tmp_path / "d", model)
    for k, v in drafter.state_dict().items():
        assert torch.equal(again.state_dict()[k], v)
    assert again.target is model  # shared by reference
    assert sum(p.numel() for p in drafter.parameters()) == sum(v.numel() for v in saved.values())


def test_training_forward_matches_the_cached_drafting_path(ckpt):
    model = load_model(ckpt)
    drafter = EagleDrafter.random_init(model, seed=4)
    seq = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5]])
    cache = model.new_cache(1, 32)
    _, h = model(
        seq, cache, Batch.make([0], None, seq.shape[1], 0, cache.trash, "cpu"), return_hidden=True
    )
    t = seq.shape[1] - 1
    feats = drafter(h[:, :t], seq[:, 1 : t + 1])  # training path: predicted h_1..h_t
    seen: list[torch.Tensor] = []

    def choose(logits, i, confidence):
        seen.append(logits)
        return logits.argmax(-1), torch.ones(logits.shape[0])

    dcache = drafter.new_cache(1, 40)
    drafts, n = drafter.propose(dcache, [h[0, :t]], [seq[0, 1 : t + 1].tolist()], 3, choose)
    assert drafts.shape == (1, 3) and dcache.lens[0] == t and n == [3]
    torch.testing.assert_close(seen[0], drafter.logits(feats[:, -1]), atol=1e-5, rtol=1e-5)
    # Second draft step: feeds (predicted h_t, draft 1) at position t.
    feats2 = drafter(
        torch.cat([h[:, :t], feats[:, -1:]], 1), torch.cat([seq[:, 1 : t + 1], drafts[:, :1]], 1)
    )
    torch.testing.assert_close(seen[1], drafter.logits(feats2[:, -1]), atol=1e-5, rtol=1e-5)


def test_drafter_hot_swap_mid_run_stays_lossless_and_catches_up(ckpt):
    sp = SamplingParams(n=2, temperature=0.0, max_new_tokens=40)
    reqs = [Request(f"r{i}", p, sp) for i, p in enumerate(PROMPTS)]
    ref = {
        (o.request_id, o.sample_index): o.token_ids
        for o in Engine(str(ckpt), EngineConfig(spec_mode="off")).generate(reqs)
    }

    e = Engine(
        str(ckpt), EngineConfig(max_batch=8, spec_mode="fixed", strategies=(Strategy("eagle", 3),))
    )
    e.set_drafter(EagleDrafter.random_init(e.model, seed=1), version=1)
    for r in reqs:
        e.add_request(r.request_id, r.prompt_ids, r.sampling)
    outs = []
    for _ in range(6):
        outs.extend(e.step())
    e.set_drafter(EagleDrafter.random_init(e.model, seed=2), version=2)  # between steps
    while e.has_work():
        outs.extend(e.step())
    assert {(o.request_id, o.sample_index): o.token_ids for o in outs} == ref
    assert all(o.drafter_version == 2 for o in outs)  # in-flight samples used the new drafter
    e.set_drafter(None, version=0)
    assert e.generate([Request("x", PROMPTS[0], sp)])[0].token_ids == ref[("r0", 0)]


def test_load_policy_between_steps(ckpt, tmp_path):
    other = make_checkpoint(
        tmp_path / "other", "llama", vocab=32, seed=9, logit_scale=2.0, tie=False
    )
    sp = SamplingParams(n=1, temperature=0.0, max_new_tokens=16)
    want = Engine(str(other)).generate([Request("a", PROMPTS[1], sp)])[0].token_ids
    e = Engine(str(ckpt))
    before = e.generate([Request("a", PROMPTS[1], sp)])[0]
    assert before.token_ids != want and before.policy_version == 0
    e.load_policy(str(other), version=3)
    after = e.generate([Request("b", PROMPTS[1], sp)])[0]
    assert after.token_ids == want and after.policy_version == 3
    e.load_policy(read_state_dict(ckpt), version=4)
    assert e.generate([Request("c", PROMPTS[1], sp)])[0].token_ids == before.token_ids


def test_a_policy_that_does_not_fit_leaves_the_model_untouched(tmp_path):
    """A checkpoint with one tensor of another shape (a resized vocabulary) or more layers is
    refused before any tensor is copied: the engine keeps its policy and version."""
    base = make_checkpoint(tmp_path / "base", vocab=32, seed=0)
    e = Engine(str(base))
    before = {k: v.clone() for k, v in e.model.state_dict().items()}
    resized = make_checkpoint(tmp_path / "resized", vocab=40, seed=1)
    deeper = make_checkpoint(tmp_path / "deeper", vocab=32, layers=3, seed=1)
    for other, why in ((resized, "shape"), (deeper, "layers")):
        with pytest.raises(ValueError, match="architecture"):
            e.load_policy(str(other), version=5)  # from a directory: config.json is compared
        with pytest.raises(ValueError, match=why):
            e.load_policy(read_state_dict(other), version=5)  # tensors alone: checked first
    assert e.policy_version == 0
    assert all(torch.equal(v, before[k]) for k, v in e.model.state_dict().items())


def test_training_forward_on_packed_rows_equals_separate_sequences(ckpt):
    model = load_model(ckpt)
    drafter = EagleDrafter.random_init(model, seed=5)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 9, model.config.hidden_size, generator=g)
    x = torch.randint(0, 32, (1, 9), generator=g)
    # Row = sequence A (5 positions) then sequence B (4), no attention across them.
    seg = torch.tensor([0] * 5 + [1] * 4)
    pos = torch.tensor([list(range(5)) + list(range(4))])
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    mask = (causal & (seg[:, None] == seg[None, :]))[None, None]
    with torch.no_grad():
        packed = drafter(h, x, positions=pos, attn_mask=mask)
        a = drafter(h[:, :5], x[:, :5])
        b = drafter(h[:, 5:], x[:, 5:])
    torch.testing.assert_close(packed, torch.cat([a, b], 1), atol=1e-5, rtol=1e-5)


def test_only_rows_that_drafted_are_credited_with_draft_steps_and_the_drafter(ckpt):
    """A speculative=False request sharing EAGLE steps, and rows one token from their limit,
    decode plainly inside them: plain steps, no draft steps, no drafter version."""
    e = Engine(
        str(ckpt), EngineConfig(max_batch=8, spec_mode="fixed", strategies=(Strategy("eagle", 3),))
    )
    e.set_drafter(EagleDrafter.random_init(e.model, seed=1), version=7)
    sp = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    e.add_request("plain", PROMPTS[0], sp, speculative=False)
    e.add_request("spec", PROMPTS[1], sp)
    outs = {}
    while e.has_work():
        outs.update({o.request_id: o for o in e.step()})
    plain, spec = outs["plain"], outs["spec"]
    assert e.stats.summary()["steps"]["spec"] > 0  # the plain row did share SD steps
    assert (plain.draft_steps, plain.accepted_tokens, plain.drafter_version) == (0, 0, 0)
    assert plain.mean_accepted_length == 0.0
    assert spec.draft_steps > 0 and spec.drafter_version == 7
    for o in (plain, spec):  # no stop tokens: the prefill's token + one per step + accepted
        assert len(o.token_ids) == 1 + o.plain_steps + o.draft_steps + o.accepted_tokens


def test_absorbing_a_backlog_then_drafting_equals_drafting_on_it_at_once(ckpt):
    model = load_model(ckpt)
    drafter = EagleDrafter.random_init(model, seed=5)
    seq = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]])
    cache = model.new_cache(1, 32)
    _, h = model(
        seq, cache, Batch.make([0], None, seq.shape[1], 0, cache.trash, "cpu"), return_hidden=True
    )
    t = seq.shape[1] - 1
    feats, toks = h[0, :t], seq[0, 1 : t + 1].tolist()

    def drafting(split: bool):
        seen: list[torch.Tensor] = []

        def choose(logits, i, confidence):
            seen.append(logits)
            return logits.argmax(-1), torch.ones(logits.shape[0])

        dcache = drafter.new_cache(1, 40)
        if split:
            drafter.absorb(dcache, [feats[:-1]], [toks[:-1]])
            assert dcache.lens[0] == t - 1
            drafts, _ = drafter.propose(dcache, [feats[-1:]], [toks[-1:]], 3, choose)
        else:
            drafts, _ = drafter.propose(dcache, [feats], [toks], 3, choose)
        return drafts, seen, dcache.lens[0]

    whole, split = drafting(False), drafting(True)
    assert torch.equal(whole[0], split[0]) and whole[2] == split[2] == t
    for a, b in zip(whole[1], split[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_drafter_reads_a_prompt_once_and_a_catch_up_is_not_charged_to_the_step(ckpt):
    """At prefill the drafter reads each prompt once, and the prompt's samples share the rows
    it wrote (copied like the target's KV), not once per sample. A drafter swapped in mid-run
    catches up on every row's positions apart (here slowed down on purpose): greedy output is
    unchanged and the bandit's step time leaves the catch-up out."""
    prompts = [list(range(1, 25)), [7, 8] * 10, [9, 10, 11] * 6]
    sp = SamplingParams(n=2, temperature=0.0, max_new_tokens=12)
    reqs = [Request(f"r{i}", p, sp) for i, p in enumerate(prompts)]
    ref = {
        (o.request_id, o.sample_index): o.token_ids
        for o in Engine(str(ckpt), EngineConfig(spec_mode="off")).generate(reqs)
    }
    e = Engine(
        str(ckpt), EngineConfig(max_batch=8, spec_mode="fixed", strategies=(Strategy("eagle", 3),))
    )
    first = EagleDrafter.random_init(e.model, seed=1)
    e.set_drafter(first, version=1)
    read: list[int] = []
    real_read = first.absorb

    def counted_absorb(cache, feats, tokens, row0=0):
        read.append(sum(len(t) for t in tokens))
        real_read(cache, feats, tokens, row0)

    first.absorb = counted_absorb
    for r in reqs:
        e.add_request(r.request_id, r.prompt_ids, r.sampling)
    outs = e.step()  # the prefill
    assert read == [sum(len(p) - 1 for p in prompts)]  # once per prompt, not per sample
    dcache = e.speculation.eagle_cache
    leader = {}
    for slot, s in enumerate(e.running):
        n = len(s.group.prompt) - 1
        assert dcache.lens[slot] == n
        src = leader.setdefault(s.group.request_id, slot)
        assert torch.equal(dcache.k[0, slot, :, :n], dcache.k[0, src, :, :n])
    assert len(leader) == len(prompts)
    for _ in range(2):
        outs.extend(e.step())

    second = EagleDrafter.random_init(e.model, seed=2)
    absorbed: list[int] = []
    real_absorb = second.absorb

    def slow_absorb(cache, feats, tokens, row0=0):
        absorbed.append(sum(len(t) for t in tokens))
        time.sleep(0.3)
        real_absorb(cache, feats, tokens, row0)

    second.absorb = slow_absorb
    e.set_drafter(second, version=2)  # every row catches up on what it holds so far
    recorded: list[float] = []
    real_record = e.bandit.record
    e.bandit.record = lambda b, s, acc, dt: (recorded.append(dt), real_record(b, s, acc, dt))
    while e.has_work():
        outs.extend(e.step())
    assert {(o.request_id, o.sample_index): o.token_ids for o in outs} == ref
    assert absorbed and absorbed[0] >= sum(len(p) - 1 for p in prompts) * 2
    assert recorded and max(recorded) < 0.3  # no recorded step carries the 0.3 s catch-up
