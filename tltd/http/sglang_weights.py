"""SGLang's distributed weight-update routes (the trainer hosts a gloo group as rank 0 and
broadcasts; `tltd.services.weight_groups` receives), on the job the URL names or the only
active one. `/update_weights_from_tensor` passes CUDA IPC handles between processes of one
GPU host: a 400 naming it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tltd.errors import InvalidArgument
from tltd.http import door
from tltd.services import Services


class InitGroupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    master_address: str
    master_port: int | str  # AReaL sends it as a string
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    # SGLang's default: a trainer that names no backend hosts an NCCL group, which the daemon
    # (a CPU rank) refuses at once rather than wait for a gloo rendezvous that never comes.
    backend: str = "nccl"
    rid: str | None = None  # SGLang's id of the control request itself: unused


class UpdateFromDistributedRequest(BaseModel):
    """SGLang's lists (names, dtypes, shapes) or its older single tensor (SkyRL's)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    names: list[str] | None = None
    dtypes: list[str] | None = None
    shapes: list[list[int]] | None = None
    name: str | None = None
    dtype: str | None = None
    shape: list[int] | None = None
    group_name: str = "weight_update_group"
    flush_cache: bool = True  # tltd keeps no KV cache across requests: nothing to drop
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    rid: str | None = None
    torch_empty_cache: bool = False  # no CUDA cache to empty
    selector: Any = None  # which runners of an engine: tltd's one rank takes all


class DestroyGroupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    group_name: str = "weight_update_group"
    rid: str | None = None


async def init_weights_update_group(services: Services, request: Request) -> JSONResponse:
    body = door.parse(InitGroupRequest, await request.body())
    port = _port(body.master_port)
    job = await door.addressed_job(services, request)
    await asyncio.to_thread(
        services.weight_groups.init_group,
        job.job_id,
        body.group_name,
        body.master_address,
        port,
        body.rank_offset,
        body.world_size,
        body.backend,
    )
    return JSONResponse({"success": True, "message": f"joined {body.group_name}"})


async def update_weights_from_distributed(services: Services, request: Request) -> JSONResponse:
    body = door.parse(UpdateFromDistributedRequest, await request.body())
    if body.load_format not in (None, "auto"):
        raise InvalidArgument("only full tensors (auto)", field="load_format")
    if body.selector is not None:
        raise InvalidArgument("not supported: only null", field="selector")
    tensors = _tensors(body)
    job = await door.addressed_job(services, request)
    if body.abort_all_requests:
        await asyncio.to_thread(
            services.pauses.abort_open, job.job_id, "aborted by a weight update"
        )
    note = f"weight_version={body.weight_version}" if body.weight_version else ""
    done = await asyncio.to_thread(
        services.weight_groups.update, job.job_id, body.group_name, tensors, note
    )
    out: dict[str, Any] = {
        "success": True,
        "received": done.received,
        "pending": done.pending,
        "message": "version recorded" if done.version else f"{done.pending} tensors to come",
    }
    if done.version is not None:
        out["policy_version"] = done.version.version
        out["weight_version"] = body.weight_version or str(done.version.version)
    return JSONResponse(out)


async def destroy_weights_update_group(services: Services, request: Request) -> JSONResponse:
    body = door.parse(DestroyGroupRequest, await request.body() or b"{}")
    job = await door.addressed_job(services, request)
    was = services.weight_groups.destroy(job.job_id, body.group_name)
    return JSONResponse({"success": was, "message": "destroyed" if was else "no such group"})


async def update_weights_from_tensor(services: Services, request: Request) -> JSONResponse:
    raise InvalidArgument(
        "needs CUDA IPC handles between processes of one GPU host; send the weights with "
        "/update_weights_from_distributed (gloo), /update_weights_from_disk or gRPC PushPolicy",
        field="serialized_named_tensors",
    )


def _port(value: int | str) -> int:
    try:
        return int(value)
    except ValueError:
        raise InvalidArgument(
            f"must be a port number, got {value!r}", field="master_port"
        ) from None


def _tensors(body: UpdateFromDistributedRequest) -> list[tuple[str, str, tuple[int, ...]]]:
    if body.names is not None:
        names, dtypes, shapes = body.names, body.dtypes or [], body.shapes or []
        if not names or not len(names) == len(dtypes) == len(shapes):
            raise InvalidArgument(
                "names, dtypes and shapes must be non-empty and of one length", field="names"
            )
        return [(n, d, tuple(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]
    if body.name is None or body.dtype is None or body.shape is None:
        raise InvalidArgument("give names/dtypes/shapes, or name/dtype/shape", field="names")
    return [(body.name, body.dtype, tuple(body.shape))]


def routes(prefix: str, route: Callable[..., Route]) -> list[Route]:
    """These routes under `prefix` ("" or "/jobs/{job_id}")."""
    return [
        route(
            f"{prefix}/init_weights_update_group",
            "weights_group",
            init_weights_update_group,
            "POST",
        ),
        route(
            f"{prefix}/update_weights_from_distributed",
            "weights_group",
            update_weights_from_distributed,
            "POST",
        ),
        route(
            f"{prefix}/destroy_weights_update_group",
            "weights_group",
            destroy_weights_update_group,
            "POST",
        ),
        route(
            f"{prefix}/update_weights_from_tensor",
            "update_weights",
            update_weights_from_tensor,
            "POST",
        ),
    ]
