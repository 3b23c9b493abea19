"""vLLM's server routes beyond the OpenAI API, as RL trainers call them (TRL's VLLMClient,
SkyRL, prime-rl): world size, server info, prefix-cache reset, pause / resume, and the
token-in/token-out `POST /inference/v1/generate`. Each addresses the job named by `model`
(query or body) or, without one, the only active job."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tltd.domain import Job
from tltd.errors import InvalidArgument
from tltd.http import door, openai_api
from tltd.http.sglang_control import weight_version_of
from tltd.http.vocab import Vocab, vocab_for
from tltd.services import PauseMode, Services

RENAMES = openai_api.RENAMES


_job = door.addressed_job


async def get_world_size(services: Services, request: Request) -> JSONResponse:
    """The ranks a trainer's weight group has beside its own: the daemon joins as one rank
    and hands the weights to its workers itself."""
    await _job(services, request)
    return JSONResponse({"world_size": 1})


async def reset_prefix_cache(services: Services, request: Request) -> JSONResponse:
    """The only KV kept across requests (sessions' turns) is dropped by the engine itself when
    new weights load, so nothing stale can be reused and there is nothing to drop."""
    await _job(services, request)
    return JSONResponse({"success": True})


async def pause(services: Services, request: Request) -> JSONResponse:
    """?mode=keep|wait|abort (vLLM's; default abort): see PauseService. `requests`: those
    aborted, waited for, or kept frozen; `frozen_workers`: this node's workers that stopped."""
    job = await _job(services, request)
    query = request.query_params
    # vLLM's older spelling of mode=wait
    waiting = query.get("wait_for_inflight_requests", "false").lower() == "true"
    raw = query.get("mode", "wait" if waiting else "abort")
    try:
        mode = PauseMode(raw)
    except ValueError:
        raise InvalidArgument(f"must be keep, wait or abort, got {raw!r}", field="mode") from None
    timeout = _float(request.query_params.get("timeout", "600"), "timeout")
    count = await services.pauses.pause(job.job_id, mode, timeout)
    frozen = services.pauses.frozen_workers.get(job.job_id, 0)
    return JSONResponse(
        {"status": "paused", "mode": mode.value, "requests": count, "frozen_workers": frozen}
    )


class AbortRequests(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    request_ids: list[str] | None = None


async def abort_requests(services: Services, request: Request) -> JSONResponse:
    """vLLM's abort without a pause: the named requests, or (none named) every open request
    of the job; their samples come back with finish reason abort."""
    body = door.parse(AbortRequests, await request.body() or b"{}")
    job = await _job(services, request)
    reason = "aborted by /abort_requests"
    if body.request_ids:
        count = 0
        for rid in body.request_ids:
            count += await asyncio.to_thread(services.pauses.abort_open, job.job_id, reason, rid)
    else:
        count = await asyncio.to_thread(services.pauses.abort_open, job.job_id, reason)
    return JSONResponse({"status": "aborted", "aborted": count})


async def weight_info(services: Services, request: Request) -> JSONResponse:
    """vLLM's weight version: the label of the job's latest update, else its number."""
    job = await _job(services, request)
    version = await asyncio.to_thread(services.policy.get, job.job_id)
    return JSONResponse(
        {"weight_version": weight_version_of(version), "policy_version": version.version}
    )


async def resume(services: Services, request: Request) -> JSONResponse:
    job = await _job(services, request)
    was = await services.pauses.resume(job.job_id)
    return JSONResponse({"status": "resumed", "was_paused": was})


async def is_paused(services: Services, request: Request) -> JSONResponse:
    job = await _job(services, request)
    paused = await asyncio.to_thread(services.pauses.is_paused, job.job_id)
    return JSONResponse({"is_paused": paused})


def _float(raw: str, field: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise InvalidArgument(f"must be a number, got {raw!r}", field=field) from None


class TokensRequest(BaseModel):
    """vLLM's `POST /inference/v1/generate`: token ids in, sampling parameters as in a
    completion request (the same fields, the same refusals)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    token_ids: list[int]
    sampling_params: dict[str, Any] | None = None
    model: str | None = None
    request_id: str | None = None
    stream: bool = False
    features: Any = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None


async def generate_tokens(services: Services, request: Request) -> Response:
    """One prompt's samples: `choices` with token ids, logprobs and finish reasons."""
    body = door.parse(TokensRequest, await request.body())
    if body.features is not None:
        raise InvalidArgument("multimodal features are not supported", field="features")
    if body.stream:
        raise InvalidArgument("only stream=false", field="stream")
    # The job and its vocabulary in one thread hop (each hop waits for a thread and the GIL:
    # on a loaded node some ms, paid once per prompt on this route).
    job, vocab = await asyncio.to_thread(
        _job_and_vocab, services, door.job_name(request, body.model)
    )
    params = _completion_params(body.sampling_params or {})
    merged = {
        **params,
        "model": job.job_id,
        "prompt": body.token_ids,
        "cache_salt": body.cache_salt,
        "priority": body.priority,
        "kv_transfer_params": body.kv_transfer_params,
        "return_tokens_as_token_ids": True,
    }
    completion = door.parse(openai_api.CompletionRequest, json.dumps(merged).encode())
    rid = door.request_id(
        request.headers.get(door.REQUEST_ID_HEADER), body.request_id, "request_id"
    )
    req = openai_api.to_rollout(completion, job, vocab, rid)
    done = await door.collect(services, req)
    return JSONResponse(
        {
            "request_id": done[0].request_id,
            "choices": [_tokens_choice(completion, req, s, vocab) for s in done],
            "prompt_logprobs": openai_api.prompt_logprobs(
                completion, req.prompts[0], done[0], vocab
            ),
            "kv_transfer_params": None,
        }
    )


def _job_and_vocab(services: Services, name: str | None) -> tuple[Job, Vocab]:
    job = door.find_job(services, name)
    return job, vocab_for(job.model_path)


def _tokens_choice(completion, req, s, vocab) -> dict:
    """One sample in vLLM's token-out choice shape."""
    c = openai_api.choice(completion, req, s, vocab)
    return {
        "index": c["index"],
        "token_ids": list(s.token_ids),
        "logprobs": None if completion.logprobs is None else _token_logprobs(completion, s),
        "finish_reason": c["finish_reason"],
        "stop_reason": c["stop_reason"],
        "tltd": c["tltd"],
    }


# vLLM's engine SamplingParams fields that a completion request does not have, with the values
# tltd honours (None: any value; whole samples are returned, ids always).
_ENGINE_ONLY: dict[str, tuple[Any, ...] | None] = {
    "output_kind": None,
    "detokenize": None,
    "flat_logprobs": None,
    "skip_reading_prefix_cache": None,
    "extra_args": (None, {}),
    "logits_processors": (None, []),
}


def _completion_params(raw: dict[str, Any]) -> dict[str, Any]:
    """The engine's sampling parameters as completion-request fields."""
    params = dict(raw)
    for name, allowed in _ENGINE_ONLY.items():
        if name in params:
            value = params.pop(name)
            if allowed is not None and value not in allowed:
                raise InvalidArgument("not supported by tltd", field=f"sampling_params.{name}")
    return params


def _token_logprobs(completion, s) -> dict:
    """vLLM's token-out logprobs: per position the sampled token and its logprob, with
    max(logprobs, 1) entries of the sampled token then the most likely others (vLLM's
    order: for logprobs=0 the sampled token alone)."""
    keep = max(completion.logprobs, 1)
    tops = s.top_logprobs or [None] * len(s.token_ids)
    floor = openai_api.floor
    return {
        "content": [
            {
                "token": f"token_id:{tok}",
                "logprob": floor(lp),
                "bytes": None,
                "top_logprobs": [
                    {"token": f"token_id:{t}", "logprob": floor(v), "bytes": None}
                    for t, v in openai_api.entries(tok, lp, top)[:keep]
                ],
            }
            for tok, lp, top in zip(s.token_ids, s.logprobs, tops, strict=True)
        ]
    }
