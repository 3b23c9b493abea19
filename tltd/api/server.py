"""The gRPC server: interceptors, tltd servicers, health, reflection and TLS on one address."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tltd.api.interceptors import AuthInterceptor, ErrorInterceptor
from tltd.api.push_wire import PUSH_POLICY_METHOD, push_request_from_bytes
from tltd.api.reflection import enable_reflection
from tltd.api.servicers import add_servicers
from tltd.errors import ConfigError
from tltd.services import NodeState, Services
from tltd.settings import Settings

log = logging.getLogger(__name__)

# Generate streams may carry thousands of samples; the default 4 MiB caps one message, and a
# request of 1024 prompts x 8192 tokens is ~40 MiB of varints.
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

ROLLOUT_SERVICE = "tltd.v1.RolloutService"


@dataclass
class ApiServer:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    services: list[str]
    port: int
    address: str
    node: NodeState
    _pending: asyncio.Future | None = field(default=None, repr=False)

    async def start(self) -> None:
        await self.server.start()
        for name in ["", *self.services]:  # "" = the whole server
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        # A drained node serves reads but no new rollouts: tell load balancers so. Drain runs
        # in a worker thread, hence the hop back onto the loop.
        loop = asyncio.get_running_loop()
        self.node.on_draining(lambda: loop.call_soon_threadsafe(self._rollouts_not_serving))

    def _rollouts_not_serving(self) -> None:
        # Keep a reference: the event loop holds tasks only weakly.
        self._pending = asyncio.ensure_future(
            self.health.set(ROLLOUT_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        )

    async def stop(self, grace: float | None) -> None:
        """NOT_SERVING first (load balancers stop sending), then let in-flight RPCs finish."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    if not settings.tls_cert:
        return None
    client_ca = _read(settings.tls_client_ca) if settings.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(_read(settings.tls_key), _read(settings.tls_cert))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def host_port(host: str, port: int) -> str:
    """gRPC target syntax: IPv6 literals need brackets ("[::1]:50051")."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def build_server(settings: Settings, services: Services) -> ApiServer:
    """Create and bind (not start) the server; port 0 binds a free port, reported in `.port`."""
    server = grpc.aio.server(
        interceptors=[
            ErrorInterceptor({PUSH_POLICY_METHOD: push_request_from_bytes}),
            AuthInterceptor(settings.tokens),
        ],
        options=[
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            # A second daemon on the same port must fail, not silently share it.
            ("grpc.so_reuseport", 0),
            # Clients ping to notice a daemon that vanished mid-stream (tltd_clients.endpoints):
            # allow pings every second even while a long rollout sends nothing.
            ("grpc.http2.min_ping_interval_without_data_ms", 1000),
        ],
    )
    names = add_servicers(server, services)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection([*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name], server)
    creds = server_credentials(settings)
    wanted = host_port(settings.host, settings.port)
    try:
        if creds is None:
            port = server.add_insecure_port(wanted)
        else:
            port = server.add_secure_port(wanted, creds)
    except RuntimeError as exc:
        raise ConfigError(f"cannot listen on {wanted}: {exc}") from exc
    if port == 0:
        raise ConfigError(f"cannot listen on {wanted} (in use or not a local address)")
    address = host_port(settings.host, port)
    return ApiServer(server, health_servicer, names, port, address, services.node)
