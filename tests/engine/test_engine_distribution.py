"""Sampled SD is lossless: the law of the first generated tokens matches the model's exactly.

A tiny-vocabulary model (V = 8) makes the joint law of the first three tokens small enough to
compute exactly (from the transformers model and transformers' own temperature / top-p
warpers) and to test with a chi-square goodness-of-fit test. All seeds are fixed, so every
p-value here is deterministic. Threshold: a correct sampler gives p-values ~ U(0, 1), so
p > 1e-3 fails a correct implementation with probability 0.1% per (fixed) draw; the sanity
check shows the same test rejects a subtly wrong rule (always keep the drafts) with p < 1e-6.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from tests.engine.helpers import chi_square_p_value as _p_value
from tests.engine.helpers import make_checkpoint, three_token_law
from tests.torch_device import torch_device
from tltd.domain import SamplingParams
from tltd_workers.engine import speculation as speculation_mod
from tltd_workers.engine.bandit import Strategy
from tltd_workers.engine.eagle import EagleDrafter
from tltd_workers.engine.engine import Engine, EngineConfig, Request
from tltd_workers.engine.stats import EngineStats

V = 8
TEMPERATURE, TOP_P = 0.8, 0.9
# Every bigram over the vocabulary occurs in the prompt, so the n-gram drafter always proposes.
PROMPT = [a for a, b in itertools.product(range(V), repeat=2) for a in (a, b)][:40]
N_SAMPLES = 4000


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(
        tmp_path_factory.mktemp("tiny") / "m",
        "llama",
        vocab=V,
        hidden=32,
        heads=2,
        kv_heads=1,
        seed=5,
        logit_scale=3.0,
    )


@pytest.fixture(scope="module")
def exact(ckpt):
    return three_token_law(ckpt, PROMPT, V, TEMPERATURE, TOP_P)


def _engine(ckpt, mode, strategy, eagle, seed=0, confidence=0.0, drafter_scale=1.0) -> Engine:
    cfg = EngineConfig(
        max_batch=64,
        max_seq_len=64,
        spec_mode=mode,
        batch_threshold=64,
        strategies=strategy if isinstance(strategy, tuple) else (strategy or Strategy("ngram", 2),),
        seed=seed,
        draft_confidence=confidence,
        device=torch_device(),
    )
    e = Engine(str(ckpt), cfg)
    if eagle:
        drafter = EagleDrafter.random_init(e.model, seed=1)
        with torch.no_grad():
            drafter.layer.down_proj.weight.mul_(drafter_scale)
        e.set_drafter(drafter, version=1)
    return e


def _sample(ckpt, mode, strategy=None, eagle=False, seed=0, confidence=0.0, drafter_scale=1.0):
    e = _engine(ckpt, mode, strategy, eagle, seed, confidence, drafter_scale)
    sp = SamplingParams(n=50, temperature=TEMPERATURE, top_p=TOP_P, max_new_tokens=4)
    outs = e.generate([Request(f"r{i}", PROMPT, sp) for i in range(N_SAMPLES // 50)])
    return Counter(tuple(o.token_ids[:3]) for o in outs), e.stats.summary()


SD_CASES = [
    (Strategy("ngram", 2), False),
    (Strategy("eagle", 3), True),
    (Strategy("history", 3), False),
    ((Strategy("history", 3), Strategy("eagle", 2)), True),
]


@pytest.mark.parametrize("strategy,eagle", SD_CASES, ids=["ngram", "eagle", "history", "both"])
def test_sampled_speculative_output_is_plain_decodings_token_for_token(ckpt, strategy, eagle):
    """The accept rule reproduces plain decoding (spec.py): seeded sampled samples are the
    same tokens, with the same logprobs, with speculation on as off."""
    sp = SamplingParams(n=16, temperature=TEMPERATURE, top_p=TOP_P, max_new_tokens=24)
    runs = {}
    for mode in ("off", "fixed"):
        e = _engine(ckpt, mode, strategy, eagle)
        outs = e.generate([Request(f"r{i}", PROMPT, sp) for i in range(8)])
        runs[mode] = ({(o.request_id, o.sample_index): o for o in outs}, e.stats.summary())
    (off, _), (on, summary) = runs["off"], runs["fixed"]
    assert on.keys() == off.keys() and len(off) == 128
    for key, o in off.items():
        assert on[key].token_ids == o.token_ids, key
        torch.testing.assert_close(on[key].logprobs, o.logprobs, atol=1e-4, rtol=0)
    # Drafts were kept and rejected (a random EAGLE drafter's are seldom kept).
    assert 0 < summary["acceptance_rate"] < 0.95, summary


@pytest.mark.parametrize(
    "mode,strategy,eagle",
    [
        ("off", None, False),
        ("fixed", Strategy("ngram", 2), False),
        ("fixed", Strategy("eagle", 2), True),
        ("fixed", Strategy("history", 3), False),
        # history rows and EAGLE rows (where the history walk is short) in one verify pass
        ("fixed", (Strategy("history", 3), Strategy("eagle", 2)), True),
    ],
    ids=["no-sd", "ngram", "eagle", "history", "history+eagle"],
)
def test_sampled_speculative_matches_exact_law(ckpt, exact, mode, strategy, eagle, monkeypatch):
    masks = []
    real_record = EngineStats.record_spec_step

    def spy(self, *args):
        masks.append(set(args[-1] or ()))  # the drafter of each row
        return real_record(self, *args)

    monkeypatch.setattr(EngineStats, "record_spec_step", spy)
    counts, summary = _sample(ckpt, mode, strategy, eagle)
    assert _p_value(counts, exact) > 1e-3
    if isinstance(strategy, tuple):  # steps that mixed both kinds of rows really ran
        assert {"history", "eagle"} in masks
    if mode != "off":
        # The test only means something if drafts were both accepted and rejected.
        assert 0.05 < summary["acceptance_rate"] < 0.95, summary


def test_the_chi_square_test_rejects_a_wrong_rule(ckpt, exact, monkeypatch):

    def always_accept(p, draft, draft_len, greedy, u_sample, *_):
        rows = torch.arange(p.shape[0])
        # keep every draft, then sample the next token from p after them
        from tltd_workers.engine.sampling import sample_from

        return draft_len, sample_from(p[rows, draft_len], u_sample[rows, draft_len])

    monkeypatch.setattr(speculation_mod, "accept_drafts", always_accept)
    counts, _ = _sample(ckpt, "fixed", Strategy("ngram", 2))
    assert _p_value(counts, exact) < 1e-6


# Truncating EAGLE chains at a confidence that depends on the drafter's distribution only
# (workers/engine/eagle.py says why it must not look at the drawn token). A random drafter
# with a scaled-up output varies in confidence, so this threshold cuts some chains, not all.
CONFIDENCE = 0.2


def test_sampled_sd_with_confidence_truncated_drafts_matches_exact_law(ckpt, exact):
    counts, summary = _sample(
        ckpt, "fixed", Strategy("eagle", 3), True, confidence=CONFIDENCE, drafter_scale=6.0
    )
    assert _p_value(counts, exact) > 1e-3
    per = summary["per_strategy"]["eagle/k3"]
    _, full = _sample(ckpt, "fixed", Strategy("eagle", 3), True, drafter_scale=6.0)
    full_per = full["per_strategy"]["eagle/k3"]
    # The threshold really cut chains (fewer drafts verified per row than without it).
    assert 0.2 < per["drafted"] / per["rows"] < 0.9 * full_per["drafted"] / full_per["rows"]
    assert 0.05 < summary["acceptance_rate"] < 0.95, summary
