"""python -m bench.soak [--publish] [--minutes 10] [--load 0.7] [--models-dir models] [--model multi30k-de-en]

The soak: the real server (`python -m server`, a subprocess on loopback) under steady load for a
long time. First a closed-loop ramp (1, 2, 4, ... callers, --ramp-seconds each) finds the
saturation throughput (the median of its three best steps: on a shared machine a single step can
be lucky); then Poisson arrivals at --load of it for --minutes. Each request carries one Multi30K
test_2016_flickr German sentence at beam 4 (the API default); the encoder and result caches are off (the
texts repeat, and cache hits would flatter the figures). Recorded: every call's status and
latency, the server's resident memory every 5 s (/proc), and the load average of the machine.

Passes when: no call fails; resident memory grows less than 5 % after the warm-up (the first
minute): the mean of the last minute's samples against the mean of the second minute's; latency
is stable: after the warm-up, no minute's p50 (p99) is more than 1.5 (2) times the median
minute's. Writes soak.json, and SOAK.md generated from it (--report-only regenerates the page
from the JSON), into runs/bench; with --publish docs/results/soak.json and docs/SOAK.md.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from bench import add_publish, pages_dir, results_dir
from bench.provenance import Run
from bench.server import Call, ServerProcess, call, server_env
from proto import gret_serve_pb2_grpc as pb_grpc
from training.corpora import PROJECT_ROOT, load_examples

OPTIONS = {"beam_size": 4}
MEMORY_GROWTH, P50_SPREAD, P99_SPREAD = 0.05, 1.5, 2.0  # the pass criteria (see above)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


async def closed_loop(stub, model: str, texts: list[str], callers: int, seconds: float, warmup: float) -> dict:
    """`callers` callers, each sending its next text when its last call returns; throughput counts
    the calls that end after the warm-up and before the time is up."""
    begin = time.perf_counter()
    stop = begin + seconds
    calls: list[Call] = []

    async def caller(offset: int):
        for text in itertools.islice(itertools.cycle(texts), offset, None):
            if time.perf_counter() >= stop:
                return
            calls.append(await call(stub, model, text, OPTIONS))

    await asyncio.gather(*(caller(i * 7) for i in range(callers)))
    counted = [c for c in calls if begin + warmup <= c.end <= stop]
    return {"callers": callers, "calls_per_s": round(len(counted) / (seconds - warmup), 2),
            "errors": sum(c.code != "OK" for c in calls),
            "p50_ms": round(1e3 * float(np.median([c.seconds for c in counted])), 1) if counted else None}


async def open_loop(stub, model: str, texts: list[str], rate: float, seconds: float) -> list[Call]:
    """Poisson arrivals at `rate` per second for `seconds`; a call's latency counts from its
    scheduled arrival, so a late send counts against it."""
    rng = random.Random(0)
    begin = arrival = time.perf_counter()
    tasks = []
    for text in itertools.cycle(texts):
        arrival += rng.expovariate(rate)
        if arrival - begin > seconds:
            break
        await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
        tasks.append(asyncio.create_task(call(stub, model, text, OPTIONS, start=arrival)))
    return list(await asyncio.gather(*tasks))


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time so far (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def sample_server(pid: int, samples: list, every: float = 5.0) -> None:
    while True:
        samples.append((time.perf_counter(), rss_mb(pid), cpu_seconds(pid), os.getloadavg()[0]))
        await asyncio.sleep(every)


def per_minute(calls: list[Call], samples: list, begin: float, minutes: int) -> list[dict]:
    rows = []
    for m in range(minutes):
        lo, hi = begin + 60 * m, begin + 60 * (m + 1)
        window = [c for c in calls if lo <= c.start < hi]
        ok = [c.seconds * 1e3 for c in window if c.code == "OK"]
        inside = [x for x in samples if lo <= x[0] < hi]
        rss, cpu, load = ([x[i] for x in inside] for i in (1, 2, 3))
        finished = sum(inside[0][0] <= c.end < inside[-1][0] for c in calls)  # between the CPU samples
        p50, p90, p99 = np.percentile(ok, [50, 90, 99]).round(1).tolist() if ok else (None, None, None)
        rows.append({"minute": m + 1, "calls": len(window), "errors": len(window) - len(ok), "p50_ms": p50,
                     "p90_ms": p90, "p99_ms": p99, "in_flight_at_end": sum(c.start < hi <= c.end for c in calls),
                     "server_cpu_ms_per_call": round(1e3 * (cpu[-1] - cpu[0]) / finished, 1) if finished else None,
                     "rss_mb_mean": round(float(np.mean(rss)), 1), "rss_mb_max": round(max(rss), 1),
                     "load_avg": round(float(np.mean(load)), 2)})
    return rows


def verdicts(minutes: list[dict], calls: list[Call]) -> dict:
    after_warmup = minutes[1:] or minutes
    base, end = after_warmup[0]["rss_mb_mean"], minutes[-1]["rss_mb_mean"]
    growth = (end - base) / base
    spread = {}
    for key in ("p50_ms", "p99_ms"):
        values = [m[key] for m in after_warmup if m[key] is not None]
        spread[key] = max(values) / float(np.median(values))
    errors = sum(c.code != "OK" for c in calls)
    return {
        "zero_errors": {"measured": errors, "target": 0, "met": errors == 0},
        "memory_growth_after_warmup": {"measured": round(growth, 4), "target": MEMORY_GROWTH,
                                       "met": growth < MEMORY_GROWTH},
        "p50_worst_minute_over_median": {"measured": round(spread["p50_ms"], 2), "target": P50_SPREAD,
                                         "met": spread["p50_ms"] <= P50_SPREAD},
        "p99_worst_minute_over_median": {"measured": round(spread["p99_ms"], 2), "target": P99_SPREAD,
                                         "met": spread["p99_ms"] <= P99_SPREAD},
    }


async def run(args) -> dict:
    record = Run("bench.soak", args.argv, args.note)  # the note stands in the report, not the command
    texts = [e.source for e in load_examples("multi30k", "test_2016_flickr", "de", "en")]
    flags = ["--models-dir", str(args.models_dir), "--models", args.model, "--metrics-port", "0", "--http-port", "0",
             "--threads",
             str(args.threads), "--cache-mb", "0", "--result-cache", "0", "--grace-seconds", "30"]
    if args.build_cache:
        flags += ["--build-cache", str(args.build_cache)]
    server = ServerProcess("soak", flags, Path(tempfile.mkdtemp(prefix="soak-")), server_env(args))
    try:
        server.wait_serving(timeout=1800)  # a first start exports and verifies the model (minutes)
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            ramp = []
            for callers in args.ramp:
                ramp.append(await closed_loop(stub, args.model, texts, callers, args.ramp_seconds, warmup=3))
                print(f"ramp: {ramp[-1]}", flush=True)
            saturation = float(np.median(sorted(point["calls_per_s"] for point in ramp)[-3:]))
            rate = args.load * saturation
            print(f"saturation {saturation:.2f} calls/s; soaking at {rate:.2f} calls/s for {args.minutes} min",
                  flush=True)
            samples: list = []
            sampler = asyncio.create_task(sample_server(server.process.pid, samples))
            begin = time.perf_counter()
            calls = await open_loop(stub, args.model, texts, rate, args.minutes * 60)
            sampler.cancel()
    finally:
        server.stop()
    minutes = per_minute(calls, samples, begin, args.minutes)
    ok = [c.seconds * 1e3 for c in calls if c.code == "OK"]
    return {
        **record.header(),
        "setup": {"model": args.model, "threads": args.threads, "options": OPTIONS, "encoder_cache": "off",
                  "texts": "Multi30K test_2016_flickr (de), one per call", "load": args.load},
        "ramp": ramp, "saturation_calls_per_s": saturation, "offered_calls_per_s": round(rate, 3),
        "calls": len(calls), "errors": sum(c.code != "OK" for c in calls),
        "error_codes": sorted({c.code for c in calls} - {"OK"}),
        "completed_in_time_per_s": round(sum(c.end - begin <= args.minutes * 60 for c in calls if c.code == "OK")
                                         / (args.minutes * 60), 3),
        "latency_ms": dict(zip(("p50", "p90", "p99", "max"), np.percentile(ok, [50, 90, 99, 100]).round(1).tolist())),
        "rss_mb": {"start": round(samples[0][1], 1), "after_warmup": (minutes[1:] or minutes)[0]["rss_mb_mean"],
                   "last_minute": minutes[-1]["rss_mb_mean"], "peak": round(max(s[1] for s in samples), 1)},
        "minutes": minutes,
        "targets": verdicts(minutes, calls),
    }


def report(result: dict) -> str:
    """docs/SOAK.md, from soak.json alone."""
    s, t = result["setup"], result["targets"]
    lines = [
        "# Soak", "",
        f"Generated by `python -m bench.soak --report-only` from `docs/results/soak.json` "
        f"(run: `{result['command']}`, {result['date']}, commit {result['commit']}).", "",
        f"The real server (`python -m server`, model `{s['model']}`, --threads {s['threads']}, encoder cache "
        f"{s['encoder_cache']}) on loopback; each call one sentence ({s['texts']}), options {s['options']}. "
        f"A closed-loop ramp found the saturation throughput; then Poisson arrivals at {s['load']:.0%} of it "
        f"for {len(result['minutes'])} minutes.", "",
    ]
    machine = result["machine"]
    if machine["note"]:
        lines += [f"**Machine:** {machine['note']} ({machine['cpus']} CPUs; load average per minute below).", ""]
    lines += ["## Verdict", "", "| criterion | measured | target | met |", "|---|---|---|---|"]
    lines += [f"| {name.replace('_', ' ')} | {v['measured']} | {v['target']} | {'yes' if v['met'] else 'NO'} |"
              for name, v in t.items()]
    after_warmup = result["minutes"][1:] or result["minutes"]
    for key in ("p50_ms", "p99_ms"):
        worst = max(after_warmup, key=lambda m: m[key] or 0)
        lines += ["", f"Worst {key[:3]} minute: {worst['minute']} ({worst[key]} ms), load average {worst['load_avg']} "
                  f"(median minute {np.median([m['load_avg'] for m in after_warmup]):.2f}), server CPU per call "
                  f"{worst['server_cpu_ms_per_call']} ms (median minute "
                  f"{np.median([m['server_cpu_ms_per_call'] for m in after_warmup]):.1f} ms)."]
    lat, rss = result["latency_ms"], result["rss_mb"]
    lines += ["", "## Figures", "",
              f"- saturation (closed loop, median of the ramp's three best steps): {result['saturation_calls_per_s']} "
              f"calls/s; offered {result['offered_calls_per_s']} calls/s; completed within the soak "
              f"{result['completed_in_time_per_s']} calls/s",
              f"- calls: {result['calls']}, errors: {result['errors']} {result['error_codes'] or ''}".rstrip(),
              f"- latency over the whole soak: p50 {lat['p50']} ms, p90 {lat['p90']} ms, p99 {lat['p99']} ms, "
              f"max {lat['max']} ms",
              f"- server resident memory (means of 5-second samples): {rss['after_warmup']} MB in the minute after "
              f"the warm-up, {rss['last_minute']} MB in the last minute (at the start {rss['start']} MB, peak "
              f"{rss['peak']} MB)", "",
              "## Ramp (closed loop)", "", "| callers | calls/s | p50 ms | errors |", "|---|---|---|---|"]
    lines += [f"| {p['callers']} | {p['calls_per_s']} | {p['p50_ms']} | {p['errors']} |" for p in result["ramp"]]
    lines += ["", "## Per minute", "",
              "Calls and latencies by arrival minute. In flight: calls sent but not answered at the minute's end "
              "(a backlog). CPU/call: the server's CPU time in the minute over the calls it finished (it rises if "
              "the server itself slows down, not when other processes take the CPU). RSS: the server's resident "
              "memory, mean and max of its 5-second samples. Load: the machine's 1-minute load average.", "",
              "| minute | calls | errors | p50 ms | p90 ms | p99 ms | in flight | CPU/call ms | RSS MB mean "
              "| RSS MB max | load |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {m['minute']} | {m['calls']} | {m['errors']} | {m['p50_ms']} | {m['p90_ms']} | {m['p99_ms']} | "
              f"{m['in_flight_at_end']} | {m['server_cpu_ms_per_call']} | {m['rss_mb_mean']} | {m['rss_mb_max']} | "
              f"{m['load_avg']} |" for m in result["minutes"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=int, default=10)
    p.add_argument("--load", type=float, default=0.7, help="offered load as a share of the saturation throughput")
    p.add_argument("--ramp", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="callers per ramp step")
    p.add_argument("--ramp-seconds", type=float, default=20)
    p.add_argument("--models-dir", type=Path, default=PROJECT_ROOT / "models")
    p.add_argument("--model", default="multi30k-de-en")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--build-cache", type=Path, help="the server's build cache (default: its own)")
    p.add_argument("--note", default="", help="what else ran on the machine, for the report")
    p.add_argument("--out", type=Path, help="default: soak.json in runs/bench (docs/results with --publish)")
    p.add_argument("--report", type=Path, help="default: SOAK.md in runs/bench (docs/ with --publish)")
    p.add_argument("--report-only", action="store_true", help="regenerate --report from --out")
    add_publish(p)
    args = p.parse_args(argv)
    args.out = args.out or results_dir(args.publish) / "soak.json"
    args.report = args.report or pages_dir(args.publish) / "SOAK.md"
    args.argv = ["…" if a == args.note and a else a for a in (sys.argv[1:] if argv is None else argv)]
    if not args.report_only:
        result = asyncio.run(run(args))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        for name, v in result["targets"].items():
            print(f"{name:32s} measured {v['measured']}  target {v['target']}  {'met' if v['met'] else 'NOT met'}")
    args.report.write_text(report(json.loads(args.out.read_text())))
    print(f"wrote {args.report}" if args.report_only else f"wrote {args.out} and {args.report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
