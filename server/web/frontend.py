"""uvicorn on the gRPC server's event loop: both front ends share the engines and the service, and
the App drains them together on SIGTERM."""
from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn

from ..config import ServerConfig
from ..registry import Registry
from ..service import InferenceService
from .routes import create_app


class _Embedded(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # the App owns SIGTERM/SIGINT: it drains the engines before this server stops


def listening_socket(host: str, port: int) -> socket.socket:
    """Made with IPPROTO_TCP named: asyncio turns Nagle's algorithm off only on connections whose
    socket says TCP, and without that each response's body waited 40 ms for the client's delayed
    ACK of its headers (bench http)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock


class HttpFrontEnd:
    def __init__(self, service: InferenceService, registry: Registry, config: ServerConfig):
        self.config = config
        self.app = create_app(service, registry, config.token())
        self.server: _Embedded | None = None
        self.task: asyncio.Task | None = None

    async def start(self) -> int:
        """Listens; returns the bound port. The socket is bound here so that a port in use fails
        the start, as it does for gRPC."""
        c = self.config
        sock = listening_socket(c.host, c.http_port)
        self.server = _Embedded(uvicorn.Config(self.app, lifespan="off", log_config=None, access_log=False,
                                               ssl_certfile=c.tls_cert or None, ssl_keyfile=c.tls_key or None))
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        return sock.getsockname()[1]

    async def stop(self, seconds: float) -> None:
        """Stops listening; open requests get `seconds` more (the drain has already waited for the engines)."""
        if self.server is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.task, max(seconds, 0.5))
