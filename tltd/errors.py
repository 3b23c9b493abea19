"""Typed errors: each carries a gRPC status code, mapped once at the transport boundary."""

from __future__ import annotations

import grpc


class TltError(Exception):
    """Base of all expected errors; `code` is what the client sees."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


class InvalidArgument(TltError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(TltError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(TltError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(TltError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Fenced(FailedPrecondition):
    """A write that depends on ownership came from a node that no longer owns the thing (its
    lease expired or was taken over, or its epoch is not the current one): it changed nothing."""


class ResourceExhausted(TltError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(TltError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(TltError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unimplemented(TltError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Aborted(TltError):
    """A conflict with a concurrent call (retry once it is over)."""

    code = grpc.StatusCode.ABORTED


class Unavailable(TltError):
    code = grpc.StatusCode.UNAVAILABLE


class ConfigError(Exception):
    """The daemon cannot start with this configuration (message says why)."""
