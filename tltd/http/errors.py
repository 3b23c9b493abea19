"""The one place HTTP errors are made: a typed error -> the HTTP status matching its gRPC code,
in OpenAI's error JSON, naming the field as the HTTP caller spelled it."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

import grpc
from pydantic import ValidationError

from tltd.errors import InvalidArgument, TltError, typed_error

log = logging.getLogger(__name__)

# The status an HTTP caller sees for each gRPC code (google.rpc's own HTTP mapping, except
# FAILED_PRECONDITION: a cancelled job or a finished request is a conflict with the
# resource's state, 409, not a malformed request).
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.INTERNAL: 500,
}
_OPENAI_TYPE = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "server_error",
    503: "server_error",
}

# How one door spells the domain's field paths: (pattern on the domain field, replacement).
Renames = Sequence[tuple[str, str]]


def rename_field(field: str | None, renames: Renames) -> str | None:
    if field is None:
        return None
    for pattern, replacement in renames:
        renamed, hits = re.subn(pattern, replacement, field, count=1)
        if hits:
            return renamed
    return field


def error_body(exc: TltError, renames: Renames = ()) -> tuple[int, dict]:
    """(HTTP status, {"error": {message, type, param, code}}) for a typed error."""
    status = HTTP_STATUS.get(exc.code, 500)
    message = str(exc)
    param = rename_field(exc.field, renames)
    if exc.field and message.startswith(f"{exc.field}: "):
        message = f"{param}: {message[len(exc.field) + 2 :]}"
    return status, {
        "error": {
            "message": message,
            "type": _OPENAI_TYPE.get(status, "invalid_request_error"),
            "param": param,
            "code": exc.code.name.lower(),
        }
    }


def failure_body(raised: BaseException, renames: Renames, where: str) -> tuple[int, dict]:
    """(HTTP status, body) for whatever a handler or a stream raised: a typed error as it
    maps; a database that is down or locked as the caller's to retry (503), not a daemon bug;
    anything else 500, its traceback logged (`where` says in what)."""
    exc = typed_error(raised)
    if exc is None:
        log.error("unexpected error in %s", where, exc_info=raised)
        return internal_error_body()
    return error_body(exc, renames)


def internal_error_body() -> tuple[int, dict]:
    return 500, {
        "error": {
            "message": "internal error (see daemon log)",
            "type": "server_error",
            "param": None,
            "code": "internal",
        }
    }


def from_validation(err: ValidationError, prefix: str = "") -> InvalidArgument:
    """The first problem pydantic found, as InvalidArgument naming the field (dotted path,
    after `prefix` for a nested object validated on its own)."""
    first = err.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return InvalidArgument(f"malformed JSON: {first['msg']}", field="body")
    field = prefix + _path(first["loc"]) if first["loc"] else (prefix.rstrip(".") or "body")
    if first["type"] == "extra_forbidden":
        return InvalidArgument(
            "not supported by tltd (docs/http.md lists the fields it takes)", field=field
        )
    shown = repr(first.get("input"))
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return InvalidArgument(f"{first['msg']} (got {shown})", field=field)


def _path(loc: Sequence[str | int]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
