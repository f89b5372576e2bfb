"""OpenAPI descriptions of the native routes, made from the proto's descriptors: the /v1/ bodies are
the proto3 JSON mapping of the gRPC messages, so the .proto stays their only definition."""
from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

# proto3 JSON: 64-bit integers travel as strings (JSON numbers lose precision beyond 2^53)
SCALARS = {
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_FLOAT: {"type": "number"},
    FieldDescriptor.TYPE_DOUBLE: {"type": "number"},
    FieldDescriptor.TYPE_INT32: {"type": "integer"},
    FieldDescriptor.TYPE_UINT32: {"type": "integer", "minimum": 0},
    FieldDescriptor.TYPE_UINT64: {"type": "string", "format": "uint64"},
}


def field_schema(f: FieldDescriptor) -> dict:
    if f.message_type:
        return schema(f.message_type)
    if f.enum_type:  # proto3 JSON writes an enum by its value's name
        return {"type": "string", "enum": [v.name for v in f.enum_type.values]}
    return SCALARS[f.type]


def schema(message: Descriptor) -> dict:
    properties = {}
    for f in message.fields:
        kind = field_schema(f)
        properties[f.name] = {"type": "array", "items": kind} if f.is_repeated else kind
    return {"title": message.name, "type": "object", "properties": properties}


def body(message: Descriptor) -> dict:
    """A route's `openapi_extra`: the request body is this message."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema(message)}}}}


def answer(message: Descriptor, media_type: str = "application/json") -> dict:
    """A route's `responses`: success returns this message (or a stream of them as events)."""
    return {200: {"description": message.name, "content": {media_type: {"schema": schema(message)}}}}
