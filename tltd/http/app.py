"""The HTTP application: routes, each behind the bearer-token check of the gRPC method it
stands for, and the one boundary where errors become HTTP statuses."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tltd.http import (
    openai_api,
    openai_sessions,
    sglang_api,
    sglang_control,
    sglang_sessions,
    sglang_weights,
    vllm_api,
    vllm_weights,
)
from tltd.http.auth import BearerAuth
from tltd.http.errors import Renames, failure_body
from tltd.services import Services

log = logging.getLogger(__name__)

Handler = Callable[[Services, Request], Awaitable[Response]]


def build_app(services: Services, tokens) -> Starlette:
    auth = BearerAuth(tokens)

    def route(path: str, name: str, handler: Handler, method: str, renames: Renames) -> Route:
        return Route(
            path, partial(_guarded, auth, name, renames, services, handler), methods=[method]
        )

    oa, sg = openai_api.RENAMES, sglang_api.RENAMES
    sgs = sglang_sessions.RENAMES + sg
    routes = [
        route(
            "/v1/completions",
            "completions",
            openai_sessions.completions,
            "POST",
            openai_sessions.RENAMES + oa,
        ),
        route("/finish_session", "close_session", openai_sessions.finish_session, "POST", oa),
        route("/v1/models", "models", openai_api.models, "GET", oa),
        route("/health", "health", sglang_api.health, "GET", sg),
        # vLLM's own routes, on the job `model` names or the only active one.
        route("/inference/v1/generate", "completions", vllm_api.generate_tokens, "POST", oa),
        route("/get_world_size", "server_info", vllm_api.get_world_size, "GET", oa),
        route("/reset_prefix_cache", "flush_cache", vllm_api.reset_prefix_cache, "POST", oa),
        route("/pause", "pause", vllm_api.pause, "POST", oa),
        route("/resume", "pause", vllm_api.resume, "POST", oa),
        route("/is_paused", "server_info", vllm_api.is_paused, "GET", oa),
        route("/abort_requests", "abort", vllm_api.abort_requests, "POST", oa),
        route("/weight_info", "weight_version", vllm_api.weight_info, "GET", oa),
    ]
    routes += vllm_weights.routes(partial(route, renames=vllm_weights.RENAMES + oa))
    # SGLang's endpoints, on the job the URL names or (without one) the only active job.
    for prefix in ("", "/jobs/{job_id}"):
        routes += [
            route(f"{prefix}/generate", "generate", sglang_sessions.generate, "POST", sgs),
            route(
                f"{prefix}/open_session", "open_session", sglang_sessions.open_session, "POST", sg
            ),
            route(
                f"{prefix}/close_session",
                "close_session",
                sglang_sessions.close_session,
                "POST",
                sg,
            ),
            route(
                f"{prefix}/update_weights_from_disk",
                "update_weights",
                sglang_api.update_weights_from_disk,
                "POST",
                sg,
            ),
            route(f"{prefix}/get_model_info", "model_info", sglang_api.get_model_info, "GET", sg),
        ]
        routes += sglang_control.routes(prefix, partial(route, renames=sg))
        routes += sglang_weights.routes(prefix, partial(route, renames=sg))
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_exception})


async def _guarded(auth, name, renames, services, handler, request: Request) -> Response:
    """Auth, then the handler; a typed error or a database that is down or locked -> its
    status and OpenAI's error JSON, anything else -> 500 with a logged traceback."""
    try:
        auth.check(name, request.headers.get("authorization"))
        return await handler(services, request)
    except Exception as raised:
        status, body = failure_body(raised, renames, f"HTTP {name}")
        if status != 500:
            log.info(
                "http request failed",
                extra={
                    "route": name,
                    "code": body["error"]["code"].upper(),
                    "error": body["error"]["message"],
                },
            )
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return JSONResponse(body, status_code=status, headers=headers)


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    """Unknown paths and methods, in the same error shape."""
    body = {
        "error": {
            "message": f"{request.method} {request.url.path}: {exc.detail}",
            "type": "invalid_request_error",
            "param": None,
            "code": "not_found",
        }
    }
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)
