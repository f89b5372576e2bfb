"""PyTorch modules used only for export: the model's encoder pass and one decoder step, with flat
tensor inputs and outputs in the order of export/spec.py. They call the model's own modules one
by one rather than Seq2Seq.encode / decode_step, which take the step as a Python int and may
dispatch to fused kernels whose eager code is not written for tracing; the parity tests in
tests/test_export.py hold the two forms together.

The decoder step is written for continuous batching: rows may belong to sentences that joined
the batch at different steps and use different beam sizes.
- `row_sentence` (R,): row r reads the per-sentence tensors of sentence row_sentence[r] (this
  generalises `row // beam`). The encoder output stays one entry per sentence between steps; the
  price is paid inside each step, which gathers the cross-attention K/V into per-row copies
  (index_select): per step N_dec * 2 * R * S * D floats written and read back by the attention,
  where a beam-grouped kernel reads B * S * D per layer and tensor. Example, the small preset
  (N_dec 3, D 256) with R = 128 rows and S = 30: 23.6 MB written per step.
- `positions` (R,): each row's own target position.
- `past_pad` (R, past_len): True where a row's self-attention cache is padding. A row that joined
  late has a shorter history; its cache is left-padded to the batch's past length.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from training.layers import DecoderLayer
from training.model import EncoderState, Seq2Seq


class EncoderGraph(nn.Module):
    """(src_ids[, src_tags]) -> src_pad, [global_state], [gate_source], cross K/V per decoder layer."""

    def __init__(self, model: Seq2Seq):
        super().__init__()
        self.model = model

    def forward(self, src_ids: torch.Tensor, src_tags: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        m = self.model  # Seq2Seq.encode, module by module
        pad = src_ids.eq(m.cfg.pad_id)
        views = m.encoder(m.embed_source(src_ids, src_tags), pad)
        memories = multiview_memories(m, views)
        kv = [layer.cross_attn.keys_values(memory) for layer, memory in zip(m.decoder, memories)]
        s = gs = None
        if m.global_state is not None:
            s = m.global_state(views, pad)
            gs = m.context_gate.source_part(s) if m.context_gate is not None else None
        return flatten_state(EncoderState(kv, pad, s, gs))


class DecoderGraph(nn.Module):
    """One step: (tokens, positions, row_sentence, past_pad, per-sentence tensors, past K/V per
    layer) -> log_probs (R, V), present K/V per layer (R, H, past_len + 1, d_h). Also the PyTorch
    backend of the server, run eagerly."""

    def __init__(self, model: Seq2Seq):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, row_sentence: torch.Tensor,
                past_pad: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        m = self.model
        n_layers = m.cfg.dec_layers
        enc = unflatten_state(m.cfg, tensors[: -2 * n_layers])
        past = tensors[-2 * n_layers:]
        rows = enc.select(row_sentence)  # per-sentence -> per-row, so beam = 1 from here on
        # One transposed copy of the tied embedding serves both the lookup and the output
        # projection; Seq2Seq.output's F.linear would leave a second (V, D) copy in the file.
        table = m.embed.weight.t()  # (D, V)
        position = m.positions.index_select(0, positions)[:, None]  # (R, 1, D)
        x = table.index_select(1, tokens).t()[:, None] * math.sqrt(m.cfg.d_model) + position  # (R, 1, D)
        self_pad = torch.cat([past_pad, torch.zeros_like(tokens, dtype=torch.bool)[:, None]], 1)  # new key: never padding
        present = []
        for i, (layer, memory) in enumerate(zip(m.decoder, rows.memory)):
            x, (k, v) = layer_step(layer, x, memory, rows.src_pad, past[2 * i], past[2 * i + 1], self_pad)
            present += [k, v]
        r = m.dec_norm(x[:, 0])  # Seq2Seq.output with beam = 1, on per-row GRET tensors
        if rows.global_state is not None and m.context_gate is not None:
            r = m.context_gate(r[:, None, None], rows.global_state, rows.gate_source)[:, 0, 0]
        elif rows.global_state is not None:
            r = r + rows.global_state
        log_probs = torch.log_softmax((r @ table).float(), -1)
        return (log_probs, *present)


def multiview_memories(m: Seq2Seq, views: list[torch.Tensor]) -> list[torch.Tensor]:
    """M_i per decoder layer (SPEC §2): LN_i(g_i(S) + S_N), or g_i(S) for direct replacement, or
    S_N without multi-view; from MultiViewMemory's parts, whose LayerNorms trace with static shapes."""
    mv = m.multiview
    if mv is None:
        return [views[-1]] * m.cfg.dec_layers
    stacked = torch.stack(views)
    views_i = [mv.view(i, stacked) for i in range(m.cfg.dec_layers)]
    return [mv.norms[i](g + views[-1]) for i, g in enumerate(views_i)] if mv.soft else views_i


def layer_step(layer: DecoderLayer, x: torch.Tensor, memory, key_pad: torch.Tensor, past_k: torch.Tensor,
               past_v: torch.Tensor, self_pad: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """DecoderLayer.forward for one new position with a cache, stated again from the layer's own
    parts: forward() derives its causal flag from a shape, which the tracer turns into a tensor.
    The parity tests hold the two together."""
    present = []

    def self_attention(h):
        k, v = layer.self_attn.keys_values(h)
        present.extend([torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)])
        return layer.self_attn.attend(layer.self_attn.split(layer.self_attn.q(h)), *present, key_pad=self_pad)

    def cross_attention(h):
        return layer.cross_attn.attend(layer.cross_attn.split(layer.cross_attn.q(h)), *memory, key_pad=key_pad)

    x = layer.res_self(x, self_attention)
    x = layer.res_cross(x, cross_attention)
    return layer.res_ffn(x, layer.ffn), (present[0], present[1])


def flatten_state(enc: EncoderState) -> tuple[torch.Tensor, ...]:
    """EncoderState -> tensors in spec order (src_pad, [global_state], [gate_source], K0, V0, K1...)."""
    out = [enc.src_pad]
    out += [t for t in (enc.global_state, enc.gate_source) if t is not None]
    for k, v in enc.memory:
        out += [k, v]
    return tuple(out)


def unflatten_state(cfg, tensors) -> EncoderState:
    """The inverse of flatten_state, given which optional tensors the config has."""
    tensors = list(tensors)
    src_pad = tensors.pop(0)
    global_state = tensors.pop(0) if cfg.gret else None
    gate_source = tensors.pop(0) if cfg.gate else None
    if len(tensors) != 2 * cfg.dec_layers:
        raise ValueError(f"expected {2 * cfg.dec_layers} cross-attention tensors, got {len(tensors)}")
    memory = [(tensors[2 * i], tensors[2 * i + 1]) for i in range(cfg.dec_layers)]
    return EncoderState(memory, src_pad, global_state, gate_source)
