"""python -m bench server [--scenario policies|backlog] [--quick] [--publish] [--models-dir models]
                         [--model multi30k-de-en]

--scenario policies (the default): gRPC load on loopback against the real server (`python -m
server`, one subprocess per batching policy: continuous, request, none), all started at once so
that the policies can take turns:
  1. saturation: closed loop at a high concurrency, in rounds; each round also times the same
     engine offline (no gRPC, in this process) on the same texts, as the in-run reference;
  2. latency against offered load: open loop (Poisson arrivals) at fractions of each policy's
     own saturation throughput, policies taking turns at every fraction;
  3. the caches: a new source, then the same source again, on a fourth (continuous) server with
     only the encoder cache on, at beam 4 and with a short greedy request (where the encoder's
     share is larger); and at beam 4 on a fifth with the result cache on too (the default).
Requests carry one Multi30K test_2016_flickr German sentence each, beam 4. The load servers run
with both caches off (--cache-mb 0 --result-cache 0): texts repeat across points, and cache hits
would flatter them. Every point is bounded in requests and in time.

A checkpoint is exported to ONNX and verified on the first start (minutes); the export is kept
in the server's build cache ($GRET_SERVE_CACHE, or --build-cache), so later runs start in seconds.
Writes bench-server.json and PNG plots to --out-dir (runs/bench; docs/results with --publish);
`python -m bench report` turns them into BENCHMARKS.md. On a shared machine only the ratios and
the side-by-side comparisons mean much: the load average is recorded at the start, at every point
and at the end, and every point records the CPU seconds each server (and the load generator) used
during it.

--scenario backlog [--compare FLAGS ...]: fairness between calls. One server with its default flags
(only the model and the ports named), and one beside it per --compare, taking turns round by round;
20 TranslateStream calls of 32 texts each are sent at once (a 640-text backlog),
then, while it decodes, a one-text Translate call every 0.1 s; the latency of those one-text calls
(p50, p99; target: p99 at most 1 s) against the same calls one at a time on the idle server. Every
text is new to the server (the backlog from Multi30K train, the one-text calls from val and the
test sets), so neither cache answers any. Writes bench-server-backlog.json; the load average
is recorded at the start, after every round and at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench import add_publish, results_dir
from bench.provenance import Run
from proto import gret_serve_pb2 as pb
from proto import gret_serve_pb2_grpc as pb_grpc
from server.client import Client
from training.corpora import PROJECT_ROOT, load_examples

POLICIES = ("continuous", "request", "none")
CACHE_SERVER = "cache"  # the fourth server: continuous batching with the encoder cache on
RESULTS_SERVER = "results"  # the fifth: the encoder cache and the result cache on (the defaults)
TARGETS = {"saturation_vs_offline": 0.9, "p99_over_p50_at_half_load": 2.0, "cache_speedup": 2.0}
CALL_TIMEOUT = 120.0  # gRPC deadline per call: far above any latency here; the benchmark's own bounds cut first
GREEDY = {"beam_size": 1, "max_length": 4}  # few decoder steps: the encoder is a large share of the call


@dataclass(frozen=True)
class Plan:
    rounds: int  # saturation rounds (each: offline + every policy)
    concurrency: int  # closed loop
    saturation_seconds: float
    warmup_seconds: float  # closed loop: calls that end before this are not counted
    max_requests: int  # per point
    fractions: tuple[float, ...]  # open loop: offered load as a share of the policy's saturation
    open_seconds: float  # open loop: arrivals stop after this ...
    drain_seconds: float  # ... and calls still running this long after are cancelled (reported as unfinished)
    offline_texts: int  # per offline round, decoded in batches of 32
    cache_pairs: int


# 64 callers: about as many Multi30K sentences at beam 4 as the servers' engine loops admit at once (their
# admission budgets, --max-batch-tokens per loop), so a larger concurrency only lengthens the queue.
FULL = Plan(rounds=2, concurrency=64, saturation_seconds=30, warmup_seconds=10, max_requests=2000,
            fractions=(0.25, 0.5, 0.75, 0.9), open_seconds=25, drain_seconds=60, offline_texts=64, cache_pairs=12)
QUICK = Plan(rounds=1, concurrency=8, saturation_seconds=5, warmup_seconds=1, max_requests=2000, fractions=(0.5,),
             open_seconds=5, drain_seconds=20, offline_texts=8, cache_pairs=2)


# ---- the servers ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m server` (or another `module` that takes --host and --port and serves health) on a free
    loopback port; logs go to a file that is shown if it fails."""

    def __init__(self, name: str, flags: list[str], log_dir: Path, env: dict, module: str = "server"):
        self.name, self.port = name, free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = log_dir / f"server-{name}.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(self.port), *flags],
                cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT, env=os.environ | env)
        self.psutil = psutil.Process(self.process.pid)
        self.metrics_port: int | None = None  # where the caller's flags put the metrics, if it needs them

    def cpu_seconds(self) -> float:
        t = self.psutil.cpu_times()
        return t.user + t.system

    def wait_serving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with Client(self.address, timeout=2) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"server {self.name} exited with {self.process.returncode}:\n{self.tail()}")
                with contextlib.suppress(grpc.RpcError):
                    if client.health() == "SERVING":
                        return
                time.sleep(0.5)
        raise RuntimeError(f"server {self.name} was not SERVING after {timeout:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def tail(self) -> str:
        return "".join(self.log.read_text(errors="replace").splitlines(keepends=True)[-20:])


def server_env(args) -> dict:
    """The ONNX backend sets ONNX Runtime's threads but leaves torch (the engine's batch bookkeeping)
    at one thread per core; pin torch to --threads too, so that --threads means one thing."""
    return {"OMP_NUM_THREADS": str(args.threads)}


def server_flags(args, policy: str, encoder_cache: bool = False, result_cache: bool = False) -> list[str]:
    flags = ["--models-dir", str(args.models_dir), "--models", args.model, "--metrics-port", "0", "--http-port", "0",
             "--batching", policy, "--threads", str(args.threads), "--grace-seconds", "5"]
    if args.build_cache:
        flags += ["--build-cache", str(args.build_cache)]
    return flags + ([] if encoder_cache else ["--cache-mb", "0"]) + ([] if result_cache else ["--result-cache", "0"])


def prepare(args) -> None:
    """Export + verify once, before the five servers start (they would all export at the same time)."""
    prepare_models(server_flags(args, "continuous"), server_env(args))


def prepare_models(flags: list[str], env: dict | None = None) -> None:
    """`python -m server --prepare-only` with these flags: the models exported and verified as a start
    would, so that no timed start includes it."""
    done = subprocess.run([sys.executable, "-m", "server", "--prepare-only", *flags], check=False, cwd=PROJECT_ROOT,
                          capture_output=True, text=True, env=os.environ | (env or {}))
    if done.returncode:
        raise RuntimeError(f"python -m server --prepare-only failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


# ---- one call, and the two load shapes -------------------------------------------------------
@dataclass
class Call:
    start: float  # open loop: the scheduled arrival, so a late send counts against the latency
    end: float
    code: str
    tokens: int = 0  # the best hypothesis's output pieces (end of sentence excluded)
    cache_hit: bool = False  # the encoder did not run
    result_hit: bool = False  # answered from the result cache

    @property
    def seconds(self) -> float:
        return self.end - self.start


async def call(stub, model: str, text: str, options: dict, start: float | None = None) -> Call:
    start = time.perf_counter() if start is None else start
    request = pb.TranslateRequest(texts=[text], model=model, options=pb.DecodingOptions(**options))
    try:
        response = await stub.Translate(request, timeout=CALL_TIMEOUT)
    except grpc.aio.AioRpcError as e:
        return Call(start, time.perf_counter(), e.code().name)
    result = response.results[0]
    return Call(start, time.perf_counter(), "OK", result.hypotheses[0].tokens, result.encoder_cache_hit,
                result.result_cache_hit)


async def closed_loop(stub, model, texts, options, plan: Plan, concurrency: int) -> dict:
    """`concurrency` callers, each sending its next text when the last one returns. Counted: calls
    that end after the warm-up and before the first of (time up, requests used up); calls still
    running then are cancelled."""
    queue = iter(itertools.islice(itertools.cycle(texts), plan.max_requests))
    calls: list[Call] = []
    begin = time.perf_counter()
    stop = begin + plan.saturation_seconds
    exhausted = asyncio.get_running_loop().create_future()

    async def caller():
        for text in queue:
            calls.append(await call(stub, model, text, options))
        if not exhausted.done():
            exhausted.set_result(time.perf_counter())

    callers = [asyncio.create_task(caller()) for _ in range(concurrency)]
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(exhausted), timeout=plan.saturation_seconds)
    end = min(stop, exhausted.result()) if exhausted.done() else stop
    if end <= begin + plan.warmup_seconds:
        raise RuntimeError(f"all {plan.max_requests} calls ended inside the {plan.warmup_seconds} s warm-up: "
                           "this machine needs a larger max_requests")
    running = sum(not t.done() for t in callers)
    for task in callers:
        task.cancel()
    await asyncio.gather(*callers, return_exceptions=True)
    counted = [c for c in calls if begin + plan.warmup_seconds <= c.end <= end]
    point = summarise(counted, seconds=end - begin - plan.warmup_seconds)
    point.update(mode="closed", concurrency=concurrency, cancelled_at_end=running)
    return point


async def open_loop(stub, model, texts, options, plan: Plan, rate: float, seed: int) -> dict:
    """Poisson arrivals at `rate` per second, each call sent without waiting for the others."""
    rng = random.Random(seed)
    begin = arrival = time.perf_counter()
    tasks = []
    for text in itertools.islice(itertools.cycle(texts), plan.max_requests):
        arrival += rng.expovariate(rate)
        if arrival - begin > plan.open_seconds:
            break
        await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
        tasks.append(asyncio.create_task(call(stub, model, text, options, start=arrival)))
    done, pending = await asyncio.wait(tasks, timeout=plan.drain_seconds) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    calls = [t.result() for t in done]
    ok = [c for c in calls if c.code == "OK"]
    seconds = max(c.end for c in ok) - min(c.start for c in calls) if ok else 0.0
    point = summarise(calls, seconds)
    point.update(mode="open", offered_per_s=round(rate, 3), unfinished=len(pending))
    return point


def summarise(calls: list[Call], seconds: float) -> dict:
    ok = [c for c in calls if c.code == "OK"]
    errors: dict[str, int] = {}
    for c in calls:
        if c.code != "OK":
            errors[c.code] = errors.get(c.code, 0) + 1
    point = {"calls": len(calls), "ok": len(ok), "errors": errors, "seconds": round(seconds, 2),
             "texts_per_s": round(len(ok) / seconds, 3) if seconds > 0 else 0.0,
             "target_tokens_per_s": round(sum(c.tokens for c in ok) / seconds, 1) if seconds > 0 else 0.0,
             "load_average": round(os.getloadavg()[0], 2)}
    if ok:
        latency = np.array([c.seconds for c in ok]) * 1000
        per_token = latency / np.array([max(c.tokens, 1) for c in ok])  # latency grows with output length
        p = [float(v) for v in np.percentile(latency, [50, 90, 99])]
        point["latency_ms"] = {"p50": round(p[0], 1), "p90": round(p[1], 1), "p99": round(p[2], 1),
                               "max": round(float(latency.max()), 1)}
        point["ms_per_token"] = {"p50": round(float(np.percentile(per_token, 50)), 2),
                                 "p99": round(float(np.percentile(per_token, 99)), 2)}
        tokens = np.array([c.tokens for c in ok])
        point["output_tokens"] = {"p50": float(np.percentile(tokens, 50)), "p99": float(np.percentile(tokens, 99))}
    return point


# ---- the offline reference ---------------------------------------------------------------------
class OfflineEngine:
    """The server's engine and backend without gRPC, driven on this thread: the texts go in
    batches of 32, each submitted at once (as `python -m bench engine` does)."""

    BATCH = 32

    def __init__(self, args):
        import torch

        from server.catalog import load_entry
        from server.pipeline import build_pipeline

        torch.set_num_threads(args.threads)
        entry = load_entry(args.models_dir / args.model, "onnx", args.build_cache)
        # both caches off, as on the load servers: every text is encoded and decoded in every round
        self.pipeline = build_pipeline(entry, "onnx", "fp32", args.threads, "continuous", cache_bytes=0)

    def run(self, texts: list[str], beam: int) -> dict:
        from server.engine.options import DecodingOptions

        engine, tokens = self.pipeline.engine, 0
        busy = dict(engine.seconds)
        start = time.perf_counter()
        for k in range(0, len(texts), self.BATCH):
            seqs = self.pipeline.sequences(texts[k: k + self.BATCH], DecodingOptions(beam=beam), lambda s: None)
            engine.submit(seqs)
            engine.run_until_idle()
            tokens += sum(len(s.hypotheses[0].tokens) for s in seqs)
        seconds = time.perf_counter() - start
        busy = {k: engine.seconds[k] - busy[k] for k in busy}
        return {"texts": len(texts), "seconds": round(seconds, 2), "texts_per_s": round(len(texts) / seconds, 3),
                "target_tokens_per_s": round(tokens / seconds, 1), "load_average": round(os.getloadavg()[0], 2),
                "encoder_share": round(busy["encode"] / sum(busy.values()), 4)}


# ---- the caches ----------------------------------------------------------------------------------
async def cache_pairs(stub, model, texts, options, cache: str = "encoder") -> dict:
    """Each text twice in a row on an otherwise idle server: first a miss, then a hit of `cache`
    (encoder | result)."""
    pairs = [(await call(stub, model, t, options), await call(stub, model, t, options)) for t in texts]
    pairs = [(new, again) for new, again in pairs if new.code == again.code == "OK"]
    new_ms = [p[0].seconds * 1000 for p in pairs]
    again_ms = [p[1].seconds * 1000 for p in pairs]
    ratios = [n / a for n, a in zip(new_ms, again_ms)]
    return {"options": options, "pairs": len(pairs), "failed_pairs": len(texts) - len(pairs),
            "cache": cache,
            "hit_flags_as_expected": sum(not (n.cache_hit or n.result_hit) and a.cache_hit
                                         and a.result_hit == (cache == "result") for n, a in pairs),
            "new_ms": spread(new_ms), "repeated_ms": spread(again_ms), "speedup": spread(ratios, 3),
            "output_tokens_median": statistics.median(p[0].tokens for p in pairs) if pairs else 0}


def spread(values: list[float], digits: int = 1) -> dict:
    if not values:
        return {}
    q = [float(v) for v in np.percentile(values, [25, 50, 75])]
    return {"median": round(q[1], digits), "q1": round(q[0], digits), "q3": round(q[2], digits)}


# ---- the run -----------------------------------------------------------------------------------
def rotate(items: list, k: int) -> list:
    """Turn k starts with a different item, so drifting machine load hits every item alike."""
    k %= len(items)
    return items[k:] + items[:k]


class CpuMeter:
    """CPU seconds each server process and this process used during a point: the server being
    measured should account for nearly all of it, the idle ones for none."""

    def __init__(self, servers: dict):
        self.servers, self.me = servers, psutil.Process()

    def read(self) -> dict:
        t = self.me.cpu_times()
        return {name: s.cpu_seconds() for name, s in self.servers.items()} | {"bench": t.user + t.system}

    async def around(self, point):
        before = self.read()
        result = await point if asyncio.iscoroutine(point) else point()
        result["cpu_seconds"] = {k: round(v - before[k], 2) for k, v in self.read().items()}
        return result


async def measure(servers: dict, offline: OfflineEngine, model: str, texts: list[str], plan: Plan, beam: int,
                  seed: int) -> dict:
    meter = CpuMeter(servers)
    channels = {name: grpc.aio.insecure_channel(s.address) for name, s in servers.items()}
    stubs = {name: pb_grpc.InferenceStub(ch) for name, ch in channels.items()}
    options = {"beam_size": beam}
    try:
        for text in texts[:2]:  # first calls set up sessions and arenas
            await asyncio.gather(*(call(stub, model, text, options) for stub in stubs.values()))
        offline.run(texts[:2], beam)

        saturation = {name: [] for name in ("offline", *POLICIES)}
        for r in range(plan.rounds):
            for name in rotate(list(saturation), r):
                if name == "offline":
                    point = await meter.around(lambda: offline.run(texts[: plan.offline_texts], beam))
                else:
                    point = await meter.around(closed_loop(stubs[name], model, texts, options, plan, plan.concurrency))
                saturation[name].append(point)
                print(f"saturation round {r} {name:10s} {point['texts_per_s']:7.2f} texts/s", flush=True)
        peak = {name: median(points, "texts_per_s") for name, points in saturation.items()}
        if not all(peak.values()):
            raise RuntimeError(f"no call finished inside a saturation window ({peak}): the windows are too short "
                               "for this machine")

        curves = {name: [] for name in POLICIES}
        for i, fraction in enumerate(plan.fractions):
            for name in rotate(list(POLICIES), i):
                point = await meter.around(open_loop(stubs[name], model, texts, options, plan, fraction * peak[name],
                                                     seed + i))
                point["fraction_of_saturation"] = fraction
                curves[name].append(point)
                print(f"open loop {fraction:.2f} x sat {name:10s} offered {point['offered_per_s']:6.2f}/s "
                      f"p50 {point.get('latency_ms', {}).get('p50', 0):7.0f} ms "
                      f"p99 {point.get('latency_ms', {}).get('p99', 0):7.0f} ms", flush=True)

        # texts the cache server has not seen: its warm-up used the first two
        fresh = texts[-2 * plan.cache_pairs:]
        cache = {"beam": await cache_pairs(stubs[CACHE_SERVER], model, fresh[::2], options),
                 "greedy": await cache_pairs(stubs[CACHE_SERVER], model, fresh[1::2], GREEDY),
                 "beam_result_cache": await cache_pairs(stubs[RESULTS_SERVER], model, fresh[::2], options, "result")}
    finally:
        for ch in channels.values():
            await ch.close()
    return {"saturation": saturation, "saturation_texts_per_s": peak, "curves": curves, "cache": cache}


def median(points: list[dict], key: str) -> float:
    return round(statistics.median(p[key] for p in points), 3)


def engine_reference(path: Path, checkpoint: Path, threads: int) -> dict | None:
    """sentences/s of our engine on ONNX fp32 from `python -m bench engine`'s JSON, if there is one
    that ran the same checkpoint with the same threads (anything else is not a comparison)."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    settings = data.get("settings", {})
    if settings.get("threads") != threads or Path(settings.get("checkpoint", "")).resolve() != checkpoint.resolve():
        return None
    for name, figures in data.get("systems", {}).items():
        if name.endswith("onnx-fp32") and not name.startswith("gret"):
            return {"file": str(path.relative_to(PROJECT_ROOT) if path.is_relative_to(PROJECT_ROOT) else path),
                    "system": name, "sentences_per_s": figures["sentences_per_s"],
                    "target_tokens_per_s": figures.get("target_tokens_per_s"), "date": data.get("date"),
                    "settings": data.get("settings"), "machine": data.get("machine")}
    return None


def targets(measured: dict, engine: dict | None) -> dict:
    """Judged on the server's default policy (continuous); the others are in the tables."""
    sat = measured["saturation_texts_per_s"]
    half = next((p for p in measured["curves"]["continuous"] if p["fraction_of_saturation"] == 0.5), None)
    out = {"saturation_vs_offline_in_run": {
        "target": TARGETS["saturation_vs_offline"], "measured": round(sat["continuous"] / sat["offline"], 3),
        "note": "continuous-batching server at saturation / the same engine offline, same run, same texts"}}
    if engine:
        out["saturation_vs_bench_engine"] = {
            "target": TARGETS["saturation_vs_offline"],
            "measured": round(sat["continuous"] / engine["sentences_per_s"], 3),
            "note": f"vs {engine['system']} sentences/s of {engine['file']} ({engine['date']}): another run, "
                    f"other machine load"}
    if half and "latency_ms" in half:
        out["p99_over_p50_at_half_load"] = {
            "target": TARGETS["p99_over_p50_at_half_load"],
            "measured": round(half["latency_ms"]["p99"] / half["latency_ms"]["p50"], 3), "lower_is_better": True,
            "note": "continuous, open loop at half its saturation throughput" + length_floor(half)}
    for name, result in measured["cache"].items():
        if result["pairs"]:
            out[f"cache_speedup_{name}"] = {"target": TARGETS["cache_speedup"],
                                            "measured": result["speedup"]["median"],
                                            "note": f"options {result['options']}, median over pairs"
                                                    + ("" if result["cache"] == "result" or result["options"] == GREEDY
                                                       else encoder_bound(measured))}
    for t in out.values():
        t["met"] = t["measured"] <= t["target"] if t.get("lower_is_better") else t["measured"] >= t["target"]
    return out


def encoder_bound(measured: dict) -> str:
    """An encoder-cache hit skips only the encoder, so the encoder's share of the work bounds it."""
    share = statistics.median(r["encoder_share"] for r in measured["saturation"]["offline"])
    return (f"; the encoder was {100 * share:.1f}% of the engine's busy time offline in this run (beam 4, batches "
            f"of 32): skipping it alone gives at most about {1 / (1 - share):.2f}x")


def length_floor(point: dict) -> str:
    """Latency grows with output length, so the spread of lengths alone sets a floor on p99/p50."""
    lengths = point.get("output_tokens")
    if not lengths or not lengths["p50"]:
        return ""
    return (f"; the same calls' output lengths: p99 {lengths['p99']:.0f} / p50 {lengths['p50']:.0f} tokens "
            f"= {lengths['p99'] / lengths['p50']:.2f}")


def plot(result: dict, out_dir: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = dict(zip(POLICIES, ("#1b9e77", "#d95f02", "#7570b3")))
    curves, sat = result["policies"], result["saturation_texts_per_s"]
    title = f"{result['settings']['model']}, beam {result['settings']['beam']}, threads {result['settings']['threads']}" \
            f"; shared machine, load {result['machine']['load_average_start'][0]:.1f}-" \
            f"{result['machine']['load_average_end'][0]:.1f}"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in POLICIES:
        points = [p for p in curves[name]["open_loop"] if "latency_ms" in p]
        x = [p["texts_per_s"] for p in points]
        left.plot(x, [p["latency_ms"]["p50"] for p in points], "o-", color=colours[name], label=f"{name} p50")
        left.plot(x, [p["latency_ms"]["p99"] for p in points], "s--", color=colours[name], label=f"{name} p99")
        left.axvline(sat[name], color=colours[name], linestyle=":", linewidth=1)
        right.plot([p["fraction_of_saturation"] for p in points],
                   [p["latency_ms"]["p99"] / p["latency_ms"]["p50"] for p in points], "o-", color=colours[name],
                   label=name)
    left.set(xlabel="achieved throughput (texts/s); dotted: saturation (closed loop)", ylabel="latency (ms)",
             yscale="log", title="open loop (Poisson arrivals)")
    left.legend(fontsize=7, ncol=3)
    right.axhline(TARGETS["p99_over_p50_at_half_load"], color="black", linewidth=0.8)
    right.set(xlabel="offered load / the policy's saturation throughput", ylabel="p99 / p50",
              title="tail: p99 over p50 (target at half load: at most 2)")
    right.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    latency_png = out_dir / "bench-server-latency.png"
    fig.savefig(latency_png, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.6))
    cache = result["cache"]
    names = [n for n in cache if cache[n]["pairs"]]
    for offset, (key, label) in enumerate((("new_ms", "new source"), ("repeated_ms", "repeated source (cache hit)"))):
        medians = [cache[n][key]["median"] for n in names]
        errors = [[m - cache[n][key]["q1"] for n, m in zip(names, medians)],
                  [cache[n][key]["q3"] - m for n, m in zip(names, medians)]]
        ax.bar([i + 0.4 * offset for i in range(len(names))], medians, width=0.4, yerr=errors, label=label)
    ax.set_xticks([i + 0.2 for i in range(len(names))],
                  [f"{n}: {cache[n]['options']}\nspeed-up x{cache[n]['speedup']['median']}" for n in names], fontsize=7)
    ax.set(ylabel="latency (ms), median and IQR", title="encoder / result cache, one idle server each")
    ax.legend(fontsize=7)
    fig.tight_layout()
    cache_png = out_dir / "bench-server-cache.png"
    fig.savefig(cache_png, dpi=110)
    plt.close(fig)
    return {"latency": latency_png.name, "cache": cache_png.name}


# ---- one-text calls behind a backlog (--scenario backlog) ------------------------------------------
@dataclass(frozen=True)
class Backlog:
    streams: int  # TranslateStream calls sent at once ...
    texts_per_stream: int  # ... of this many texts each: the backlog
    probe_interval_s: float  # then one one-text Translate call every this many seconds while it decodes
    rounds: int
    idle_probes: int  # first, one-text calls one at a time on the idle server: the reference
    queue_s: float  # the first one-text call goes this long after the backlog (time for it to reach the queue)


BACKLOG = Backlog(streams=20, texts_per_stream=32, probe_interval_s=0.1, rounds=5, idle_probes=20, queue_s=0.5)
BACKLOG_QUICK = Backlog(streams=8, texts_per_stream=32, probe_interval_s=0.05, rounds=1, idle_probes=3, queue_s=0.02)
BACKLOG_TARGET_P99_MS = 1000.0


def scrape(metrics_port: int) -> list[tuple[str, dict, float]]:
    """The server's own /metrics on loopback, as (sample name, labels, value)."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(body) for s in family.samples]


def total(samples: list[tuple[str, dict, float]], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(value for n, have, value in samples if n == name and labels.items() <= have.items())


def queue_depth(metrics_port: int) -> float:
    """Texts waiting for admission, from the server's own metrics (all models)."""
    return total(scrape(metrics_port), "gret_serve_queue_depth")


def latency(calls: list[Call]) -> dict:
    ms = np.array([c.seconds for c in calls]) * 1000
    p = [float(v) for v in np.percentile(ms, [50, 90, 99])] if len(ms) else [0.0] * 3
    return {"p50": round(p[0], 1), "p90": round(p[1], 1), "p99": round(p[2], 1),
            "max": round(float(ms.max()), 1) if len(ms) else 0.0}


async def backlog_round(stub, model: str, backlog: list[str], probes, plan: Backlog, metrics_port: int) -> dict:
    """The backlog's streams sent at once, then one-text calls at intervals until the last stream
    ends. Counted: the one-text calls sent before then."""
    async def stream(texts: list[str]) -> tuple[int, str, float]:
        answered, code = 0, "OK"
        try:
            async for response in stub.TranslateStream(pb.TranslateRequest(texts=texts, model=model),
                                                       timeout=CALL_TIMEOUT):
                answered += len(response.results)
        except grpc.aio.AioRpcError as e:
            code = f"{e.code().name}: {e.details()}"
        return answered, code, time.perf_counter()

    n = plan.texts_per_stream
    begin = time.perf_counter()
    streams = [asyncio.create_task(stream(backlog[i * n: (i + 1) * n])) for i in range(plan.streams)]
    await asyncio.sleep(plan.queue_s)  # the backlog reaches the server first
    queued = asyncio.get_running_loop().run_in_executor(None, queue_depth, metrics_port)
    sent = []
    while not sent or not all(t.done() for t in streams):
        sent.append(asyncio.create_task(call(stub, model, next(probes), {})))
        await asyncio.sleep(plan.probe_interval_s)
    queued = await queued
    ended = await asyncio.gather(*streams)
    end = max(e[2] for e in ended)
    calls = [c for c in await asyncio.gather(*sent) if c.start < end]
    ok = [c for c in calls if c.code == "OK"]
    return {"backlog_texts": sum(e[0] for e in ended), "backlog_errors": sorted({e[1] for e in ended} - {"OK"}),
            "backlog_seconds": round(end - begin, 2), "backlog_texts_per_s": round(sum(e[0] for e in ended)
                                                                                   / (end - begin), 2),
            "queued_at_first_call": queued, "calls": len(calls), "ok": len(ok),
            "errors": dict(collections.Counter(c.code for c in calls if c.code != "OK")),
            "result_cache_hits": sum(c.result_hit for c in ok), "latency_ms": latency(ok),
            "load_average": [round(x, 2) for x in os.getloadavg()], "_calls": ok}


async def measure_backlog(servers: dict, model: str, texts: dict, plan: Backlog) -> dict:
    """Each server (name -> (address, metrics port)) in turn, round by round."""
    channels = {name: grpc.aio.insecure_channel(address) for name, (address, _) in servers.items()}
    stubs = {name: pb_grpc.InferenceStub(ch) for name, ch in channels.items()}
    probes, backlog = iter(texts["probes"]), iter(texts["backlog"])
    measured = {}
    try:
        for name, stub in stubs.items():
            for _ in range(2):  # first calls set up sessions and arenas
                await call(stub, model, next(probes), {})
            idle = [await call(stub, model, next(probes), {}) for _ in range(plan.idle_probes)]
            measured[name] = {"idle": {"calls": len(idle), "latency_ms": latency([c for c in idle if c.code == "OK"])},
                              "rounds": []}
        for r in range(plan.rounds):
            for name in rotate(list(stubs), r):
                work = list(itertools.islice(backlog, plan.streams * plan.texts_per_stream))
                point = await backlog_round(stubs[name], model, work, probes, plan, servers[name][1])
                measured[name]["rounds"].append(point)
                print(f"backlog round {r} {name}: {point['backlog_texts']} texts in {point['backlog_seconds']} s; "
                      f"{point['ok']} one-text calls, p50 {point['latency_ms']['p50']:.0f} ms, "
                      f"p99 {point['latency_ms']['p99']:.0f} ms; load {point['load_average'][0]}", flush=True)
    finally:
        for ch in channels.values():
            await ch.close()
    for m in measured.values():
        pooled = [c for r in m["rounds"] for c in r.pop("_calls")]
        m["all_rounds"] = {"calls": len(pooled), "latency_ms": latency(pooled),
                           "backlog_texts_per_s_median": round(statistics.median(
                               r["backlog_texts_per_s"] for r in m["rounds"]), 2)}
    return measured


def backlog_texts(plan: Backlog, servers: int, seed: int) -> dict:
    """Texts the server has never seen in this run: the backlog from Multi30K train, the one-text
    calls from val and the test sets (the caches stay on, as by default, and must not answer)."""
    backlog = [e.source for e in load_examples("multi30k", "train", "de", "en")]
    probes = [e.source for split in ("val", "test_2016_flickr", "test_2017_flickr")
              for e in load_examples("multi30k", split, "de", "en")]
    rng = random.Random(seed)
    rng.shuffle(backlog)
    rng.shuffle(probes)
    backlog = list(dict.fromkeys(backlog))
    seen = set(backlog)
    probes = list(dict.fromkeys(p for p in probes if p not in seen))
    needed = plan.rounds * servers * plan.streams * plan.texts_per_stream
    if len(backlog) < needed:
        raise RuntimeError(f"the backlogs need {needed} distinct texts; Multi30K train has {len(backlog)}")
    return {"backlog": backlog[:needed], "probes": probes}


def run_backlog(args) -> int:
    plan = BACKLOG_QUICK if args.quick else BACKLOG
    started = time.monotonic()
    record = Run("bench server", args.argv, "shared machine: nothing paused", args.note)
    settings = {"defaults": [], **{" ".join(c): c for c in map(shlex.split, args.compare)}}
    texts = backlog_texts(plan, len(settings), args.seed)
    base = ["--models-dir", str(args.models_dir), "--models", args.model, "--http-port", "0"] + \
        (["--build-cache", str(args.build_cache)] if args.build_cache else [])
    flags, servers = {}, {}
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as stack:
        for i, (name, extra) in enumerate(settings.items()):
            port = free_port()
            flags[name] = [*base, "--metrics-port", str(port), *extra]
            server = ServerProcess(f"setting{i}", flags[name], Path(logs), {})
            stack.callback(server.stop)
            servers[name] = (server, port)
        for server, _ in servers.values():
            server.wait_serving(timeout=600)
        with Client(servers["defaults"][0].address, timeout=10) as client:
            info = next(m for m in client.list_models() if m.name == args.model)
        measured = asyncio.run(measure_backlog({n: (s.address, port) for n, (s, port) in servers.items()},
                                               args.model, texts, plan))
    for name, m in measured.items():
        m["server_flags"] = flags[name]
    judged = measured["defaults"]["all_rounds"]
    p99 = judged["latency_ms"]["p99"]
    result = {
        **record.header(),
        "settings": {"model": args.model, "model_version": info.version, "architecture": info.architecture,
                     "backend": f"{info.backend} {info.precision}", "quick": args.quick,
                     "seed": args.seed, "plan": dataclasses.asdict(plan), "options": "the server's defaults (beam 4)",
                     "texts": "The backlog's texts come from Multi30K train (de), the one-text calls' from val and "
                              "the test sets (de), each sent once", "call_timeout_s": CALL_TIMEOUT},
        "servers": measured,
        "targets": {"one_text_p99_ms_behind_backlog": {
            "target": BACKLOG_TARGET_P99_MS, "measured": p99, "lower_is_better": True,
            "met": p99 <= BACKLOG_TARGET_P99_MS,
            "note": f"the server's defaults: {judged['calls']} one-text calls over {plan.rounds} round(s), each sent "
                    f"while a {plan.streams * plan.texts_per_stream}-text backlog decoded"}},
        "wall_seconds": round(time.monotonic() - started, 1),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "bench-server-backlog.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    for name, m in measured.items():
        a = m["all_rounds"]
        print(f"{name}: one-text calls behind the backlog p50 {a['latency_ms']['p50']:.0f} ms, p99 "
              f"{a['latency_ms']['p99']:.0f} ms; idle p50 {m['idle']['latency_ms']['p50']:.0f} ms; backlog "
              f"{a['backlog_texts_per_s_median']} texts/s (median round)")
    met = "met" if p99 <= BACKLOG_TARGET_P99_MS else "NOT met"
    print(f"target p99 <= {BACKLOG_TARGET_P99_MS:.0f} ms with the defaults: {met}")
    print(f"wrote {out} in {result['wall_seconds']:.0f} s")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models-dir", type=Path, default=PROJECT_ROOT / "models")
    p.add_argument("--model", default="multi30k-de-en", help="a folder under --models-dir (translation)")
    p.add_argument("--threads", type=int, default=2,
                   help="intra-op threads of each server and of the offline engine (the server's default is 2; on "
                        "a host whose cores are busy with other work, 1 avoids steps that wait for a descheduled "
                        "thread)")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--build-cache", type=Path, help="the servers' ONNX build cache (default: $GRET_SERVE_CACHE "
                                                    "or ~/.cache/gret-serve)")
    p.add_argument("--engine-results", type=Path,
                   help="python -m bench engine's JSON: the offline figure saturation is compared with "
                        "(default: bench-engine.json in --out-dir)")
    p.add_argument("--out-dir", type=Path, help="default: runs/bench (docs/results with --publish)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default="", help="what else the machine was doing, for the record")
    p.add_argument("--quick", action="store_true", help="CI smoke run: one round, one open-loop point, few requests")
    p.add_argument("--scenario", choices=("policies", "backlog"), default="policies",
                   help="policies: the batching policies under load (bench-server.json); backlog: one-text calls "
                        "while a 640-text backlog decodes, the server with its defaults (bench-server-backlog.json)")
    p.add_argument("--compare", action="append", default=[], metavar="FLAGS",
                   help="backlog: another server beside the defaults, with these flags (repeatable); the servers take "
                        "turns, and the target is judged on the defaults")
    add_publish(p)
    args = p.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    args.out_dir = args.out_dir or results_dir(args.publish)
    if args.scenario == "backlog":
        return run_backlog(args)
    args.engine_results = args.engine_results or args.out_dir / "bench-engine.json"
    plan = QUICK if args.quick else FULL
    started = time.monotonic()
    record = Run("bench server", args.argv, "shared machine: compare within this run only", args.note)

    texts = [e.source for e in load_examples("multi30k", "test_2016_flickr", "de", "en")]
    random.Random(args.seed).shuffle(texts)
    prepare(args)
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as stack:
        servers = {}
        for name in (*POLICIES, CACHE_SERVER, RESULTS_SERVER):
            flags = server_flags(args, name if name in POLICIES else "continuous",
                                 encoder_cache=name in (CACHE_SERVER, RESULTS_SERVER), result_cache=name == RESULTS_SERVER)
            servers[name] = ServerProcess(name, flags, Path(logs), server_env(args))
            stack.callback(servers[name].stop)
        for s in servers.values():
            s.wait_serving(timeout=300)
        with Client(servers["continuous"].address, timeout=10) as client:
            info = next(m for m in client.list_models() if m.name == args.model)
        offline = OfflineEngine(args)
        measured = asyncio.run(measure(servers, offline, args.model, texts, plan, args.beam, args.seed))

    engine = engine_reference(args.engine_results, args.models_dir / args.model, args.threads)
    sat = measured["saturation_texts_per_s"]
    policies = {}
    for name in POLICIES:
        points = measured["saturation"][name]
        policies[name] = {
            "saturation": {"texts_per_s": sat[name], "target_tokens_per_s": median(points, "target_tokens_per_s"),
                           "vs_offline_in_run": round(sat[name] / sat["offline"], 3),
                           "vs_bench_engine": round(sat[name] / engine["sentences_per_s"], 3) if engine else None,
                           "rounds": points},
            "open_loop": measured["curves"][name]}
    result = {
        **record.header(),
        "settings": {"model": args.model, "model_version": info.version, "architecture": info.architecture,
                     "backend": f"{info.backend} {info.precision}", "threads": args.threads, "beam": args.beam,
                     "split": "multi30k test_2016_flickr (de)", "texts_per_call": 1, "quick": args.quick,
                     "seed": args.seed, "plan": dataclasses.asdict(plan), "greedy_options": GREEDY,
                     "call_timeout_s": CALL_TIMEOUT, "server_env": server_env(args), "caches": "both off on the three load servers "
                     "(--cache-mb 0 --result-cache 0); the encoder cache (256 MB) alone on the cache server; "
                     "both (the defaults) on the results server",
                     "target_tokens": "the best hypothesis's output pieces, end of sentence excluded"},
        "offline": {"texts_per_s": sat["offline"],
                    "target_tokens_per_s": median(measured["saturation"]["offline"], "target_tokens_per_s"),
                    "rounds": measured["saturation"]["offline"]},
        "bench_engine": engine,
        "saturation_texts_per_s": sat,
        "policies": policies,
        "cache": measured["cache"],
        "targets": targets(measured, engine),
        "wall_seconds": round(time.monotonic() - started, 1),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result["plots"] = plot(result, args.out_dir)
    (args.out_dir / "bench-server.json").write_text(json.dumps(result, indent=2) + "\n")
    for name, t in result["targets"].items():
        print(f"{name:32s} measured {t['measured']:7.3f}  target {t['target']}  {'met' if t['met'] else 'NOT met'}")
    print(f"wrote {args.out_dir / 'bench-server.json'} in {result['wall_seconds']:.0f} s")
    return 0
