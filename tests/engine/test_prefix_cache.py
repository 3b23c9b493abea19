"""A session's KV kept between turns (prefix_cache.py) is lossless: every turn's tokens are the
same as a stateless re-send of the whole sequence (greedy and seeded sampling, SD off, n-gram
and EAGLE drafts; an EAGLE drafter drafts the same tokens too),
logprobs within the tolerance SD is held to, and the law of a reusing turn's sampled tokens is
the model's exact one (chi-square, as tests/engine/test_engine_distribution.py). New weights,
another prefix, a tiny budget: a full prefill, with the same tokens."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from tests.engine.helpers import chi_square_p_value, make_checkpoint, three_token_law
from tests.torch_device import torch_device
from tltd.domain import SamplingParams
from tltd_workers.engine import engine as engine_mod
from tltd_workers.engine import prefix_cache as prefix_mod
from tltd_workers.engine.bandit import Strategy
from tltd_workers.engine.engine import Engine, EngineConfig, Request

GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=10)
SAMPLED = SamplingParams(n=1, temperature=0.9, top_p=0.95, max_new_tokens=10)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # Sharpened so that greedy answers repeat: n-gram drafts get accepted inside turns.
    return make_checkpoint(
        tmp_path_factory.mktemp("m") / "m", "qwen2", vocab=32, seed=1, logit_scale=2.0
    )


NGRAM = (Strategy("ngram", 3),)


def _engine(ckpt, budget=64 << 20, mode="off", strategies=NGRAM, **kw) -> Engine:
    cfg = EngineConfig(
        max_batch=16,
        max_seq_len=256,
        spec_mode=mode,
        strategies=strategies,
        batch_threshold=16,
        prefix_cache_bytes=budget,
        device=torch_device(),
        **kw,
    )
    return Engine(str(ckpt), cfg)


def _env(session: int, turn: int) -> list[int]:
    """What the environment answers after a turn (1-3 tokens, fixed per session and turn)."""
    return [(7 * session + 3 * turn + j) % 31 + 1 for j in range(1 + (session + turn) % 3)]


def run_sessions(engine: Engine, prompts, turns: int, sampling, keyed=True, between=None):
    """Every session's turns, turn by turn (all sessions' turn t in one batch): per session the
    outputs of its turns. `between(t)` runs before turn t > 0 (e.g. a weight update)."""
    contexts = [list(p) for p in prompts]
    outs: list[list] = [[] for _ in prompts]
    for t in range(turns):
        if t and between is not None:
            between(t)
        reqs = []
        for i, ctx in enumerate(contexts):
            if t:
                ctx += _env(i, t)
            sp = sampling if sampling.temperature == 0 else _seeded(sampling, 100 * i + t)
            key = f"s{i}" if keyed else ""
            reqs.append(Request(f"s{i}:{t}", list(ctx), sp, cache_key=key))
        by_id = {o.request_id: o for o in engine.generate(reqs)}
        for i, ctx in enumerate(contexts):
            o = by_id[f"s{i}:{t}"]
            outs[i].append(o)
            ctx += o.token_ids
    return outs


def _seeded(sp: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(sp, seed=seed)


PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [4, 4, 5, 6, 7, 8, 2], [3]]


def _same(a, b):
    for sa, sb in zip(a, b, strict=True):
        for oa, ob in zip(sa, sb, strict=True):
            assert oa.token_ids == ob.token_ids, (oa.request_id, oa.token_ids, ob.token_ids)
            torch.testing.assert_close(oa.logprobs, ob.logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("mode", ["off", "fixed"], ids=["plain", "sd"])
def test_turns_reusing_kv_are_a_stateless_resends_tokens(ckpt, sampling, mode):
    stateless = _engine(ckpt, budget=0, mode=mode)
    reusing = _engine(ckpt, mode=mode)
    want = run_sessions(stateless, PROMPTS, 5, sampling)
    got = run_sessions(reusing, PROMPTS, 5, sampling)
    _same(got, want)
    st, off = reusing.prefix.stats, stateless.prefix.stats
    assert (st.hits, st.misses) == (4 * len(PROMPTS), len(PROMPTS))  # every turn after the first
    assert (off.hits, off.reused_tokens) == (0, 0)
    assert st.reused_tokens > 0
    assert st.prefilled_tokens + st.reused_tokens == off.prefilled_tokens
    # Each reusing turn fed only its last turn's final token and the environment's tokens.
    fed = sum(1 + len(_env(i, t)) for i in range(len(PROMPTS)) for t in range(1, 5))
    assert st.prefilled_tokens == sum(map(len, PROMPTS)) + fed
    if mode == "fixed":
        assert reusing.stats.summary()["acceptance_rate"] > 0  # drafts ran inside turns


def test_a_wrong_restore_would_be_seen(ckpt, monkeypatch):
    """The identity above can fail: KV restored for tokens the prompt does not have (the check
    of the kept tokens bypassed) changes the next turns' tokens."""
    want = run_sessions(_engine(ckpt, budget=0), PROMPTS, 3, GREEDY)
    monkeypatch.setattr(prefix_mod, "shared_prefix", lambda a, b: len(a))
    engine = _engine(ckpt)
    run_sessions(engine, [[p[0] + 1] + p[1:] for p in PROMPTS], 1, GREEDY)  # other tokens kept
    wrong = run_sessions(engine, PROMPTS, 1, GREEDY)  # same keys: their KV is restored
    assert engine.prefix.stats.hits == sum(len(p) > 1 for p in PROMPTS)  # [3]: nothing to reuse
    assert any(w[0].token_ids != x[0].token_ids for w, x in zip(wrong, want, strict=True))


def test_new_weights_between_turns_prefill_in_full(ckpt, tmp_path):
    other = make_checkpoint(tmp_path / "v1", "qwen2", vocab=32, seed=2, logit_scale=2.0)
    engine = _engine(ckpt)
    fresh = _engine(ckpt, budget=0)

    def update(e):
        return lambda t: e.load_policy(str(other if t % 2 else ckpt), version=t)

    got = run_sessions(engine, PROMPTS, 3, GREEDY, between=update(engine))
    want = run_sessions(fresh, PROMPTS, 3, GREEDY, between=update(fresh))
    _same(got, want)
    st = engine.prefix.stats
    assert st.hits == 0 and st.misses == 3 * len(PROMPTS)  # turns 1 and 2 each follow an update
    assert st.evicted == 2 * len(PROMPTS)  # what turns 0 and 1 kept, dropped by the updates
    assert [o.policy_version for o in got[0]] == [0, 1, 2]


def test_a_weight_update_while_a_turn_runs_keeps_nothing_of_it(ckpt, tmp_path):
    other = make_checkpoint(tmp_path / "v1", "qwen2", vocab=32, seed=2, logit_scale=2.0)
    engine = _engine(ckpt)
    engine.add_request("t0", PROMPTS[0], GREEDY, cache_key="k")
    engine.step()  # prefill: the turn runs
    engine.load_policy(str(other), version=1)
    while engine.has_work():
        out = engine.step()
    assert out[0].policy_spans  # its tokens span two versions
    assert not engine.prefix.entries  # its KV mixes two sets of weights: not kept


def test_a_tiny_budget_evicts_and_keeps_the_tokens(ckpt):
    model = _engine(ckpt).model.config
    per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 4  # fp32 K and V
    budget = 40 * per_token  # about one session's kept KV
    engine = _engine(ckpt, budget=budget)
    got = run_sessions(engine, PROMPTS, 4, GREEDY)
    want = run_sessions(_engine(ckpt, budget=0), PROMPTS, 4, GREEDY)
    _same(got, want)
    st = engine.prefix.stats
    assert st.evicted > 0 and st.misses > len(PROMPTS) and engine.prefix.held_bytes <= budget


def test_another_prefix_reuses_only_what_it_shares(ckpt):
    engine = _engine(ckpt)
    first = engine.generate([Request("a", [1, 2, 3, 4, 5, 6], GREEDY, cache_key="k")])[0]
    kept = engine.prefix.entries["k"].tokens
    assert kept == tuple([1, 2, 3, 4, 5, 6] + first.token_ids[:-1])  # the last one has no KV
    other = [1, 2, 3, 9, 9]
    got = engine.generate([Request("b", other, GREEDY, cache_key="k")])[0]
    want = _engine(ckpt, budget=0).generate([Request("b", other, GREEDY)])[0]
    assert got.token_ids == want.token_ids
    assert engine.prefix.stats.reused_tokens == 3
    engine.generate([Request("c", [2, 2, 2], GREEDY, cache_key="k")])
    assert engine.prefix.stats.misses == 2  # nothing shared: "a" missed, and "c"


def test_prompts_that_need_their_hidden_states_prefill_in_full(ckpt):
    engine = _engine(ckpt)
    first = engine.generate([Request("a", [1, 2, 3, 4], GREEDY, cache_key="k")])[0]
    ctx = [1, 2, 3, 4, *first.token_ids, 5]
    r = Request("b", ctx, GREEDY, return_hidden_states=True, cache_key="k")
    out = engine.generate([r])[0]
    assert engine.prefix.stats.hits == 0
    assert out.hidden_states.shape[0] == len(ctx) + len(out.token_ids) - 1


# ---- the law of a reusing turn's sampled tokens --------------------------------------------

V = 8
TEMPERATURE, TOP_P = 0.8, 0.9
PROMPT = [a for a, b in itertools.product(range(V), repeat=2) for a in (a, b)][:30]
ENV = [3, 1, 4]
N_SESSIONS = 4000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint(
        tmp_path_factory.mktemp("tiny") / "m", "llama", vocab=V, hidden=32, heads=2,
        kv_heads=1, seed=5, logit_scale=3.0,
    )  # fmt: skip


def _reusing_turns(tiny, mode, first_prompt=PROMPT):
    """Many sessions: a greedy first turn of `first_prompt`, then a sampled turn of PROMPT,
    its answer and ENV that reuses the first turn's KV; its tokens' counts and context.
    `mode` "eagle": SD with a (random) EAGLE drafter, which reads the restored hidden states."""
    drafter = "eagle" if mode == "eagle" else "ngram"
    cfg = EngineConfig(
        max_batch=64, max_seq_len=64, spec_mode="fixed" if mode == "eagle" else mode,
        strategies=(Strategy(drafter, 2),), batch_threshold=64, device=torch_device(),
    )  # fmt: skip
    engine = Engine(str(tiny), cfg)
    if mode == "eagle":
        from tltd_workers.engine.eagle import EagleDrafter

        engine.set_drafter(EagleDrafter.random_init(engine.model, seed=3), 1)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=4)
    first = engine.generate(
        [Request(f"a{i}", first_prompt, greedy, cache_key=f"k{i}") for i in range(N_SESSIONS)]
    )
    answer = first[0].token_ids
    assert all(o.token_ids == answer for o in first)
    context = PROMPT + answer + ENV
    sp = SamplingParams(n=1, temperature=TEMPERATURE, top_p=TOP_P, max_new_tokens=4)
    second = engine.generate(
        [Request(f"b{i}", context, sp, cache_key=f"k{i}") for i in range(N_SESSIONS)]
    )
    assert engine.prefix.stats.hits == N_SESSIONS
    return Counter(tuple(o.token_ids[:3]) for o in second), context


@pytest.mark.parametrize("mode", ["off", "fixed", "eagle"], ids=["plain", "sd", "eagle"])
def test_a_reusing_turns_sampled_tokens_follow_the_exact_law(tiny, mode):
    counts, context = _reusing_turns(tiny, mode)
    law = three_token_law(tiny, context, V, TEMPERATURE, TOP_P)
    assert chi_square_p_value(counts, law) > 1e-3


def test_the_law_test_sees_kv_of_other_tokens(tiny, monkeypatch):
    """KV kept for another first prompt, restored as if it matched (the check bypassed)."""
    monkeypatch.setattr(prefix_mod, "shared_prefix", lambda a, b: len(a))
    counts, context = _reusing_turns(tiny, "off", first_prompt=[(t + 3) % V for t in PROMPT])
    law = three_token_law(tiny, context, V, TEMPERATURE, TOP_P)
    assert chi_square_p_value(counts, law) < 1e-6


def test_a_resumed_turn_keeps_its_kv_too(ckpt):
    """A turn paused at a step's token budget and resumed (from its stored tokens) on another
    engine leaves that engine the KV of the prompt and all its tokens."""
    prompt = [1, 2, 3, 4, 5]
    first = _engine(ckpt)
    first.add_request("t", prompt, GREEDY, pause_after=3)
    paused = []
    while first.has_work():
        paused += first.step()
    stored = paused[0].to_domain()
    assert len(stored.token_ids) == 3 and stored.partial
    engine = _engine(ckpt)
    engine.add_request("t", prompt, GREEDY, resume=stored, cache_key="k")
    done = []
    while engine.has_work():
        done += engine.step()
    tokens = done[0].token_ids
    assert engine.prefix.entries["k"].tokens == tuple(prompt + tokens[:-1])
    context = prompt + tokens + [7, 8]
    got = engine.generate([Request("t2", context, GREEDY, cache_key="k")])[0]
    want = _engine(ckpt, budget=0).generate([Request("t2", context, GREEDY)])[0]
    assert got.token_ids == want.token_ids and engine.prefix.stats.hits == 1


# ---- a group: sessions of one prompt share its prefill ---------------------------------------

GROUP_PROMPT = [4, 4, 5, 6, 7, 8, 2, 9, 1, 3]


def _first_turns(engine: Engine, shared: bool, seeds=(11, 12, 13, 14), one_by_one=False):
    """The first turns of sessions of GROUP_PROMPT (each its own key and seed), all added at
    once or one after the other; their outputs in session order."""
    key = "#p" if shared else ""
    reqs = [
        Request(f"g{i}", GROUP_PROMPT, _seeded(SAMPLED, seed), cache_key=f"g{i}", share_key=key)
        for i, seed in enumerate(seeds)
    ]
    outs = [o for r in reqs for o in engine.generate([r])] if one_by_one else engine.generate(reqs)
    return sorted(outs, key=lambda o: o.request_id)


@pytest.mark.parametrize("one_by_one", [False, True], ids=["together", "one_by_one"])
def test_a_groups_first_turns_share_one_prefill_and_sample_the_same_tokens(ckpt, one_by_one):
    engine = _engine(ckpt)
    got = _first_turns(engine, shared=True, one_by_one=one_by_one)
    want = _first_turns(_engine(ckpt, budget=0), shared=True)
    _same([got], [want])
    assert len({tuple(o.token_ids) for o in got}) > 1  # their own seeds: other answers
    st = engine.prefix.stats
    # One prefill of the prompt; the others restore all of it but its last token.
    assert st.prefilled_tokens == len(GROUP_PROMPT) + 3
    assert (st.hits, st.reused_tokens) == (3, 3 * (len(GROUP_PROMPT) - 1))
    assert [o.reused_tokens for o in got] == [0] + [len(GROUP_PROMPT) - 1] * 3
    # The shared entry stays for later sessions of the prompt; each session keeps its own.
    assert {"#p", "g0", "g1", "g2", "g3"} <= engine.prefix.entries.keys()


def test_without_a_share_key_each_first_turn_prefills_the_prompt(ckpt):
    engine = _engine(ckpt)
    _first_turns(engine, shared=False)
    assert engine.prefix.stats.prefilled_tokens == 4 * len(GROUP_PROMPT)
    assert engine.prefix.stats.hits == 0


def _eagle_engine(ckpt, budget=64 << 20) -> Engine:
    from tltd_workers.engine.eagle import EagleDrafter

    engine = _engine(ckpt, budget=budget, mode="fixed", strategies=(Strategy("eagle", 3),))
    engine.set_drafter(EagleDrafter.random_init(engine.model, seed=0), 1)
    return engine


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_turns_reusing_kv_under_an_eagle_drafter_are_a_stateless_resends_tokens(ckpt, sampling):
    """The entry keeps its positions' hidden states; the drafter reads the whole prompt from
    them and the prefill's, so it drafts exactly what it drafts after a full prefill."""
    stateless, reusing = _eagle_engine(ckpt, budget=0), _eagle_engine(ckpt)
    want = run_sessions(stateless, PROMPTS, 5, sampling)
    got = run_sessions(reusing, PROMPTS, 5, sampling)
    _same(got, want)
    st = reusing.prefix.stats
    assert (st.hits, st.misses) == (4 * len(PROMPTS), len(PROMPTS))
    assert st.prefilled_tokens + st.reused_tokens == stateless.prefix.stats.prefilled_tokens
    assert _drafts(reusing)[0] > 0 and _drafts(reusing) == _drafts(stateless)


def _drafts(engine: Engine) -> tuple[int, dict[str, int]]:
    """Tokens drafted, and the tokens emitted by source (accepted drafts among them)."""
    summary = engine.stats.summary()
    return summary["drafted_tokens"], summary["tokens"]


def test_the_eagle_check_sees_wrong_restored_hidden_states(ckpt, monkeypatch):
    """The draft counts above can differ: zeroed restored hidden states change the drafts."""
    real = engine_mod._with_restored
    zeroed = lambda h, r, f: real(h, [x * 0 if x is not None else None for x in r], f)  # noqa: E731
    monkeypatch.setattr(engine_mod, "_with_restored", zeroed)
    stateless, reusing = _eagle_engine(ckpt, budget=0), _eagle_engine(ckpt)
    run_sessions(stateless, PROMPTS, 5, GREEDY)
    run_sessions(reusing, PROMPTS, 5, GREEDY)
    assert _drafts(reusing) != _drafts(stateless)


def test_kv_kept_without_hidden_states_is_not_reused_under_an_eagle_drafter(ckpt):
    """A turn finished before a drafter was set kept no hidden states: the next turn, with a
    drafter, prefills in full (same tokens), and the turn after it reuses again."""
    from tltd_workers.engine.eagle import EagleDrafter

    want = run_sessions(_eagle_engine(ckpt, budget=0), PROMPTS, 3, GREEDY)
    engine = _engine(ckpt, mode="fixed", strategies=(Strategy("eagle", 3),))

    def drafter_after_the_first_turn(t: int) -> None:
        if t == 1:
            engine.set_drafter(EagleDrafter.random_init(engine.model, seed=0), 1)

    got = run_sessions(engine, PROMPTS, 3, GREEDY, between=drafter_after_the_first_turn)
    assert [[o.token_ids for o in s] for s in got] == [[o.token_ids for o in s] for s in want]
    assert (engine.prefix.stats.hits, engine.prefix.stats.misses) == (4, 8)


def test_a_shared_prompt_with_an_eagle_drafter_is_prefilled_once(ckpt):
    """The shared entry keeps the prompt's hidden states: the others restore all of it but its
    last token, and their drafter reads the prompt from those."""
    engine = _eagle_engine(ckpt)
    got = _first_turns(engine, shared=True)
    _same([got], [_first_turns(_eagle_engine(ckpt, budget=0), shared=True)])
    assert engine.prefix.stats.prefilled_tokens == len(GROUP_PROMPT) + 3
    assert engine.prefix.stats.hits == 3
