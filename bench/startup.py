"""python -m bench startup [--models NAME ...] [--calls N]: a new server as its first clients meet it.

Each model is served alone by `python -m server` with its defaults (caches off, loopback ports) and
started twice: with Numba's cache directory empty, as in a new container, where the engine processes
compile the beam search (and a POS model's pipeline its tagger's search) before they report ready;
then again on the cache that the first start filled. Each start records the seconds until Health
says SERVING (polled every half second) and the latency of N one-sentence calls sent one after
another as soon as it does: the first is what a client that arrives at start-up waits. The models
are prepared (exported, verified) beforehand, so no start includes that.

Writes bench-startup.json to runs/bench (--out-dir).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench import results_dir
from bench.provenance import Run
from bench.server import ServerProcess, call, prepare_models
from proto import gret_serve_pb2_grpc as pb_grpc
from server.catalog import load_entry
from training.corpora import PROJECT_ROOT, load_examples

BEAM = 4
STARTS = ("empty cache", "filled cache")


def texts_in(language: str, n: int) -> list[str]:
    """n Multi30K test sentences in `language` (a summariser's English reads them as articles)."""
    other = "de" if language == "en" else "en"
    return [e.source for e in load_examples("multi30k", "test_2016_flickr", language, other)[:n]]


async def first_calls(address: str, model: str, texts: list[str]) -> list[float]:
    """Each text's call in turn, ms; a failed call fails the run."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        latencies = []
        for text in texts:
            c = await call(stub, model, text, {"beam_size": BEAM})
            if c.code != "OK":
                raise RuntimeError(f"model {model}: a call after start-up ended {c.code}")
            latencies.append(round((c.end - c.start) * 1e3, 1))
        return latencies


def start(model: str, flags: list[str], texts: list[str], numba_cache: Path, log_dir: Path, name: str) -> dict:
    began = time.monotonic()
    server = ServerProcess(name, flags, log_dir, {"NUMBA_CACHE_DIR": str(numba_cache)})
    try:
        server.wait_serving(timeout=1800)
        serving_s = round(time.monotonic() - began, 1)
        return {"serving_s": serving_s, "calls_ms": asyncio.run(first_calls(server.address, model, texts))}
    finally:
        server.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models-dir", type=Path, default=PROJECT_ROOT / "models")
    p.add_argument("--models", nargs="+", default=["multi30k-de-en-vanilla", "multi30k-de-en"])
    p.add_argument("--calls", type=int, default=8, help="one-sentence calls after each start")
    p.add_argument("--build-cache", type=Path, help="the servers' build cache (default: theirs)")
    p.add_argument("--out-dir", type=Path, help="default: runs/bench")
    args = p.parse_args(argv)
    record = Run("bench startup", argv)
    out = args.out_dir or results_dir(False)
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    build = ["--build-cache", str(args.build_cache)] if args.build_cache else []
    models = {}
    for model in args.models:
        flags = ["--models-dir", str(args.models_dir), "--models", model, *build]
        prepare_models(flags)
        entry = load_entry(args.models_dir / model, "onnx", args.build_cache)  # the prepared repository
        texts = texts_in(entry.source_language, args.calls)
        serve = [*flags, "--metrics-port", "0", "--http-port", "0", "--cache-mb", "0", "--result-cache", "0"]
        with tempfile.TemporaryDirectory() as numba_cache:
            models[model] = {label: start(model, serve, texts, Path(numba_cache), log_dir,
                                           f"startup-{model}-{label.split()[0]}")
                             for label in STARTS}  # in order: the first start fills the cache
        print(model, json.dumps(models[model]))
    payload = {**record.header(),
               "settings": {"beam": BEAM, "calls": args.calls}, "models": models}
    (out / "bench-startup.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(out / "bench-startup.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
