"""A gRPC handler of server.service called over HTTP: the context it expects, its status codes as
HTTP statuses, and its stream as server-sent events."""
from __future__ import annotations

import asyncio
import json
import time

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from google.protobuf import json_format

# One-to-one, so that an HTTP client can tell every outcome a gRPC client can; anything else is 500.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,  # nginx's "client closed request": no client is left to read it
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
RETRY_AFTER_S = 1  # a full queue drains in about a decoding step or two: worth retrying soon
TIMEOUT_HEADER = "X-Request-Timeout"  # seconds: the HTTP form of a gRPC deadline


class CallFailed(Exception):
    """What the handler's context.abort raises: the gRPC status and message for the HTTP answer."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message

    def body(self) -> dict:
        return {"error": self.message, "code": self.code.name}

    def response(self) -> JSONResponse:
        headers = {}
        if self.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            headers["Retry-After"] = str(RETRY_AFTER_S)
        if self.code == grpc.StatusCode.UNAUTHENTICATED:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), HTTP_STATUS.get(self.code, 500), headers)


class HttpContext:
    """The part of grpc.aio's ServicerContext that the service uses."""

    def __init__(self, timeout: float | None, write=None):
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self._write = write

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, message: str, trailing_metadata=()):
        raise CallFailed(code, message)

    def invocation_metadata(self) -> tuple:  # the request id is already set (server.web.routes.RequestIds)
        return ()

    def set_trailing_metadata(self, metadata) -> None:  # the request id goes back as a header instead
        pass

    async def write(self, message) -> None:
        await self._write(message)


def timeout_of(request: Request) -> float | None:
    text = request.headers.get(TIMEOUT_HEADER)
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, f"{TIMEOUT_HEADER} must be a positive number of seconds")
    return seconds


async def unary(handler, message, request: Request):
    """The handler's response message; a failure raises CallFailed."""
    return await handler(message, HttpContext(timeout_of(request)))


def as_json(message) -> dict:
    """The proto3 JSON mapping, with the proto's field names and every field present."""
    return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


async def event_stream(handler, message, request: Request) -> StreamingResponse:
    """Each response the handler writes becomes one `data:` event. A call that fails before its
    first text fails with its HTTP status; one that fails later ends with an `error` event. A client
    that goes cancels the handler, which releases its texts as a cancelled gRPC call does."""
    written: asyncio.Queue = asyncio.Queue()
    call = asyncio.create_task(handler(message, HttpContext(timeout_of(request), written.put)))
    call.add_done_callback(lambda _: written.put_nowait(None))
    first = await written.get()
    if first is None:
        call.result()  # raises its CallFailed: nothing was sent yet, so the status can still say it

    async def events():
        try:
            item = first
            while item is not None:
                yield f"data: {json.dumps(as_json(item))}\n\n"
                item = await written.get()
            call.result()
        except CallFailed as e:
            yield f"event: error\ndata: {json.dumps(e.body())}\n\n"
        finally:
            call.cancel()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
