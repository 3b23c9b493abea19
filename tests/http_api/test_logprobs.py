"""Top alternatives and prompt logprobs over the HTTP door, against a real daemon: vLLM's
shapes (`logprobs=N`, `prompt_logprobs` on /v1/completions and /inference/v1/generate),
SGLang's meta_info (`top_logprobs_num`, `logprob_start_len`), the values those of a
`transformers` forward of the same model, and bad counts refused by name."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.http_api.conftest import JOB

PROMPTS = [[1, 5, 6, 7, 5, 6], [1, 9, 8]]
N, PROMPT_N = 3, 2


@pytest.fixture(scope="module")
def http(http_daemon):
    with httpx.Client(base_url=http_daemon.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def hf(text_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(text_model, dtype=torch.float32).eval()


def _dist(hf, ids: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every position (row j predicts token j + 1); at
    temperature 1 without top-k / top-p this is the distribution tltd's logprobs refer to."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-4


def _token(key: str) -> int:
    assert key.startswith("token_id:")
    return int(key.split(":")[1])


def test_completion_top_and_prompt_logprobs_are_the_targets(http, hf):
    body = {
        "model": JOB,
        "prompt": PROMPTS,
        "n": 2,
        "max_tokens": 5,
        "temperature": 1.0,
        "seed": 11,
        "logprobs": N,
        "prompt_logprobs": PROMPT_N,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 4
    for c in choices:
        prompt, out = c["prompt_token_ids"], c["token_ids"]
        dist = _dist(hf, prompt + out)
        lp = c["logprobs"]
        assert len(lp["top_logprobs"]) == len(out)
        for i, (tok, top) in enumerate(zip(out, lp["top_logprobs"], strict=True)):
            row = dist[len(prompt) - 1 + i]
            # vLLM's: the sampled token and the N most likely (N + 1 keys, N if among them)
            ids = [_token(k) for k in top]
            best = row.topk(N).indices.tolist()
            assert ids[0] == tok and set(best) <= set(ids)
            assert len(ids) == (N if tok in best else N + 1)
            assert all(_close(v, float(row[_token(k)])) for k, v in top.items())
            assert _close(lp["token_logprobs"][i], float(row[tok]))
        pl = c["prompt_logprobs"]
        assert pl[0] is None and len(pl) == len(prompt)
        pdist = _dist(hf, prompt)
        for j, entry in enumerate(pl[1:], start=1):
            row = pdist[j - 1]
            tok = prompt[j]
            assert list(entry)[0] == str(tok)  # the prompt token first
            assert _close(entry[str(tok)]["logprob"], float(row[tok]))
            assert entry[str(tok)]["rank"] == int((row >= row[tok]).sum())
            for rank, t in enumerate(row.topk(PROMPT_N).indices.tolist(), start=1):
                assert entry[str(t)]["rank"] == rank
                assert _close(entry[str(t)]["logprob"], float(row[t]))
                assert entry[str(t)]["decoded_token"] == f"token_id:{t}"


def test_tokens_route_carries_the_same_values(http):
    params = {"max_tokens": 4, "temperature": 1.0, "seed": 5, "logprobs": N, "prompt_logprobs": 0}
    r = http.post(
        "/inference/v1/generate", json={"token_ids": PROMPTS[0], "sampling_params": params}
    )
    assert r.status_code == 200, r.text
    out = r.json()
    ref = http.post(
        "/v1/completions",
        json={
            "model": JOB,
            "prompt": PROMPTS[0],
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            **params,
        },
    ).json()["choices"][0]
    content = out["choices"][0]["logprobs"]["content"]
    for e, tok, top in zip(
        content, out["choices"][0]["token_ids"], ref["logprobs"]["top_logprobs"], strict=True
    ):
        # vLLM's token-out order: max(N, 1) entries, the sampled token first
        assert len(e["top_logprobs"]) == N
        assert e["top_logprobs"][0] == {
            "token": f"token_id:{tok}",
            "logprob": e["logprob"],
            "bytes": None,
        }
        assert [x["logprob"] for x in e["top_logprobs"]] == list(top.values())[:N]
    assert out["prompt_logprobs"] == ref["prompt_logprobs"]
    assert out["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in out["prompt_logprobs"][1:])  # 0: the token alone


def test_grpc_client_gets_the_same_values(http, http_daemon):
    """The same request over gRPC (the Python client's keywords) carries what HTTP shows."""
    from tltd_clients import RolloutClient

    body = {"model": JOB, "prompt": PROMPTS[1], "max_tokens": 4, "temperature": 1.0, "seed": 21}
    ref = http.post(
        "/v1/completions",
        json={**body, "logprobs": 2, "prompt_logprobs": 1, "return_tokens_as_token_ids": True},
    ).json()["choices"][0]
    with RolloutClient(http_daemon.target, JOB) as c:
        (s,) = c.generate(
            [PROMPTS[1]],
            temperature=1.0,
            max_new_tokens=4,
            seed=21,
            stop_token_ids=[2],
            top_logprobs=2,
            prompt_logprobs=1,
        )
    assert [f"token_id:{t}" for t in s.token_ids] == ref["logprobs"]["tokens"]
    for top, want in zip(s.top_logprobs, ref["logprobs"]["top_logprobs"], strict=True):
        for t, v in zip(top.token_ids, top.logprobs, strict=True):
            assert v == pytest.approx(want[f"token_id:{t}"], abs=1e-5)  # float32 on the wire
    pl = s.prompt_logprobs
    for j, entry in enumerate(ref["prompt_logprobs"][1:]):
        tok = str(PROMPTS[1][j + 1])
        assert pl.logprobs[j] == pytest.approx(entry[tok]["logprob"], abs=1e-5)
        assert pl.ranks[j] == entry[tok]["rank"]
        assert str(pl.top[j].token_ids[0]) in entry
    with RolloutClient(http_daemon.target, JOB) as c_bare:
        (bare,) = c_bare.generate([PROMPTS[1]], max_new_tokens=2, seed=21)
    assert bare.top_logprobs is None and bare.prompt_logprobs is None


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
        ("/v1/completions", {"logprobs": 129}, "logprobs"),
        ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": 129}, "prompt_logprobs"),
        ("/generate", {"return_logprob": True, "top_logprobs_num": 129}, "top_logprobs_num"),
        ("/generate", {"return_logprob": True, "top_logprobs_num": -2}, "top_logprobs_num"),
        ("/generate", {"return_logprob": True, "logprob_start_len": -3}, "logprob_start_len"),
        ("/generate", {"return_logprob": True, "logprob_start_len": 6}, "logprob_start_len"),
    ],
)
def test_bad_counts_are_refused_by_name(http, path, body, field):
    if path == "/generate":
        full = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}, **body}
    else:
        full = {"model": JOB, "prompt": PROMPTS[0], "max_tokens": 2, **body}
    r = http.post(path, json=full)
    assert r.status_code == 400, r.text
    err = r.json()
    param = err["error"]["param"] if "error" in err else err.get("param")
    assert param == field, err


def test_sglang_meta_info_logprobs(http, hf):
    body = {
        "input_ids": PROMPTS[0],
        "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 2},
        "return_logprob": True,
        "top_logprobs_num": N,
        "logprob_start_len": 2,
    }
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    meta, out = r.json()["meta_info"], r.json()["output_ids"]
    prompt = PROMPTS[0]
    dist = _dist(hf, prompt + out)
    # input: from logprob_start_len, the first entry without a logprob (SGLang's)
    inp = meta["input_token_logprobs"]
    assert [e[1] for e in inp] == prompt[2:] and inp[0][0] is None
    for j, (lp, tok, text) in enumerate(inp[1:], start=3):
        assert _close(lp, float(dist[j - 1, tok])) and text is None
    tops = meta["input_top_logprobs"]
    assert tops[0] is None and len(tops) == len(inp)
    for j, top in enumerate(tops[1:], start=3):
        assert [e[1] for e in top] == dist[j - 1].topk(N).indices.tolist()
        assert all(_close(v, float(dist[j - 1, t])) for v, t, _ in top)
    outs = meta["output_token_logprobs"]
    assert [e[1] for e in outs] == out
    for i, (top, (lp, tok, _)) in enumerate(zip(meta["output_top_logprobs"], outs, strict=True)):
        row = dist[len(prompt) - 1 + i]
        assert _close(lp, float(row[tok]))
        assert [e[1] for e in top] == row.topk(N).indices.tolist()
        assert all(_close(v, float(row[t])) for v, t, _ in top)
    # SGLang's default start (-1): the last prompt token alone, nothing computed for it
    r = http.post("/generate", json={**body, "logprob_start_len": -1, "top_logprobs_num": 0})
    meta = r.json()["meta_info"]
    assert meta["input_token_logprobs"] == [[None, prompt[-1], None]]
    assert "input_top_logprobs" not in meta
