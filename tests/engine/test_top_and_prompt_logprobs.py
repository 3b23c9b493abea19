"""Top alternatives per output token and prompt logprobs against `transformers` on the shipped
policy: the target's values, the same with speculative decoding on (read from the verify pass)
as off, in the distribution the sampled logprobs refer to."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.torch_device import torch_device
from tltd.domain import LogprobMode, SamplingParams
from tltd_workers.engine.bandit import Strategy
from tltd_workers.engine.engine import Engine, EngineConfig, Request

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-policy"
TOP, PROMPT_TOP = 5, 3
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        MODEL, local_files_only=True, torch_dtype=torch.float32
    ).eval()


def _prompts() -> list[list[int]]:
    """Prompts whose repeated spans give the n-gram drafter matches."""
    cfg = json.loads((MODEL / "config.json").read_text())
    rng = random.Random(1)
    out = []
    for length in (4, 9):
        body = [rng.randrange(3, cfg["vocab_size"]) for _ in range(length)]
        out.append([cfg["bos_token_id"], *body, *body, *body[:2]])
    return out


def _engine(spec_mode: str, drafter: str = "ngram") -> Engine:
    return Engine(
        str(MODEL),
        EngineConfig(
            max_batch=16,
            spec_mode=spec_mode,
            strategies=(Strategy(drafter, 3),),
            device=torch_device(),
            cost_budget_s=0,
        ),
    )


def _distribution(hf, ids: list[int], start: int, sp: SamplingParams) -> torch.Tensor:
    """HF's log-distribution at positions start-1 .. len-2 (each predicts the next token), as
    the row's logprobs are defined: log_softmax(logits / T) here (no top-k / top-p), raw
    log_softmax(logits) for raw or greedy rows."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, start - 1 : -1].float()
    if sp.temperature > 0 and sp.logprob_mode is LogprobMode.PROCESSED:
        logits = logits / sp.temperature
    return torch.log_softmax(logits, -1)


def _check_top(tops, dist: torch.Tensor, n: int) -> None:
    """Each position's alternatives are the reference's n most likely, values within 1e-4."""
    assert len(tops) == dist.shape[0]
    ref_vals, _ = dist.topk(n, dim=-1)
    for t, ref, row in zip(tops, ref_vals, dist, strict=True):
        assert len(t.token_ids) == len(t.logprobs) == n
        got = torch.tensor(t.logprobs)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)  # the top values, in order
        torch.testing.assert_close(row[list(t.token_ids)], got, atol=1e-4, rtol=1e-4)


def _run(engine: Engine, sps: dict[str, SamplingParams]) -> dict:
    reqs = [
        Request(f"{name}-{i}", p, sp, prompt_index=i)
        for name, sp in sps.items()
        for i, p in enumerate(_prompts())
    ]
    return {(o.request_id, o.sample_index): o for o in engine.generate(reqs)}


SPS = {
    "t07": SamplingParams(
        n=2,
        temperature=0.7,
        max_new_tokens=NEW_TOKENS,
        seed=3,
        top_logprobs=TOP,
        prompt_logprobs=PROMPT_TOP,
    ),
    "raw": SamplingParams(
        n=1,
        temperature=0.7,
        max_new_tokens=NEW_TOKENS,
        seed=4,
        logprob_mode=LogprobMode.RAW,
        top_logprobs=TOP,
        prompt_logprobs=0,
    ),
    "greedy": SamplingParams(
        n=1, temperature=0.0, max_new_tokens=NEW_TOKENS, top_logprobs=TOP, prompt_logprobs=1
    ),
    "plain": SamplingParams(n=1, temperature=1.0, max_new_tokens=4, seed=5),
}


@pytest.mark.parametrize(("spec_mode", "drafter"), [("off", "ngram"), ("fixed", "ngram")])
def test_top_and_prompt_logprobs_match_transformers(hf, spec_mode, drafter):
    engine = _engine(spec_mode, drafter)
    outs = _run(engine, SPS)
    prompts = _prompts()
    for (rid, _), o in outs.items():
        name, i = rid.split("-")
        sp, prompt = SPS[name], prompts[int(i)]
        if name == "plain":  # nothing asked: nothing computed
            assert o.top_logprobs is None and o.prompt_logprobs is None
            continue
        dist = _distribution(hf, prompt + o.token_ids, len(prompt), sp)
        _check_top(o.top_logprobs, dist, TOP)
        sampled = dist.gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(o.logprobs), sampled, atol=1e-4, rtol=1e-4)
        pl = o.prompt_logprobs
        pdist = _distribution(hf, prompt, 1, sp)
        ref = pdist.gather(-1, torch.tensor(prompt[1:])[:, None])
        assert len(pl.logprobs) == len(pl.ranks) == len(prompt) - 1
        torch.testing.assert_close(torch.tensor(pl.logprobs), ref[:, 0], atol=1e-4, rtol=1e-4)
        assert list(pl.ranks) == (pdist >= ref - 1e-6).sum(-1).tolist()
        if sp.prompt_logprobs:
            _check_top(pl.top, pdist, sp.prompt_logprobs)
        else:
            assert pl.top == ()
    if spec_mode == "fixed":  # some alternatives came from verify passes
        assert engine.stats.summary()["row_steps"]["draft"] > 0


def test_speculation_leaves_the_values_unchanged():
    """Greedy rows emit the same tokens in every mode: their alternatives and prompt
    logprobs with SD on equal SD off's."""
    sps = {"greedy": SPS["greedy"]}
    off = _run(_engine("off"), sps)
    spec_engine = _engine("fixed")
    on = _run(spec_engine, sps)
    assert spec_engine.stats.summary()["row_steps"]["draft"] > 0
    assert off.keys() == on.keys()
    for key, a in off.items():
        b = on[key]
        assert a.token_ids == b.token_ids
        for x, y in zip(a.top_logprobs, b.top_logprobs, strict=True):
            assert x.token_ids == y.token_ids
            torch.testing.assert_close(
                torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=1e-4
            )
        assert a.prompt_logprobs.ranks == b.prompt_logprobs.ranks
        torch.testing.assert_close(
            torch.tensor(a.prompt_logprobs.logprobs),
            torch.tensor(b.prompt_logprobs.logprobs),
            atol=1e-5,
            rtol=1e-5,
        )


def test_alternatives_stop_with_the_sample():
    """A stop token ends the alternatives too: one entry per emitted token."""
    engine = _engine("fixed")
    prompt = _prompts()[0]
    first = engine.generate([Request("probe", prompt, SPS["greedy"])])[0]
    stop = first.token_ids[3]
    sp = SamplingParams(
        n=1, temperature=0.0, max_new_tokens=NEW_TOKENS, stop_token_ids=(stop,), top_logprobs=2
    )
    out = engine.generate([Request("stopped", prompt, sp)])[0]
    assert out.token_ids[-1] == stop and len(out.token_ids) <= 4
    assert len(out.top_logprobs) == len(out.token_ids)
    assert all(len(t.token_ids) == 2 for t in out.top_logprobs)
