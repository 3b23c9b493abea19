"""Typed errors: each carries a gRPC status code, mapped once at the transport boundary (the
doors ask `typed_error` what a caller is told)."""

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


def typed_error(exc: BaseException) -> TltError | None:
    """What a door (the gRPC interceptor, the HTTP error bodies) tells the caller of `exc`: a
    TltError as it is; a failure of the database itself as the caller's to retry
    (`database_error`); None for anything else, an internal error the door logs."""
    return exc if isinstance(exc, TltError) else database_error(exc)


# SQLite result codes of a database that is busy or unreachable for now, not of a bad statement
# (primary codes: extended ones carry them in the low byte).
_SQLITE_TRANSIENT = frozenset({5, 6, 10, 14, 15})  # BUSY, LOCKED, IOERR, CANTOPEN, PROTOCOL
_SQLITE_FULL = 13


def database_error(exc: BaseException) -> TltError | None:
    """A database failure a caller can retry, as a typed error: the connection lost or refused
    (a PostgreSQL restart), a lock held past the busy timeout; RESOURCE_EXHAUSTED for a full
    disk. None for anything else (a bad statement stays an internal error).

    Only for the transport boundary: inside the daemon, store writes that fail this way are
    retried as they are (they must not look like a request's own refusal)."""
    # Imported here: the client imports this module where SQLAlchemy is not installed.
    from sqlalchemy import exc as sa_exc

    if isinstance(exc, sa_exc.TimeoutError):  # no pooled connection came free
        return Unavailable(f"database unavailable, retry: {_first_line(exc)}")
    if not isinstance(exc, sa_exc.DBAPIError):
        return None
    code = getattr(exc.orig, "sqlite_errorcode", None)
    if code is not None:
        if code & 0xFF == _SQLITE_FULL:
            return ResourceExhausted(f"database disk full: {_first_line(exc.orig)}")
        if code & 0xFF not in _SQLITE_TRANSIENT:
            return None
    elif not (
        exc.connection_invalidated
        or isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError))
    ):
        return None
    return Unavailable(f"database unavailable, retry: {_first_line(exc.orig or exc)}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]
