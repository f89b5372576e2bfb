"""python -m bench engine [--checkpoint models/multi30k-de-en-vanilla] [--gret-checkpoint models/multi30k-de-en] [--quick]

Offline decoding speed, side by side in one run: a test split, beam 4, batches of 32 sentences
(length-sorted), the same token ids into every system:
  pytorch          training.seq2seq.search.beam_search on the checkpoint (eager PyTorch, the reference)
  engine-torch     our continuous-batching engine on the PyTorch backend
  engine-onnx-fp32 / engine-onnx-int8   our engine on ONNX Runtime (the server's default backend),
                                        one engine loop with --threads intra-op threads
  engine-onnx-int8-Nw                   N = --threads engine loops (server --workers N) of 1 thread
  ct2-fp32 / ct2-int8                   CTranslate2's own beam search on the same weights, one
                                        call per batch with --threads intra-op threads
  ct2-int8-Nr                           CTranslate2 with N = --threads replicas (inter_threads) of
                                        1 thread, the batch cut in N sub-batches decoded in parallel
  gret-*           the same engine on a GRET checkpoint (--gret-checkpoint), if given
Systems take turns batch by batch, each batch starting with a different system, so load from
other processes on a shared machine hits all of them alike; ratios are computed per batch and
reported as medians with their spread. Per system: target tokens/s, sentences/s, BLEU of its
own output (a speed-up that changes translations shows here), the share of outputs identical to
the PyTorch reference, resident memory. Writes bench-engine.json and a bar chart into runs/bench
(docs/results with --publish).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from bench import add_publish, results_dir
from bench.provenance import Run
from export.ct2_runtime import Ct2Translator, max_lengths
from export.manifest import sha256
from export.repository import write_repository
from export.spec import export_digest
from server.backends import OnnxBackend, TorchBackend
from server.engine.engine import TOP_K_PHASE, Engine, Replicas
from server.engine.options import DecodingOptions, Limits
from server.engine.scheduler import Scheduler
from server.engine.sequence import Sequence
from training.corpora import PROJECT_ROOT, load_examples
from training.metrics import bleu
from training.seq2seq import search
from training.seq2seq.checkpoint import WEIGHTS, load_checkpoint, load_target_pieces
from training.decode import source_inputs
from training.seq2seq.inputs import pad

REFERENCE, BASELINE = "pytorch", "ct2-int8"
VANILLA, GRET = "vanilla", "gret"  # whose inputs a system reads: each model its own pieces (and POS tags)
TARGETS = {"best_engine_vs_ct2_int8": 1.0, "gret_vs_vanilla": 0.9, "best_engine_vs_pytorch": 10.0}


class PyTorchReference:
    inputs = VANILLA

    def __init__(self, model, options: DecodingOptions, threads: int):
        self.model, self.o, self.torch_threads = model, options, threads

    def decode(self, batch: list[tuple]) -> list[list[int]]:
        ids, tags = zip(*batch)
        hyps = search.beam_search(self.model, pad(list(ids)), None if tags[0] is None else pad(list(tags)),
                                  beam=self.o.beam, length_penalty=self.o.length_penalty,
                                  max_len_a=self.o.max_len_a, max_len_b=self.o.max_len_b)
        return [h[0].tokens for h in hyps]


class OurEngine:
    """The server's engine (or `workers` of its loops, as server --workers runs them) driven until
    idle: the batch is submitted at once, like a server receiving 32 texts together."""

    def __init__(self, backend, options: DecodingOptions, torch_threads: int = 1, workers: int = 1,
                 inputs: str = VANILLA):
        engines = [Engine(backend, "bench", Scheduler("continuous", max_batch_tokens=1 << 30, max_waiting=1 << 20))
                   for _ in range(workers)]
        self.engine = engines[0] if workers == 1 else Replicas(engines)
        self.o, self.cfg, self.inputs = options, backend.cfg, inputs
        self.torch_threads = torch_threads  # as the server runs it: see server/__main__.py

    def decode(self, batch: list[tuple]) -> list[list[int]]:
        limit = lambda n: self.o.output_limit(n, self.cfg.max_positions - 1, Limits())  # noqa: E731
        seqs = [Sequence(src, self.o, limit(len(src)), on_done=lambda s: None, tags=tags) for src, tags in batch]
        self.engine.submit(seqs)
        self.engine.run_until_idle()
        return [s.hypotheses[0].tokens if s.hypotheses else [] for s in seqs]


class CTranslate2:
    """At its fastest: one CTranslate2 call per batch, with the batch's largest length limit for
    every sentence (per-sentence limits would split the batch into several calls). Where a
    shorter sentence's own limit would have bound, its output may differ: BLEU shows it."""
    inputs = VANILLA

    def __init__(self, repo: Path, precision: str, threads: int, options: DecodingOptions, replicas: int = 1):
        self.t = Ct2Translator(repo, precision=precision, threads=threads, replicas=replicas)
        self.o, self.replicas = options, replicas
        self.torch_threads = 1  # unused by CTranslate2

    def decode(self, batch: list[tuple]) -> list[list[int]]:
        ids = [src for src, _ in batch]  # a vanilla model: no POS tags
        limit = max(max_lengths(self.t.cfg, [len(s) for s in ids], self.o.max_len_a, self.o.max_len_b))
        split = -(-len(ids) // self.replicas) if self.replicas > 1 else 0
        out = self.t.translate(ids, beam=self.o.beam, length_penalty=self.o.length_penalty, max_length=limit,
                               max_batch_size=split)
        return [n_best[0].tokens for n_best in out]


class MemorySampler:
    """How far resident memory rises above its level at the start while a system decodes (sampled
    every 5 ms): the working memory of that system's turn."""

    def __init__(self):
        self.process, self.peak, self._on = psutil.Process(), 0, False

    def __enter__(self):
        self.start = self.peak = self.process.memory_info().rss
        self._on = True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while self._on:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._on = False
        self._thread.join()


def build_systems(checkpoint: Path, gret: Path | None, build: Path, threads: int, options: DecodingOptions,
                  quick: bool) -> tuple[dict, dict]:
    """name -> system, and name -> resident bytes its loading added."""
    torch.set_num_threads(threads)
    process = psutil.Process()
    systems, memory = {}, {}

    def add(name, make):
        before = process.memory_info().rss
        systems[name] = make()
        memory[name] = process.memory_info().rss - before

    model, _, _ = load_checkpoint(checkpoint)
    onnx = export(checkpoint, build / "onnx", "onnx")
    ct2 = export(checkpoint, build / "ct2", "ct2")
    add(REFERENCE, lambda: PyTorchReference(model, options, threads))
    add("engine-torch", lambda: OurEngine(TorchBackend(model, threads), options, threads))
    add("engine-onnx-fp32", lambda: OurEngine(OnnxBackend(onnx, "fp32", threads), options))
    add("engine-onnx-int8", lambda: OurEngine(OnnxBackend(onnx, "int8", threads), options))
    if threads > 1:
        add(f"engine-onnx-int8-{threads}w", lambda: OurEngine(OnnxBackend(onnx, "int8", 1), options, workers=threads))
    add("ct2-fp32", lambda: CTranslate2(ct2, "fp32", threads, options))
    add(BASELINE, lambda: CTranslate2(ct2, "int8", threads, options))
    if threads > 1:
        add(f"ct2-int8-{threads}r", lambda: CTranslate2(ct2, "int8", 1, options, replicas=threads))
    if gret is not None:
        gret_onnx = export(gret, build / "gret-onnx", "onnx")
        add("gret-engine-onnx-fp32", lambda: OurEngine(OnnxBackend(gret_onnx, "fp32", threads), options, inputs=GRET))
        add("gret-engine-onnx-int8", lambda: OurEngine(OnnxBackend(gret_onnx, "int8", threads), options, inputs=GRET))
        if threads > 1:
            add(f"gret-engine-onnx-int8-{threads}w",
                lambda: OurEngine(OnnxBackend(gret_onnx, "int8", 1), options, workers=threads, inputs=GRET))
    if quick:  # CI smoke: fewer systems, same code paths
        for name in ("engine-torch", "ct2-fp32"):
            systems.pop(name), memory.pop(name)
    return systems, memory


def export(checkpoint: Path, out: Path, fmt: str) -> Path:
    """A repository with fp32 + int8, reused when it was built from the same weights."""
    stamp = out / "weights.sha256"
    cfg = load_checkpoint(checkpoint)[1].model
    weights = sha256(checkpoint / WEIGHTS) + export_digest(cfg, load_target_pieces(checkpoint))
    if not (stamp.exists() and stamp.read_text() == weights):
        write_repository(checkpoint, out, fmt=fmt, quantize="int8", overwrite=True)
        stamp.write_text(weights)
    return out


def run(systems: dict, batches: dict[str, list[list[tuple]]]) -> tuple[dict, dict, dict]:
    """Every system decodes every batch (of its own model's inputs: batches[system.inputs], the
    same sentences for every model), turns rotating. Returns outputs, seconds per batch and the
    largest rise of resident memory during a turn, per system."""
    names = list(systems)
    outputs = {n: [] for n in names}
    seconds = {n: [] for n in names}
    peak = {n: 0 for n in names}
    for i in range(len(batches[VANILLA])):
        order = names[i % len(names):] + names[: i % len(names)]
        for name in order:
            torch.set_num_threads(systems[name].torch_threads)
            with MemorySampler() as sampler:
                start = time.perf_counter()
                out = systems[name].decode(batches[systems[name].inputs][i])
                seconds[name].append(time.perf_counter() - start)
            peak[name] = max(peak[name], sampler.peak - sampler.start)
            outputs[name].append(out)
    return outputs, seconds, peak


def time_split(system) -> dict | None:
    """Our engine's busy time by part (shares of the sum), or None for other systems."""
    if not isinstance(system, OurEngine):
        return None
    parts = system.engine.seconds
    busy = sum(parts.values()) or 1.0
    return {k: round(v / busy, 3) for k, v in parts.items()}


def summarise(systems, memory, outputs, seconds, peak, order, pieces: dict, refs) -> dict:
    """Per system: speed, BLEU (its model's own SentencePiece: pieces[system.inputs]), memory, and
    the share of outputs identical to the PyTorch reference's (vanilla systems: a GRET model's
    outputs are another model's)."""
    figures = {}
    for name in systems:
        tokens = [t for batch in outputs[name] for t in batch]
        restored = [None] * len(tokens)
        for position, i in enumerate(order):
            restored[i] = tokens[position]
        total = sum(seconds[name])
        n_tokens = sum(len(t) + 1 for t in restored)  # EOS counts: it is decoded too
        figures[name] = {
            "seconds": round(total, 3),
            "sentences_per_s": round(len(restored) / total, 2),
            "target_tokens_per_s": round(n_tokens / total, 1),
            "bleu": round(bleu([pieces[systems[name].inputs].decode(t) for t in restored], refs), 2),
            "identical_to_pytorch": None,
            "load_rss_mb": round(memory[name] / 2**20, 1),
            "decode_rss_mb": round(peak[name] / 2**20, 1),
            "time_split": time_split(systems[name]),
            "_tokens": restored,
        }
    reference = figures[REFERENCE]["_tokens"]
    for name, f in figures.items():
        tokens = f.pop("_tokens")
        if systems[name].inputs == VANILLA:
            f["identical_to_pytorch"] = round(sum(a == b for a, b in zip(tokens, reference)) / len(reference), 4)
        for base in (REFERENCE, BASELINE):
            if base in seconds:
                ratios = [b / s for s, b in zip(seconds[name], seconds[base])]  # > 1: faster than base
                q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
                f[f"speed_vs_{base}"] = {"median": round(statistics.median(ratios), 3), "q1": round(q[0], 3),
                                         "q3": round(q[2], 3), "total": round(sum(seconds[base]) / sum(seconds[name]), 3)}
    return figures


def targets(figures: dict) -> dict:
    engines = {n: f for n, f in figures.items() if n.startswith("engine-")}
    best = max(engines, key=lambda n: engines[n]["speed_vs_" + BASELINE]["median"]) if BASELINE in figures else \
        max(engines, key=lambda n: engines[n]["speed_vs_" + REFERENCE]["median"])
    out = {"best_engine": best}
    if BASELINE in figures:
        out["best_engine_vs_ct2_int8"] = {"target": TARGETS["best_engine_vs_ct2_int8"],
                                          "measured": figures[best]["speed_vs_" + BASELINE]["median"]}
        # CTranslate2 at its fastest on these cores (intra-op threads or replicas), by total throughput
        ct2 = max((n for n in figures if n.startswith(BASELINE)), key=lambda n: figures[n]["target_tokens_per_s"])
        ours = max(engines, key=lambda n: engines[n]["target_tokens_per_s"])
        out["best_engine_vs_fastest_ct2_int8"] = {
            "target": TARGETS["best_engine_vs_ct2_int8"], "engine": ours, "ct2": ct2,
            "measured": round(figures[ours]["target_tokens_per_s"] / figures[ct2]["target_tokens_per_s"], 3),
            "note": f"{ours} vs {ct2}: total target tokens/s over the run"}
    fastest = max((n for n in figures if n != REFERENCE), key=lambda n: figures[n]["speed_vs_" + REFERENCE]["median"])
    out["best_engine_vs_pytorch"] = {
        "target": TARGETS["best_engine_vs_pytorch"], "measured": figures[best]["speed_vs_" + REFERENCE]["median"],
        "note": f"the fastest system of this run, {fastest}, is {figures[fastest]['speed_vs_' + REFERENCE]['median']}x "
                f"PyTorch"}
    for gret in (n for n in figures if n.startswith("gret-")):
        vanilla = gret[len("gret-"):]
        if vanilla in figures:
            ratio = figures[gret]["target_tokens_per_s"] / figures[vanilla]["target_tokens_per_s"]
            out[f"gret_vs_vanilla_{vanilla[len('engine-onnx-'):]}"] = {
                "target": TARGETS["gret_vs_vanilla"], "measured": round(ratio, 3),
                "note": "target tokens/s; the two models' outputs differ"}
    for v in out.values():
        if isinstance(v, dict):
            v["met"] = v["measured"] >= v["target"]
    return out


def plot(figures: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(figures)
    medians = [figures[n]["speed_vs_" + BASELINE]["median"] if BASELINE in figures else
               figures[n]["speed_vs_" + REFERENCE]["median"] for n in names]
    low = [m - (figures[n]["speed_vs_" + (BASELINE if BASELINE in figures else REFERENCE)]["q1"]) for n, m in
           zip(names, medians)]
    high = [figures[n]["speed_vs_" + (BASELINE if BASELINE in figures else REFERENCE)]["q3"] - m for n, m in
            zip(names, medians)]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh(names, medians, xerr=[low, high], color=["#4c72b0" if "engine" in n else "#999999" for n in names])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel(f"speed relative to {BASELINE if BASELINE in figures else REFERENCE} (median over batches, IQR)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=PROJECT_ROOT / "models" / "multi30k-de-en-vanilla",
                   help="a vanilla checkpoint: CTranslate2 runs it too")
    p.add_argument("--gret-checkpoint", type=lambda s: Path(s) if s else None,
                   default=PROJECT_ROOT / "models" / "multi30k-de-en",
                   help="a GRET checkpoint of the same task, for GRET vs vanilla ('' for none)")
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--limit", type=int, default=0, help="first N sentences only")
    p.add_argument("--build-dir", type=Path, help="where exported repositories are kept (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="CI smoke run: 64 sentences, fewer systems")
    p.add_argument("--out", type=Path, help="default: bench-engine.json in runs/bench (docs/results with --publish)")
    add_publish(p)
    args = p.parse_args(argv)
    args.out = args.out or results_dir(args.publish) / "bench-engine.json"
    paths = {VANILLA: args.checkpoint} | ({GRET: args.gret_checkpoint} if args.gret_checkpoint else {})
    loaded = {key: load_checkpoint(path) for key, path in paths.items()}  # (model, checkpoint, SentencePiece)
    data = loaded[VANILLA][1].data
    examples = load_examples(data.dataset, args.split, data.src_lang, data.tgt_lang)
    examples = examples[: 64 if args.quick else (args.limit or None)]
    texts = [e.source for e in examples]
    pieces = {key: sp for key, (_, _, sp) in loaded.items()}
    inputs = {}
    for key, (model, ckpt, sp) in loaded.items():  # each model its own pieces, and POS tags if it reads them
        ids, tags = source_inputs(model, sp, texts, ckpt.data.src_lang, ckpt.data.max_src_len)
        inputs[key] = list(zip(ids, tags or [None] * len(ids)))
    order = sorted(range(len(texts)), key=lambda i: len(inputs[VANILLA][i][0]))
    batches = {key: [[sources[i] for i in order[k: k + args.batch]] for k in range(0, len(order), args.batch)]
               for key, sources in inputs.items()}
    options = DecodingOptions(beam=args.beam)
    record = Run("bench engine", argv)
    with tempfile.TemporaryDirectory() as tmp:
        build = args.build_dir or Path(tmp)
        systems, memory = build_systems(args.checkpoint, args.gret_checkpoint, build, args.threads, options, args.quick)
        outputs, seconds, peak = run(systems, batches)
    figures = summarise(systems, memory, outputs, seconds, peak, order, pieces, [e.refs for e in examples])
    result = {
        **record.header(),
        "settings": {"checkpoint": str(args.checkpoint), "gret_checkpoint": str(args.gret_checkpoint or ""),
                     "split": args.split, "sentences": len(texts), "batch": args.batch, "beam": args.beam,
                     "threads": args.threads, "quick": args.quick, "top_k_phase": TOP_K_PHASE},
        "systems": figures,
        "targets": targets(figures),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot_path = args.out.with_suffix(".png")
    plot(figures, plot_path, f"{args.split}, beam {args.beam}, batch {args.batch}, {args.threads} threads")
    result["plot"] = plot_path.name
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, f in figures.items():
        shares = " ".join(f"{k} {100 * v:.0f}%" for k, v in (f["time_split"] or {}).items())
        same = "-" if f["identical_to_pytorch"] is None else f["identical_to_pytorch"]
        print(f"{name:24s} {f['sentences_per_s']:7.1f} sent/s {f['target_tokens_per_s']:8.1f} tok/s  "
              f"BLEU {f['bleu']:5.2f}  identical {same}  "
              f"x{BASELINE if BASELINE in figures else REFERENCE} "
              f"{f['speed_vs_' + (BASELINE if BASELINE in figures else REFERENCE)]['median']:.2f}  {shares}")
    print(json.dumps(result["targets"], indent=2))
    return 0
