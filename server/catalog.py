"""The catalog of what a server can serve: the model folders it finds (discover) and the entry each
becomes (ModelEntry: load_entry, from_repository); model repositories, or shipped checkpoints
turned into one.

Each folder under the models directory is either
  - a model repository (model.json + spm.model + the backend's files; `python -m export`), or
  - a checkpoint (config.json + model.safetensors + spm.model; what models/ ships, because an
    fp32 ONNX repository of a `small` model is larger than a tracked file may be).
A checkpoint is exported to an ONNX repository on first start, into the build cache
(~/.cache/gret-serve or $GRET_SERVE_CACHE), keyed by the weights' sha256, and verified once
(server.pipeline.verify_build: the served model must reproduce the checkpoint's recorded
validation score).
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


from export.manifest import MANIFEST, TASKS, read_manifest, sha256
from export.repository import RepositoryError, check_checkpoint, write_repository
from export.spec import export_digest
from training.seq2seq.checkpoint import WEIGHTS, load_checkpoint, load_target_pieces
from training.seq2seq.config import Checkpoint, ModelConfig
from training.seq2seq.inputs import INPUT_STYLES, input_style, load_sentencepiece

log = logging.getLogger("server.catalog")

VERIFY_FILE = "verified.json"


class ModelError(Exception):
    """A model folder that cannot be served; the message names the file and the problem."""


@dataclass
class ModelEntry:
    name: str
    version: str
    task: str
    source_language: str
    target_language: str
    architecture: str
    parameters: int
    cfg: ModelConfig
    sp: object  # SentencePieceProcessor
    max_src_len: int
    repository: Path | None  # None for the torch backend on a checkpoint
    checkpoint: Path | None
    metrics: dict = field(default_factory=dict)
    input_style: str | None = None  # training.seq2seq.inputs.normalize_input's style for plain text, if any


def cache_root() -> Path:
    return Path(os.environ.get("GRET_SERVE_CACHE", Path.home() / ".cache" / "gret-serve"))


def discover(models_dir: Path, names: list[str] | None = None) -> list[Path]:
    models_dir = Path(models_dir)
    if not models_dir.is_dir():
        raise ModelError(f"models directory {models_dir} does not exist")
    folders = sorted(p for p in models_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if names:
        unknown = sorted(set(names) - {p.name for p in folders})
        if unknown:
            raise ModelError(f"no model folder {', '.join(unknown)} under {models_dir} "
                             f"(it has {', '.join(p.name for p in folders) or 'none'})")
        folders = [p for p in folders if p.name in names]
    return folders


def is_repository(folder: Path) -> bool:
    return (folder / MANIFEST).exists()


def is_checkpoint(folder: Path) -> bool:
    return (folder / "config.json").exists()


def load_entry(folder: Path, backend: str, build_cache: Path | None = None,
               verify: Callable[[Path, Path], dict] | None = None) -> ModelEntry:
    """A servable description of `folder` for `backend`; builds the repository if needed."""
    folder = Path(folder)
    if is_repository(folder):
        return from_repository(folder, backend)
    if not is_checkpoint(folder):
        raise ModelError(f"{folder} is neither a model repository ({MANIFEST}) nor a checkpoint (config.json)")
    try:
        check_checkpoint(folder)
    except RepositoryError as e:
        raise ModelError(str(e)) from e
    if backend == "torch":
        return _from_checkpoint(folder)
    repo = build_repository(folder, build_cache or cache_root(), verify, backend)
    return from_repository(repo, backend, checkpoint=folder)


def _from_checkpoint(folder: Path) -> ModelEntry:
    try:
        model, ckpt, sp = load_checkpoint(folder)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ModelError(f"{folder}: cannot load the checkpoint: {e}") from e
    from export.manifest import architecture_summary

    arch = architecture_summary(ckpt.model, model.num_parameters())
    return ModelEntry(folder.name, sha256(folder / WEIGHTS)[:12], ckpt.data.task, ckpt.data.src_lang,
                      ckpt.data.tgt_lang, arch["summary"], arch["parameters"], ckpt.model, sp,
                      ckpt.data.max_src_len, None, folder, _recorded(folder), input_style(ckpt.data.dataset))


def from_repository(folder: Path, backend: str, checkpoint: Path | None = None) -> ModelEntry:
    path = folder / MANIFEST
    try:
        manifest = read_manifest(folder, verify=True)
        cfg = ModelConfig.from_dict(manifest["model_config"])
        sp = load_sentencepiece(folder / manifest["tokenizer"]["file"])
        if manifest["backend"] != backend:
            raise ModelError(f"{folder} holds a model for the {manifest['backend']} backend; the server is configured "
                         f"for {backend}")
        if manifest["task"] not in TASKS:
            raise ModelError(f"{path}: task {manifest['task']!r} is not one of {', '.join(TASKS)}")
        arch = manifest["architecture"]
        style = manifest["tokenizer"].get("normalize")
        if style is not None and style not in INPUT_STYLES:
            raise ModelError(f"{path}: tokenizer.normalize {style!r} is not one of {', '.join(INPUT_STYLES)}")
        return ModelEntry(manifest["name"], manifest["version"], manifest["task"], manifest["source_language"],
                          manifest["target_language"], arch["summary"], arch["parameters"], cfg, sp,
                          manifest["tokenizer"]["max_src_len"], folder, checkpoint, manifest.get("metrics", {}), style)
    except json.JSONDecodeError as e:
        raise ModelError(f"{path} is not valid JSON: {e}") from e
    except KeyError as e:
        raise ModelError(f"{path} has no field {e}") from e
    except (AttributeError, TypeError) as e:
        raise ModelError(f"{path} is not laid out as a model repository's manifest: {e}") from e
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelError(f"{folder}: {e}") from e


def _recorded(folder: Path) -> dict:
    path = folder / "metrics.json"
    return json.loads(path.read_text()) if path.exists() else {}


def build_repository(checkpoint: Path, cache: Path, verify: Callable[[Path, Path], dict] | None,
                     fmt: str = "onnx") -> Path:
    """The repository (fp32 + int8) of format `fmt` (onnx | ct2) for a checkpoint, from the build
    cache or exported now. verify(checkpoint, repo) runs once per build; it raises ModelError to
    refuse the build. A checkpoint CTranslate2 cannot hold is refused with export's reason."""
    key = sha256(checkpoint / WEIGHTS)[:12]
    try:
        graphs = export_digest(Checkpoint.load(checkpoint).model, load_target_pieces(checkpoint))
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"{checkpoint / 'config.json'}: {e}") from e
    repo = cache / f"{checkpoint.name}-{key}-{fmt}-{graphs}"
    if (repo / MANIFEST).exists() and (not verify or (repo / VERIFY_FILE).exists()):
        log.info("model %s: using the %s repository built earlier at %s", checkpoint.name, fmt, repo)
        return repo
    if not (repo / MANIFEST).exists():
        log.info("model %s: first start, exporting the checkpoint (%s) to %s", checkpoint.name, fmt, repo)
        start = time.monotonic()
        try:
            write_repository(checkpoint, repo, fmt=fmt, quantize="int8", name=checkpoint.name, version=key,
                             overwrite=True)
        except (OSError, ValueError) as e:
            raise ModelError(f"{checkpoint}: export ({fmt}) failed: {e}") from e
        log.info("model %s: exported in %.1f s", checkpoint.name, time.monotonic() - start)
    if verify is not None:
        result = verify(checkpoint, repo)
        (repo / VERIFY_FILE).write_text(json.dumps(result, indent=2) + "\n")
    return repo
