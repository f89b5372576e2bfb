"""python -m bench memory [--quick] [--publish] [--models-dir models] [--setting defaults|pod ...]

Peak memory of `python -m server` serving every model under --models-dir (the shipped models),
under load: the server process and every process it started (engine workers, multiprocessing's
resource tracker) together, sampled every 0.2 s. Settings:
  defaults  `python -m server` with its default flags (a worker process per usable core per model)
  pod       the arguments of deploy/k8s/deployment.yaml (its --models-dir replaced by --models-dir)
  pod-threads  the pod's arguments with the engine loops as threads of one process, as many per model
            as usable cores (--replicas=thread, no --workers: what the pod ran before)

The load drives all models at once, in four phases:
  1. caches   distinct texts with cheap options (beam 1, one output token), until every model's
              encoder cache has evicted: the caches hold their share of --cache-mb
  2. steady   48 callers in a closed loop, one text per call with the default options (beam 4), the
              models in turn: the texts/s and latency each setting gives for its memory
  3. extreme  the largest valid options (beam and n-best at the server's maximum, every output as
              long as the model allows, scores) beside many short greedy texts: every engine loop's
              admission budget full, its rows as wide as the longest output (the costliest valid mix)
  4. spike    500 one-text calls at once
Each phase ends when its calls are answered or after its time (calls still running are cancelled).
Memory: RSS (what `ps` shows; pages shared between processes, such as the libraries and the
read-only ONNX files, counted in each) and PSS (proportional set size: a shared page divided among
its sharers; summed over the processes, each page once: what a cgroup memory limit charges for
them). The pod's limit is read from deployment.yaml and compared with both peaks.

Writes bench-memory.json to runs/bench (docs/results with --publish); `python -m bench report`
renders it into BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import psutil
import yaml

from bench import add_publish, results_dir
from bench.provenance import Run
from bench.server import ServerProcess, free_port, scrape
from proto import gret_serve_pb2 as pb
from proto import gret_serve_pb2_grpc as pb_grpc
from training.corpora import PROJECT_ROOT, load_examples

DEPLOYMENT = PROJECT_ROOT / "deploy" / "k8s" / "deployment.yaml"
SAMPLE_S = 0.2
CALL_TIMEOUT = 300.0


def phases(quick: bool) -> dict:
    """Seconds each phase may last, and its size."""
    if quick:
        return {"caches": {"seconds": 20, "texts": 512}, "steady": {"seconds": 4, "callers": 8},
                "extreme": {"seconds": 8, "callers": 2}, "spike": {"seconds": 20, "calls": 50}}
    return {"caches": {"seconds": 120, "texts": 8192}, "steady": {"seconds": 20, "callers": 48},
            "extreme": {"seconds": 45, "callers": 4}, "spike": {"seconds": 90, "calls": 500}}


# ---- what the server holds ------------------------------------------------------------------------
def pod_memory_limit() -> tuple[str, int]:
    """deployment.yaml's memory limit, as written and in bytes."""
    (container,) = yaml.safe_load(DEPLOYMENT.read_text())["spec"]["template"]["spec"]["containers"]
    text = str(container["resources"]["limits"]["memory"])
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    return text, int(text[:-2]) * units[text[-2:]] if text[-2:] in units else int(text)


def pod_flags(models_dir: Path) -> list[str]:
    """deployment.yaml's server arguments; the models from `models_dir`, the ports free ones."""
    (container,) = yaml.safe_load(DEPLOYMENT.read_text())["spec"]["template"]["spec"]["containers"]
    keep = [a for a in container["args"]
            if not a.startswith(("--models-dir", "--port", "--http-port", "--metrics-port", "--host"))]
    return ["--models-dir", str(models_dir), *keep]


class Sampler:
    """Samples the memory of a process and its descendants every SAMPLE_S on a thread, and once more
    whenever asked (the end of each phase, which may be shorter than SAMPLE_S); keeps the peak of
    each phase (the sums over processes, and each process's own)."""

    def __init__(self, pid: int):
        self.root = psutil.Process(pid)
        self.phase = "loaded"
        self.peaks: dict[str, dict] = {}
        self.series: list[tuple[float, str, float, float]] = []  # (seconds, phase, rss MiB, pss MiB)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the thread's samples and the phases' own
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Sampler":
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()

    def sample(self) -> None:
        rss = pss = 0
        each = {}
        for p in [self.root, *self.root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                m = p.memory_full_info()
                rss, pss = rss + m.rss, pss + m.pss
                each[f"{p.pid} {' '.join(p.cmdline()[1:4])[:60]}"] = m.pss
        mib = 2**20
        with self._lock:
            self.series.append((round(time.monotonic() - self._start, 1), self.phase, round(rss / mib, 1),
                                round(pss / mib, 1)))
            peak = self.peaks.setdefault(self.phase, {"rss_mib": 0.0, "pss_mib": 0.0, "processes": 0,
                                                      "pss_by_process": {}})
            peak["rss_mib"] = max(peak["rss_mib"], round(rss / mib, 1))
            if pss / mib > peak["pss_mib"]:
                peak.update(pss_mib=round(pss / mib, 1), processes=len(each),
                            pss_by_process={k: round(v / mib, 1) for k, v in sorted(each.items())})


def metric(port: int, name: str) -> dict[str, float]:
    """A metric's value by model label, from the server's own /metrics."""
    values: dict[str, float] = collections.defaultdict(float)
    for sample, labels, value in scrape(port):
        if sample == name:
            values[labels.get("model", "")] += value
    return dict(values)


# ---- the load -------------------------------------------------------------------------------------
def sources(model: pb.ModelInfo) -> list[str]:
    """Distinct texts in the model's input language, never seen by the load before."""
    if model.task == "summarize":
        texts = [e.source for e in load_examples("gigaword", "train")]
    else:
        other = "en" if model.source_language != "en" else "de"
        texts = [e.source for e in load_examples("multi30k", "train", model.source_language, other)]
    return list(dict.fromkeys(texts))


def request(model: pb.ModelInfo, texts: list[str], **options):
    o = pb.DecodingOptions(**options)
    if model.task == "summarize":
        return pb.SummarizeRequest(texts=texts, model=model.name, options=o)
    return pb.TranslateRequest(texts=texts, model=model.name, options=o)


def method(stub, model: pb.ModelInfo):
    return stub.Summarize if model.task == "summarize" else stub.Translate


class Load:
    def __init__(self, stub, models: list[pb.ModelInfo], metrics_port: int):
        self.stub, self.models, self.metrics_port = stub, models, metrics_port
        self.texts = {m.name: iter(sources(m)) for m in models}
        self.codes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.phase = ""

    def fresh(self, model: pb.ModelInfo, n: int) -> list[str]:
        texts = [t for t in (next(self.texts[model.name], None) for _ in range(n)) if t is not None]
        if len(texts) < n:
            raise RuntimeError(f"model {model.name}: ran out of distinct texts")
        return texts

    async def send(self, model: pb.ModelInfo, texts: list[str], **options) -> int:
        try:
            response = await method(self.stub, model)(request(model, texts, **options), timeout=CALL_TIMEOUT)
        except grpc.aio.AioRpcError as e:
            self.codes[self.phase][e.code().name] += 1
            return 0
        self.codes[self.phase]["OK"] += 1
        return len(response.results)

    async def bounded(self, seconds: float, tasks: list) -> int:
        """Waits for the tasks at most `seconds`, cancels the rest; the texts answered."""
        done, pending = await asyncio.wait(tasks, timeout=seconds)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self.codes[self.phase]["cancelled at the phase's end"] += len(pending)
        return sum(t.result() for t in done if not t.cancelled())

    async def caches(self, plan: dict) -> dict:
        """Distinct cheap texts until every model's encoder cache has evicted."""
        begin, sent = time.monotonic(), collections.Counter()
        while time.monotonic() - begin < plan["seconds"]:
            evicted = await asyncio.to_thread(metric, self.metrics_port, "gret_serve_encoder_cache_evictions_total")
            filling = [m for m in self.models if not evicted.get(m.name) and sent[m.name] < plan["texts"]]
            if not filling:
                break
            calls = []
            for m in filling:
                n = min(m.limits.max_texts, 256)
                calls.append(self.send(m, self.fresh(m, n), beam_size=1, max_length=1))
                sent[m.name] += n
            await asyncio.gather(*calls)
        cached = await asyncio.to_thread(metric, self.metrics_port, "gret_serve_encoder_cache_bytes")
        evicted = await asyncio.to_thread(metric, self.metrics_port, "gret_serve_encoder_cache_evictions_total")
        return {"texts_sent": dict(sent), "encoder_cache_mib": {k: round(v / 2**20, 1) for k, v in cached.items()},
                "evictions": evicted, "seconds": round(time.monotonic() - begin, 1)}

    async def steady(self, plan: dict) -> dict:
        """Closed loop: each caller sends its next one-text call when the last is answered."""
        begin, latencies = time.monotonic(), []

        async def caller(k: int) -> int:
            answered = 0
            while time.monotonic() - begin < plan["seconds"]:
                m = self.models[(k + answered) % len(self.models)]
                sent = time.monotonic()
                answered += await self.send(m, self.fresh(m, 1))
                latencies.append(time.monotonic() - sent)
            return answered

        answered = sum(await asyncio.gather(*(caller(k) for k in range(plan["callers"]))))
        seconds = time.monotonic() - begin
        ms = sorted(1000 * x for x in latencies)
        return {"texts_answered": answered, "seconds": round(seconds, 1), "texts_per_s": round(answered / seconds, 2),
                "latency_ms": {"p50": round(ms[len(ms) // 2], 1), "p99": round(ms[int(len(ms) * 0.99)], 1)}}

    async def extreme(self, plan: dict) -> dict:
        """Per model, callers with the largest valid options beside callers with many short greedy texts."""
        begin, tasks = time.monotonic(), []
        for m in self.models:
            longest = m.limits.max_output_tokens
            most = dict(beam_size=m.limits.max_beam_size, n_best=m.limits.max_n_best, return_scores=True,
                        max_length_ratio=10, max_length_offset=longest, max_length=longest, min_length=longest)
            for _ in range(plan["callers"]):
                tasks.append(asyncio.create_task(self.send(m, self.fresh(m, 16), **most)))
                tasks.append(asyncio.create_task(self.send(m, self.fresh(m, min(m.limits.max_texts, 256)),
                                                           beam_size=1, max_length=8)))
        answered = await self.bounded(plan["seconds"], tasks)
        return {"texts_answered": answered, "seconds": round(time.monotonic() - begin, 1)}

    async def spike(self, plan: dict) -> dict:
        begin = time.monotonic()
        tasks = [asyncio.create_task(self.send(self.models[i % len(self.models)],
                                               self.fresh(self.models[i % len(self.models)], 1)))
                 for i in range(plan["calls"])]
        answered = await self.bounded(plan["seconds"], tasks)
        return {"texts_answered": answered, "seconds": round(time.monotonic() - begin, 1)}


async def drive(address: str, metrics_port: int, sampler: Sampler, quick: bool) -> dict:
    plan = phases(quick)
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stub = pb_grpc.InferenceStub(ch)
        models = list((await stub.ListModels(pb.ListModelsRequest(), timeout=60)).models)
        load = Load(stub, models, metrics_port)
        report = {}
        for name in ("caches", "steady", "extreme", "spike"):
            sampler.phase = load.phase = name
            report[name] = await getattr(load, name)(plan[name])
            await asyncio.to_thread(sampler.sample)  # the phase's own sample, however short it was
            report[name]["calls"] = dict(load.codes[name])
            print(f"{name}: {report[name]}; peak so far RSS {max(p['rss_mib'] for p in sampler.peaks.values())} MiB, "
                  f"PSS {max(p['pss_mib'] for p in sampler.peaks.values())} MiB", flush=True)
        sampler.phase = "after"
        await asyncio.sleep(2)
    return {"models": [m.name for m in models], "phases": report, "plan": plan}


def measure(name: str, flags: list[str], args) -> dict:
    metrics_port = free_port()
    flags = [*flags, "--metrics-port", str(metrics_port), "--http-port", "0"] + \
        (["--build-cache", str(args.build_cache)] if args.build_cache else [])
    with tempfile.TemporaryDirectory() as logs:
        server = ServerProcess(name, flags, Path(logs), {})
        try:
            server.wait_serving(timeout=900)
            sampler = Sampler(server.process.pid).start()
            try:
                load = asyncio.run(drive(server.address, metrics_port, sampler, args.quick))
            finally:
                sampler.stop()
        finally:
            server.stop()
    peak = max(sampler.peaks.values(), key=lambda p: p["pss_mib"])
    return {"flags": flags, "load": load, "peaks": sampler.peaks,
            "peak_rss_mib": max(p["rss_mib"] for p in sampler.peaks.values()),
            "peak_pss_mib": peak["pss_mib"], "processes_at_peak": peak["processes"],
            "series": sampler.series[:: max(1, int(1 / SAMPLE_S))]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models-dir", type=Path, default=PROJECT_ROOT / "models")
    p.add_argument("--setting", nargs="+", choices=("defaults", "pod", "pod-threads"),
                   default=["pod", "pod-threads", "defaults"])
    p.add_argument("--build-cache", type=Path, help="the server's ONNX build cache (default: $GRET_SERVE_CACHE "
                                                    "or ~/.cache/gret-serve)")
    p.add_argument("--out-dir", type=Path, help="default: runs/bench (docs/results with --publish)")
    p.add_argument("--note", default="", help="what else the machine was doing, for the record")
    p.add_argument("--quick", action="store_true", help="CI smoke run: short phases, few texts")
    add_publish(p)
    args = p.parse_args(argv)
    args.out_dir = args.out_dir or results_dir(args.publish)
    started = time.monotonic()
    record = Run("bench memory", argv, "shared machine", args.note)
    settings = {"defaults": ["--models-dir", str(args.models_dir)], "pod": pod_flags(args.models_dir),
                "pod-threads": [*(a for a in pod_flags(args.models_dir)
                                  if not a.startswith(("--replicas", "--workers"))), "--replicas=thread"]}
    limit_text, limit = pod_memory_limit()
    measured = {}
    for name in args.setting:
        measured[name] = measure(name, settings[name], args)
        print(f"{name}: peak RSS {measured[name]['peak_rss_mib']} MiB, PSS {measured[name]['peak_pss_mib']} MiB "
              f"in {measured[name]['processes_at_peak']} processes", flush=True)
    result = {
        **record.header(),
        "quick": args.quick,
        "pod_limit": {"memory": limit_text, "mib": limit / 2**20},
        "settings": measured,
        "wall_seconds": round(time.monotonic() - started, 1),
    }
    if "pod" in measured:
        pod = measured["pod"]
        result["targets"] = {
            "pod_peak_pss_within_limit": {"target": round(limit / 2**20), "measured": pod["peak_pss_mib"],
                                          "lower_is_better": True, "met": pod["peak_pss_mib"] * 2**20 <= limit,
                                          "note": "MiB; the pod's arguments, every shipped model, all phases"},
            "pod_peak_rss_within_limit": {"target": round(limit / 2**20), "measured": pod["peak_rss_mib"],
                                          "lower_is_better": True, "met": pod["peak_rss_mib"] * 2**20 <= limit,
                                          "note": "MiB; RSS counts shared pages in every process: an upper bound"}}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "bench-memory.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out} in {result['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
