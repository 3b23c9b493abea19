"""What both HTTP APIs share: body parsing, job lookup, request ids, running a rollout through
the rollout service (the same admission, idempotency and persistence as gRPC Generate) and
server-sent events."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from tltd.domain import FinishReason, Job, JobStatus, RolloutRequest, Sample
from tltd.errors import InvalidArgument, NotFound
from tltd.http.errors import from_validation
from tltd.services import Services
from tltd.services.validation import check_id

M = TypeVar("M", bound=BaseModel)

REQUEST_ID_HEADER = "x-request-id"  # vLLM's request-id header; a retry with it attaches


def parse(model: type[M], body: bytes) -> M:
    """The body as `model`; InvalidArgument naming the first bad field otherwise."""
    try:
        return model.model_validate_json(body or b"null")
    except ValidationError as exc:
        raise from_validation(exc) from None


def request_id(header: str | None, body_value: str | None, field: str) -> str:
    """The caller's idempotency key (header or body; both must agree); "" = a new request."""
    if header and body_value and header != body_value:
        raise InvalidArgument(
            f"differs from the X-Request-Id header ({header!r} vs {body_value!r})", field=field
        )
    value = header or body_value or ""
    check_id(value, field if body_value else "X-Request-Id", required=False)
    return value


async def get_job(services: Services, job_id: str) -> Job:
    return await asyncio.to_thread(services.jobs.get, job_id)


def sole_active_job(services: Services) -> Job:
    """The job of a URL that names none: the only active one, or an error saying to name it
    (reads the store: call it off the event loop)."""
    jobs = services.jobs.list([JobStatus.ACTIVE], 2)
    if not jobs:
        raise NotFound("no active job (create one with tltctl or gRPC CreateJob)", field="job")
    if len(jobs) > 1:
        raise InvalidArgument(
            "several jobs are active: name one in the URL, /jobs/<job_id>/...", field="job"
        )
    return jobs[0]


def job_name(request, model: str | None = None) -> str | None:
    """The job a route names: the URL's /jobs/<job_id>/ prefix, else `model` (a body's field
    or the ?model= query); None: the only active job."""
    return request.path_params.get("job_id") or model or request.query_params.get("model")


def find_job(services: Services, name: str | None) -> Job:
    """The job `name` names, or the only active one (reads the store: off the event loop)."""
    return services.jobs.get(name) if name else sole_active_job(services)


async def addressed_job(services: Services, request, model: str | None = None) -> Job:
    """The job a route addresses (`job_name`)."""
    return await asyncio.to_thread(find_job, services, job_name(request, model))


async def collect(services: Services, req: RolloutRequest) -> list[Sample]:
    """Every sample of the request, in (prompt, sample) order.

    The answer is whole once each of the request's samples is in, complete and not failed:
    nothing else can come, so it goes out then rather than after the daemon has closed the
    request's books (its status write, on a loaded store tens of ms per request, paid once
    per prompt by vLLM's one-prompt route). Otherwise (a failed or partial sample) the stream
    runs to its end, which raises for a failed request as before."""
    expected = len(req.prompts) * req.sampling.n
    samples: list[Sample] = []
    stream = services.rollouts.generate(req)
    try:
        async for sample in stream:
            samples.append(sample)
            if len(samples) == expected and all(_settled(s) for s in samples):
                break
    finally:
        await stream.aclose()
    samples.sort(key=lambda s: (s.prompt_index, s.sample_index))
    return samples


def _settled(sample: Sample) -> bool:
    """A sample that no later event of its request can replace or turn into an error."""
    return not sample.partial and sample.finish_reason is not FinishReason.FAILED


async def open_stream(
    services: Services, req: RolloutRequest
) -> tuple[RolloutRequest, AsyncIterator[Sample]]:
    """Validate and admit-check first, so that a bad request is an HTTP error status rather
    than an error event inside a 200 stream; then the samples as they finish."""
    prepared = await asyncio.to_thread(services.rollouts.prepare, req)
    return prepared, services.rollouts.generate(prepared)


def sse(data: dict | str) -> str:
    """One server-sent event carrying JSON (or the literal [DONE])."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"
