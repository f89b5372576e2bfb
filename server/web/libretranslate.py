"""LibreTranslate's API (https://libretranslate.com/docs), so that its clients work unchanged.

`source: "auto"` and /detect choose among the languages the loaded models translate from
(server.languages.detect); its classifier gives no calibrated probability, so `confidence` is
null. `format: "html"` translates the text between the tags and keeps the markup
(server/markup.py)."""
from __future__ import annotations

import json
from typing import Literal
from urllib.parse import parse_qsl

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError

from proto import gret_serve_pb2 as pb

from ..engine.options import DecodingOptions
from ..languages import AUTO, detect, normalize
from ..registry import Registry
from ..service import InferenceService
from .calls import CallFailed, unary

NAMES = {"ar": "Arabic", "cs": "Czech", "de": "German", "en": "English", "es": "Spanish", "fr": "French",
         "it": "Italian", "ja": "Japanese", "nl": "Dutch", "pt": "Portuguese", "ro": "Romanian", "ru": "Russian",
         "tr": "Turkish", "uk": "Ukrainian", "zh": "Chinese"}


class TranslateBody(BaseModel):
    q: str | list[str] = Field(description="a text, or a list of texts")
    source: str = Field("auto", description="language code, or auto")
    target: str = Field(description="language code")
    format: Literal["text", "html"] = "text"
    alternatives: int = Field(0, ge=0, description="other translations to return per text (the n-best list)")
    api_key: str = Field("", description="ignored: send the bearer token in the Authorization header")


class DetectBody(BaseModel):
    q: str | list[str] = Field(description="a text, or a list of texts")


async def read(request: Request, kind: type[BaseModel]):
    """JSON or a form (LibreTranslate's own clients send both) as a `kind`."""
    raw = await request.body()
    try:
        if request.headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
            return kind.model_validate(dict(parse_qsl(raw.decode())))
        return kind.model_validate(json.loads(raw or b"{}"))
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, error['loc'])) or 'body'}: {error['msg']}" for error in e.errors())
        raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {problems}") from None
    except ValueError as e:
        raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, f"the body is not JSON: {e}") from None


def documented(kind: type[BaseModel]) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": kind.model_json_schema()}}}}


def libretranslate_routes(service: InferenceService, registry: Registry) -> APIRouter:
    router = APIRouter(tags=["LibreTranslate"])

    @router.post("/translate", summary="Translate a text or a list of texts", openapi_extra=documented(TranslateBody))
    async def translate(request: Request):
        body = await read(request, TranslateBody)
        options = None
        if body.alternatives:
            n_best = body.alternatives + 1
            options = pb.DecodingOptions(n_best=n_best, beam_size=max(n_best, DecodingOptions().beam))
        texts = [body.q] if isinstance(body.q, str) else body.q
        response = await unary(service.Translate, pb.TranslateRequest(
            texts=texts, source_language=body.source, target_language=body.target, options=options,
            format=pb.HTML if body.format == "html" else pb.TEXT), request)
        best = [r.hypotheses[0].text if r.hypotheses else "" for r in response.results]
        others = [[h.text for h in r.hypotheses[1:]] for r in response.results]
        one = isinstance(body.q, str)
        answer = {"translatedText": best[0] if one else best}
        if body.alternatives:
            answer["alternatives"] = others[0] if one else others
        if normalize(body.source) == AUTO:  # the detector gives no probability: confidence stays null
            detected = {"language": response.source_language, "confidence": None}
            answer["detectedLanguage"] = detected if one else [detected] * len(texts)
        return JSONResponse(answer)

    @router.get("/languages", summary="Source languages and the targets each translates into")
    async def languages():
        pairs = {}
        for p in registry:
            if p.entry.task == "translate":
                pairs.setdefault(p.entry.source_language, set()).add(p.entry.target_language)
        return [{"code": code, "name": NAMES.get(code, code), "targets": sorted(targets)}
                for code, targets in sorted(pairs.items())]

    @router.post("/detect", summary="The most likely of the languages this server translates from",
                 openapi_extra=documented(DetectBody))
    async def detect_language(request: Request):
        body = await read(request, DetectBody)
        sources = {p.entry.source_language for p in registry if p.entry.task == "translate"}
        texts = [body.q] if isinstance(body.q, str) else body.q
        found = [detect(text, sources) for text in texts]
        if not all(found):
            raise CallFailed(grpc.StatusCode.NOT_FOUND, f"none of this server's source languages "
                                                        f"({', '.join(sorted(sources)) or 'none'}) fits the text")
        return JSONResponse([{"language": code, "confidence": None} for code in found])

    return router
