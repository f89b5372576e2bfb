"""model.json: what a model repository holds, written by the exporter and read by the runtime.

The contract: name, version, task, source/target language, an
architecture summary, the backend ("onnx" or "ct2") with its own section (for ONNX the opset and
graph signatures, for CT2 its version and model folders), every file with its sha256 (paths
relative to the repository, "/"-separated), and the metrics the checkpoint recorded.
`model_config` is the full ModelConfig, so a backend needs nothing from the checkpoint directory.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from training.seq2seq.config import Checkpoint, ModelConfig
from training.seq2seq.inputs import input_style

from .spec import OPSET, GraphSpec

MANIFEST = "model.json"
FORMAT_VERSION = 1
TASKS = ("translate", "summarize")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def architecture_summary(cfg: ModelConfig, n_parameters: int) -> dict:
    gret = [k for k in ("capsule", "aggregate", "gate") if getattr(cfg, k)]
    parts = [f"GRET({'+'.join(gret)})"] if gret else []
    if cfg.multiview:
        parts.append(f"multi-view {cfg.multiview.upper()}{'' if cfg.multiview_soft else ' (replace)'}")
    if cfg.encoder == "graph":
        parts.append(f"Graph-Transformer encoder ({cfg.graph_fusion})")
    if cfg.pe_k != 1:
        parts.append(f"mvPE k={cfg.pe_k}")
    if cfg.pos_tags:
        parts.append("POS tags")
    return {
        "summary": ", ".join(parts) or "vanilla Transformer",
        "norm": "pre" if cfg.pre_norm else "post",
        "d_model": cfg.d_model, "heads": cfg.n_heads, "d_ff": cfg.d_ff,
        "encoder_layers": cfg.enc_layers, "decoder_layers": cfg.dec_layers,
        "vocab_size": cfg.vocab_size, "parameters": n_parameters,
    }


def recorded_metrics(ckpt: Checkpoint, checkpoint_dir: Path) -> dict:
    """What the checkpoint says about its quality: the validation record in config.json and, for a
    checkpoint shipped by training.ship, the test-set metrics it measured (metrics.json)."""
    tr = ckpt.training
    metrics = {"dataset": ckpt.data.dataset, "validation": tr.get("best_valid"), "selected": tr.get("selected"),
               "best_step": tr.get("best_step"), "training_steps": tr.get("steps")}
    shipped = Path(checkpoint_dir) / "metrics.json"
    if shipped.exists():
        metrics["measured_by_ship"] = json.loads(shipped.read_text())
    return metrics


def signature(spec: GraphSpec) -> dict:
    def tensors(ts):
        return [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in ts]

    return {"inputs": tensors(spec.inputs), "outputs": tensors(spec.outputs)}


def onnx_section(specs: tuple[GraphSpec, ...], precisions: dict[str, dict[str, str]]) -> dict:
    """precisions: {"fp32": {"encoder": file, "decoder": file}, "int8": {...}}."""
    return {"opset": OPSET, "precisions": precisions, "graphs": {s.name: signature(s) for s in specs}}


def list_files(directory: Path) -> dict[str, dict]:
    """Every file under `directory` (subfolders included) but model.json, with its sha256."""
    directory = Path(directory)
    paths = sorted(p for p in directory.rglob("*") if p.is_file() and p != directory / MANIFEST)
    return {p.relative_to(directory).as_posix(): {"sha256": sha256(p), "bytes": p.stat().st_size} for p in paths}


def build_manifest(*, name: str, version: str, ckpt: Checkpoint, checkpoint_dir: Path, n_parameters: int,
                   backend: str, backend_section: dict, directory: Path, tools: dict[str, str]) -> dict:
    """backend_section goes under the key `backend` (onnx_section for "onnx"); every file present
    in `directory` is listed with its sha256."""
    if ckpt.data.task not in TASKS:
        raise ValueError(f"task {ckpt.data.task!r} is not one of {TASKS}")
    return {
        "format_version": FORMAT_VERSION,
        "name": name,
        "version": version,
        "task": ckpt.data.task,
        "source_language": ckpt.data.src_lang,
        "target_language": ckpt.data.tgt_lang,
        "backend": backend,
        "architecture": architecture_summary(ckpt.model, n_parameters),
        "model_config": ckpt.model.to_dict(),
        "tokenizer": {"type": "sentencepiece", "file": "spm.model", "max_src_len": ckpt.data.max_src_len,
                      "max_tgt_len": ckpt.data.max_tgt_len, "normalize": input_style(ckpt.data.dataset)},
        backend: backend_section,
        "files": list_files(directory),
        "metrics": recorded_metrics(ckpt, checkpoint_dir),
        "exported_with": tools,
    }


def write_manifest(directory: Path, manifest: dict) -> None:
    (Path(directory) / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def read_manifest(directory: Path, verify: bool = True) -> dict:
    """Loads model.json; with `verify`, every listed file must exist with its recorded sha256."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: {directory} is not a model repository")
    manifest = json.loads(path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {manifest.get('format_version')}, this code reads {FORMAT_VERSION}")
    if verify:
        for name, entry in manifest["files"].items():
            if not (directory / name).exists():
                raise FileNotFoundError(f"{directory / name} listed in {MANIFEST} but missing")
            if sha256(directory / name) != entry["sha256"]:
                raise ValueError(f"{directory / name}: sha256 differs from {MANIFEST} (file changed or corrupt)")
    return manifest
