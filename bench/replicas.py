"""python -m bench replicas --repository REPO [--texts 200] [--workers 2] [--rounds 7]

Engine loops as threads of one process (server --replicas thread) against worker processes
(--replicas process): the same texts of a test split, all submitted at once as one large request
would be, `--workers` loops of 1 intra-op thread each, on the same repository and precision. The
two take turns round by round, a different one first each round, so load from other processes
hits both alike; per round the ratio thread time / process time, reported as the median. Also
the share of identical outputs (int8 graphs quantise activations per batch, so a text's output
may change with the texts it is batched with) and each process's resident memory. Prints JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import psutil
import torch

from server.backends import OnnxBackend
from server.catalog import from_repository
from server.engine.engine import Engine, Replicas
from server.engine.options import DecodingOptions, Limits
from server.engine.scheduler import Scheduler
from server.engine.sequence import Sequence
from server.engine.workers import WorkerReplicas, WorkerSpec
from training.corpora import load_examples
from training.seq2seq.inputs import encode_source

UNBOUNDED = dict(max_batch_tokens=16384, max_waiting=1 << 20)  # the server's budget, no queue bound


def decode(group, sources: list[list[int]], options: DecodingOptions, max_positions: int) -> tuple[float, list]:
    seqs = [Sequence(src, options, options.output_limit(len(src), max_positions - 1, Limits()), lambda s: None)
            for src in sources]
    start = time.monotonic()
    group.submit(seqs)
    group.run_until_idle()
    failed = [s for s in seqs if not s.hypotheses]
    assert not failed, f"{len(failed)} texts failed: {failed[0].status} {failed[0].message}"
    return time.monotonic() - start, [s.hypotheses[0].tokens for s in seqs]


def resident_mib(pid: int) -> float:
    return psutil.Process(pid).memory_full_info().pss / 2**20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench replicas", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repository", type=Path, required=True, help="an ONNX model repository (python -m export)")
    p.add_argument("--precision", default="int8")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--texts", type=int, default=200)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as the server runs it (server/__main__.py)
    entry = from_repository(args.repository, "onnx")
    examples = load_examples(entry.metrics.get("dataset", "multi30k"), args.split, entry.source_language,
                             entry.target_language)[: args.texts]
    sources = [encode_source(entry.sp, e.source, entry.max_src_len) for e in examples]
    options = DecodingOptions(beam=args.beam)
    backend = OnnxBackend(args.repository, args.precision, threads=1)
    # not started: its run_until_idle drives each loop on a thread of its own
    threads = Replicas([Engine(backend, entry.version, Scheduler("continuous", **UNBOUNDED))
                        for _ in range(args.workers)])
    spec = WorkerSpec(entry.name, entry.version, args.repository, None, "onnx", args.precision, 1, "continuous",
                      UNBOUNDED["max_batch_tokens"], UNBOUNDED["max_waiting"], 0)
    processes = WorkerReplicas(spec, args.workers).start()
    systems = {"thread": threads, "process": processes}
    seconds, outputs = {name: [] for name in systems}, {}
    try:
        for group in systems.values():  # untimed: first runs allocate (ONNX Runtime's arenas, the KV store)
            decode(group, sources, options, entry.cfg.max_positions)
        for r in range(args.rounds):
            for name in (list(systems) if r % 2 == 0 else list(systems)[::-1]):
                took, outputs[name] = decode(systems[name], sources, options, entry.cfg.max_positions)
                seconds[name].append(took)
        memory = {"server process": resident_mib(os.getpid()),
                  **{f"worker {w.index}": resident_mib(w.process.pid) for w in processes.workers}}
    finally:
        processes.stop(30)
    ratios = [t / p for t, p in zip(seconds["thread"], seconds["process"])]
    print(json.dumps({
        "repository": str(args.repository), "precision": args.precision, "texts": len(sources), "beam": args.beam,
        "loops": args.workers, "intra_op_threads": 1, "cpus": len(os.sched_getaffinity(0)),
        "load_average_1min": os.getloadavg()[0],
        "seconds": {k: [round(s, 2) for s in v] for k, v in seconds.items()},
        "sentences_per_second": {k: round(len(sources) / statistics.median(v), 1) for k, v in seconds.items()},
        "speedup_process_vs_thread": {"median": round(statistics.median(ratios), 2),
                                      "min": round(min(ratios), 2), "max": round(max(ratios), 2)},
        "identical_outputs": round(statistics.mean(a == b for a, b in zip(outputs["thread"], outputs["process"])), 3),
        "pss_mib_after": {k: round(v) for k, v in memory.items()},
    }, indent=2))
    return 0
