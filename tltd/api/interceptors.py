"""Server interceptors: bearer-token auth with roles, and the one place errors become statuses."""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
from collections.abc import Callable, Mapping

import grpc
from google.protobuf.message import DecodeError

from tltd.domain import Role
from tltd.errors import InvalidArgument, typed_error

log = logging.getLogger(__name__)

PUBLIC = "public"  # no token needed: liveness probes (kubelet, load balancers) cannot send one

_HEALTH = "/grpc.health.v1.Health/"
_REFLECTION = (
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)

# What a trainer token may call: everything a training loop needs (create/cancel its job,
# roll out, push weights) and every read-only RPC. Tokens are not identities, so "its job" is
# not enforced: a trainer token can cancel any job. Device control, drafter pin/export (which
# writes files on the node) and anything not listed here need an admin token.
_TRAINER_METHODS = frozenset(
    {
        "/tltd.v1.RolloutService/Generate",
        "/tltd.v1.RolloutService/GetRequest",
        "/tltd.v1.RolloutService/CancelRequest",
        "/tltd.v1.PolicyService/UpdatePolicy",
        "/tltd.v1.PolicyService/GetPolicy",
        "/tltd.v1.PolicyService/PushPolicy",
        "/tltd.v1.PolicyService/GetPush",
        "/tltd.v1.PolicyService/OpenBroadcast",
        "/tltd.v1.JobService/CreateJob",
        "/tltd.v1.JobService/GetJob",
        "/tltd.v1.JobService/ListJobs",
        "/tltd.v1.JobService/CancelJob",
        "/tltd.v1.DrafterService/ListDrafters",
        "/tltd.v1.DrafterService/GetDrafter",
        "/tltd.v1.AdminService/ListDevices",
        "/tltd.v1.AdminService/ListWorkers",
        "/tltd.v1.AdminService/GetStats",
        "/tltd.v1.SessionService/OpenSession",
        "/tltd.v1.SessionService/OpenSessionGroup",
        "/tltd.v1.SessionService/Turn",
        "/tltd.v1.SessionService/GetSession",
        "/tltd.v1.SessionService/CloseSession",
        "/tltd.v1.SessionService/ListSessions",
    }
)


def required_role(method: str) -> str:
    """The least role that may call `method` ("public", "trainer" or "admin"); deny by default."""
    if method.startswith(_HEALTH):
        return PUBLIC
    if method in _TRAINER_METHODS or method.startswith(_REFLECTION):
        return Role.TRAINER.value
    return Role.ADMIN.value


def _bearer(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, token = str(value).partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def _replace_behavior(
    handler: grpc.RpcMethodHandler, wrap: Callable, deserializer: Callable | None = None
) -> grpc.RpcMethodHandler:
    """A handler of the same kind and serializer with its behavior passed through `wrap` (and
    its request deserializer replaced by `deserializer`, when given)."""
    if handler.unary_unary:
        factory, behavior = grpc.unary_unary_rpc_method_handler, handler.unary_unary
    elif handler.unary_stream:
        factory, behavior = grpc.unary_stream_rpc_method_handler, handler.unary_stream
    elif handler.stream_unary:
        factory, behavior = grpc.stream_unary_rpc_method_handler, handler.stream_unary
    else:
        factory, behavior = grpc.stream_stream_rpc_method_handler, handler.stream_stream
    streaming = bool(handler.unary_stream or handler.stream_stream)
    return factory(
        wrap(behavior, streaming),
        request_deserializer=deserializer or handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """`authorization: Bearer <token>` -> role by settings.tokens. Off when no tokens are set
    (settings.validate allows that on loopback only)."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        self._tokens = [(t.encode(), role) for t, role in tokens.items()]

    def role_for(self, token: str | None) -> str | None:
        if token is None:
            return None
        given = token.encode()
        role = None
        # Compare against every token in constant time: no early exit that leaks a prefix.
        for known, known_role in self._tokens:
            if hmac.compare_digest(given, known):
                role = known_role
        return role

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not self._tokens:
            return handler
        method = handler_call_details.method
        needed = required_role(method)
        if needed == PUBLIC:
            return handler
        role = self.role_for(_bearer(handler_call_details.invocation_metadata))
        if role is None:
            return _deny(
                handler,
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or unknown bearer token (metadata 'authorization: Bearer <token>')",
            )
        if needed == Role.ADMIN.value and role != Role.ADMIN.value:
            return _deny(
                handler,
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method} needs an admin token; this token has role {role!r}",
            )
        return handler


def _deny(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str):
    def wrap(_behavior, _streaming):
        async def deny(_request, context):
            await context.abort(code, message)

        deny.ignores_request = True  # type: ignore[attr-defined]  # see _guard
        return deny

    return _replace_behavior(handler, wrap)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """TltError -> its status code and message; a database that is down or locked ->
    UNAVAILABLE (`tltd.errors.typed_error`); anything else -> INTERNAL plus a logged
    traceback. Works for unary and streaming methods, generator- or write()-style.

    Request bytes that do not decode (truncated, invalid UTF-8 in a string field) are the
    caller's error, INVALID_ARGUMENT: grpc runs the deserializer before any handler code and
    reports its exceptions as UNKNOWN, so the deserializer hands the error over as a value
    (`_Undecodable`) that the guard raises."""

    def __init__(self, deserializers: Mapping[str, Callable] | None = None) -> None:
        # Per method, a deserializer in place of the generated one (PushPolicy's chunks).
        self._deserializers = dict(deserializers or {})

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        return _replace_behavior(
            handler,
            lambda behavior, streaming: _guard(method, behavior, streaming),
            _tolerant(self._deserializers.get(method, handler.request_deserializer)),
        )


class _Undecodable:
    """A request message that failed to decode, in place of the message."""

    def __init__(self, error: InvalidArgument) -> None:
        self.error = error


def _tolerant(deserializer: Callable | None) -> Callable | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except DecodeError as exc:  # its message names the request type and the fault
            return _Undecodable(InvalidArgument(f"does not decode: {exc}", field="request"))

    return deserialize


def _checked(request):
    """The request, unless it did not decode; a request stream checked message by message."""
    if isinstance(request, _Undecodable):
        raise request.error
    if hasattr(request, "__aiter__"):
        return _checked_stream(request)
    return request


async def _checked_stream(requests):
    async for request in requests:
        yield _checked(request)


async def _map_error(method: str, exc: BaseException, context) -> None:
    # A database outage or lock is the caller's to retry (UNAVAILABLE), not a daemon bug.
    typed = typed_error(exc)
    if typed is not None:
        extra = {"method": method, "code": typed.code.name, "error": str(typed)}
        log.info("rpc failed", extra=extra)
        await context.abort(typed.code, str(typed))  # raises AbortError: nothing below runs
    log.error("unexpected error in %s", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, "internal error (see daemon log)")


def _guard(method: str, behavior: Callable, streaming: bool) -> Callable:
    # AbortError means the handler (or a nested abort) already set the status; CancelledError
    # is the client going away. Neither is an error to map.
    passthrough = (grpc.aio.AbortError, asyncio.CancelledError)
    # A caller without the right token learns that, not whether its bytes decode.
    check = (lambda r: r) if getattr(behavior, "ignores_request", False) else _checked

    if streaming:

        async def stream_guard(request, context):
            try:
                result = behavior(check(request), context)
                if inspect.isasyncgen(result) or hasattr(result, "__aiter__"):
                    async for item in result:
                        yield item
                elif inspect.isawaitable(result):
                    await result  # write()-style handler (e.g. health Watch)
            except passthrough:
                raise
            except Exception as exc:
                await _map_error(method, exc, context)

        return stream_guard

    async def unary_guard(request, context):
        try:
            result = behavior(check(request), context)
            return await result if inspect.isawaitable(result) else result
        except passthrough:
            raise
        except Exception as exc:
            await _map_error(method, exc, context)

    return unary_guard
