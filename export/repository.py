"""Checkpoint directory -> model repository (models/<name>/): model.json, spm.model and the
backend's files. The repository is assembled in a temporary folder beside the target and moved
into place at the end, so a failed export never leaves a half-written repository."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import onnx
import onnxruntime
import torch

from training.checkpoint import SPM, WEIGHTS, load_checkpoint
from training.config import Checkpoint

from .manifest import build_manifest, sha256, write_manifest
from .onnx_export import export_onnx
from .quantize import QUANTIZATIONS, quantize_int8, quantized_name
from .spec import model_specs

FORMATS = ("onnx",)
CHECKPOINT_FILES = ("config.json", WEIGHTS, SPM)


class RepositoryError(ValueError):
    pass


def check_checkpoint(directory: Path) -> None:
    if not Path(directory).is_dir():
        raise RepositoryError(f"checkpoint {directory} is not a directory")
    missing = [f for f in CHECKPOINT_FILES if not (Path(directory) / f).exists()]
    if missing:
        raise RepositoryError(f"checkpoint {directory} is incomplete: missing {', '.join(missing)} "
                              f"(a checkpoint directory holds {', '.join(CHECKPOINT_FILES)})")


def write_repository(checkpoint: Path, out: Path, *, fmt: str = "onnx", quantize: str | None = None,
                     name: str | None = None, version: str | None = None, overwrite: bool = False) -> dict:
    """Exports `checkpoint` into the repository `out`; returns its manifest. The version defaults to
    the first 12 hex digits of the weights' sha256, so a changed model never shares a version
    (the server's encoder cache is keyed by it)."""
    checkpoint, out = Path(checkpoint), Path(out)
    if fmt not in FORMATS:
        raise RepositoryError(f"unknown format {fmt!r}: choose from {', '.join(FORMATS)}")
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise RepositoryError(f"unknown quantization {quantize!r}: choose from {', '.join(QUANTIZATIONS)}")
    check_checkpoint(checkpoint)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise RepositoryError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    model, ckpt, _ = load_checkpoint(checkpoint)
    weights_sha = sha256(checkpoint / WEIGHTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        paths = export_onnx(model, staging)
        precisions = {"fp32": {g: p.name for g, p in paths.items()}}
        if quantize:
            precisions[quantize] = {}
            for graph, path in paths.items():
                target = quantized_name(path, quantize)
                quantize_int8(path, target)
                precisions[quantize][graph] = target.name
        shutil.copyfile(checkpoint / SPM, staging / SPM)
        manifest = build_manifest(
            name=name or out.name, version=version or weights_sha[:12], ckpt=ckpt, checkpoint_dir=checkpoint,
            n_parameters=model.num_parameters(), specs=model_specs(ckpt.model), precisions=precisions,
            directory=staging, tools=_tools())
        manifest["source_checkpoint"] = {"weights_sha256": weights_sha, "training": _training_record(ckpt)}
        write_manifest(staging, manifest)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return manifest


def _training_record(ckpt: Checkpoint) -> dict:
    tr = ckpt.training
    return {k: tr.get(k) for k in ("steps", "wall_minutes", "train_pairs") if k in tr}


def _tools() -> dict[str, str]:
    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}
