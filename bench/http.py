"""python -m bench http [--quick] [--publish] [--models-dir models] [--model multi30k-de-en] [--threads 2]

The HTTP/JSON front end's overhead: one server (continuous batching, caches off) answers the same
closed-loop load over gRPC and over HTTP (/v1/translate, keep-alive connections), the two taking
turns in every round so that a busy machine weighs on both alike. Two workloads: beam 4 on
Multi30K test_2016_flickr sentences (the server benchmark's), and short greedy calls, where the
transport is a larger share of each call. Reports texts/s per transport and HTTP/gRPC per round;
the target is HTTP >= 0.9 x gRPC. Writes bench-http.json to --out-dir.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import re
import statistics
import tempfile
import time
from pathlib import Path

import grpc
from google.protobuf import json_format

from bench import add_publish, results_dir
from bench.provenance import Run
from bench.server import FULL, GREEDY, QUICK, ServerProcess, closed_loop, free_port, prepare, server_env, server_flags
from proto import gret_serve_pb2 as pb
from proto import gret_serve_pb2_grpc as pb_grpc
from training.corpora import PROJECT_ROOT, load_examples

TARGET = 0.9
WORKLOADS = {"beam4": {"beam_size": 4}, "greedy": GREEDY}


class HttpStub:
    """The gRPC stub's Translate, over POST /v1/translate: bench.server's load loops drive it as
    they drive gRPC. Each concurrent caller takes an idle keep-alive connection or opens one."""

    def __init__(self, port: int):
        self.port, self.idle = port, []

    async def Translate(self, request: pb.TranslateRequest, timeout: float) -> pb.GenerateResponse:
        body = json.dumps(json_format.MessageToDict(request, preserving_proto_field_name=True)).encode()
        reader, writer = self.idle.pop() if self.idle else await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(b"POST /v1/translate HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation that
            # arrives as the read completes, and a load loop's caller would then never stop
            async with asyncio.timeout(timeout):
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)[1])
                answer = json.loads(await reader.readexactly(length))
        except BaseException:  # a cancelled or broken call leaves the connection in an unknown state
            writer.close()
            raise
        self.idle.append((reader, writer))
        if not head.startswith(b"HTTP/1.1 200"):
            raise grpc.aio.AioRpcError(grpc.StatusCode[answer["code"]], grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       answer["error"])
        return json_format.ParseDict(answer, pb.GenerateResponse())


async def measure(server: ServerProcess, http_port: int, model: str, texts: list[str], plan) -> list[dict]:
    points = []
    async with grpc.aio.insecure_channel(server.address) as channel:
        stubs = {"grpc": pb_grpc.InferenceStub(channel), "http": HttpStub(http_port)}
        for round_ in range(plan.rounds):
            for workload, options in WORKLOADS.items():
                order = list(stubs) if round_ % 2 == 0 else list(reversed(stubs))
                for transport in order:
                    cpu, own = server.cpu_seconds(), time.process_time()
                    point = await closed_loop(stubs[transport], model, texts, options, plan, plan.concurrency)
                    point.update(round=round_, workload=workload, transport=transport,
                                 server_cpu_s=round(server.cpu_seconds() - cpu, 1),
                                 client_cpu_s=round(time.process_time() - own, 1))
                    print(f"round {round_} {workload:6} {transport:4}: {point['texts_per_s']:.1f} texts/s, "
                          f"p50 {point.get('latency_ms', {}).get('p50', 0):.0f} ms, errors {point['errors']}",
                          flush=True)
                    points.append(point)
    return points


def ratios(points: list[dict]) -> dict:
    """HTTP / gRPC texts per second, per workload: each round's, and their median."""
    result = {}
    for workload in WORKLOADS:
        rounds = sorted({p["round"] for p in points if p["workload"] == workload})
        per_round = []
        for r in rounds:
            rate = {p["transport"]: p["texts_per_s"] for p in points if p["workload"] == workload and p["round"] == r}
            per_round.append(round(rate["http"] / rate["grpc"], 3) if rate["grpc"] else 0.0)
        median = statistics.median(per_round)
        result[workload] = {"per_round": per_round, "median": median, "met": median >= TARGET}
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench http", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models-dir", type=Path, default=PROJECT_ROOT / "models")
    p.add_argument("--model", default="multi30k-de-en", help="a folder under --models-dir (translation)")
    p.add_argument("--threads", type=int, default=2, help="the server's intra-op threads")
    p.add_argument("--build-cache", type=Path, help="the server's ONNX build cache")
    p.add_argument("--rounds", type=int, help="default: 3 (1 with --quick)")
    p.add_argument("--seconds", type=float, help="per point (default: bench server's saturation time)")
    p.add_argument("--out-dir", type=Path, help="default: runs/bench (docs/results with --publish)")
    p.add_argument("--quick", action="store_true", help="CI smoke run: one short round")
    add_publish(p)
    args = p.parse_args(argv)
    args.out_dir = args.out_dir or results_dir(args.publish)
    plan = QUICK if args.quick else FULL
    # short greedy calls finish by the thousand: bound the points by time alone
    plan = dataclasses.replace(plan, rounds=args.rounds or (1 if args.quick else 3), max_requests=1_000_000,
                               saturation_seconds=args.seconds or plan.saturation_seconds,
                               warmup_seconds=min(plan.warmup_seconds, 3))
    texts = [e.source for e in load_examples("multi30k", "test_2016_flickr", "de", "en")]
    random.Random(0).shuffle(texts)
    prepare(args)
    http_port = free_port()
    record = Run("bench http", argv)
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as stack:
        flags = server_flags(args, "continuous") + ["--http-port", str(http_port)]
        server = ServerProcess("http", flags, Path(logs), server_env(args))
        stack.callback(server.stop)
        server.wait_serving(timeout=300)
        points = asyncio.run(measure(server, http_port, args.model, texts, plan))
    result = {**record.header(), "model": args.model, "threads": args.threads, "plan": dataclasses.asdict(plan),
              "points": points, "http_over_grpc": ratios(points),
              "target": TARGET}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "bench-http.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["http_over_grpc"]))
    return 0
