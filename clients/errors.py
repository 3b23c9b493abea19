"""Typed client errors: one class per gRPC status a caller may want to handle differently."""

from __future__ import annotations

import grpc


class TltClientError(Exception):
    """A failed call: `.code` is the grpc.StatusCode, `.message` the daemon's explanation."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code.name}: {message}")


class InvalidArgumentError(TltClientError): ...


class NotFoundError(TltClientError): ...


class AlreadyExistsError(TltClientError): ...


class FailedPreconditionError(TltClientError): ...


class ResourceExhaustedError(TltClientError): ...


class UnauthenticatedError(TltClientError): ...


class PermissionDeniedError(TltClientError): ...


class UnimplementedError(TltClientError): ...


class UnavailableError(TltClientError):
    """The daemon is unreachable or draining: retry elsewhere or later."""


class AllEndpointsUnavailableError(UnavailableError):
    """Every endpoint the client was given failed (down, unreachable or draining) through all
    its retries; the message names each endpoint and its last error."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


class DeadlineExceededError(TltClientError):
    """The call's timeout passed before the daemon answered (or finished streaming)."""


class CallCancelledError(TltClientError):
    """The call was cancelled on this side (not a cancelled rollout request: those end
    normally, with samples whose finish_reason is "cancelled")."""


class InternalError(TltClientError):
    """The daemon failed unexpectedly (a bug there, or a broken connection's internals)."""


_BY_CODE: dict[grpc.StatusCode, type[TltClientError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CallCancelledError,
    grpc.StatusCode.INTERNAL: InternalError,
}


def from_rpc_error(exc: grpc.RpcError) -> TltClientError:
    """The typed error for a failed call (grpc.RpcError from a sync stub is also a grpc.Call)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    message = exc.details() if hasattr(exc, "details") else str(exc)
    return _BY_CODE.get(code, TltClientError)(code, message or code.name)
