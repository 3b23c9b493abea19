"""Engine behaviour: lossless greedy SD, continuous batching, seeds, stops, cancel, prefill once."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.engine.helpers import make_checkpoint
from tests.torch_device import torch_device
from tltd.domain import FinishReason, SamplingParams
from tltd_workers.engine.bandit import Strategy
from tltd_workers.engine.datatypes import HISTORY_DRAFT_LENGTHS
from tltd_workers.engine.eagle import EagleDrafter
from tltd_workers.engine.engine import Engine, EngineConfig, Request
from tltd_workers.engine.transformer import load_model

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7, 8], [9, 10, 11, 12, 9, 10], [3], [5, 6, 5, 6, 5, 6, 5]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # logit_scale sharpens the model so that greedy continuations repeat (n-grams get accepted).
    return make_checkpoint(
        tmp_path_factory.mktemp("m") / "m", "qwen2", vocab=32, seed=1, logit_scale=2.0
    )


def _engine(ckpt, mode="off", strategy=None, eagle=False, **kw):
    cfg = EngineConfig(
        max_batch=kw.pop("max_batch", 16),
        max_seq_len=kw.pop("max_seq_len", 96),
        spec_mode=mode,
        strategies=(strategy or Strategy("ngram", 4),),
        device=kw.pop("device", torch_device()),
        **kw,
    )
    e = Engine(str(ckpt), cfg)
    if eagle:
        e.set_drafter(EagleDrafter.random_init(e.model, seed=0), version=7)
    return e


def _by_key(outs):
    return {(o.request_id, o.prompt_index, o.sample_index): o for o in outs}


def _run_staggered(e, sampling, join_every=3):
    """Add one request, step a few times, add the next... (requests join mid-way)."""
    outs, pending = [], list(enumerate(PROMPTS))
    steps = 0
    while pending or e.has_work():
        if pending and steps % join_every == 0:
            i, p = pending.pop(0)
            e.add_request(f"r{i}", p, sampling)
        outs.extend(e.step())
        steps += 1
    return _by_key(outs)


GREEDY = SamplingParams(n=2, temperature=0.0, max_new_tokens=24)


@pytest.mark.parametrize(
    "strategy,eagle",
    [
        (Strategy("ngram", 2), False),
        (Strategy("ngram", 5), False),
        (Strategy("eagle", 1), True),
        (Strategy("eagle", 4), True),
    ],
)
def test_greedy_speculative_is_token_identical(ckpt, strategy, eagle):
    ref = _run_staggered(_engine(ckpt), GREEDY)
    e = _engine(ckpt, "fixed", strategy, eagle)
    got = _run_staggered(e, GREEDY)
    assert got.keys() == ref.keys()
    for key, o in ref.items():
        assert got[key].token_ids == o.token_ids, key
        torch.testing.assert_close(got[key].logprobs, o.logprobs, atol=1e-4, rtol=0)
    summary = e.stats.summary()
    assert summary["steps"]["spec"] > 0
    if not eagle:  # the sharpened model repeats itself: n-gram drafts do get accepted
        assert summary["acceptance_rate"] > 0
    else:
        assert all(o.drafter_version == 7 for o in got.values() if o.draft_steps)


def test_greedy_with_confidence_truncated_eagle_drafts_is_token_identical(ckpt):
    ref = _run_staggered(_engine(ckpt), GREEDY)
    e = _engine(ckpt, "fixed", Strategy("eagle", 4), True, draft_confidence=0.5)
    got = _run_staggered(e, GREEDY)
    for key, o in ref.items():
        assert got[key].token_ids == o.token_ids, key
    per = e.stats.summary()["per_strategy"]["eagle/k4"]
    assert per["drafted"] < 4 * per["rows"], per  # the threshold did cut chains


def test_threshold_gate_speculates_only_at_small_batch(ckpt):
    """TLT's reference gate (an ablation): plain decoding while > threshold rows run, SD in
    the tail."""

    def run(e):
        reqs = [
            Request(f"r{i}", p, SamplingParams(n=2, temperature=0.0, max_new_tokens=6 + 10 * i))
            for i, p in enumerate(PROMPTS)
        ]
        return {(o.request_id, o.sample_index): o.token_ids for o in e.generate(reqs)}

    e = _engine(ckpt, "adaptive", gate="threshold", batch_threshold=4)
    assert e.costs is None and not e.bandit.plain_arm
    assert run(e) == run(_engine(ckpt))
    s = e.stats.summary()
    assert s["steps"]["plain"] > 0 and s["steps"]["spec"] > 0
    assert s["mean_batch"]["spec"] <= 4 < s["mean_batch"]["plain"]


def test_logprobs_are_the_targets(ckpt):
    """Greedy logprobs = log_softmax of the transformers model's logits at each position."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    e = _engine(ckpt, "fixed", Strategy("ngram", 4))
    prompt = PROMPTS[0]
    (o,) = e.generate([Request("a", prompt, SamplingParams(temperature=0.0, max_new_tokens=12))])
    seq = torch.tensor([prompt + o.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(ref(seq).logits[0], -1)
    want = logp[len(prompt) - 1 : -1].gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(o.logprobs), want, atol=1e-4, rtol=0)
    assert o.token_ids == logp[len(prompt) - 1 : -1].argmax(-1).tolist()


def test_sampled_logprobs_follow_temperature_and_top_k(ckpt):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    sp = SamplingParams(temperature=0.7, top_k=5, max_new_tokens=10, seed=3)
    (o,) = _engine(ckpt).generate([Request("a", PROMPTS[1], sp)])
    seq = torch.tensor([PROMPTS[1] + o.token_ids])
    with torch.no_grad():
        logits = ref(seq).logits[0, len(PROMPTS[1]) - 1 : -1] / 0.7
    kth = logits.topk(5, dim=-1).values[:, -1:]
    logp = torch.log_softmax(logits.masked_fill(logits < kth, float("-inf")), -1)
    want = logp.gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(o.logprobs), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("mode", ["off", "fixed"])
def test_seeded_sample_does_not_depend_on_the_batch(ckpt, mode):
    sp = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_new_tokens=20, seed=42)
    alone = _by_key(_engine(ckpt, mode).generate([Request("x", PROMPTS[2], sp)]))
    e = _engine(ckpt, mode)
    others = SamplingParams(n=4, temperature=0.8, max_new_tokens=30, seed=1)
    e.add_request("o1", PROMPTS[0], others)
    for _ in range(3):
        e.step()
    e.add_request("x", PROMPTS[2], sp)  # joins mid-way, in other slots, with other rows
    e.add_request("o2", PROMPTS[4], others)
    outs = []
    while e.has_work():
        outs.extend(e.step())
    mixed = _by_key(outs)
    for key, o in alone.items():
        assert mixed[key].token_ids == o.token_ids
        torch.testing.assert_close(mixed[key].logprobs, o.logprobs, atol=1e-4, rtol=0)
    assert len({tuple(o.token_ids) for o in alone.values()}) > 1  # samples do differ


def test_greedy_output_does_not_depend_on_the_batch(ckpt):
    e = _engine(ckpt)
    alone = {p[0]: e.generate([Request("a", p, GREEDY)])[0].token_ids for p in PROMPTS[:3]}
    mixed = _run_staggered(_engine(ckpt, max_batch=5), GREEDY, join_every=2)
    for i, p in enumerate(PROMPTS[:3]):
        assert mixed[(f"r{i}", 0, 0)].token_ids == alone[p[0]]
        assert mixed[(f"r{i}", 0, 1)].token_ids == alone[p[0]]


def test_n_samples_share_one_prefill(ckpt):
    e = _engine(ckpt)
    sp = SamplingParams(n=6, temperature=1.0, max_new_tokens=5, seed=0)
    out = e.generate([Request("a", PROMPTS[0], sp), Request("b", PROMPTS[1], sp)])
    assert len(out) == 12 and e.prefills == 2
    assert sorted(o.sample_index for o in out if o.request_id == "a") == list(range(6))


def test_queue_waits_for_room_and_prefills_each_prompt_once(ckpt):
    e = _engine(ckpt, max_batch=4)
    sp = SamplingParams(n=3, temperature=0.0, max_new_tokens=4)
    out = e.generate([Request(f"r{i}", p, sp) for i, p in enumerate(PROMPTS)])
    assert len(out) == 15 and e.prefills == 5


def test_stop_tokens_and_max_new_tokens(ckpt):
    e = _engine(ckpt)
    (free,) = e.generate(
        [Request("a", PROMPTS[0], GREEDY.__class__(temperature=0.0, max_new_tokens=24))]
    )
    assert free.finish_reason == FinishReason.LENGTH and len(free.token_ids) == 24
    stop = free.token_ids[5]
    first = free.token_ids.index(stop)
    for mode in ("off", "fixed"):
        sp = SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=(stop,))
        (o,) = _engine(ckpt, mode).generate([Request("a", PROMPTS[0], sp)])
        assert o.finish_reason == FinishReason.STOP
        assert o.token_ids == free.token_ids[: first + 1]  # the stop token is included
    for mode in ("off", "fixed"):
        sp = SamplingParams(temperature=0.0, max_new_tokens=7)
        (o,) = _engine(ckpt, mode).generate([Request("a", PROMPTS[0], sp)])
        assert o.token_ids == free.token_ids[:7] and o.finish_reason == FinishReason.LENGTH
    (one,) = e.generate(
        [Request("b", PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=1))]
    )
    assert one.token_ids == free.token_ids[:1]


def test_max_seq_len_ends_with_length(ckpt):
    e = _engine(ckpt, "fixed", max_seq_len=16)
    (o,) = e.generate(
        [Request("a", PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=50))]
    )
    assert o.finish_reason == FinishReason.LENGTH and len(PROMPTS[0]) + len(o.token_ids) == 16


def test_cancel_running_and_waiting(ckpt):
    e = _engine(ckpt, max_batch=4)
    long = SamplingParams(n=2, temperature=1.0, max_new_tokens=50, seed=1)
    e.add_request("keep", PROMPTS[0], long)
    e.add_request("kill", PROMPTS[1], long)
    e.add_request("queued", PROMPTS[2], long)  # no room: waits
    for _ in range(4):
        e.step()
    e.cancel("kill")
    e.cancel("queued")
    outs = []
    while e.has_work():
        outs.extend(e.step())
    got = _by_key(outs)
    for i in range(2):
        assert got[("kill", 0, i)].finish_reason == FinishReason.CANCELLED
        assert 0 < len(got[("kill", 0, i)].token_ids) < 50
        assert got[("queued", 0, i)].finish_reason == FinishReason.CANCELLED
        assert got[("queued", 0, i)].token_ids == []
        assert got[("keep", 0, i)].finish_reason == FinishReason.LENGTH


def test_hidden_states_returned_on_request(ckpt):
    model = load_model(ckpt)
    e = _engine(ckpt, "fixed", Strategy("eagle", 3), eagle=True)
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=9, seed=4)
    outs = e.generate(
        [Request("h", PROMPTS[0], sp, return_hidden_states=True), Request("n", PROMPTS[1], sp)]
    )
    for o in outs:
        if o.request_id == "n":
            assert o.hidden_states is None
            continue
        seq = PROMPTS[0] + o.token_ids
        assert o.hidden_states.shape == (len(seq) - 1, model.config.hidden_size)
        cache = model.new_cache(1, 64)
        from tltd_workers.engine.transformer import Batch

        batch = Batch.make([0], None, len(seq) - 1, 0, cache.trash, "cpu")
        _, h = model(torch.tensor([seq[:-1]]), cache, batch, return_hidden=True)
        torch.testing.assert_close(o.hidden_states, h[0], atol=1e-4, rtol=1e-4)


def test_bad_requests_are_rejected(ckpt):
    e = _engine(ckpt)
    with pytest.raises(ValueError, match="prompt_ids"):
        e.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="prompt_ids"):
        e.add_request("a", [999], GREEDY)
    with pytest.raises(ValueError, match="sampling.n"):
        e.add_request("a", [1], SamplingParams(n=100))
    e.add_request("a", [1], GREEDY)
    with pytest.raises(ValueError, match="already queued"):
        e.add_request("a", [1], GREEDY)


def test_a_finished_sample_can_run_again_while_its_siblings_run(ckpt):
    """A retry of sample 0 (e.g. its result could not be stored) while samples 1.. added with
    it still run is accepted, and gives the same tokens (seeded randomness)."""
    for seed in range(100):  # a seed where sample 0 stops first (deterministic search)
        sp = SamplingParams(
            n=3, temperature=1.0, max_new_tokens=40, seed=seed, stop_token_ids=(1, 2, 3, 4)
        )
        e = _engine(ckpt)
        e.add_request("r", PROMPTS[0], sp)
        first: list = []
        while not first and (e.running or e.waiting):
            first = e.step()
        if [o.sample_index for o in first] == [0] and len(e.running) == 2:
            break
    else:
        pytest.fail("no seed where sample 0 finishes alone first")
    with pytest.raises(ValueError, match=r"samples \[1, 2\] are already queued"):
        e.add_request("r", PROMPTS[0], replace(sp, n=2), sample_offset=1)
    e.add_request("r", PROMPTS[0], replace(sp, n=1))  # sample 0 again: accepted
    rest = []
    while e.running or e.waiting:
        rest.extend(e.step())
    again = [o for o in rest if o.sample_index == 0]
    assert len(again) == 1 and again[0].token_ids == first[0].token_ids
    assert sorted(o.sample_index for o in rest) == [0, 1, 2]


def test_sample_output_converts_to_the_domain_sample(ckpt):
    e = _engine(ckpt, "fixed", Strategy("ngram", 3))
    (o,) = e.generate([Request("a", PROMPTS[0], GREEDY.__class__(temperature=0.0))])
    s = o.to_domain()
    assert s.token_ids == tuple(o.token_ids) and s.finish_reason == o.finish_reason
    assert s.speculative.draft_steps == o.draft_steps > 0
    assert s.speculative.mean_accepted_length == pytest.approx(
        (o.accepted_tokens + o.draft_steps) / o.draft_steps
    )


def test_config_from_a_jobs_speculative_config():
    from tltd.contract.rollout_messages import EngineSpec
    from tltd.domain import SpeculativeConfig, SpeculativeMode

    job = SpeculativeConfig(draft_lengths=(2, 5, 5))
    cfg = EngineConfig.from_spec(EngineSpec.for_job(job, max_batch=8, cost_budget_s=0.5))
    assert cfg.spec_mode == "adaptive" and cfg.max_batch == 8 and cfg.batch_threshold == 32
    assert cfg.cost_budget_s == 0.5  # the daemon's worker_cost_budget_seconds
    assert set(cfg.strategies) == {Strategy(d, k) for d in ("ngram", "eagle") for k in (2, 5)} | {
        Strategy("history", k) for k in HISTORY_DRAFT_LENGTHS
    }
    off = EngineConfig.from_spec(
        EngineSpec.for_job(SpeculativeConfig(mode=SpeculativeMode.OFF, drafter="ngram"))
    )
    assert off.spec_mode == "off" and {s.drafter for s in off.strategies} == {"ngram"}


def test_finished_groups_leave_the_ngram_index(ckpt):
    e = _engine(ckpt, "fixed", max_batch=4)
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=0)
    e.generate([Request(f"r{i}", p, sp) for i, p in enumerate(PROMPTS)])
    assert len(e.ngram) == 0 and not e.running and not e.waiting
    assert e.cache.lens == [0] * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_on_cuda_matches_cpu(ckpt):
    sp = SamplingParams(n=2, temperature=0.0, max_new_tokens=24)
    reqs = [Request(f"r{i}", p, sp) for i, p in enumerate(PROMPTS)]
    cpu = _by_key(_engine(ckpt, device="cpu").generate(reqs))
    e = Engine(
        str(ckpt),
        EngineConfig(
            max_batch=16,
            max_seq_len=96,
            spec_mode="fixed",
            strategies=(Strategy("ngram", 4),),
            device="cuda",
        ),
    )
    e.set_drafter(EagleDrafter.random_init(e.model, seed=0), version=1)
    gpu = _by_key(e.generate(reqs))
    assert {k: o.token_ids for k, o in gpu.items()} == {k: o.token_ids for k, o in cpu.items()}


@pytest.mark.parametrize("eagle", [False, True], ids=["ngram", "eagle"])
def test_greedy_rows_stay_exact_next_to_sampled_rows_in_one_sd_batch(ckpt, eagle):
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=30)
    sampled = SamplingParams(n=3, temperature=0.9, top_k=8, max_new_tokens=30, seed=2)
    want = {
        p[0]: o.token_ids
        for p in PROMPTS[:2]
        for o in _engine(ckpt).generate([Request("g", p, greedy)])
    }
    e = _engine(ckpt, "fixed", Strategy("eagle" if eagle else "ngram", 3), eagle=eagle)
    reqs = [Request(f"g{i}", p, greedy) for i, p in enumerate(PROMPTS[:2])]
    reqs += [Request(f"s{i}", p, sampled) for i, p in enumerate(PROMPTS[2:])]
    outs = e.generate(reqs)
    for o in outs:
        if o.request_id.startswith("g"):
            assert o.token_ids == want[PROMPTS[int(o.request_id[1:])][0]]
    assert e.stats.summary()["steps"]["spec"] > 0


def test_measured_gate_without_a_cost_model_measures_plain_first(ckpt):
    """cost_budget_s=0: no cost model, so every bucket is measured online; lossless."""

    def run(e):
        reqs = [
            Request(f"r{i}", p, SamplingParams(n=2, temperature=0.0, max_new_tokens=6 + 10 * i))
            for i, p in enumerate(PROMPTS)
        ]
        return {(o.request_id, o.sample_index): o.token_ids for o in e.generate(reqs)}

    e = _engine(ckpt, "adaptive", batch_threshold=2, cost_budget_s=0)
    assert e.costs is None and e.bandit.plain_arm
    assert run(e) == run(_engine(ckpt))
    s = e.stats.summary()
    assert s["steps"]["spec"] > 0
    assert s["mean_batch"]["spec"] > 2  # the threshold does not bind the measured gate
    # Untried plain decoding goes first: a bucket speculates only once plain was measured.
    for arms in e.strategy_snapshot().values():
        if any(a["count"] for name, a in arms.items() if name != "plain"):
            assert arms["plain"]["count"] >= 1
            assert arms["plain"]["median_reward"] > 0


def test_a_seed_beyond_int64_is_reproducible_and_its_own(ckpt):
    """The API's seed is uint64: a seed >= 2**63 (half of all random 64-bit seeds) folds into
    the int64 row keys (`row_key` masks it), gives the same samples on every run, and
    other ones than its neighbours."""
    from tltd_workers.engine.sampling import row_key

    def run(seed):
        sp = SamplingParams(n=3, temperature=1.0, max_new_tokens=16, seed=seed)
        outs = _engine(ckpt).generate([Request("x", PROMPTS[2], sp)])
        return {o.sample_index: tuple(o.token_ids) for o in outs}

    top = 2**64 - 1
    assert -(2**63) <= row_key(top, 0, 0) < 2**63
    assert run(top) == run(top)
    assert len(set(run(top).values())) > 1  # each sample its own randomness
    assert run(2**63) != run(0) and run(top) != run(2**63)
