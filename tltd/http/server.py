"""The HTTP server: uvicorn on the daemon's event loop, beside the gRPC server, on the same
host with the same TLS (and mTLS) settings."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from dataclasses import dataclass, field

import uvicorn

from tltd.errors import ConfigError
from tltd.http.app import build_app
from tltd.services import Services
from tltd.settings import Settings

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # The daemon owns SIGTERM/SIGINT and stops this server in its shutdown order.
        yield


@dataclass
class HttpServer:
    server: uvicorn.Server
    sock: socket.socket
    port: int
    url: str
    _task: asyncio.Task | None = field(default=None, repr=False)

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self._task.done():
                self._task.result()  # its exception, if any
                raise ConfigError(f"HTTP server on {self.url} did not start")
            await asyncio.sleep(0.01)

    async def stop(self, grace: float | None) -> None:
        """Stop accepting, let requests in flight finish for up to `grace` seconds."""
        if self._task is None:
            self.sock.close()
            return
        self.server.config.timeout_graceful_shutdown = max(0.1, grace or 0.1)
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        self.sock.close()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        # SO_REUSEADDR (set by create_server) only reuses TIME_WAIT ports: a second daemon on
        # the same port still fails here.
        sock = socket.create_server((host.strip("[]"), port), family=family)
    except OSError as exc:
        raise ConfigError(f"cannot listen for HTTP on {host}:{port}: {exc}") from exc
    # uvicorn writes a response's head and body as two segments and sets no TCP_NODELAY:
    # with Nagle's algorithm the body then waits for the client's delayed ACK of the head
    # (~40 ms on Linux) on every JSON answer. Accepted sockets inherit the option.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def build_http_server(settings: Settings, services: Services) -> HttpServer:
    """Create and bind (not start) the server; port 0 binds a free port, reported in `.port`."""
    sock = _bind(settings.host, settings.http_port)
    tls = bool(settings.tls_cert)
    config = uvicorn.Config(
        build_app(services, settings.tokens),
        lifespan="off",
        log_config=None,  # the daemon's logging stays as configured
        access_log=False,
        server_header=False,
        ssl_certfile=settings.tls_cert or None,
        ssl_keyfile=settings.tls_key or None,
        ssl_ca_certs=settings.tls_client_ca or None,
        ssl_cert_reqs=ssl.CERT_REQUIRED if settings.tls_client_ca else ssl.CERT_NONE,
        timeout_graceful_shutdown=settings.shutdown_grace_seconds,
    )
    try:
        config.load()  # a bad certificate fails start-up, not the first request
    except (OSError, ssl.SSLError) as exc:
        sock.close()
        raise ConfigError(f"cannot set up TLS for HTTP: {exc}") from exc
    port = sock.getsockname()[1]
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    url = f"{'https' if tls else 'http'}://{host}:{port}"
    return HttpServer(_Server(config), sock, port, url)
