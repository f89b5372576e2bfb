"""PyTorch modules used only for export: the model's encoder pass and one decoder step, with flat
tensor inputs and outputs in the order of export/spec.py. They call the model's own modules one
by one rather than Seq2Seq.encode / decode_step, which take the step as a Python int and may
dispatch to fused kernels whose eager code is not written for tracing; the parity tests in
tests/test_export.py hold the two forms together.

The decoder step is written for continuous batching: rows may belong to sentences that joined
the batch at different steps and use different beam sizes.
- `row_sentence` (R,): row r belongs to sentence row_sentence[r] (this generalises `row // beam`);
  the small per-sentence tensors (src_pad, GRET's s^M and Gs) are gathered per row with it.
- `group_rows` (B, W) and `row_slot` (R,): the beam-grouped layout of the rows (row_groups()).
  Cross-attention never copies a sentence's K/V per row: the queries are gathered into one group
  per sentence (B, H, W, d_h), attend to that sentence's K/V once, and go back to their rows.
  Copying K/V per row instead would write N_dec * 2 * R * S * D floats per step (23.6 MB for the
  small preset with R = 128 rows and S = 30); the query gather moves R * D.
- `positions` (R,): each row's own target position.
- `past_pad` (R, past_len): True where a column of a row's self-attention cache is not its own.
  Rows of different ages share one past length; the columns may sit anywhere (the server keeps
  each row's t-th key in column t). Only the step's new key/value is returned, never the grown cache.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels.context_gate import gated_output
from kernels.cross_attention import grouped_cross_attention as grouped_cross_attention_kernel
from training.seq2seq.layers import DecoderLayer
from training.seq2seq.model import EncoderState, Seq2Seq

from .spec import cross_names, decoder_spec, encoder_spec, past_names


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
    """One step: the inputs of decoder_spec (tokens, positions, [row_sentence], row_slot, group_rows,
    past_pad, the per-sentence tensors, past K/V per layer), positionally in spec order ->
    log_probs (R, V), this step's K/V per layer (R, H, 1, d_h). Also the PyTorch backend
    of the server, run eagerly (decoder_inputs() builds the inputs for both); there `kernels=True`
    routes the cross-attention and the context gate through kernels' dispatchers (Triton on CUDA),
    which tracing cannot follow."""

    def __init__(self, model: Seq2Seq, kernels: bool = False):
        super().__init__()
        self.model, self.kernels = model, kernels
        self.input_names = decoder_spec(model.cfg).input_names()

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        m = self.model
        named = dict(zip(self.input_names, inputs))
        enc = unflatten_state(m.cfg, [named[t.name] for t in encoder_spec(m.cfg).outputs])
        past = [named[n] for i in range(m.cfg.dec_layers) for n in past_names(i)]
        tokens, positions, past_pad = named["tokens"], named["positions"], named["past_pad"]
        row_sentence = named.get("row_sentence")
        per_row = lambda t: None if t is None else t.index_select(0, row_sentence)  # noqa: E731
        global_state, gate_source = per_row(enc.global_state), per_row(enc.gate_source)  # GRET's s^M, Gs
        # The lookup gathers rows of the (V, D) table; the output projection multiplies by its
        # transpose, which export folds into a second (D, V) constant (gathering columns of one
        # transposed copy cost ONNX Runtime as much as all the LayerNorms of a step).
        position = m.positions.index_select(0, positions)[:, None]  # (R, 1, D)
        x = m.embed.weight.index_select(0, tokens)[:, None] * math.sqrt(m.cfg.d_model) + position  # (R, 1, D)
        new = []
        groups = (named["group_rows"], named["row_slot"])
        for i, (layer, memory) in enumerate(zip(m.decoder, enc.memory)):
            x, (k, v) = layer_step(layer, x, memory, enc.src_pad, groups, past[2 * i], past[2 * i + 1], past_pad,
                                   self.kernels)
            new += [k, v]
        # Seq2Seq.output with beam = 1, on per-row GRET tensors
        if m.context_gate is not None and self.kernels:  # LN_out + gate as one kernel on CUDA
            norm = m.dec_norm
            params = (norm.weight, norm.bias, norm.eps) if isinstance(norm, nn.LayerNorm) else None
            r = gated_output(x, m.context_gate.w_r.weight, global_state, gate_source, 1, params)[:, 0]
        else:
            r = m.dec_norm(x[:, 0])
            if m.context_gate is not None:
                r = m.context_gate(r[:, None, None], global_state, gate_source)[:, 0, 0]
            elif global_state is not None:
                r = r + global_state
        log_probs = torch.log_softmax((r @ m.embed.weight.t()).float(), -1)
        return (log_probs, *new)


def multiview_memories(m: Seq2Seq, views: list[torch.Tensor]) -> list[torch.Tensor]:
    """M_i per decoder layer (docs/MODEL.md): LN_i(g_i(S) + S_N), or g_i(S) for direct replacement, or
    S_N without multi-view; from MultiViewMemory's parts, whose LayerNorms trace with static shapes."""
    mv = m.multiview
    if mv is None:
        return [views[-1]] * m.cfg.dec_layers
    stacked = torch.stack(views)
    views_i = [mv.view(i, stacked) for i in range(m.cfg.dec_layers)]
    return [mv.norms[i](g + views[-1]) for i, g in enumerate(views_i)] if mv.soft else views_i


def layer_step(layer: DecoderLayer, x: torch.Tensor, memory, src_pad: torch.Tensor, groups, past_k: torch.Tensor,
               past_v: torch.Tensor, past_pad: torch.Tensor, kernels: bool = False
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """DecoderLayer.forward for one new position with a cache, stated again from the layer's own
    parts: forward() derives its causal flag from a shape, which the tracer turns into a tensor.
    Returns the new position's K/V, not the grown cache. The parity tests hold the two together."""
    new = []

    def self_attention(h):
        a, x = layer.self_attn, h[:, 0]
        k, v = one_position(a, a.k(x)), one_position(a, a.v(x))
        new.extend([k, v])
        return a.o(attention_with_new(one_position(a, a.q(x)), past_k, past_v, ~past_pad[:, None, None, :],
                                      k, v).flatten(1))[:, None]

    def cross_attention(h):
        return grouped_cross_attention(layer.cross_attn, h, memory, src_pad, *groups, kernels)

    x = layer.res_self(x, self_attention)
    x = layer.res_cross(x, cross_attention)
    return layer.res_ffn(x, layer.ffn), (new[0], new[1])


def grouped_cross_attention(attn, h: torch.Tensor, memory, src_pad: torch.Tensor, group_rows: torch.Tensor,
                            row_slot: torch.Tensor, kernels: bool = False) -> torch.Tensor:
    """MultiHeadAttention.attend over per-sentence K/V (B, H, S, d_h) for rows h (R, 1, D) grouped
    by sentence: queries (R, D) -> groups (B, W, D) (slot R is a zero query: padding) -> attention
    per sentence -> back to rows (R, 1, D)."""
    q = attn.q(h[:, 0])
    q = torch.cat([q, torch.zeros_like(q[:1])]).index_select(0, group_rows.flatten())
    q = attn.split(q.view(group_rows.shape[0], group_rows.shape[1], -1))  # (B, H, W, d_h)
    if kernels:  # the W slots of a group are the dispatcher's `beam`: Triton on CUDA reads K/V once
        width = group_rows.shape[1]
        out = grouped_cross_attention_kernel(q.transpose(1, 2).flatten(0, 1)[:, :, None], *memory, src_pad, width)
        out = out.flatten(1)  # (B * W, D)
    else:
        out = attention(q, *memory, ~src_pad[:, None, None, :])
        out = out.transpose(1, 2).flatten(2).flatten(0, 1)  # (B * W, D)
    return attn.o(out.index_select(0, row_slot))[:, None]


def one_position(attn, x: torch.Tensor) -> torch.Tensor:
    """(R, H*d) -> (R, H, 1, d) for a single position: a reshape, where split() is a transpose."""
    return x.view(x.shape[0], attn.n_heads, 1, attn.d_head)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v, keys where `keep` is False masked; keep broadcasts to the scores.
    Spelled out instead of scaled_dot_product_attention, whose exported form scales and transposes
    all of K at every step (a copy of the whole cache); here ONNX Runtime folds the transpose into
    the MatMul and only q is scaled."""
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)
    return scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v


def attention_with_new(q: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor, keep: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """attention() over the past keys (masked where `keep` is False) and one new key (R, H, 1, d_h),
    without concatenating it to the past: appending would copy the whole cache at every step."""
    q = q * q.shape[-1] ** -0.5
    past = (q @ past_k.transpose(-1, -2)).masked_fill(~keep, float("-inf"))  # (R, H, 1, T)
    weights = torch.cat([past, (q * k).sum(-1, keepdim=True)], -1).softmax(-1)
    return weights[..., :-1] @ past_v + weights[..., -1:] * v


def decoder_inputs(tokens: torch.Tensor, positions: torch.Tensor, row_sentence: torch.Tensor, past_pad: torch.Tensor,
                   enc: EncoderState, cache: list) -> dict[str, torch.Tensor]:
    """The decoder step's inputs by name (a superset of any one model's spec). A row whose
    row_sentence is -1 is an empty slot of the caller's cache: computed, in no sentence's group."""
    row_slot, group_rows = row_groups(row_sentence, enc.src_pad.shape[0])
    inputs = {"tokens": tokens, "positions": positions, "row_sentence": row_sentence.clamp(min=0),
              "row_slot": row_slot, "group_rows": group_rows, "past_pad": past_pad}
    inputs |= dict(zip(state_names(enc), flatten_state(enc)))
    for i, (k, v) in enumerate(cache):
        inputs |= dict(zip(past_names(i), (k, v)))
    return inputs


def row_groups(row_sentence: torch.Tensor, n_sentences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_slot (R,), group_rows (B, W)) for rows in any order: row r is slot w of its sentence's
    group (its w-th row), row_slot[r] = sentence * W + w, group_rows[b, w] = that row, or R where
    sentence b has fewer than W rows. Rows of sentence -1 join no group (row_slot 0)."""
    rows = row_sentence.shape[0]
    live = (row_sentence >= 0).nonzero()[:, 0]
    sentence = row_sentence.index_select(0, live)
    counts = torch.bincount(sentence, minlength=n_sentences)
    width = max(1, int(counts.max())) if len(live) else 1
    order = torch.sort(sentence, stable=True).indices
    first = torch.cumsum(counts, 0) - counts
    within = torch.empty_like(sentence)
    within[order] = torch.arange(len(live)) - first[sentence[order]]
    row_slot = torch.zeros(rows, dtype=torch.long)
    row_slot[live] = sentence * width + within
    group_rows = torch.full((n_sentences * width,), rows, dtype=torch.long)
    group_rows[sentence * width + within] = live
    return row_slot, group_rows.view(n_sentences, width)


def flatten_state(enc: EncoderState) -> tuple[torch.Tensor, ...]:
    """EncoderState -> tensors in spec order (src_pad, [global_state], [gate_source], K0, V0, K1...)."""
    out = [enc.src_pad]
    out += [t for t in (enc.global_state, enc.gate_source) if t is not None]
    for k, v in enc.memory:
        out += [k, v]
    return tuple(out)


def state_names(enc: EncoderState) -> list[str]:
    """The spec names of flatten_state(enc), in its order."""
    names = ["src_pad"] + [n for n, t in (("global_state", enc.global_state), ("gate_source", enc.gate_source))
                           if t is not None]
    return names + [n for i in range(len(enc.memory)) for n in cross_names(i)]


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
