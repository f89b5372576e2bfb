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
        family = socket.AF_INET6 if ":" in c.host else socket.AF_INET
        sock = socket.create_server((c.host, c.http_port), family=family)
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
