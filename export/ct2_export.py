"""Seq2Seq -> CTranslate2 model folder, through CTranslate2's declarative TransformerSpec.

Only models that CT2's Transformer can express are converted: vanilla (pre- or post-norm) and
mvPE, whose positions are just a different fixed table. Every weight comes from our checkpoint:
QKV are fused as CT2 expects, the embedding matrix is shared by encoder, decoder and output
projection, and our own position table is written explicitly, because CT2's built-in sinusoid
differs from ours (concatenated [sin | cos] halves, positions counted from 1, another frequency
spacing). The spec is validated (every declared weight set) before anything is written.

The folder holds model.bin, config.json and shared_vocabulary.json: our SentencePiece pieces in
id order, so a CT2 token index is our token id.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from ctranslate2.specs import transformer_spec as ct2
from torch import nn

from training.seq2seq.config import ModelConfig
from training.seq2seq.inputs import UNK
from training.seq2seq.model import Seq2Seq

WEIGHT_QUANTIZATION = {"int8": "int8"}  # our --quantize name -> CT2's weight quantization
VOCABULARY = "shared_vocabulary.json"
LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default; CT2 would otherwise use its own


class Ct2ExportError(ValueError):
    pass


def unsupported_switches(cfg: ModelConfig) -> list[str]:
    """One reason per switch of `cfg` that CT2's Transformer has no place for."""
    reasons = []
    gret = [k for k in ("capsule", "aggregate", "gate") if getattr(cfg, k)]
    if gret:
        reasons.append(f"GRET ({'+'.join(gret)}): CT2's decoder has no global sentence state added to its "
                       "output and no context gate")
    if cfg.multiview:
        reasons.append(f"multi-view decoding ({cfg.multiview}): every CT2 decoder layer attends to the last "
                       "encoder layer only, not to per-layer encoder views")
    if cfg.encoder == "graph":
        reasons.append("Graph-Transformer encoder: CT2's encoder layers are plain self-attention + feed-forward, "
                       "with no graph attention or fusion gate")
    if cfg.pos_tags:
        reasons.append("POS-tag embeddings: CT2 adds positions after merging source factors and has no input "
                       "projection, while this model adds positions to the word embedding only")
    return reasons


def check_ct2_compatible(cfg: ModelConfig) -> None:
    reasons = unsupported_switches(cfg)
    if reasons:
        raise Ct2ExportError("cannot export to CTranslate2: " + "; ".join(reasons)
                             + ". Use --format onnx, which runs every architecture.")


class _Weights:
    """The model's parameters as float32 numpy arrays, taken by module (no weight is named here:
    the model's own modules say which tensors they hold); what no spec field took is an error."""

    def __init__(self, model: Seq2Seq):
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.taken: set[str] = set()

    def __call__(self, *tensors: torch.Tensor) -> np.ndarray:
        self.taken.update(self.names[id(t)] for t in tensors)
        return np.ascontiguousarray(np.concatenate([t.detach().float().cpu().numpy() for t in tensors]))

    def check_all_taken(self) -> None:
        left = sorted(set(self.names.values()) - self.taken)
        if left:
            raise Ct2ExportError(f"the CT2 spec has no place for {left}")


def _linear(spec, w: _Weights, *linears: nn.Linear) -> None:
    """Several of our Linears as one CT2 linear (rows stacked: fused Q|K|V or K|V)."""
    spec.weight = w(*(m.weight for m in linears))
    spec.bias = w(*(m.bias for m in linears))


def _layer_norm(spec, w: _Weights, norm: nn.LayerNorm) -> None:
    spec.gamma, spec.beta = w(norm.weight), w(norm.bias)


def _ffn(spec, w: _Weights, layer) -> None:
    _linear(spec.linear_0, w, layer.ffn.w1)
    _linear(spec.linear_1, w, layer.ffn.w2)
    _layer_norm(spec.layer_norm, w, layer.res_ffn.norm)


def transformer_spec(model: Seq2Seq, pieces: list[str]) -> ct2.TransformerSpec:
    """The filled and validated spec; `pieces` are the SentencePiece pieces in id order."""
    cfg = model.cfg
    check_ct2_compatible(cfg)
    if len(pieces) != cfg.vocab_size:
        raise Ct2ExportError(f"the SentencePiece model has {len(pieces)} pieces, the model {cfg.vocab_size} ids")
    encoder = ct2.TransformerEncoderSpec(cfg.enc_layers, cfg.n_heads, pre_norm=cfg.pre_norm)
    decoder = ct2.TransformerDecoderSpec(cfg.dec_layers, cfg.n_heads, pre_norm=cfg.pre_norm)
    spec = ct2.TransformerSpec(encoder, decoder)
    w = _Weights(model)
    embedding = w(model.embed.weight)  # tied: source, target and output projection
    positions = model.positions.numpy().astype(np.float32)  # our table, mvPE's k included

    encoder.embeddings[0].weight = embedding
    encoder.position_encodings.encodings = positions
    for ours, layer in zip(model.encoder.layers, encoder.layer):
        a = ours.self_attn
        _linear(layer.self_attention.linear[0], w, a.q, a.k, a.v)
        _linear(layer.self_attention.linear[1], w, a.o)
        _layer_norm(layer.self_attention.layer_norm, w, ours.res_attn.norm)
        _ffn(layer.ffn, w, ours)
    if cfg.pre_norm:
        _layer_norm(encoder.layer_norm, w, model.encoder.norm)

    decoder.embeddings.weight = embedding
    decoder.position_encodings.encodings = positions
    decoder.projection.weight = embedding
    for ours, layer in zip(model.decoder, decoder.layer):
        a, c = ours.self_attn, ours.cross_attn
        _linear(layer.self_attention.linear[0], w, a.q, a.k, a.v)
        _linear(layer.self_attention.linear[1], w, a.o)
        _layer_norm(layer.self_attention.layer_norm, w, ours.res_self.norm)
        _linear(layer.attention.linear[0], w, c.q)
        _linear(layer.attention.linear[1], w, c.k, c.v)
        _linear(layer.attention.linear[2], w, c.o)
        _layer_norm(layer.attention.layer_norm, w, ours.res_cross.norm)
        _ffn(layer.ffn, w, ours)
    if cfg.pre_norm:
        _layer_norm(decoder.layer_norm, w, model.dec_norm)
    w.check_all_taken()

    config = spec.config
    config.layer_norm_epsilon = LAYER_NORM_EPS
    config.unk_token = pieces[UNK]
    config.bos_token = config.decoder_start_token = pieces[cfg.bos_id]
    config.eos_token = pieces[cfg.eos_id]
    # The source already ends with EOS (training.seq2seq.inputs.encode_source); CT2 must add nothing.
    config.add_source_bos = config.add_source_eos = False
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    spec.validate()
    return spec


def export_ct2(model: Seq2Seq, pieces: list[str], folder: Path, quantize: str | None = None) -> Path:
    """Writes the CT2 model folder; with quantize="int8" its weights are stored as int8 (CT2's
    converter quantization: one scale per output row)."""
    if quantize is not None and quantize not in WEIGHT_QUANTIZATION:
        raise Ct2ExportError(f"unknown quantization {quantize!r}: choose from {', '.join(WEIGHT_QUANTIZATION)}")
    spec = transformer_spec(model, pieces)
    spec.optimize(quantization=WEIGHT_QUANTIZATION.get(quantize))  # also aliases the three tied embeddings
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=False)
    spec.save(str(folder))
    return folder
