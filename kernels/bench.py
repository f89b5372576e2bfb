"""Benchmark: each Triton kernel vs its PyTorch reference, and the encoder cache's effect.

    python -m kernels.bench --out kernels_bench.json [--dtype float32] [--threads 1] [--checkpoint DIR]

`python -m bench report` shows the runs saved as bench-kernels-DTYPE.json beside the other benchmarks.

On CUDA: kernel and reference times per shape with triton.testing.do_bench, as a ratio, and the
whole model's beam search on its Triton path vs its reference path (batches 1, --batch and 64).
Elsewhere the kernels cannot be timed (the interpreter says nothing about GPU speed): only the
references are timed, plus the cache effect, i.e. the end-to-end beam search time of a repeated
request (encoder skipped) over a new one, measured alternately in one run on the same model.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

from . import context_gate, cross_attention, routing
from .dispatch import force_triton, use_reference
from server.engine.encoder_cache import CachedEncoder, EncoderCache

# Shapes of the "small" (D=256) and "base" (D=512) presets: batch 32, ~24 source tokens, beam 4.
ROUTING = [dict(G=96, S=24, D=256, K=32, C=64, iters=3), dict(G=192, S=24, D=512, K=32, C=64, iters=3)]
GATE = [dict(B=32, beam=4, D=256), dict(B=32, beam=4, D=512), dict(B=1, beam=4, D=512)]
MEMORY = [dict(N=3, B=32, S=24, D=256, H=4), dict(N=6, B=32, S=24, D=512, H=8)]
ATTENTION = [dict(B=32, beam=4, H=4, S=24, d=64), dict(B=32, beam=4, H=8, S=24, d=64), dict(B=8, beam=4, H=8, S=100, d=64)]


def _randn(*shape, device, dtype, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def _cases(device, dtype):
    """(kernel name, shape, triton callable, reference callable) for every benchmarked shape."""
    r = lambda *s, scale=1.0: _randn(*s, device=device, dtype=dtype, scale=scale)
    for p in ROUTING:
        h, w = r(p["G"], p["S"], p["D"]), r(p["K"], p["D"], p["C"], scale=p["D"] ** -0.5)
        pad = torch.arange(p["S"], device=device)[None] >= torch.randint(1, p["S"] + 1, (p["G"], 1), device=device)
        yield ("routing", p, lambda h=h, pad=pad, w=w, p=p: routing.capsule_routing_triton(h, pad, w, p["iters"]),
               lambda h=h, pad=pad, w=w, p=p: routing.capsule_routing_reference(h, pad, w, p["iters"]))
    for p in GATE:
        h, w = r(p["B"] * p["beam"], 1, p["D"]), r(p["D"], p["D"], scale=p["D"] ** -0.5)
        s, gs, norm = r(p["B"], p["D"]), r(p["B"], p["D"]), (r(p["D"]), r(p["D"]), 1e-5)
        args = (h, w, s, gs, p["beam"], norm)
        yield ("context_gate", p, lambda a=args: context_gate.gated_output_triton(*a),
               lambda a=args: context_gate.gated_output_reference(*a))
    for p in MEMORY:
        n, d = p["N"], p["D"]
        sources, index = r(n, p["B"], p["S"], d), [n - 1 - i for i in range(n)]
        norms = [(r(d), r(d), 1e-5) for _ in range(n)]
        proj = [(r(d, d, scale=d ** -0.5), r(d), r(d, d, scale=d ** -0.5), r(d)) for _ in range(n)]
        args = (sources, index, sources[-1], norms, proj, p["H"])
        yield ("memory_build", p, lambda a=args: cross_attention.memory_kv_triton(*a),
               lambda a=args: cross_attention.memory_kv_reference(*a))
    for p in ATTENTION:
        q = r(p["B"] * p["beam"], p["H"], 1, p["d"])
        k, v = r(p["B"], p["H"], p["S"], p["d"]), r(p["B"], p["H"], p["S"], p["d"])
        pad = torch.arange(p["S"], device=device)[None] >= torch.randint(1, p["S"] + 1, (p["B"], 1), device=device)
        args = (q, k, v, pad, p["beam"])
        yield ("grouped_attention", p, lambda a=args: cross_attention.grouped_attention_triton(*a),
               lambda a=args: cross_attention.grouped_attention_reference(*a))


def _cpu_ms(fn, reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def bench_kernels(device: str, dtype: torch.dtype) -> list[dict]:
    rows = []
    for name, shape, kernel, reference in _cases(device, dtype):
        with torch.no_grad():
            if device == "cuda":
                ref_ms, tri_ms = triton.testing.do_bench(reference), triton.testing.do_bench(kernel)
            else:
                ref_ms, tri_ms = _cpu_ms(reference), None
        rows.append(dict(kernel=name, shape=shape, dtype=str(dtype).removeprefix("torch."), reference_ms=ref_ms,
                         triton_ms=tri_ms, reference_over_triton=None if tri_ms is None else ref_ms / tri_ms))
        print(f"{name:18s} {json.dumps(shape):60s} reference {ref_ms:8.3f} ms"
              + ("" if tri_ms is None else f"  triton {tri_ms:8.3f} ms  x{ref_ms / tri_ms:.2f}"))
    return rows


def _model(checkpoint: str | None, device: str):
    if checkpoint:
        from training.seq2seq.checkpoint import load_checkpoint
        model = load_checkpoint(Path(checkpoint))[0]
    else:  # random weights: timings only, the translations are meaningless
        from training.seq2seq.config import PRESETS, ModelConfig
        from training.seq2seq.model import Seq2Seq
        torch.manual_seed(0)
        cfg = ModelConfig(**{**PRESETS["small"], "capsule": True, "aggregate": True, "gate": True,
                             "multiview": "gca"}).validate()
        model = Seq2Seq(cfg)
    return model.to(device).eval()


def _sources(cfg, batch: int, device: str) -> torch.Tensor:
    """`batch` random sources of 8 to 29 pieces, EOS-terminated, right-padded."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 30, (batch,), generator=gen)
    src = torch.full((batch, int(lengths.max())), cfg.pad_id, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        src[i, : n - 1] = torch.randint(4, cfg.vocab_size, (n - 1,), generator=gen)
        src[i, n - 1] = cfg.eos_id
    return src.to(device)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_model(device: str, checkpoint: str | None, batches: list[int], beam: int, reps: int) -> list[dict]:
    """The kernels in place: median beam search time of the whole model on its Triton path vs on its
    reference path, alternated in one run, and whether their outputs agree (a timing on CUDA only)."""
    from training.seq2seq.search import beam_search
    model = _model(checkpoint, device)
    rows = []
    for batch in batches:
        src = _sources(model.cfg, batch, device)
        paths = {"triton": force_triton, "reference": use_reference}
        times, outputs = {name: [] for name in paths}, {}
        for rep in range(reps + 1):  # the first round compiles and warms: not timed
            for name, mode in paths.items():
                with mode(), torch.no_grad():
                    _sync(device)
                    start = time.perf_counter()
                    hyps = beam_search(model, src, beam=beam)
                    _sync(device)
                if rep:
                    times[name].append(time.perf_counter() - start)
                outputs[name] = [h[0].tokens for h in hyps]
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        same = sum(a == b for a, b in zip(outputs["triton"], outputs["reference"]))
        rows.append(dict(batch=batch, beam=beam, reps=reps, triton_ms=ms["triton"], reference_ms=ms["reference"],
                         reference_over_triton=ms["reference"] / ms["triton"], same_outputs=f"{same}/{batch}"))
        print(f"model batch {batch:4d} beam {beam}: reference {ms['reference']:8.1f} ms  triton {ms['triton']:8.1f} ms"
              f"  x{ms['reference'] / ms['triton']:.2f}  same outputs {same}/{batch}")
    return rows


def bench_cache(device: str, checkpoint: str | None, batch: int, beam: int, reps: int) -> dict:
    """Median end-to-end beam search time of a new request (encoder runs) vs a repeated one (hit)."""
    from training.seq2seq.search import beam_search
    model = _model(checkpoint, device)
    cfg = model.cfg
    src = _sources(cfg, batch, device)
    cache = EncoderCache(max_bytes=1 << 30)
    run = lambda version: beam_search(CachedEncoder(model, cache, version), src, beam=beam,
                                      max_len_a=1.0, max_len_b=5)
    run("warm")  # prime the repeated request (and any lazy initialisation)
    new, repeated = [], []
    for rep in range(reps):  # alternate, so load changes on a shared machine hit both alike
        for version, times in ((f"new-{rep}", new), ("warm", repeated)):
            _sync(device)
            start = time.perf_counter()
            run(version)
            _sync(device)
            times.append(time.perf_counter() - start)
    new_s, repeated_s = statistics.median(new), statistics.median(repeated)
    result = dict(batch=batch, beam=beam, reps=reps, new_request_s=new_s, repeated_request_s=repeated_s,
                  repeated_over_new=repeated_s / new_s, cache=cache.stats(),
                  model="checkpoint " + checkpoint if checkpoint else "random-init small preset, GRET + GCA")
    print(f"cache: new request {new_s * 1e3:.1f} ms, repeated {repeated_s * 1e3:.1f} ms, "
          f"ratio {repeated_s / new_s:.3f}")
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="kernel benchmark dtype (CUDA)")
    parser.add_argument("--checkpoint", help="checkpoint directory for the cache benchmark (default: random init)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--note", default="", help="recorded with the results (e.g. the code's commit)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if not cuda:
        print("No CUDA device: kernel timings need CUDA (the Triton interpreter measures nothing useful).\n"
              "Timing the PyTorch references and the encoder cache only.")
    dtype = getattr(torch, args.dtype) if cuda else torch.float32
    report = dict(command="python -m kernels.bench " + " ".join(sys.argv[1:] if argv is None else argv),
                  date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), note=args.note,
                  device=torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
                  torch=torch.__version__, triton=triton.__version__, threads=args.threads,
                  kernel_timings="triton vs reference" if cuda else "reference only (no CUDA)",
                  kernels=bench_kernels(device, dtype))
    if cuda:
        report["model"] = bench_model(device, args.checkpoint, [1, args.batch, 64], args.beam, args.reps)
    report["cache"] = bench_cache(device, args.checkpoint, args.batch, args.beam, args.reps)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
