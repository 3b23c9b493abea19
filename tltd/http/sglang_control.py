"""SGLang's control routes as slime, AReaL and SkyRL call them around a weight update:
pause / continue, abort, cache flush, server info, weight version and a generating health
check, on the job the URL names (/jobs/<job_id>/...) or the only active one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tltd.domain import MAX_TOP_LOGPROBS, Job, RolloutRequest, SamplingParams
from tltd.errors import InvalidArgument, Unavailable
from tltd.http import door, vllm_weights
from tltd.services import PauseMode, Services

# SGLang's pause modes -> tltd's. in_place and retract both freeze the requests in flight
# where they stand (their workers stop stepping, their KV cache kept: tltd does not retract a
# request to recompute its prefix), and they continue after /continue_generation.
_MODES = {"abort": PauseMode.ABORT, "in_place": PauseMode.KEEP, "retract": PauseMode.KEEP}


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    mode: str = "abort"
    rid: str | None = None  # SGLang's id of the control request itself: unused


class ContinueRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    rid: str | None = None
    torch_empty_cache: bool = False  # no CUDA cache to empty


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    rid: str = ""
    abort_all: bool = False
    abort_message: str | None = None


_job = door.addressed_job


async def pause_generation(services: Services, request: Request) -> JSONResponse:
    """SGLang's modes: abort (default; in-flight requests return finish reason abort with
    their output so far), in_place and retract (they freeze in place until continued). New
    requests wait."""
    body = door.parse(PauseRequest, await request.body() or b"{}")
    if body.mode not in _MODES:
        raise InvalidArgument(
            f"must be abort, in_place or retract, got {body.mode!r}", field="mode"
        )
    job = await _job(services, request)
    mode = _MODES[body.mode]
    count = await services.pauses.pause(job.job_id, mode)
    return JSONResponse(
        {
            "message": "Generation paused successfully.",
            "status": "ok",
            "aborted": count if mode is PauseMode.ABORT else 0,
            "frozen_workers": services.pauses.frozen_workers.get(job.job_id, 0),
        }
    )


async def continue_generation(services: Services, request: Request) -> JSONResponse:
    door.parse(ContinueRequest, await request.body() or b"{}")
    job = await _job(services, request)
    await services.pauses.resume(job.job_id)
    return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})


async def abort_request(services: Services, request: Request) -> JSONResponse:
    """One request by rid, or all of the job's open requests (abort_all, or an empty rid as
    SGLang reads it): their samples come back with finish reason abort."""
    body = door.parse(AbortRequest, await request.body() or b"{}")
    job = await _job(services, request)
    rid = None if body.abort_all or not body.rid else body.rid
    reason = body.abort_message or "aborted by /abort_request"
    count = await asyncio.to_thread(services.pauses.abort_open, job.job_id, reason, rid)
    return JSONResponse({"success": True, "aborted": count})


async def flush_cache(services: Services, request: Request) -> Response:
    """tltd keeps no KV cache across requests: nothing stale survives a weight update."""
    await _job(services, request)
    return Response("Cache flushed.\n", status_code=200)


async def server_info(services: Services, request: Request) -> JSONResponse:
    """SGLang's server arguments that trainers read, tltd's own, and (for vLLM's callers of
    the same path) `vllm_config`."""
    job = await _job(services, request)
    version = await asyncio.to_thread(services.policy.get, job.job_id)
    info: dict[str, Any] = {
        "model_path": job.model_path,
        "tokenizer_path": job.model_path,
        "served_model_name": job.job_id,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "weight_version": weight_version_of(version),
        "paused": await asyncio.to_thread(services.pauses.is_paused, job.job_id),
        "internal_states": [{"policy_version": job.policy_version}],
        "tltd": {
            "job_id": job.job_id,
            # this node's requests held at admission by a pause, workers frozen by one
            "held_requests": services.pauses.held(job.job_id),
            "frozen_workers": services.pauses.frozen_workers.get(job.job_id, 0),
            "backend": job.backend.value,
            "policy_version": job.policy_version,
            "drafter_version": job.drafter_version,
            "speculative": job.speculative.mode.value,
        },
    }
    vllm = vllm_config(job)
    as_json = request.query_params.get("config_format", "text") == "json"
    info["vllm_config"] = vllm if as_json else json.dumps(vllm)
    return JSONResponse(info)


def vllm_config(job: Job) -> dict:
    """What vLLM's /server_info says of its configuration, for this job."""
    return {
        "model_config": {
            "model": job.model_path,
            "served_model_name": job.job_id,
            "logprobs_mode": "processed_logprobs",
            "max_logprobs": MAX_TOP_LOGPROBS,
        },
        "parallel_config": {"tensor_parallel_size": 1, "data_parallel_size": 1},
        # vLLM's weight-transfer routes, on a gloo group the trainer hosts (vllm_weights).
        "weight_transfer_config": vllm_weights.CONFIG,
    }


async def get_weight_version(services: Services, request: Request) -> JSONResponse:
    job = await _job(services, request)
    version = await asyncio.to_thread(services.policy.get, job.job_id)
    return JSONResponse(
        {"weight_version": weight_version_of(version), "policy_version": version.version}
    )


def weight_version_of(version) -> str:
    """The label the trainer gave the update (weight_version), else tltd's version number."""
    prefix = "weight_version="
    return version.note[len(prefix) :] if version.note.startswith(prefix) else str(version.version)


async def health_generate(services: Services, request: Request) -> Response:
    """Healthy when the job generates one token now (SGLang's /health_generate)."""
    if services.node.draining:
        raise Unavailable("node is draining: not accepting new rollouts")
    job = await _job(services, request)
    req = RolloutRequest(
        "", job.job_id, ((0,),), SamplingParams(n=1, temperature=0.0, max_new_tokens=1)
    )
    samples = await door.collect(services, req)
    if not samples or not samples[0].token_ids:
        raise Unavailable("the job generated no token")
    return Response(status_code=200)


def routes(prefix: str, route: Callable[..., Route]) -> list[Route]:
    """These routes under `prefix` ("" or "/jobs/{job_id}")."""
    out = [
        route(f"{prefix}/pause_generation", "pause", pause_generation, "POST"),
        route(f"{prefix}/continue_generation", "pause", continue_generation, "POST"),
        route(f"{prefix}/abort_request", "abort", abort_request, "POST"),
        route(f"{prefix}/get_server_info", "server_info", server_info, "GET"),
        route(f"{prefix}/get_weight_version", "weight_version", get_weight_version, "GET"),
        route(f"{prefix}/health_generate", "generate", health_generate, "GET"),
    ]
    for method in ("GET", "POST"):  # slime GETs it, SGLang serves both
        out.append(route(f"{prefix}/flush_cache", "flush_cache", flush_cache, method))
    # /server_info is SGLang's newer name and vLLM's route both: one answer serves either.
    out.append(route(f"{prefix}/server_info", "server_info", server_info, "GET"))
    return out
