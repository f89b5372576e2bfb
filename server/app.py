"""Wiring: the gRPC server (service + health + reflection, auth, TLS, message limits), the HTTP
front end on the same service (server/web), the metrics endpoint, the engines, and graceful shutdown.

Shutdown on SIGTERM/SIGINT: health goes NOT_SERVING first (load balancers stop sending), new
calls get UNAVAILABLE (HTTP 503), in-flight calls finish within `grace_seconds`, then the process exits 0.
"""
from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto import gret_serve_pb2 as pb
from proto import gret_serve_pb2_grpc as pb_grpc

from .auth import Token
from .config import ServerConfig
from .metrics import Metrics
from .registry import Registry
from .service import InferenceService
from .web.frontend import HttpFrontEnd

log = logging.getLogger("server")
SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


class BearerToken(grpc.aio.ServerInterceptor):
    """Every call but health checks must carry `authorization: Bearer <token>`."""

    def __init__(self, token: str):
        self.token = Token(token)

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, Token.REFUSAL)

        self.deny = deny

    async def intercept_service(self, continuation, details):
        if details.method.startswith(f"/{HEALTH}/"):
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        if self.token.allows(metadata.get("authorization", "")):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self.deny)
        if handler.unary_stream:
            async def deny_stream(request, context):
                await self.deny(request, context)
                yield  # pragma: no cover - abort raises
            return grpc.unary_stream_rpc_method_handler(deny_stream)
        return grpc.stream_stream_rpc_method_handler(self.deny) if handler.stream_stream else \
            grpc.stream_unary_rpc_method_handler(self.deny)


class MalformedRequests(grpc.aio.ServerInterceptor):
    """A request that is not a valid message of its type (broken wire format, a string that is not
    UTF-8) gets INVALID_ARGUMENT; without this, grpc answers UNKNOWN. Refusals are counted like
    any other call (no model label: the request could not be read)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.wrapped: dict[str, grpc.RpcMethodHandler] = {}  # by method: built once, not per call

    async def intercept_service(self, continuation, details):
        wrapped = self.wrapped.get(details.method)
        if wrapped is not None:
            return wrapped
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE}/"):
            return handler
        self.wrapped[details.method] = wrapped = self._wrap(details.method, handler)
        return wrapped

    def _wrap(self, name: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        method = pb.DESCRIPTOR.services_by_name["Inference"].methods_by_name[name.rsplit("/", 1)[1]]
        parse, message = handler.request_deserializer, f"the request is not a valid {method.input_type.full_name}"
        invalid = grpc.StatusCode.INVALID_ARGUMENT

        def deserialize(raw: bytes):
            try:
                return parse(raw)
            except DecodeError as e:
                return e  # the handler refuses it, with a status code this function cannot set

        async def refuse(error: DecodeError, context) -> None:
            self.metrics.call_ended("", method.name, invalid.name, 0.0)  # refused before any work
            await context.abort(invalid, f"{message}: {error}")

        if handler.unary_unary:
            async def unary(request, context):
                if isinstance(request, DecodeError):
                    await refuse(request, context)
                return await handler.unary_unary(request, context)
            return grpc.unary_unary_rpc_method_handler(unary, deserialize, handler.response_serializer)

        async def stream(request, context):  # the service's streams write through context.write
            if isinstance(request, DecodeError):
                await refuse(request, context)
            await handler.unary_stream(request, context)
        return grpc.unary_stream_rpc_method_handler(stream, deserialize, handler.response_serializer)


class App:
    def __init__(self, config: ServerConfig, registry: Registry | None = None, metrics: Metrics | None = None):
        self.config = config
        self.metrics = metrics or Metrics()
        self.registry = registry or Registry.load(config, self.metrics)
        self.service = InferenceService(self.registry, self.metrics, log_text=config.log_level == "debug")
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.metrics_http = None
        self.http = HttpFrontEnd(self.service, self.registry, config) if config.http_port else None
        self.port = config.port
        self.http_port = 0
        self._stopped = asyncio.Event()

    async def start(self) -> int:
        """Starts everything; returns the bound gRPC port (config port 0 picks a free one)."""
        c = self.config
        limit = c.max_message_mb << 20
        interceptors = ([BearerToken(c.token())] if c.token() else []) + [MalformedRequests(self.metrics)]
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)])
        pb_grpc.add_InferenceServicer_to_server(self.service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection([SERVICE, HEALTH, reflection.SERVICE_NAME], self.server)
        address = f"{c.host}:{c.port}"
        if c.tls_cert:
            credentials = grpc.ssl_server_credentials([(open(c.tls_key, "rb").read(), open(c.tls_cert, "rb").read())])
            self.port = self.server.add_secure_port(address, credentials)
        else:
            self.port = self.server.add_insecure_port(address)
        self.registry.start()
        await self.server.start()
        if self.http is not None:
            self.http_port = await self.http.start()
        if c.metrics_port:
            self.metrics_http = self.metrics.serve(c.metrics_port, c.host)
        for name in ("", SERVICE, *(p.entry.name for p in self.registry)):  # a model's name: its own readiness
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on %s:%d (metrics on %s, http on %s)", ", ".join(p.entry.name for p in self.registry),
                 c.host, self.port, c.metrics_port or "off", self.http_port or "off")
        return self.port

    async def shutdown(self) -> None:
        """Drain: NOT_SERVING, refuse new calls, let in-flight ones finish within the grace period."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        grace = self.config.grace_seconds
        log.info("shutting down: draining for up to %.0f s", grace)
        await self.health.enter_graceful_shutdown()
        self.service.draining = True
        self.registry.drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while not self.registry.idle() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await self.server.stop(max(0.0, deadline - loop.time()))
        if self.http is not None:
            await self.http.stop(deadline - loop.time())
        self.registry.stop()
        if self.metrics_http is not None:
            self.metrics_http.shutdown()
        log.info("stopped")

    async def serve_forever(self) -> None:
        await self.start()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await self.shutdown()
