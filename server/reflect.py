"""A grpcurl-like client that knows nothing of our API: it reads the services and message types
from the server's reflection service and speaks JSON, with no .proto file and no generated code.
For machines without grpcurl (it needs a Go binary), and a check that reflection is complete.

    python -m server.reflect localhost:50051 list
    python -m server.reflect localhost:50051 describe gretserve.v1.Inference
    python -m server.reflect localhost:50051 call gretserve.v1.Inference/Translate \\
        '{"texts": ["Ein Hund läuft."], "target_language": "en"}'

Server-streaming methods print one JSON object per message. Exit status 1 on an RPC error, with
its status code and message on stderr.
"""
from __future__ import annotations

import argparse
import json
import sys

import grpc
from google.protobuf import json_format
from google.protobuf.descriptor_pool import DescriptorPool
from google.protobuf.message_factory import GetMessageClass
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase


def describe(pool: DescriptorPool, service: str) -> list[str]:
    lines = [f"service {service}"]
    for m in pool.FindServiceByName(service).methods:
        stream = "stream " if m.server_streaming else ""
        lines.append(f"  rpc {m.name}({m.input_type.full_name}) returns ({stream}{m.output_type.full_name})")
    return lines


def call(channel: grpc.Channel, pool: DescriptorPool, target: str, body: str, timeout: float, metadata) -> list[str]:
    service, _, name = target.rpartition("/")
    method = pool.FindServiceByName(service).FindMethodByName(name)
    request_class, response_class = GetMessageClass(method.input_type), GetMessageClass(method.output_type)
    request = json_format.Parse(body, request_class())
    kind = channel.unary_stream if method.server_streaming else channel.unary_unary
    stub = kind(f"/{service}/{name}", request_serializer=request_class.SerializeToString,
                response_deserializer=response_class.FromString)
    responses = stub(request, timeout=timeout, metadata=metadata)
    responses = responses if method.server_streaming else [responses]
    return [json.dumps(json_format.MessageToDict(r, preserving_proto_field_name=True,
                                                  always_print_fields_with_no_presence=True), ensure_ascii=False, indent=2)
            for r in responses]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m server.reflect", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("address")
    p.add_argument("command", choices=("list", "describe", "call"))
    p.add_argument("target", nargs="?", help="describe: a service; call: service/method")
    p.add_argument("body", nargs="?", default="{}", help="call: the request as JSON")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--token", default="", help="bearer token, if the server requires one")
    args = p.parse_args(argv)
    if args.command != "list" and not args.target:
        p.error(f"{args.command} needs a target")
    metadata = [("authorization", f"Bearer {args.token}")] if args.token else None
    with grpc.insecure_channel(args.address) as channel:
        pool = DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        try:
            if args.command == "list":
                lines = sorted(ProtoReflectionDescriptorDatabase(channel).get_services())
            elif args.command == "describe":
                lines = describe(pool, args.target)
            else:
                lines = call(channel, pool, args.target, args.body, args.timeout, metadata)
        except grpc.RpcError as e:
            print(f"{e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except KeyError as e:  # the server does not know the service or method
            print(f"not found by reflection: {e}", file=sys.stderr)
            return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
