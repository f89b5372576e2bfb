"""python -m bench step [--publish] [--quick]

What one step of the engine costs against the rows it carries: the fixed overhead a step pays
whatever its size, and the cost of each row. Two parts, in one run:

  graph   the decoder step alone (export.onnx_runtime.OnnxModel.step: the ONNX graph and its
          binding, one thread) for R rows: beam 4 rows per sentence, a 20-piece source, a
          self-attention cache 32 columns wide with each row at a random position in it (a row
          reads its own columns). One model per architecture: vanilla, GRET (capsules,
          layer-wise GRU, context gate: the output term), multi-view (GCA: a memory per decoder layer),
          Graph-Transformer, mvPE + POS. The weights are untrained, at the shipped models' size
          (--preset, 8000 pieces): a step's time depends on shapes, not on values. Architectures
          take turns at each row count.
          The vanilla int8 step is timed once more per row count with its memory cold: 64 MB
          written before each step, as the rest of a served step (the other graphs, the other
          worker, gRPC) evicts what the step read last time.
  engine  the engine loop (the server's, with its admission defaults, driven in this process) on
          trained checkpoints, vanilla and GRET, int8, one thread, with N texts in flight: a closed loop over test_2016_flickr
          in which a finished text is replaced at once, as N callers would. Per step: the
          milliseconds of each phase (encoder passes, decoder step, search, cache) and the rows.
  ops     the engine loop at the widest in-flight count again, with ONNX Runtime's profiler on both
          graphs: each operator type's kernel time in milliseconds per text (where the graphs'
          time goes in a loaded engine, not in a step repeated on warm memory).

A line through the (rows, ms) points, fitted to their relative errors, gives each its fixed overhead
(the intercept) and its cost per row (the slope). Writes bench-step.json and bench-step.png into runs/bench
(docs/results with --publish); `python -m bench report` renders them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from bench import add_publish, results_dir
from bench.engine import export
from bench.loop import BEAM, Rows, closed_loop
from bench.provenance import Run
from export.onnx_runtime import OnnxModel
from server.engine.engine import PHASES, Engine
from server.engine.scheduler import Scheduler
from training.corpora import PROJECT_ROOT, load_examples
from training.decode import source_inputs
from training.seq2seq.checkpoint import SPM, load_checkpoint, save_checkpoint
from training.seq2seq.config import PRESETS, Checkpoint, DataConfig, ModelConfig
from training.seq2seq.model import Seq2Seq

ARCHITECTURES = {
    "vanilla": {},
    "gret": dict(capsule=True, aggregate=True, gate=True),
    "multiview-gca": dict(multiview="gca"),
    "graph": dict(encoder="graph", graph_fusion="weight_gate", graph_half_dim=True),
    "mvpe-pos": dict(pe_k=7, pos_tags=True),
}
SOURCE, WIDTH = 20, 32
EVICT_BYTES = 64 << 20  # written before a cold step: twice this machine's last-level cache


def line(points: list[tuple[float, float]]) -> dict:
    """ms = fixed + per_row * rows through (rows, ms) points, each point's error counted relative to its
    own time: the noise of a step's time grows with the time, and a plain least-squares line let the
    256-row points' noise (tenths of a millisecond) decide the intercept, even below zero."""
    xs, ys = np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)
    slope, intercept = np.polyfit(xs, ys, 1, w=1 / ys)  # polyfit's weights scale the residuals
    return {"fixed_ms": round(float(intercept), 3), "per_row_us": round(float(slope) * 1e3, 2)}


def median_ms(run, reps: int, before=None) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(reps):
        if before:
            before()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


# ---- the decoder graph alone -------------------------------------------------------------------
def untrained_repository(name: str, preset: str, vocab: int, spm: bytes, build: Path) -> Path:
    """An exported repository (fp32 + int8) of an untrained model of this architecture. The seeded
    weights are the same at every run, so bench.engine.export reuses a repository built from them."""
    cfg = ModelConfig(**{**PRESETS[preset], "vocab_size": vocab, **ARCHITECTURES[name]}).validate()
    torch.manual_seed(0)
    checkpoint = build / f"{name}-{preset}-checkpoint"
    save_checkpoint(checkpoint, Seq2Seq(cfg).eval(), Checkpoint(cfg, DataConfig()), spm)
    return export(checkpoint, build / f"{name}-{preset}", "onnx")


def step_case(model: OnnxModel, rows: int):
    """A closure that runs one decoder step of `rows` rows."""
    cfg, g = model.cfg, torch.Generator().manual_seed(rows)
    sentences = -(-rows // BEAM)
    src = torch.randint(4, cfg.vocab_size, (sentences, SOURCE), generator=g)
    tags = torch.randint(1, cfg.n_pos_tags, src.shape, generator=g) if cfg.pos_tags else None
    enc = model.encode(src, tags)
    tokens = torch.randint(4, cfg.vocab_size, (rows,), generator=g)
    positions = torch.randint(0, WIDTH, (rows,), generator=g)
    row_sentence = torch.arange(rows) // BEAM
    shape = (rows, cfg.n_heads, WIDTH, cfg.d_model // cfg.n_heads)
    cache = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(cfg.dec_layers)]
    return lambda: model.step(tokens, positions, row_sentence, enc, cache)


def graph_part(args, spm: bytes, build: Path) -> dict:
    models = {(name, precision): OnnxModel(untrained_repository(name, args.preset, args.vocab, spm, build),
                                           precision=precision, threads=1, verify=False)
              for name in args.architectures for precision in args.precisions}
    ms = {key: [] for key in models}
    for rows in args.rows:
        for key, model in models.items():  # turns at each row count: load drifts hit all alike
            ms[key].append(round(median_ms(step_case(model, rows), args.reps), 3))
    out = {}
    for (name, precision), times in ms.items():
        out.setdefault(name, {})[precision] = {"rows": args.rows, "ms": times, **line(list(zip(args.rows, times)))}
    cold_model = models.get(("vanilla", "int8"))
    if cold_model is not None:  # the same step with what it read evicted before each run
        evict = torch.zeros(EVICT_BYTES // 4)
        cold = [round(median_ms(step_case(cold_model, rows), args.reps, lambda: evict.add_(1)), 3) for rows in args.rows]
        out["vanilla"]["int8"]["cold_ms"] = cold
    return out


# ---- the engine loop ---------------------------------------------------------------------------
def engine_setups(args, build: Path) -> dict:
    """Per checkpoint: (a maker of a fresh engine on the int8 repository, as the server's admission
    defaults set it up; its test_2016_flickr sources)."""
    from server.backends import OnnxBackend
    from server.config import ServerConfig

    config = ServerConfig()
    setups = {}
    for path in args.checkpoints:
        model, ckpt, sp = load_checkpoint(path)
        texts = [e.source for e in load_examples(ckpt.data.dataset, "test_2016_flickr", ckpt.data.src_lang,
                                                 ckpt.data.tgt_lang)]
        ids, tags = source_inputs(model, sp, texts, ckpt.data.src_lang, ckpt.data.max_src_len)
        sources = list(zip(ids, tags or [None] * len(ids)))  # a model that reads POS tags gets them
        repository = export(path, build / f"engine-{path.name}", "onnx")
        make = lambda r=repository: Engine(OnnxBackend(r, "int8", 1), "bench", Scheduler(  # noqa: E731
            config.batching, config.max_batch_tokens, 1 << 20, config.max_call_share), observer=Rows())
        setups[path.name] = make, sources
    return setups


def loop_texts(args, in_flight: int) -> int:
    """Texts through a closed loop of `in_flight`: --texts, and at least 4 per caller."""
    return max(args.texts, 4 * in_flight)


def engine_part(args, setups: dict) -> dict:
    points = {name: [] for name in setups}
    for in_flight in args.in_flight:
        for name, (make, sources) in setups.items():
            points[name].append(closed_loop(make(), sources, in_flight, loop_texts(args, in_flight)))
    out = {}
    for name, series in points.items():
        fits = {k: line([(p["rows"], p["ms"][k]) for p in series]) for k in PHASES}
        fits["step"] = line([(p["rows"], sum(p["ms"].values())) for p in series])
        out[name] = {"points": series, "fit": fits}
    return out


# ---- the engine loop's graphs, operator by operator ---------------------------------------------
def profiled(graph) -> None:
    """Give an OnnxGraph a session of the same model and options that records ONNX Runtime's profile."""
    options = graph.session.get_session_options()
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.gettempdir()) / f"bench-step-{graph.spec.name}")
    graph.session = ort.InferenceSession(str(graph.path), options, providers=graph.session.get_providers())


def kernel_us(graph) -> dict[str, float]:
    """Microseconds of kernel time per operator type since the session started (ends its profile)."""
    path = Path(graph.session.end_profiling())
    totals: dict[str, float] = {}
    for event in json.loads(path.read_text()):
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            op = event["args"]["op_name"]
            totals[op] = totals.get(op, 0.0) + event["dur"]
    path.unlink()
    return totals


def ops_part(args, setups: dict) -> dict:
    """Per model: each graph's kernel time by operator type, ms per text, over a closed loop at the
    widest in-flight count (warm-up included: the profile starts with the session)."""
    in_flight = max(args.in_flight)
    texts = loop_texts(args, in_flight)
    out = {}
    for name, (make, sources) in setups.items():
        engine = make()
        graphs = engine.backend.graphs
        for graph in graphs.values():
            profiled(graph)
        closed_loop(engine, sources, in_flight, texts)
        out[name] = {"in_flight": in_flight, "texts": texts,
                     "ms_per_text": {g: {op: round(us / 1e3 / texts, 4) for op, us in sorted(
                         kernel_us(graph).items(), key=lambda kv: -kv[1])} for g, graph in graphs.items()}}
    return out


def plot(graph: dict, engine: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, by_precision in graph.items():
        for precision, f in by_precision.items():
            left.plot(f["rows"], f["ms"], marker="o", label=f"{name} {precision}")
    left.set(xlabel="rows in the step", ylabel="ms per decoder step", title="decoder graph alone")
    left.legend(fontsize=7)
    for name, f in engine.items():
        rows = [p["rows"] for p in f["points"]]
        right.plot(rows, [sum(p["ms"].values()) for p in f["points"]], marker="o", label=f"{name}: whole step")
        right.plot(rows, [p["ms"]["search"] + p["ms"]["cache"] for p in f["points"]], marker=".", linestyle="--",
                   label=f"{name}: search + cache")
    right.set(xlabel="mean rows per step", ylabel="ms per engine step", title="engine loop, int8, 1 thread")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoints", type=Path, nargs="+",
                   default=[PROJECT_ROOT / "models" / "multi30k-de-en-vanilla", PROJECT_ROOT / "models" / "multi30k-de-en"],
                   help="trained checkpoints of one task for the engine part")
    p.add_argument("--architectures", nargs="+", default=list(ARCHITECTURES), choices=list(ARCHITECTURES))
    p.add_argument("--preset", default="small", choices=list(PRESETS))
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--precisions", nargs="+", default=["int8", "fp32"], choices=["int8", "fp32"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 256])
    p.add_argument("--reps", type=int, default=21, help="timed steps per point (the median is kept)")
    p.add_argument("--in-flight", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    p.add_argument("--texts", type=int, default=300, help="texts per engine point (at least 4 x in flight)")
    p.add_argument("--build-dir", type=Path, help="where the exported repositories are kept (default: a temp dir)")
    p.add_argument("--note", default="", help="recorded with the results (e.g. 'training paused with SIGSTOP')")
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny models, few points")
    add_publish(p)
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.vocab, args.rows, args.reps, args.in_flight, args.texts = "tiny", 64, [1, 8], 3, [1, 4], 8
    torch.set_num_threads(1)  # as the server's engine loops run
    record = Run("bench step", argv, args.note)
    spm = (args.checkpoints[0] / SPM).read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        build = args.build_dir or Path(tmp)
        graph = graph_part(args, spm, build)
        setups = engine_setups(args, build)
        engine = engine_part(args, setups)
        ops = ops_part(args, setups)
    out = results_dir(args.publish) / "bench-step.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(graph, engine, out.with_suffix(".png"))
    result = {
        **record.header(),
        "settings": {"preset": args.preset, "vocab": args.vocab, "beam": BEAM, "source": SOURCE, "width": WIDTH,
                     "reps": args.reps, "evict_mb": EVICT_BYTES >> 20, "checkpoints": [str(c) for c in args.checkpoints],
                     "quick": args.quick},
        "graph": graph,
        "engine": engine,
        "ops": ops,
        "plot": out.with_suffix(".png").name,
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    for name, by_precision in graph.items():
        for precision, f in by_precision.items():
            print(f"graph  {name:14s} {precision}: fixed {f['fixed_ms']:.3f} ms + {f['per_row_us']:.1f} us/row")
    for name, f in engine.items():
        fits = "  ".join(f"{k} {v['fixed_ms']:.2f} ms + {v['per_row_us']:.1f} us/row" for k, v in f["fit"].items())
        print(f"engine {name}: {fits}")
    for name, f in ops.items():
        for g, by_op in f["ms_per_text"].items():
            top = ", ".join(f"{op} {ms:.3f}" for op, ms in list(by_op.items())[:5])
            print(f"ops    {name} {g}: {sum(by_op.values()):.3f} ms per text ({top}, ...)")
    return 0
