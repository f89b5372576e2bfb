"""python -m bench gpu [--publish] [--quick]

The engine on a CUDA device against the same engine on the CPU, in one run on one machine. Both run
the PyTorch backend in fp32 (the model's own modules; on the GPU with its Triton kernels, kernels/),
the server's one backend that leaves the CPU (python -m server --backend torch --device cuda). For
each checkpoint, over Multi30K test_2016_flickr, beam 4:

  outputs  each text's best hypothesis from the GPU engine against the CPU engine's, both in a closed
           loop of 64 texts in flight (the CPU engine gives each text what training.seq2seq.search
           gives it alone: tests/test_engine.py)
  speed    texts/s of the GPU engine in closed loops of 1, 16, 64 and 256 texts in flight (its
           admission budget holds them all; 4 texts per caller, at least 64, except at 64: every
           text), and of the CPU engine at 64 with the server's default budget and --cpu-threads
           threads: the same code on the same machine, so the ratio is the device's

Writes bench-gpu.json into runs/bench (docs/results with --publish). Needs a CUDA device.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from bench import add_publish, results_dir
from bench.loop import BEAM, Rows, closed_loop
from bench.provenance import Run
from server.backends import TorchBackend
from server.config import ServerConfig
from server.engine.engine import Engine
from server.engine.scheduler import Scheduler
from training.corpora import PROJECT_ROOT, load_examples
from training.decode import source_inputs
from training.seq2seq.checkpoint import load_checkpoint

COMPARED_IN_FLIGHT = 64
GPU_IN_FLIGHT = (1, 16, 64, 256)
GPU_BUDGET = 1 << 22  # beam x tokens: far more than 256 texts hold, so the loop's count is the batch


def engine(model, budget: int) -> Engine:
    config = ServerConfig()
    return Engine(TorchBackend(model), "bench", Scheduler(config.batching, budget, 1 << 20, config.max_call_share),
                  observer=Rows())


def measure(checkpoint: Path, texts: int, cpu_threads: int, in_flight: tuple[int, ...]) -> dict:
    """One checkpoint's outputs and speeds; in_flight holds COMPARED_IN_FLIGHT."""
    model, ckpt, sp = load_checkpoint(checkpoint)
    examples = load_examples(ckpt.data.dataset, "test_2016_flickr", ckpt.data.src_lang, ckpt.data.tgt_lang)[:texts]
    ids, tags = source_inputs(model, sp, [e.source for e in examples], ckpt.data.src_lang, ckpt.data.max_src_len)
    sources = list(zip(ids, tags or [None] * len(ids)))
    torch.set_num_threads(cpu_threads)
    on_cpu, on_gpu = {}, {}
    cpu = closed_loop(engine(model, ServerConfig().max_batch_tokens), sources, COMPARED_IN_FLIGHT, len(sources), on_cpu)
    gpu_model = model.cuda()  # the same weights, moved
    points = []
    for n in in_flight:  # at the compared count every text is decoded once and its output kept
        compared = n == COMPARED_IN_FLIGHT
        texts_run = len(sources) if compared else max(64, 4 * n)
        points.append(closed_loop(engine(gpu_model, GPU_BUDGET), sources, n, texts_run, on_gpu if compared else None))
    same = sum(on_cpu[i] == on_gpu[i] for i in range(len(sources)))
    at = next(p for p in points if p["in_flight"] == COMPARED_IN_FLIGHT)
    speeds = ", ".join(f"{p['in_flight']}: {p['texts_per_s']}" for p in points)
    print(f"{checkpoint.name}: GPU outputs identical to the CPU engine's for {same}/{len(sources)} texts; "
          f"CPU {cpu['texts_per_s']} texts/s; GPU {speeds}", flush=True)
    return {"texts": len(sources), "identical_outputs": same, "cpu": cpu, "gpu": points,
            "gpu_over_cpu_at_64": round(at["texts_per_s"] / cpu["texts_per_s"], 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoints", type=Path, nargs="+",
                   default=[PROJECT_ROOT / "models" / name for name in ("multi30k-de-en-vanilla", "multi30k-de-en")])
    p.add_argument("--texts", type=int, default=1000, help="test sentences compared (the first N)")
    p.add_argument("--cpu-threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="the CPU engine's torch threads (default: every core this process may use)")
    p.add_argument("--note", default="", help="recorded with the results")
    p.add_argument("--out", type=Path, help="default: bench-gpu.json in runs/bench (docs/results with --publish)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 64 texts, two in-flight counts")
    add_publish(p)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m bench gpu: torch sees no CUDA device", file=sys.stderr)
        return 2
    record = Run("bench gpu", argv, args.note)
    texts, in_flight = (64, (1, COMPARED_IN_FLIGHT)) if args.quick else (args.texts, GPU_IN_FLIGHT)
    models = {c.name: measure(c, texts, args.cpu_threads, in_flight) for c in args.checkpoints}
    result = {**record.header(), "device": torch.cuda.get_device_name(),
              "settings": {"beam": BEAM, "precision": "fp32", "backend": "torch", "cpu_threads": args.cpu_threads,
                           "compared_in_flight": COMPARED_IN_FLIGHT, "gpu_budget": GPU_BUDGET,
                           "cpu_budget": ServerConfig().max_batch_tokens, "split": "multi30k test_2016_flickr"},
              "models": models}
    out = args.out or results_dir(args.publish) / "bench-gpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
