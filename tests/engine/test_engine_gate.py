"""The measured SD gate in the engine, driven by injected cost models (no timing asserted)."""

from __future__ import annotations

import pytest

from tests.engine.helpers import make_checkpoint
from tltd.domain import SamplingParams
from tltd_workers.engine.bandit import Strategy
from tltd_workers.engine.costs import BucketCost, CostModel
from tltd_workers.engine.eagle import EagleDrafter
from tltd_workers.engine.engine import Engine, EngineConfig, Request

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7, 8], [9, 10, 11, 12, 9, 10], [3], [5, 6, 5, 6, 5, 6, 5]]
STRATEGIES = (Strategy("ngram", 2), Strategy("ngram", 4))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(
        tmp_path_factory.mktemp("m") / "m", "qwen2", vocab=32, seed=1, logit_scale=2.0
    )


def _costs(plain_ms: float, verify_ms: float, buckets=(1, 2, 4, 8, 16)) -> CostModel:
    """Stated costs, the same in every bucket (key None: taken by any engine)."""
    return CostModel(
        {b: BucketCost(plain_ms, {3: verify_ms, 5: verify_ms}, 0.1) for b in buckets}, 64
    )


def _engine(ckpt, costs=None, mode="adaptive", gate_state=None, **kw) -> Engine:
    kw.setdefault("strategies", STRATEGIES)
    cfg = EngineConfig(max_batch=16, max_seq_len=96, spec_mode=mode, **kw)
    return Engine(str(ckpt), cfg, costs=costs, gate_state=gate_state)


def _run(e: Engine, tag: str = "r", seed: int = 0):
    reqs = [
        Request(
            f"{tag}{i}",
            p,
            SamplingParams(n=2, temperature=0.0, max_new_tokens=6 + 8 * i, seed=seed),
            prompt_index=i,
        )
        for i, p in enumerate(PROMPTS)
    ]
    return {(o.request_id, o.sample_index): o.token_ids for o in e.generate(reqs)}


def test_where_sd_is_predicted_to_pay_it_speculates_above_the_threshold(ckpt):
    """Verify costs a plain step (the deep-narrow CPU regime): a bucket measures its plain
    baseline once, then speculates as predicted, at batch 10 > batch_threshold 2; lossless."""
    e = _engine(ckpt, _costs(plain_ms=1000.0, verify_ms=1000.0), batch_threshold=2)
    sp = SamplingParams(n=2, temperature=0.0, max_new_tokens=20)
    for i, p in enumerate(PROMPTS):
        e.add_request(f"r{i}", p, sp)
    outs = e.step()  # prefill
    outs += e.step()
    assert (e.stats.plain_steps, e.stats.spec_totals.steps) == (1, 0)  # the baseline
    outs += e.step()
    assert (e.stats.plain_steps, e.stats.spec_totals.steps) == (1, 1)
    assert e.stats.spec_totals.rows == 10
    while e.has_work():
        outs += e.step()
    ref = _engine(ckpt, mode="off").generate(
        [Request(f"r{i}", p, sp) for i, p in enumerate(PROMPTS)]
    )
    key = lambda o: (o.request_id, o.sample_index)  # noqa: E731
    assert {key(o): o.token_ids for o in outs} == {key(o): o.token_ids for o in ref}
    g = e.gate_snapshot()
    assert g["gate"] == "measured" and set(g["buckets"]) == {1, 2, 4, 8, 16}
    assert all(v["predicted_gain"] > 1 for v in g["buckets"].values())
    assert g["buckets"][16]["measured_gain"] is not None  # plain and SD both ran there
    fresh = _engine(ckpt, _costs(plain_ms=1000.0, verify_ms=1000.0)).gate_snapshot()
    assert fresh["speculating_buckets"] == [1, 2, 4, 8, 16]  # predicted, nothing measured yet


def test_where_sd_is_predicted_to_lose_it_speculates_only_to_measure_the_drafter(ckpt):
    """Verify costs 10^6 plain steps: after the first bucket's baseline the n-gram drafter,
    never run yet, runs one step (its acceptance is measured, not assumed); no other bucket
    speculates."""
    e = _engine(ckpt, _costs(plain_ms=1.0, verify_ms=1e6))
    assert _run(e) == _run(_engine(ckpt, mode="off"))
    s = e.stats.summary()
    assert s["steps"]["spec"] >= 1 and s["steps"]["plain"] > 0
    assert e.gate_state is not None and e.gate_state.acceptance["ngram"].steps >= 1
    snap = e.strategy_snapshot()
    sd_buckets = [
        b for b, arms in snap.items() if any(a["count"] for n, a in arms.items() if n != "plain")
    ]
    assert sd_buckets == [16]  # the first decode steps run 10 rows
    g = e.gate_snapshot()
    assert all(v["predicted_gain"] < 1 for v in g["buckets"].values())
    assert set(g["speculating_buckets"]) <= {16}  # there, the measurement decides


def test_the_gate_state_carries_over_to_the_next_engine_of_a_job(ckpt):
    costs = _costs(plain_ms=1000.0, verify_ms=1000.0)
    first = _engine(ckpt, costs, strategies=STRATEGIES[:1])
    _run(first, "a")
    state = first.gate_state
    assert state is not None and first.stats.plain_steps > 0  # each bucket's baseline
    ngram = state.acceptance["ngram"]
    positions = ngram.accepted + ngram.rejected
    assert positions > 0
    # Say step 1 measured n-gram/k2 far ahead of plain decoding in every bucket.
    state.bandit.forget("ngram")
    for b in state.bandit.buckets:
        state.bandit.record_plain(b, b / 100.0)
        for _ in range(5):
            state.bandit.record(b, STRATEGIES[0], 1e9, 1.0)

    second = _engine(ckpt, costs, gate_state=state, strategies=STRATEGIES[:1])
    assert second.gate_state is state and second.bandit is state.bandit
    assert second.costs is costs
    _run(second, "b", seed=1)
    s = second.stats.summary()  # no baseline, no exploration: what step 1 found best
    assert s["steps"]["plain"] == 0 and set(s["per_strategy"]) == {"ngram/k2"}
    assert ngram.accepted + ngram.rejected > positions  # acceptance kept learning

    fresh = _engine(ckpt, costs, strategies=STRATEGIES[:1])
    _run(fresh, "b", seed=1)
    assert fresh.stats.plain_steps > 0
    other = _engine(ckpt, costs, gate_state=state)  # another configuration (strategies)
    assert other.gate_state is not state


def test_a_new_drafter_version_forgets_eagle_rewards_in_the_engine(ckpt):
    strategies = (Strategy("eagle", 3),)
    cfg = EngineConfig(max_batch=16, max_seq_len=96, strategies=strategies, cost_budget_s=0)
    e = Engine(str(ckpt), cfg)
    e.set_drafter(EagleDrafter.random_init(e.model, seed=0), version=1)
    _run(e)
    state = e.gate_state
    assert state is not None
    assert any(a["eagle/k3"]["median_reward"] for a in e.strategy_snapshot().values())
    alpha = state.acceptance["eagle"].alpha
    e.set_drafter(EagleDrafter.random_init(e.model, seed=1), version=2)
    e.add_request("x", PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=2))
    e.step()  # prefill
    e.step()  # a decode step: the gate sees version 2
    assert state.drafter_version == 2 and state.acceptance["eagle"].prior == pytest.approx(alpha)
    measured = [a["eagle/k3"]["median_reward"] for a in e.strategy_snapshot().values()]
    assert sum(m is not None for m in measured) <= 1  # only what this one step measured


def test_the_engine_measures_its_cost_model_and_reuses_it(ckpt):
    e = _engine(ckpt, cost_budget_s=30.0)
    assert e.costs is not None and set(e.costs.buckets) == {1, 2, 4, 8, 16}
    assert all(c.plain_ms > 0 for c in e.costs.buckets.values())
    assert e.gate_snapshot()["costs"]["buckets"].keys() == {1, 2, 4, 8, 16}
    assert e.cache.lens == [0] * 16  # the scratch use left the cache empty
    again = _engine(ckpt, e.costs, cost_budget_s=30.0)
    assert again.costs is e.costs  # same shape: not measured twice
    longer = _engine(ckpt, e.costs, cost_budget_s=30.0, cost_context=32)
    assert longer.costs is not e.costs and longer.costs.context == 32
    assert _engine(ckpt, cost_budget_s=0).costs is None
    assert _engine(ckpt, mode="adaptive", gate="threshold").costs is None


def test_the_fixed_and_threshold_ablations_keep_the_threshold(ckpt):
    for mode, gate in (("fixed", "measured"), ("adaptive", "threshold")):
        e = _engine(ckpt, mode=mode, gate=gate, batch_threshold=3)
        assert _run(e) == _run(_engine(ckpt, mode="off"))
        s = e.stats.summary()
        assert s["steps"]["spec"] > 0 and s["mean_batch"]["spec"] <= 3, mode
    with pytest.raises(ValueError, match="gate"):
        _engine(ckpt, gate="sometimes")
