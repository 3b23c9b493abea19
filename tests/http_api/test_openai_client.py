"""The official `openai` client against a real daemon's /v1/completions and /v1/models: token-id
and text prompts, n > 1, logprobs, streaming, seeds, idempotent retries, typed errors."""

from __future__ import annotations

import httpx
import openai
import pytest

from examples.task.tokenizer import SPECIAL_TOKENS, VOCAB, build_tokenizer
from tests.http_api.conftest import JOB
from tltd_clients import RolloutClient

PROMPTS = [[1, 5, 6, 7], [1, 9, 8]]
SPECIAL_IDS = range(len(SPECIAL_TOKENS))


@pytest.fixture(scope="module")
def oai(http_daemon):
    with openai.OpenAI(base_url=f"{http_daemon.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_token_id_prompts_n_and_logprobs(oai, http_daemon):
    out = oai.completions.create(
        model=JOB,
        prompt=PROMPTS,
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=11,
        logprobs=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert [c.index for c in out.choices] == list(range(6))  # prompt-major, as vLLM orders them
    assert out.usage.completion_tokens == 6 * 6
    assert out.usage.prompt_tokens == 7
    by_index = {c.index: c for c in out.choices}
    # The same request over gRPC (same seed, SD off) gives the same tokens and logprobs:
    # one service behind both doors.
    with RolloutClient(http_daemon.target, JOB) as grpc_client:
        grpc_samples = grpc_client.generate(
            PROMPTS, n=3, temperature=1.0, max_new_tokens=6, seed=11
        )
    for s in grpc_samples:
        c = by_index[s.prompt_index * 3 + s.sample_index]
        extra = c.model_extra
        assert extra["token_ids"] == s.token_ids
        assert extra["prompt_token_ids"] == PROMPTS[s.prompt_index]
        # Within float32 rounding: the two calls may be batched differently across the
        # workers, and a batch's sums then differ in the last bits (1.2e-6 seen).
        assert c.logprobs.token_logprobs == pytest.approx(s.logprobs, abs=1e-5)
        assert len(c.logprobs.tokens) == 6 and c.finish_reason == "length"
        assert c.text  # the job's model has a tokenizer


def test_tokens_as_token_ids(oai):
    out = oai.completions.create(
        model=JOB,
        prompt=PROMPTS[0],
        max_tokens=4,
        seed=1,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    c = out.choices[0]
    assert c.logprobs.tokens == [f"token_id:{t}" for t in c.model_extra["token_ids"]]


def test_seed_reproduces_a_sample_with_sd_off(oai):
    def sample(seed):
        out = oai.completions.create(
            model=JOB,
            prompt=PROMPTS[1],
            max_tokens=12,
            seed=seed,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        return out.choices[0].model_extra["token_ids"]

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3))


def test_text_prompt_and_stop_string(oai):
    def greedy(stop):
        return oai.completions.create(
            model=JOB,
            prompt=["12+3=", "4+4="],
            max_tokens=20,
            temperature=0.0,
            stop=stop,
            extra_body={"return_token_ids": True},
        ).choices

    # The model is random, so the stop strings are read from an unstopped greedy run: for each
    # answer, its first plain character from the third token on (a token the model does emit).
    free = [c.model_extra["token_ids"] for c in greedy(None)]
    stop_ids = {next(t for t in ids[2:] if t not in SPECIAL_IDS) for ids in free}
    stopped = greedy([VOCAB[t] for t in sorted(stop_ids)])
    tokenizer = build_tokenizer()
    for c, ids in zip(stopped, free, strict=True):
        end = next(i for i, t in enumerate(ids) if t in stop_ids)
        assert c.model_extra["token_ids"] == ids[: end + 1]  # stopped at the first stop token
        assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == ids[end]
        # The matched stop is not in the text (as OpenAI's): the text is the tokens before it.
        assert c.text == tokenizer.decode(ids[:end])


def test_streaming_one_chunk_per_sample(oai):
    chunks = list(
        oai.completions.create(
            model=JOB,
            prompt=PROMPTS,
            n=2,
            max_tokens=5,
            seed=3,
            logprobs=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    samples = [ch.choices[0] for ch in chunks if ch.choices]
    assert sorted(c.index for c in samples) == [0, 1, 2, 3]
    assert all(c.finish_reason in ("stop", "length") and c.logprobs.token_logprobs for c in samples)
    assert len({ch.id for ch in chunks}) == 1  # one request
    assert chunks[-1].usage.completion_tokens == sum(len(c.logprobs.tokens) for c in samples)


def test_request_id_header_makes_a_retry_attach(oai, http_daemon):
    def call():
        return oai.completions.create(
            model=JOB,
            prompt=PROMPTS[0],
            max_tokens=5,
            logprobs=0,
            extra_headers={"X-Request-Id": "http-retry-1"},
            extra_body={"return_token_ids": True},
        )

    first, again = call(), call()
    assert first.id == again.id == "http-retry-1"
    assert first.choices[0].model_extra["token_ids"] == again.choices[0].model_extra["token_ids"]
    with RolloutClient(http_daemon.target, JOB) as c:  # stored like any gRPC request
        assert c.raw.get_request("http-retry-1").request.status == 3  # COMPLETED


def test_models_lists_active_jobs(oai):
    assert JOB in [m.id for m in oai.models.list().data]


def test_errors_are_typed_exceptions_and_the_daemon_keeps_serving(oai, http_daemon):
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="no-such-job", prompt=[1, 2], max_tokens=2)
    assert info.value.body["param"] == "model"
    cases = [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"logprobs": 129}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"prompt": [1, 999]}, "prompt[0][1]"),
        ({"prompt": [[1], "x", 3]}, "prompt[2]"),
        ({"stop": ["12"]}, "stop[0]"),
        ({"extra_body": {"min_tokens": 3}}, "min_tokens"),
        ({"extra_body": {"top_k": -5}}, "top_k"),
        ({"extra_body": {"request_id": "bad id"}}, "request_id"),
    ]
    for extra, param in cases:
        kwargs = {"model": JOB, "prompt": [1, 2], "max_tokens": 2} | extra
        with pytest.raises(openai.BadRequestError) as info:
            oai.completions.create(**kwargs)
        assert info.value.body["param"] == param, (extra, info.value.body)
        assert param in info.value.body["message"]
    malformed = httpx.post(f"{http_daemon.url}/v1/completions", content=b'{"model": ')
    assert malformed.status_code == 400 and malformed.json()["error"]["param"] == "body"
    assert oai.completions.create(model=JOB, prompt=[1, 2], max_tokens=2).choices
