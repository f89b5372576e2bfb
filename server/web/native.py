"""/v1/: the gRPC API over HTTP. Bodies are the proto3 JSON mapping of its messages (field names as
in proto/gret_serve.proto); the streaming methods answer with server-sent events. Answers are
JSONResponse, already plain JSON: FastAPI's own encoding of a returned dict walks it again (bench http)."""
from __future__ import annotations

import json

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from google.protobuf import json_format

from proto import gret_serve_pb2 as pb

from ..service import InferenceService
from .calls import CallFailed, as_json, event_stream, unary
from .openapi import answer, body


async def parse(request: Request, kind):
    """The body as a `kind` message; a body that is not one is refused as gRPC refuses broken wire format."""
    try:
        return json_format.ParseDict(json.loads(await request.body() or b"{}"), kind())
    except (ValueError, json_format.ParseError) as e:
        raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT,
                         f"the request is not a valid {kind.DESCRIPTOR.full_name}: {e}") from None


def native_routes(service: InferenceService) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["native"])

    def routes(path: str, kind, unary_handler, stream_handler, summary: str) -> None:
        async def call(request: Request):
            return JSONResponse(as_json(await unary(unary_handler, await parse(request, kind), request)))

        async def stream(request: Request):
            return await event_stream(stream_handler, await parse(request, kind), request)

        router.add_api_route(path, call, methods=["POST"], summary=summary, openapi_extra=body(kind.DESCRIPTOR),
                             responses=answer(pb.GenerateResponse.DESCRIPTOR))
        router.add_api_route(f"{path}/stream", stream, methods=["POST"], summary=f"{summary}: one event per text",
                             openapi_extra=body(kind.DESCRIPTOR),
                             responses=answer(pb.GenerateResponse.DESCRIPTOR, "text/event-stream"))

    routes("/translate", pb.TranslateRequest, service.Translate, service.TranslateStream, "Translate every text")
    routes("/summarize", pb.SummarizeRequest, service.Summarize, service.SummarizeStream, "Summarise every text")

    @router.get("/models", summary="The loaded models", responses=answer(pb.ListModelsResponse.DESCRIPTOR))
    async def models(request: Request):
        return JSONResponse(as_json(await unary(service.ListModels, pb.ListModelsRequest(), request)))

    return router
