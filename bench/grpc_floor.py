"""python -m bench.grpc_floor [--host H] --port N: gRPC alone, for `python -m bench speed`.

The Inference service with no model behind it: Translate answers each call with the same response
a served sentence gets (one text, one hypothesis), after a pause drawn between PAUSE_S's bounds,
about the server's own latency under the score's 64 callers. The pause keeps the calls as spread
out in time as the server's are: calls that all end at once share the socket's writes and would
cost less each. What this process spends per call is what any Python gRPC service pays before it
does any work: the floor under the server's parent process. Served as the server serves (grpc.aio
on uvloop, the health service for readiness).
"""
from __future__ import annotations

import argparse
import asyncio
import random

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from proto import gret_serve_pb2 as pb
from proto import gret_serve_pb2_grpc as pb_grpc

PAUSE_S = (0.1, 0.3)
ANSWER = pb.GenerateResponse(
    model="grpc-floor", model_version="0", source_language="de",
    results=[pb.TextResult(index=0, source_tokens=16, sentences=1,
                           hypotheses=[pb.Hypothesis(text="A man in an orange hat starring at something.",
                                                     tokens=12)])])


class Floor(pb_grpc.InferenceServicer):
    def __init__(self, seed: int = 0):
        self.random = random.Random(seed)

    async def Translate(self, request, context):
        await asyncio.sleep(self.random.uniform(*PAUSE_S))
        return ANSWER


async def serve(host: str, port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_InferenceServicer_to_server(Floor(), server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await checks.set("", health_pb2.HealthCheckResponse.SERVING)
    await server.wait_for_termination()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
