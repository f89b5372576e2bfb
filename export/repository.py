"""Checkpoint directory -> model repository (models/<name>/): model.json, spm.model and the
backend's files. The repository is assembled in a temporary folder beside the target and moved
into place at the end, so a failed export never leaves a half-written repository.

Backends:
  onnx  encoder.onnx + decoder.onnx + decoder2.onnx (the step over two length classes), + global.onnx
        for capsule models (each + NAME.int8.onnx with --quantize int8)
  ct2   ct2/ (model.bin, config.json, shared_vocabulary.json), + ct2.int8/ with --quantize int8:
        a second CT2 folder whose weights the converter stored as int8, so the file that was
        measured is the file that is served and the fp32 folder stays there as the reference.
        Vanilla and mvPE models only (export/ct2_export.py says why the others are refused)."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import ctranslate2
import onnx
import onnxruntime
import torch
from safetensors import safe_open

from training.seq2seq.checkpoint import SPM, WEIGHTS, load_checkpoint, load_target_pieces
from training.seq2seq.config import Checkpoint

from .ct2_export import check_ct2_compatible, export_ct2
from .manifest import build_manifest, onnx_section, sha256, write_manifest
from .onnx_export import export_onnx
from .quantize import QUANTIZATIONS, quantize_int8, quantized_name
from .spec import SOURCE_CLASSES, decoder_name, model_specs

FORMATS = ("onnx", "ct2")
CT2_FOLDERS = {"fp32": "ct2", "int8": "ct2.int8"}  # precision -> folder in the repository
CHECKPOINT_FILES = ("config.json", WEIGHTS, SPM)


class RepositoryError(ValueError):
    pass


def check_checkpoint(directory: Path) -> None:
    """Every file of a checkpoint is there and its config.json and weights parse: a missing, truncated
    or corrupt file is named here rather than failing somewhere inside loading or export."""
    directory = Path(directory)
    if not directory.is_dir():
        raise RepositoryError(f"checkpoint {directory} is not a directory")
    missing = [f for f in CHECKPOINT_FILES if not (directory / f).exists()]
    if missing:
        raise RepositoryError(f"checkpoint {directory} is incomplete: missing {', '.join(missing)} "
                              f"(a checkpoint directory holds {', '.join(CHECKPOINT_FILES)})")
    try:
        json.loads((directory / "config.json").read_text())
    except ValueError as e:
        raise RepositoryError(f"{directory / 'config.json'} is not valid JSON: {e}") from e
    try:
        with safe_open(str(directory / WEIGHTS), "pt"):
            pass
    except Exception as e:  # safetensors raises its own error type
        raise RepositoryError(f"{directory / WEIGHTS} is not a readable safetensors file: {e}") from e


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
    model, ckpt, sp = load_checkpoint(checkpoint)
    if fmt == "ct2":
        check_ct2_compatible(ckpt.model)  # before any work: the refusal says why and what to use
    weights_sha = sha256(checkpoint / WEIGHTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        section, tools = (_write_ct2(model, sp, staging, quantize) if fmt == "ct2" else
                          _write_onnx(model, sp, staging, quantize, load_target_pieces(checkpoint)))
        shutil.copyfile(checkpoint / SPM, staging / SPM)
        manifest = build_manifest(
            name=name or out.name, version=version or weights_sha[:12], ckpt=ckpt, checkpoint_dir=checkpoint,
            n_parameters=model.num_parameters(), backend=fmt, backend_section=section, directory=staging,
            tools=tools)
        manifest["source_checkpoint"] = {"weights_sha256": weights_sha, "training": _training_record(ckpt)}
        write_manifest(staging, manifest)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return manifest


def _write_onnx(model, sp, staging: Path, quantize: str | None, pieces: list[int] | None) -> tuple[dict, dict]:
    """`pieces`: the checkpoint's target pieces, the only columns of the quantized decoders' output
    layer (export.quantize.trim_output), listed in the manifest."""
    paths = export_onnx(model, staging)
    precisions = {"fp32": {g: p.name for g, p in paths.items()}}
    decoders = {decoder_name(c) for c in range(1, SOURCE_CLASSES + 1)}
    if quantize:
        precisions[quantize] = {}
        for graph, path in paths.items():
            target = quantized_name(path, quantize)
            quantize_int8(path, target, pieces if graph in decoders else None)
            precisions[quantize][graph] = target.name
    tools = {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}
    section = onnx_section(model_specs(model.cfg), precisions)
    if quantize and pieces is not None:
        section["output_pieces"] = {quantize: pieces}
    return section, tools


def _write_ct2(model, sp, staging: Path, quantize: str | None) -> tuple[dict, dict]:
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    precisions = {"fp32": CT2_FOLDERS["fp32"]}
    export_ct2(model, pieces, staging / CT2_FOLDERS["fp32"])
    if quantize:
        precisions[quantize] = CT2_FOLDERS[quantize]
        export_ct2(model, pieces, staging / CT2_FOLDERS[quantize], quantize)
    section = {"version": ctranslate2.__version__, "spec": "TransformerSpec", "precisions": precisions}
    return section, {"torch": torch.__version__, "ctranslate2": ctranslate2.__version__}


def _training_record(ckpt: Checkpoint) -> dict:
    tr = ckpt.training
    return {k: tr.get(k) for k in ("steps", "wall_minutes", "train_pairs") if k in tr}
