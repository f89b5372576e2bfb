"""Checkpoint directory = config.json + model.safetensors + spm.model (never pickle), and optionally
target_pieces.json: the pieces its int8 decoder writes (training.target_pieces)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import Checkpoint
from .inputs import load_sentencepiece
from .model import Seq2Seq

WEIGHTS = "model.safetensors"
SPM = "spm.model"
TARGET_PIECES = "target_pieces.json"


def save_weights(state: dict[str, torch.Tensor], path: Path, dtype: torch.dtype | None = None) -> None:
    tensors = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
               for k, v in state.items()}
    save_file(tensors, str(path))


def save_checkpoint(directory: Path, model: Seq2Seq, ckpt: Checkpoint, spm_bytes: bytes,
                    state: dict[str, torch.Tensor] | None = None, dtype: torch.dtype | None = None) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_weights(state if state is not None else model.state_dict(), directory / WEIGHTS, dtype)
    (directory / SPM).write_bytes(spm_bytes)
    ckpt.save(directory)


def load_checkpoint(directory: Path) -> tuple[Seq2Seq, Checkpoint, object]:
    """Returns (model in eval mode, fp32, on CPU; its config; the SentencePiece processor)."""
    directory = Path(directory)
    ckpt = Checkpoint.load(directory)
    for name in (WEIGHTS, SPM):
        if not (directory / name).exists():
            raise FileNotFoundError(f"{directory / name} missing: incomplete checkpoint")
    model = Seq2Seq(ckpt.model)
    state = {k: v.float() for k, v in load_file(str(directory / WEIGHTS)).items()}
    model.load_state_dict(state, strict=True)
    return model.eval(), ckpt, load_sentencepiece(directory / SPM)


def warm_start(model: Seq2Seq, directory: Path) -> list[str]:
    """Load a trained checkpoint into a model that may add modules (GRET, multi-view).
    Returns the names of the newly added parameters; anything the new model lacks is an error."""
    state = {k: v.float() for k, v in load_file(str(Path(directory) / WEIGHTS)).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(f"warm start from {directory}: the new model has no place for {unexpected}")
    return missing


def average_weights(paths: list[Path]) -> dict[str, torch.Tensor]:
    total = None
    for path in paths:
        state = load_file(str(path))
        if total is None:
            total = {k: v.double() for k, v in state.items()}
        else:
            for k, v in state.items():
                total[k] += v.double()
    return {k: (v / len(paths)).float() for k, v in total.items()}


def save_optimizer(optimizer: torch.optim.Optimizer, path: Path, extra: dict) -> None:
    """Adam moments as safetensors; hyper-parameters and `extra` (step, epoch...) as metadata."""
    sd = optimizer.state_dict()
    tensors = {f"{i}.{name}": t.contiguous() for i, s in sd["state"].items() for name, t in s.items()}
    meta = {"param_groups": json.dumps(sd["param_groups"]), "extra": json.dumps(extra)}
    save_file(tensors, str(path), metadata=meta)


def load_optimizer(optimizer: torch.optim.Optimizer, path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        state: dict[int, dict] = {}
        for key in f.keys():
            i, name = key.split(".", 1)
            state.setdefault(int(i), {})[name] = f.get_tensor(key)
    optimizer.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})
    return json.loads(meta["extra"])


def load_target_pieces(directory: Path) -> list[int] | None:
    """The checkpoint's target pieces (training.target_pieces), or None: it writes its whole vocabulary."""
    path = Path(directory) / TARGET_PIECES
    return json.loads(path.read_text())["pieces"] if path.exists() else None
