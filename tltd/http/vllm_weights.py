"""vLLM's weight-transfer routes (`/init_weight_transfer_engine`, `/start_weight_update`,
`/update_weights`, `/finish_weight_update`) on the daemon's gloo weight groups: the trainer is
rank 0 of a group it hosts the plain torch way (`init_process_group("gloo", "tcp://...")`),
the daemon joins at `rank_offset`; each update names tensors the trainer then broadcasts in
that order, and `finish` records what arrived as the job's next policy version."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tltd.contract.broadcast import default_group_prefix
from tltd.errors import InvalidArgument
from tltd.http import door
from tltd.services import Services

# The daemon's name for a job's vLLM-style group (never on the wire: vLLM's has none).
GROUP = "vllm_weight_transfer"
# WeightGroupService's field paths as these routes spell them.
RENAMES = (
    (r"^(master_address|master_port|rank_offset|world_size|backend)$", r"init_info.\1"),
    (r"^names\[(\d+)\]$", r"update_info.names[\1]"),
    (r"^dtypes\[(\d+)\]$", r"update_info.dtype_names[\1]"),
    (r"^shapes\[(\d+)\]$", r"update_info.shapes[\1]"),
    (r"^group_name$", "init_info"),
)
# What /server_info's weight_transfer_config says (vLLM's WeightTransferConfig).
CONFIG = {"backend": "gloo"}


class InitInfo(BaseModel):
    """vLLM's NCCLWeightTransferInitInfo, with gloo as the only backend."""

    model_config = ConfigDict(extra="forbid", strict=True)
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    backend: str = "gloo"
    timeout_seconds: float = 300.0


class InitBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    init_info: InitInfo


class UpdateInfo(BaseModel):
    """vLLM's NCCLWeightTransferUpdateInfo: full tensors broadcast one by one."""

    model_config = ConfigDict(extra="forbid", strict=True)
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool = False
    packed_buffer_size_bytes: int | None = None
    packed_num_buffers: int | None = None
    is_checkpoint_format: bool = True


class UpdateBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    update_info: UpdateInfo


class FinishBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    weight_version: str | None = None


async def init_weight_transfer_engine(services: Services, request: Request) -> JSONResponse:
    """Join the trainer's group (blocks until every rank has)."""
    info = door.parse(InitBody, await request.body()).init_info
    if info.packed:
        raise InvalidArgument(
            "packed buffers are not served: send tensors one by one", field="init_info.packed"
        )
    job = await door.addressed_job(services, request)
    await asyncio.to_thread(
        services.weight_groups.init_group,
        job.job_id,
        GROUP,
        info.master_address,
        info.master_port,
        info.rank_offset,
        info.world_size,
        info.backend,
        info.timeout_seconds,
        default_group_prefix(),
    )
    return JSONResponse({"message": "Weight transfer initialized"})


async def start_weight_update(services: Services, request: Request) -> JSONResponse:
    job = await door.addressed_job(services, request)
    await asyncio.to_thread(services.weight_groups.start, job.job_id, GROUP)
    return JSONResponse({"message": "Weight update started"})


async def update_weights(services: Services, request: Request) -> JSONResponse:
    """Receive the named tensors as rank 0 broadcasts them, in order."""
    info = door.parse(UpdateBody, await request.body()).update_info
    if info.packed:
        raise InvalidArgument(
            "packed buffers are not served: send tensors one by one", field="update_info.packed"
        )
    if not info.is_checkpoint_format:
        raise InvalidArgument(
            "only the checkpoint's own tensor names (true)",
            field="update_info.is_checkpoint_format",
        )
    if not info.names or not len(info.names) == len(info.dtype_names) == len(info.shapes):
        raise InvalidArgument(
            "names, dtype_names and shapes must be non-empty and of one length",
            field="update_info.names",
        )
    tensors = [
        (n, d, tuple(s)) for n, d, s in zip(info.names, info.dtype_names, info.shapes, strict=True)
    ]
    job = await door.addressed_job(services, request)
    done = await asyncio.to_thread(services.weight_groups.update, job.job_id, GROUP, tensors)
    return JSONResponse({"message": "Weights updated", "received": done.received})


async def finish_weight_update(services: Services, request: Request) -> JSONResponse:
    """The update's tensors (and the current version's for the rest) become the job's next
    policy version, labelled `weight_version` when given."""
    body = door.parse(FinishBody, await request.body() or b"{}")
    job = await door.addressed_job(services, request)
    note = f"weight_version={body.weight_version}" if body.weight_version else ""
    version = await asyncio.to_thread(services.weight_groups.finish, job.job_id, GROUP, note)
    return JSONResponse(
        {
            "message": "Weight update finished",
            "policy_version": version.version,
            "weight_version": body.weight_version or str(version.version),
        }
    )


def routes(route: Callable[..., Route]) -> list[Route]:
    return [
        route("/init_weight_transfer_engine", "weights_group", init_weight_transfer_engine, "POST"),
        route("/start_weight_update", "weights_group", start_weight_update, "POST"),
        route("/update_weights", "weights_group", update_weights, "POST"),
        route("/finish_weight_update", "weights_group", finish_weight_update, "POST"),
    ]
