"""Bearer tokens and roles on the HTTP door: each route takes the role of the gRPC method it
stands for, so both doors let the same token do the same things."""

from __future__ import annotations

from collections.abc import Mapping

from tltd.api.interceptors import PUBLIC, AuthInterceptor, required_role
from tltd.domain import Role
from tltd.errors import PermissionDenied, Unauthenticated

# route name -> the gRPC method whose role it needs
ROUTE_METHODS = {
    "completions": "/tltd.v1.RolloutService/Generate",
    "generate": "/tltd.v1.RolloutService/Generate",
    "models": "/tltd.v1.JobService/ListJobs",
    "model_info": "/tltd.v1.JobService/GetJob",
    "update_weights": "/tltd.v1.PolicyService/UpdatePolicy",
    "health": "/grpc.health.v1.Health/Check",
    "server_info": "/tltd.v1.JobService/GetJob",
    "weight_version": "/tltd.v1.PolicyService/GetPolicy",
    # Pausing and cache resets are steps of a trainer's weight update.
    "pause": "/tltd.v1.PolicyService/UpdatePolicy",
    "flush_cache": "/tltd.v1.PolicyService/UpdatePolicy",
    "abort": "/tltd.v1.RolloutService/CancelRequest",
    "weights_group": "/tltd.v1.PolicyService/OpenBroadcast",
    "open_session": "/tltd.v1.SessionService/OpenSession",
    "close_session": "/tltd.v1.SessionService/CloseSession",
}


class BearerAuth:
    """`Authorization: Bearer <token>` -> role by settings.tokens; off when no tokens are set
    (settings.validate allows that on loopback only)."""

    def __init__(self, tokens: Mapping[str, str]) -> None:
        self._roles = AuthInterceptor(tokens)  # the same constant-time token comparison
        self.enabled = bool(tokens)

    def check(self, route: str, authorization: str | None) -> None:
        """Raise Unauthenticated / PermissionDenied unless the header allows `route`."""
        method = ROUTE_METHODS[route]
        needed = required_role(method)
        if not self.enabled or needed == PUBLIC:
            return
        role = self._roles.role_for(_bearer(authorization))
        if role is None:
            raise Unauthenticated(
                "missing or unknown bearer token (header 'Authorization: Bearer <token>')"
            )
        if needed == Role.ADMIN.value and role != Role.ADMIN.value:
            raise PermissionDenied(f"{route} needs an admin token; this token has role {role!r}")


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None
