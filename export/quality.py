"""python -m export.quality --checkpoint models/multi30k-de-en-vanilla

What exporting costs and buys, measured side by side in one run: the checkpoint is exported
into a temporary folder as ONNX (fp32 + int8) and CTranslate2 (fp32 + int8) repositories, and a
test split is translated with beam search by each of them and by the PyTorch reference. Per
system: sacreBLEU BLEU and chrF, the share of outputs token-identical to the PyTorch beam
search, sentences/s and its ratio to PyTorch and to the system's own fp32, and the BLEU change
of int8 against fp32. Every system runs on 1 intra-op thread by default; the systems take turns
batch by batch (a different one first each time), so load from other processes hits all alike.

Writes docs/results/export-quality.json and docs/EXPORT.md, rendered from that JSON.
A backend that fails to export or to run is reported with its error; the others still run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ctranslate2
import onnxruntime
import torch

from training.corpora import PROJECT_ROOT, load_examples
from training.metrics import bleu, chrf
from training.seq2seq import search
from training.seq2seq.checkpoint import WEIGHTS, load_checkpoint
from training.seq2seq.inputs import encode_source, pad

from .ct2_runtime import Ct2Translator, max_lengths
from .manifest import read_manifest, sha256
from .onnx_runtime import OnnxModel
from .repository import write_repository

REFERENCE = "pytorch"
EXPORTS = {"onnx-fp32": ("onnx", "fp32"), "onnx-int8": ("onnx", "int8"),
           "ct2-fp32": ("ct2", "fp32"), "ct2-int8": ("ct2", "int8")}
TARGETS = {"ct2_fp32_identical": 0.99, "int8_bleu_drop": 0.3}  # from the Export issue


def model_bytes(repo: Path, fmt: str, precision: str) -> int:
    """Size of the files one system loads (the tokenizer aside)."""
    manifest = read_manifest(repo, verify=False)
    if fmt == "onnx":
        names = manifest["onnx"]["precisions"][precision].values()
    else:
        names = [f"{manifest['ct2']['precisions'][precision]}/model.bin"]
    return sum(manifest["files"][n]["bytes"] for n in names)


def build_systems(checkpoint: Path, work: Path, model, options: dict, threads: int):
    """{name: translate(batch of source id lists) -> top-1 id lists}, {name: model bytes},
    {name: error} for backends that could not be exported or loaded."""
    systems = {REFERENCE: lambda batch: [h[0].tokens for h in search.beam_search(model, pad(batch), **options)]}
    sizes, errors = {}, {}
    for fmt in ("onnx", "ct2"):
        repo = work / fmt
        names = [n for n, (f, _) in EXPORTS.items() if f == fmt]
        try:
            write_repository(checkpoint, repo, fmt=fmt, quantize="int8")
            for name in names:
                precision = EXPORTS[name][1]
                systems[name] = (_onnx if fmt == "onnx" else _ct2)(repo, precision, options, threads)
                sizes[name] = model_bytes(repo, fmt, precision)
        except Exception as e:  # noqa: BLE001 - one broken backend is reported, the others still run
            errors.update({n: f"{type(e).__name__}: {e}" for n in names if n not in systems})
    return systems, sizes, errors


def _onnx(repo: Path, precision: str, options: dict, threads: int):
    onnx_model = OnnxModel(repo, precision=precision, device="cpu", threads=threads)
    return lambda batch: [h[0].tokens for h in search.beam_search(onnx_model, pad(batch), **options)]


def _ct2(repo: Path, precision: str, options: dict, threads: int):
    translator = Ct2Translator(repo, precision=precision, device="cpu", threads=threads)
    return lambda batch: [h[0].tokens for h in translator.translate(batch, **options)]


def length_sorted_batches(sources: list[list[int]], size: int) -> list[list[int]]:
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    return [order[i: i + size] for i in range(0, len(order), size)]


def run_side_by_side(systems: dict, sources: list[list[int]], batches: list[list[int]], errors: dict):
    """Outputs and decode seconds per system; systems take turns batch by batch."""
    outputs = {name: [None] * len(sources) for name in systems}
    seconds = dict.fromkeys(systems, 0.0)
    names = list(systems)
    for name in names:  # warm-up (first-call allocations, thread pools), not timed
        systems[name]([sources[i] for i in batches[0][:2]])
    for b, ids in enumerate(batches):
        batch = [sources[i] for i in ids]
        for name in names[b % len(names):] + names[: b % len(names)]:
            if name in errors:
                continue
            start = time.perf_counter()
            try:
                result = systems[name](batch)
            except Exception as e:  # noqa: BLE001 - reported in the results, the others go on
                errors[name] = f"{type(e).__name__}: {e}"
                continue
            seconds[name] += time.perf_counter() - start
            for i, tokens in zip(ids, result):
                outputs[name][i] = tokens
    return outputs, seconds


def score_systems(outputs: dict, seconds: dict, sizes: dict, errors: dict, sp, refs: list[list[str]]) -> dict:
    n = len(refs)
    rows = {}
    for name, system_outputs in outputs.items():
        if name in errors:
            continue
        hyps = [sp.decode(tokens) for tokens in system_outputs]
        same = sum(a == b for a, b in zip(system_outputs, outputs[REFERENCE])) / n
        rows[name] = {"bleu": round(bleu(hyps, refs), 2), "chrf": round(chrf(hyps, refs), 2),
                      "identical_to_pytorch": round(same, 4), "decode_seconds": round(seconds[name], 2),
                      "sentences_per_s": round(n / seconds[name], 2), "model_bytes": sizes.get(name)}
    for name, row in rows.items():
        row["speed_vs_pytorch"] = round(row["sentences_per_s"] / rows[REFERENCE]["sentences_per_s"], 3)
        fp32 = name.replace("int8", "fp32")
        if name.endswith("int8") and fp32 in rows:
            row["speed_vs_own_fp32"] = round(row["sentences_per_s"] / rows[fp32]["sentences_per_s"], 3)
            row["bleu_change_vs_fp32"] = round(row["bleu"] - rows[fp32]["bleu"], 2)
            row["identical_to_own_fp32"] = round(
                sum(a == b for a, b in zip(outputs[name], outputs[fp32])) / n, 4)
    return rows


def check_targets(rows: dict) -> dict:
    out = {}
    if "ct2-fp32" in rows:
        value = rows["ct2-fp32"]["identical_to_pytorch"]
        out["ct2-fp32 identical to PyTorch"] = {"target": f">= {TARGETS['ct2_fp32_identical']:.0%}",
                                                 "measured": value, "met": value >= TARGETS["ct2_fp32_identical"]}
    for name in ("onnx-int8", "ct2-int8"):
        if "bleu_change_vs_fp32" in rows.get(name, {}):
            change = rows[name]["bleu_change_vs_fp32"]
            out[f"{name} BLEU change vs fp32"] = {"target": f">= -{TARGETS['int8_bleu_drop']} (drop at most "
                                                            f"{TARGETS['int8_bleu_drop']})",
                                                  "measured": change, "met": change >= -TARGETS["int8_bleu_drop"]}
    return out


def measure(args, command: str) -> dict:
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    model, ckpt, sp = load_checkpoint(args.checkpoint)
    data = ckpt.data
    examples = load_examples(data.dataset, args.split, data.src_lang, data.tgt_lang)[: args.limit or None]
    sources = [encode_source(sp, e.source, data.max_src_len) for e in examples]
    options = {"beam": args.beam, "length_penalty": args.length_penalty, "max_len_a": args.max_len_a,
               "max_len_b": args.max_len_b}
    batches = length_sorted_batches(sources, args.batch)
    with tempfile.TemporaryDirectory(prefix="export-quality-") as work:
        systems, sizes, errors = build_systems(args.checkpoint, Path(work), model, options, args.threads)
        outputs, seconds = run_side_by_side(systems, sources, batches, errors)
    rows = score_systems(outputs, seconds, sizes, errors, sp, [e.refs for e in examples])
    ct2_calls = sum(len(set(max_lengths(ckpt.model, [len(sources[i]) for i in ids], args.max_len_a,
                                        args.max_len_b))) for ids in batches)
    return {
        "command": command,
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "commit": _git_commit(),
        "checkpoint": {"path": str(args.checkpoint), "weights_sha256": sha256(args.checkpoint / WEIGHTS),
                       "architecture": "vanilla Transformer" if ckpt.model.pe_k == 1 else f"mvPE k={ckpt.model.pe_k}",
                       "parameters": model.num_parameters()},
        "data": {"dataset": data.dataset, "split": args.split, "direction": f"{data.src_lang}-{data.tgt_lang}",
                 "sentences": len(examples)},
        "settings": {**options, "batch_sentences": args.batch, "batches": len(batches), "order": "length-sorted",
                     "intra_op_threads": args.threads, "ct2_calls": ct2_calls},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_average_1min": {"start": round(load_start[0], 2), "end": round(os.getloadavg()[0], 2)},
                    "note": args.note},
        "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
                     "ctranslate2": ctranslate2.__version__},
        "systems": rows,
        "errors": errors,
        "targets": check_targets(rows),
    }


def _git_commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
                            cwd=PROJECT_ROOT)
    return result.stdout.strip()


def _size(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**20:.1f} MiB"


def render(report: dict) -> str:
    """docs/EXPORT.md from the JSON report."""
    s, d, m = report["settings"], report["data"], report["machine"]
    lines = [
        "# Export: quality and speed of the exported backends", "",
        (f"Generated by `{report['command']}` ({report['date_utc']} UTC, commit {report['commit']}) into "
         "`docs/results/export-quality.json`; this page is rendered from that file, no number is typed by hand."), "",
        (f"{d['dataset']} `{d['split']}` {d['direction']}, {d['sentences']} sentences; checkpoint "
         f"`{report['checkpoint']['path']}` ({report['checkpoint']['architecture']}, "
         f"{report['checkpoint']['parameters'] / 1e6:.2f}M parameters). Beam {s['beam']}, length penalty "
         f"{s['length_penalty']}, max length {s['max_len_a']}·source + {s['max_len_b']}; {s['batches']} "
         f"{s['order']} batches of {s['batch_sentences']} sentences; the systems take turns batch by batch."), "",
        (f"**{s['intra_op_threads']} intra-op thread(s) per system**: {m['note']} "
         f"(load average {m['load_average_1min']['start']} at the start, {m['load_average_1min']['end']} at the "
         f"end, {m['cpus']} CPUs)."), "",
        ("| system | BLEU | chrF | identical to PyTorch | sentences/s | × PyTorch | × own fp32 | ΔBLEU vs fp32 "
         "| model files |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["systems"].items():
        lines.append(" | ".join([
            f"| {name}", f"{r['bleu']:.2f}", f"{r['chrf']:.2f}", f"{r['identical_to_pytorch']:.1%}",
            f"{r['sentences_per_s']:.1f}", f"{r['speed_vs_pytorch']:.2f}",
            f"{r['speed_vs_own_fp32']:.2f}" if "speed_vs_own_fp32" in r else "—",
            f"{r['bleu_change_vs_fp32']:+.2f}" if "bleu_change_vs_fp32" in r else "—",
            _size(r["model_bytes"])]) + " |")
    for name, error in report["errors"].items():
        lines.append(f"| {name} | failed: {error} ||||||||")
    lines += ["", "Targets (Export issue):", ""]
    for name, t in report["targets"].items():
        lines.append(f"- {name}: target {t['target']}, measured {t['measured']} — {'met' if t['met'] else 'NOT met'}")
    lines += [
        "", "How to read it:", "",
        ("- *identical to PyTorch*: the share of sentences whose top-1 output is token-identical to "
         "`training.seq2seq.search.beam_search` on the checkpoint (fp32 PyTorch)."),
        ("- ONNX int8: ONNX Runtime dynamic quantization of the MatMul weights (`encoder.int8.onnx`, "
         "`decoder.int8.onnx`); where the checkpoint has a `target_pieces.json` (training.target_pieces), "
         "the int8 decoders' output layer has only the pieces its training targets hold. CT2 int8: "
         "`--format ct2 --quantize int8` writes a second model folder, "
         "`ct2.int8/`, whose weights CTranslate2's converter stored as int8 (one scale per output row); "
         "CT2 then computes in int8 on CPU. The fp32 folder `ct2/` stays beside it as the reference."),
        (f"- CTranslate2 takes one max length per call, ours is per sentence, so `export.ct2_runtime` splits a "
         f"batch by length limit: {s['ct2_calls']} CT2 calls for {s['batches']} batches here."),
        "- Speeds are decode time only (encoder + beam search over prepared token ids), model loading excluded.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m export.quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, type=Path)
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--length-penalty", type=float, default=1.0)
    p.add_argument("--max-len-a", type=float, default=1.5)
    p.add_argument("--max-len-b", type=int, default=10)
    p.add_argument("--batch", type=int, default=32, help="sentences per batch")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of every system")
    p.add_argument("--limit", type=int, default=0, help="only the first N sentences (a quick check)")
    p.add_argument("--json", type=Path, default=PROJECT_ROOT / "docs" / "results" / "export-quality.json")
    p.add_argument("--doc", type=Path, default=PROJECT_ROOT / "docs" / "EXPORT.md")
    p.add_argument("--note", default="a shared machine: absolute speeds move between runs, compare the ratios",
                   help="what else the machine was doing during the run (goes into the report)")
    args = p.parse_args(argv)
    command = "python -m export.quality " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    report = measure(args, command)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    args.doc.write_text(render(json.loads(args.json.read_text())))
    print(json.dumps({"systems": report["systems"], "errors": report["errors"], "targets": report["targets"]},
                     indent=2))
    return report


if __name__ == "__main__":
    main()
