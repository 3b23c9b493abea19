"""Both logprob modes against `transformers` on the shipped policy (whatever models/tiny-policy
holds): "processed" is the law the token was drawn from, "raw" is log_softmax(logits)."""

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
TEMPERATURE, TOP_K, TOP_P = 0.7, 20, 0.9
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        MODEL, local_files_only=True, torch_dtype=torch.float32
    ).eval()


def _prompts() -> list[list[int]]:
    """A few short prompts of valid token ids for whatever model is shipped (it starts with
    BOS when the config names one); repeated spans give the n-gram drafter matches."""
    cfg = json.loads((MODEL / "config.json").read_text())
    rng = random.Random(0)
    bos = cfg.get("bos_token_id")
    head = [bos] if isinstance(bos, int) else []
    out = []
    for length in (5, 8):
        body = [rng.randrange(cfg["vocab_size"]) for _ in range(length)]
        out.append(head + body + body[:3])
    return out


def _reference(hf, prompt: list[int], tokens: list[int], temperature: float) -> dict:
    """HF's log-probabilities of `tokens` after `prompt`: raw, and processed with HF's own
    warpers in generate()'s order (temperature, top-k, top-p); greedy rows are raw."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()  # predicts each output token
    idx = torch.tensor(tokens)[:, None]
    raw = torch.log_softmax(logits, -1).gather(-1, idx)[:, 0]
    if temperature == 0:
        return {LogprobMode.RAW: raw, LogprobMode.PROCESSED: raw}
    scores = logits
    for warp in (
        TemperatureLogitsWarper(temperature),
        TopKLogitsWarper(TOP_K),
        TopPLogitsWarper(TOP_P),
    ):
        scores = warp(ids, scores)
    processed = torch.log_softmax(scores, -1).gather(-1, idx)[:, 0]
    return {LogprobMode.RAW: raw, LogprobMode.PROCESSED: processed}


@pytest.mark.parametrize(
    ("spec_mode", "drafter"), [("off", "ngram"), ("fixed", "ngram"), ("fixed", "history")]
)
def test_both_logprob_modes_match_transformers(hf, spec_mode, drafter):
    prompts = _prompts()
    engine = Engine(
        str(MODEL),
        EngineConfig(
            max_batch=16,
            spec_mode=spec_mode,
            strategies=(Strategy(drafter, 3),),
            device=torch_device(),
        ),
    )
    if drafter == "history":  # earlier answers to the prompts, for the history to draft from
        sp = SamplingParams(n=2, temperature=TEMPERATURE, max_new_tokens=NEW_TOKENS, seed=3)
        engine.generate([Request(f"earlier{i}", p, sp) for i, p in enumerate(prompts)])
        engine.stats.reset()
    for temperature in (TEMPERATURE, 0.0):
        for mode in LogprobMode:
            sp = SamplingParams(
                n=2,
                temperature=temperature,
                top_k=TOP_K,
                top_p=TOP_P,
                max_new_tokens=NEW_TOKENS,
                seed=7,
                logprob_mode=mode,
            )
            for i, p in enumerate(prompts):
                engine.add_request(f"{temperature}-{mode}-{i}", p, sp, prompt_index=i)
    outs = []
    while engine.has_work():
        outs.extend(engine.step())
    assert len(outs) == 2 * 2 * len(prompts) * 2
    tokens: dict[tuple[float, int, int], dict[LogprobMode, list[int]]] = {}
    gaps = []
    for o in outs:
        temperature, mode, _ = o.request_id.split("-")
        temperature, mode = float(temperature), LogprobMode(mode)
        ref = _reference(hf, prompts[o.prompt_index], o.token_ids, temperature)
        got = torch.tensor(o.logprobs)
        torch.testing.assert_close(got, ref[mode], atol=1e-4, rtol=1e-4)
        gaps.append(float((ref[LogprobMode.RAW] - ref[LogprobMode.PROCESSED]).abs().max()))
        tokens.setdefault((temperature, o.prompt_index, o.sample_index), {})[mode] = o.token_ids
    # The modes really differ for sampled rows (else the comparison above proves nothing) ...
    assert max(gaps) > 0.05
    # ... and the mode changes only what is returned: the same seeded tokens either way.
    for per_mode in tokens.values():
        assert per_mode[LogprobMode.PROCESSED] == per_mode[LogprobMode.RAW]
    if spec_mode == "fixed":  # some logprobs came from verify passes
        assert engine.stats.summary()["row_steps"]["draft"] > 0
