"""python -m bench speed [--quick] [--publish]: the server, as a user runs it, against CTranslate2.

One run, the systems taking turns, so that every ratio compares numbers taken under the same
machine load (each system first runs one untimed round or point, and the servers warm up inside
every point too):
  1. the score: `python -m server` with its default flags (both caches off: the texts repeat
     across rounds), 64 callers in a closed loop, one unseen Multi30K test sentence per call,
     beam 4, found like a user finds it: over gRPC on loopback, from another process. Against it,
     CTranslate2 int8 offline on the same weights and texts in batches of 32, at its best of one
     replica x all threads and all replicas x one thread. The same load on the GRET model gives
     GRET / vanilla. The same engine without gRPC (built with the server's defaults, all texts at
     once) splits the time: server / engine is what gRPC and dispatch cost, the engine's busy time
     by phase (encoder, decoder, search, cache) is where the rest goes. Each server round also
     splits its own CPU per text: the client, the server's parent process (gRPC, the text
     pipeline, dispatch to the workers), the worker processes and their engine loops' phases,
     read from the server's metrics. Medians over rounds, and the ratios per round. The same
     server with `--backend ct2` (CTranslate2's own engine and replicas behind our gRPC service)
     splits the gap to CTranslate2 offline: what the service around an engine costs, whatever
     the engine. `grpc-floor` (bench.grpc_floor) takes the same load with no model behind the
     service: its CPU per call is what gRPC alone costs the client and the service. Each
     `--compare FLAGS` adds the vanilla server with those flags on top of its defaults, in the same
     rounds (`server-vanilla FLAGS`, its own ratio to CTranslate2): what a setting would change,
     measured beside the defaults rather than in another run.
  2. the sweep: texts/s against the number of callers (1, 4, 16, 64, 256) for the server with
     defaults and for CTranslate2 answering each caller's one sentence itself (all replicas x one
     thread; callers are threads, CTranslate2 releases the GIL). One caller's p50 latency is the
     single-user latency.
Writes bench-speed.json and bench-speed.png (runs/bench; docs/results with --publish);
`python -m bench report` renders them into BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import psutil

from bench import add_publish, results_dir
from bench.engine import CTranslate2, export
from bench.provenance import Run
from bench.server import FULL, Plan, ServerProcess, call, closed_loop, free_port, scrape, total
from proto import gret_serve_pb2_grpc as pb_grpc
from server.config import ServerConfig
from server.engine.engine import PHASES, TOP_K_PHASE
from server.engine.options import DecodingOptions
from server.engine.sequence import OK
from server.engine.workers import WorkerReplicas
from training.corpora import PROJECT_ROOT, load_examples
from training.seq2seq.checkpoint import load_checkpoint
from training.seq2seq.inputs import encode_source

BEAM, CALLERS, CT2_BATCH = 4, 64, 32
SWEEP = (1, 4, 16, 64, 256)
TARGETS = {"server_vs_ct2": 1.0, "engine_vs_ct2": 1.0, "gret_vs_vanilla": 0.9}


def window(seconds: float, warmup: float) -> Plan:
    """A closed-loop point of `seconds`, the first `warmup` not counted (all closed_loop reads of a Plan)."""
    return dataclasses.replace(FULL, saturation_seconds=seconds, warmup_seconds=warmup, max_requests=100_000)


# ---- CTranslate2 ---------------------------------------------------------------------------------
class Ct2Offline:
    """CTranslate2 int8 in this process: the texts in batches of 32, `replicas` x `threads`."""

    def __init__(self, repo: Path, threads: int, replicas: int):
        self.system = CTranslate2(repo, "int8", threads, DecodingOptions(beam=BEAM), replicas=replicas)

    def run(self, sources: list[tuple]) -> dict:
        start = time.perf_counter()
        for k in range(0, len(sources), CT2_BATCH):
            self.system.decode(sources[k: k + CT2_BATCH])
        seconds = time.perf_counter() - start
        return {"texts": len(sources), "seconds": round(seconds, 2), "texts_per_s": round(len(sources) / seconds, 3),
                "load_average": round(os.getloadavg()[0], 2)}


def ct2_callers(system: CTranslate2, sources: list[tuple], callers: int, seconds: float, warmup: float) -> dict:
    """`callers` threads, each translating one sentence at a time with CTranslate2 directly: the
    best a server without cross-request batching could do on these cores."""
    latencies, stop, lock = [], time.perf_counter() + seconds, threading.Lock()
    counted_from = time.perf_counter() + warmup

    def caller(offset: int):
        k = offset
        while time.perf_counter() < stop:
            start = time.perf_counter()
            system.decode([sources[k % len(sources)]])
            end = time.perf_counter()
            if counted_from <= end <= stop:
                with lock:
                    latencies.append(end - start)
            k += callers

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return point(latencies, seconds - warmup)


def point(latencies: list[float], seconds: float) -> dict:
    ms = np.array(latencies) * 1000 if latencies else np.zeros(1)
    return {"ok": len(latencies), "texts_per_s": round(len(latencies) / seconds, 3),
            "latency_ms": {"p50": round(float(np.percentile(ms, 50)), 1), "p99": round(float(np.percentile(ms, 99)), 1)},
            "load_average": round(os.getloadavg()[0], 2)}


# ---- our engine without gRPC ---------------------------------------------------------------------
class EngineOffline:
    """The server's engine, built as `python -m server` builds it with its defaults, driven in this
    process: no gRPC. Each round submits all its texts at once, in calls as large as the server
    takes; they may fill the whole budget (bulk share 1: no one-text call waits behind an offline
    job). The busy time is split by phase (thread-seconds summed over the loops), which says where
    the server's time goes."""

    def __init__(self, args):
        from server.catalog import load_entry
        from server.pipeline import build_pipeline

        config = ServerConfig()
        entry = load_entry(args.models_dir / args.model, config.backend, args.build_cache)
        self.pipeline = build_pipeline(entry, config.backend, config.precision, config.threads, config.batching,
                                       config.max_batch_tokens, config.max_queue, 0, config.limits(),
                                       workers=config.loops(), replicas=config.replicas, bulk_share=1.0)
        self.setting = (f"{config.backend} {self.pipeline.precision}, {config.loops()} {config.replicas} loop(s) "
                        f"x {config.threads} thread(s), --max-batch-tokens {config.max_batch_tokens}, bulk share 1")
        if isinstance(self.pipeline.engine, WorkerReplicas):  # thread loops are driven by run_until_idle itself
            self.pipeline.engine.start()

    def run(self, texts: list[str]) -> dict:
        engine, per_call = self.pipeline.engine, self.pipeline.limits.max_texts
        busy = dict(engine.seconds)
        start = time.perf_counter()
        for k in range(0, len(texts), per_call):
            engine.submit(self.pipeline.sequences(texts[k: k + per_call], DecodingOptions(beam=BEAM), lambda s: None))
        engine.run_until_idle()
        seconds = time.perf_counter() - start
        spent = {k: engine.seconds[k] - busy[k] for k in busy}
        return {"texts": len(texts), "seconds": round(seconds, 2), "texts_per_s": round(len(texts) / seconds, 3),
                "busy_share": {k: round(v / max(sum(spent.values()), 1e-9), 3) for k, v in spent.items()},
                "load_average": round(os.getloadavg()[0], 2)}

    def stop(self) -> None:
        self.pipeline.engine.stop(30)


# ---- the servers ---------------------------------------------------------------------------------
def start_server(name: str, model: str, args, log_dir: Path, extra: tuple[str, ...] = ()) -> ServerProcess:
    """Default flags but for the caches (off: the texts repeat) and the ports (free, loopback), plus `extra`."""
    metrics_port = free_port()
    flags = [*extra, "--models-dir", str(args.models_dir), "--models", model, "--metrics-port", str(metrics_port),
             "--http-port", "0", "--cache-mb", "0", "--result-cache", "0"]
    if args.build_cache:
        flags += ["--build-cache", str(args.build_cache)]
    server = ServerProcess(name, flags, log_dir, {})
    server.metrics_port = metrics_port
    server.wait_serving(timeout=1800)
    return server


async def load(server: ServerProcess, model: str, texts: list[str], callers: int, plan: Plan) -> dict:
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        await call(stub, model, texts[0], {"beam_size": BEAM})  # sessions and arenas warm
        before = usage(server)
        point = await closed_loop(stub, model, texts, {"beam_size": BEAM}, plan, callers)
        point["ms_per_text"] = per_text(before, usage(server))
        return point


async def floor_load(floor: ServerProcess, texts: list[str], callers: int, plan: Plan) -> dict:
    """The same closed loop against bench.grpc_floor: its CPU per call is gRPC's alone, the client's
    and the service's. No metrics there: the loop is warmed first, then every call of a second loop
    counts (the calls it cancels at its end were paid for in part: a slight overcount)."""
    async with grpc.aio.insecure_channel(floor.address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        await closed_loop(stub, "", texts, {"beam_size": BEAM}, window(max(plan.warmup_seconds, 1), 0), callers)
        before = {"client": client_cpu(), "server parent": floor.cpu_seconds(), "texts": 0}
        point = await closed_loop(stub, "", texts, {"beam_size": BEAM}, window(plan.saturation_seconds, 0), callers)
        after = {"client": client_cpu(), "server parent": floor.cpu_seconds(), "texts": point["calls"]}
        point["ms_per_text"] = per_text(before, after)
        return point


def client_cpu() -> float:
    """CPU seconds of this process: the load generator."""
    t = psutil.Process().cpu_times()
    return t.user + t.system


def usage(server: ServerProcess) -> dict:
    """Running totals: CPU seconds of this process (the client), of the server's parent process and of
    its worker processes; the engine loops' seconds by phase; the texts answered."""
    samples = scrape(server.metrics_port)
    return {"client": client_cpu(), "server parent": server.cpu_seconds(),
            "workers": total(samples, "gret_serve_worker_cpu_seconds_total"),
            **{phase: total(samples, "gret_serve_engine_seconds_total", phase=phase) for phase in PHASES},
            "texts": total(samples, "gret_serve_texts_total", status=OK)}


def per_text(before: dict, after: dict) -> dict:
    """Milliseconds per answered text between two readings of running totals (usage())."""
    texts = max(after["texts"] - before["texts"], 1)
    return {k: round((after[k] - before[k]) / texts * 1e3, 3) for k in after if k != "texts"}


# ---- the run -------------------------------------------------------------------------------------
def measure(args, log_dir: Path) -> dict:
    checkpoint = args.models_dir / args.model
    _, ckpt, sp = load_checkpoint(checkpoint)
    examples = load_examples(ckpt.data.dataset, "test_2016_flickr", ckpt.data.src_lang, ckpt.data.tgt_lang)
    # Every system takes the same texts: the servers' callers cycle through them, the offline systems
    # decode them once per round. The test set's second half is longer than its first (12.5 reference
    # target words a sentence against 11.3, counted ad hoc), so offline systems given its first half alone would be timed on
    # easier texts than the servers.
    texts = [e.source for e in examples][: args.texts]
    sources = [(encode_source(sp, t, ckpt.data.max_src_len), None) for t in texts]  # (pieces, no POS tags)
    ct2_repo = export(checkpoint, args.build_dir / "ct2", "ct2")
    cores = ServerConfig().loops()  # the cores the server's defaults use: CTranslate2 gets as many
    ct2 = {f"ct2-int8-1x{cores}": Ct2Offline(ct2_repo, cores, 1), f"ct2-int8-{cores}x1": Ct2Offline(ct2_repo, 1, cores)}
    plan = window(args.seconds, args.warmup)
    servers = {"server-vanilla": (start_server("vanilla", args.model, args, log_dir), args.model),
               "server-gret": (start_server("gret", args.gret, args, log_dir), args.gret),
               "server-ct2": (start_server("ct2", args.model, args, log_dir, ("--backend", "ct2")), args.model)}
    for flags in args.compare:
        servers[f"server-vanilla {flags}"] = (start_server("compare", args.model, args, log_dir,
                                                           tuple(shlex.split(flags))), args.model)
    engine = EngineOffline(args)
    floor = ServerProcess("grpc-floor", [], log_dir, {}, module="bench.grpc_floor")
    rounds = []
    try:
        floor.wait_serving(timeout=60)
        # One untimed round each, as large as a timed one: a fresh engine loop's first round is
        # mostly the first touch of its batch's memory (this VM backs a page when it is first
        # touched: 9 new cache storages, 312 MB, took 1.42 s in a fresh loop at 256 texts in flight,
        # measured ad hoc), which is no measure of its throughput; CTranslate2 gets the same.
        engine.run(texts)
        for system in ct2.values():
            system.run(sources)
        # The servers too, with one untimed point each: a server's first point met the same first
        # touch in its workers, and on the POS model the tagger's first analysis of every word of
        # the texts (parent 1.82 core-ms per text in round 0 against 1.30-1.54 in rounds 1-4; GRET
        # / vanilla 0.742 against 0.835-0.933; a 5-round run on 00d63a5).
        for server, model in servers.values():
            asyncio.run(load(server, model, texts, CALLERS, plan))
        for r in range(args.rounds):
            names = list(ct2) + ["engine-offline"] + list(servers) + ["grpc-floor"]
            names = names[r % len(names):] + names[: r % len(names)]
            row = {}
            for name in names:
                if name in ct2:
                    row[name] = ct2[name].run(sources)
                elif name == "engine-offline":
                    row[name] = engine.run(texts)
                elif name == "grpc-floor":
                    row[name] = asyncio.run(floor_load(floor, texts, CALLERS, plan))
                else:
                    server, model = servers[name]
                    row[name] = asyncio.run(load(server, model, texts, CALLERS, plan))
                print(f"round {r} {name:18s} {row[name]['texts_per_s']:8.2f} texts/s", flush=True)
            best = max(ct2, key=lambda n: row[n]["texts_per_s"])
            row["ratios"] = {"server_vs_ct2": round(row["server-vanilla"]["texts_per_s"] / row[best]["texts_per_s"], 3),
                             "ct2_best": best,
                             "server_vs_engine": round(row["server-vanilla"]["texts_per_s"]
                                                       / row["engine-offline"]["texts_per_s"], 3),
                             "engine_vs_ct2": round(row["engine-offline"]["texts_per_s"] / row[best]["texts_per_s"], 3),
                             "gret_vs_vanilla": round(row["server-gret"]["texts_per_s"]
                                                      / row["server-vanilla"]["texts_per_s"], 3),
                             "server_ct2_vs_ct2": round(row["server-ct2"]["texts_per_s"] / row[best]["texts_per_s"], 3),
                             **{compared(flags): round(row[f"server-vanilla {flags}"]["texts_per_s"]
                                                       / row[best]["texts_per_s"], 3) for flags in args.compare}}
            rounds.append(row)
        sweep = {"server": {}, "ct2": {}}
        sweep_plan = window(args.sweep_seconds, args.warmup)
        ct2_server = CTranslate2(ct2_repo, "int8", 1, DecodingOptions(beam=BEAM), replicas=cores)
        for callers in SWEEP:
            server, model = servers["server-vanilla"]
            sweep["server"][callers] = asyncio.run(load(server, model, texts, callers, sweep_plan))
            sweep["ct2"][callers] = ct2_callers(ct2_server, sources, callers, args.sweep_seconds, args.warmup)
            print(f"sweep {callers:4d} callers: server {sweep['server'][callers]['texts_per_s']:8.2f}, "
                  f"ct2 {sweep['ct2'][callers]['texts_per_s']:8.2f} texts/s", flush=True)
        memory = {name: resident_mb(server) for name, (server, _) in servers.items()}
    finally:
        engine.stop()
        floor.stop()
        for server, _ in servers.values():
            server.stop()
    return {"texts": len(texts), "rounds": rounds, "engine_setting": engine.setting, "sweep": sweep,
            "resident_mb": memory, "cores": cores,
            "medians": medians(rounds, args.compare),
            "texts_per_s": {name: round(statistics.median(r[name]["texts_per_s"] for r in rounds), 2)
                            for name in rounds[0] if name != "ratios"}}


def compared(flags: str) -> str:
    """The ratio of the vanilla server with `flags` to CTranslate2."""
    return f"server_vs_ct2 {flags}"


def medians(rounds: list[dict], compare: list[str]) -> dict:
    """Each ratio's median over the rounds (each compared server's too)."""
    keys = ("server_vs_ct2", "engine_vs_ct2", "gret_vs_vanilla", "server_vs_engine", "server_ct2_vs_ct2")
    return {key: round(statistics.median(r["ratios"][key] for r in rounds), 3)
            for key in keys + tuple(map(compared, compare))}


def resident_mb(server: ServerProcess) -> dict:
    """The server process and its children (process replicas), in MB."""
    procs = [server.psutil] + server.psutil.children(recursive=True)
    per = {f"{p.pid}:{p.name()}": round(p.memory_info().rss / 2**20, 1) for p in procs}
    return {"total": round(sum(per.values()), 1), "processes": per}


def plot(sweep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, label in (("server", "python -m server (defaults)"), ("ct2", "CTranslate2 int8, one sentence per call")):
        callers = sorted(int(c) for c in sweep[name])
        ax.plot(callers, [sweep[name][c]["texts_per_s"] for c in callers], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent callers (closed loop)")
    ax.set_ylabel("texts/s")
    ax.set_title("Throughput against callers, beam 4, Multi30K de→en")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models-dir", type=Path, default=PROJECT_ROOT / "models")
    p.add_argument("--model", default="multi30k-de-en-vanilla", help="a vanilla model: CTranslate2 serves it too")
    p.add_argument("--gret", default="multi30k-de-en", help="the GRET model compared with it")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=30, help="per closed-loop point of the score")
    p.add_argument("--warmup", type=float, default=8, help="seconds at the start of a point that are not counted")
    p.add_argument("--sweep-seconds", type=float, default=20)
    p.add_argument("--texts", type=int, default=None,
                   help="the first this many test sentences, for every system (default: all 1000)")
    p.add_argument("--build-dir", type=Path, default=Path(tempfile.gettempdir()) / "bench-build")
    p.add_argument("--build-cache", type=Path, help="the servers' build cache (default: theirs)")
    p.add_argument("--quick", action="store_true", help="a smoke run: one short round")
    p.add_argument("--note", default="", help="recorded with the results (e.g. 'training paused with SIGSTOP')")
    p.add_argument("--compare", action="append", default=[], metavar="FLAGS",
                   help="also the vanilla server with these flags on top of its defaults (repeatable)")
    add_publish(p)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds, args.warmup, args.sweep_seconds, args.texts = 1, 6, 2, 4, 64
    out = results_dir(args.publish)
    out.mkdir(parents=True, exist_ok=True)
    log_dir = PROJECT_ROOT / "runs" / "bench" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    record = Run("bench speed", argv, args.note)
    measured = measure(args, log_dir)
    payload = {**record.header(),
               "settings": {"model": args.model, "gret": args.gret, "beam": BEAM, "callers": CALLERS,
                            "rounds": args.rounds, "seconds": args.seconds, "warmup": args.warmup,
                            "ct2_batch": CT2_BATCH, "texts": measured.pop("texts"), "sweep": SWEEP,
                            "top_k_phase": TOP_K_PHASE, "compare": args.compare},
               "targets": {k: {"target": v, "measured": measured["medians"][k],
                               "met": measured["medians"][k] >= v} for k, v in TARGETS.items()},
               **measured}
    (out / "bench-speed.json").write_text(json.dumps(payload, indent=2) + "\n")
    plot(measured["sweep"], out / "bench-speed.png")
    print(json.dumps(payload["targets"], indent=2))
    print(out / "bench-speed.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
