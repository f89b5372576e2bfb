"""PyTorch modules used only for export: the model's encoder pass, one decoder step and, for capsule
models, the global state after routing, with flat tensor inputs and outputs in the order of
export/spec.py.

The encoder pass calls the model's own modules one by one rather than Seq2Seq.encode, which
dispatches to fused kernels whose eager code is not written for tracing; the decoder step is the
model's own Seq2Seq.step_rows (training/seq2seq/model.py explains its row layout: rows at their own
positions, grouped by sentence, each with its own cache). The parity tests in tests/test_export.py
hold the ONNX graphs to the model.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels.routing import capsule_votes
from training.seq2seq.beam import block_maxima
from training.seq2seq.model import EncoderState, Seq2Seq, row_groups

from .spec import class_name, cross_names, decoder_spec, past_names, per_sentence


class EncoderGraph(nn.Module):
    """(src_ids[, src_tags]) -> encoder_spec's outputs: src_pad, [global_state], [gate_source], cross
    K/V per decoder layer; a capsule model gives its routing's votes in place of the global state."""

    def __init__(self, model: Seq2Seq):
        super().__init__()
        self.model = model

    def forward(self, src_ids: torch.Tensor, src_tags: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        m = self.model  # Seq2Seq.encode, module by module
        pad = src_ids.eq(m.cfg.pad_id)
        views = m.encoder(m.embed_source(src_ids, src_tags), pad)
        memories = multiview_memories(m, views)
        kv = [layer.cross_attn.keys_values(memory) for layer, memory in zip(m.decoder, memories)]
        if m.cfg.capsule:  # the votes of the routed layers' real tokens, layer-major (kernels.routing.route_votes)
            h, routed_pad = m.global_state.routing_input(views, pad)
            return (*flatten_state(EncoderState(kv, pad)), capsule_votes(h[~routed_pad], m.global_state.capsule_w))
        s = gs = None
        if m.global_state is not None:
            s = m.global_state(views, pad)
            gs = m.context_gate.source_part(s) if m.context_gate is not None else None
        return flatten_state(EncoderState(kv, pad, s, gs))


class GlobalGraph(nn.Module):
    """Capsule models: the routed capsules U (M*B, K, d_c) -> global_state[, gate_source], the rest
    of GlobalState.forward after its routing."""

    def __init__(self, model: Seq2Seq):
        super().__init__()
        self.model = model

    def forward(self, capsules: torch.Tensor) -> tuple[torch.Tensor, ...]:
        m = self.model
        s = m.global_state.aggregate(m.global_state.capsule_vectors(capsules))
        return (s,) if m.context_gate is None else (s, m.context_gate.source_part(s))


class DecoderGraph(nn.Module):
    """One step over `classes` length classes of sentences: the inputs of decoder_spec (tokens,
    positions, [row_sentence], row_slot, per class its group_rows and per-sentence tensors, past
    K/V per layer), positionally in spec order ->
    log_probs (R, V), the past K/V per layer with this step's column written (present, (R, H, T, d_h)),
    the maxima of log_probs' blocks (training.seq2seq.beam.block_maxima, for the host's top-k):
    Seq2Seq.step_rows, the model's own step, in plain torch ops (kernels=False) so that tracing
    follows it."""

    def __init__(self, model: Seq2Seq, classes: int = 1):
        super().__init__()
        self.model, self.classes = model, classes
        self.input_names = decoder_spec(model.cfg, classes).input_names()

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        m = self.model
        named = dict(zip(self.input_names, inputs))
        classes = tuple(unflatten_state(m.cfg, [named[class_name(c, t.name)] for t in per_sentence(m.cfg)])
                        for c in range(self.classes))
        groups = tuple(named[class_name(c, "group_rows")] for c in range(self.classes))
        past = [tuple(named[n] for n in past_names(i)) for i in range(m.cfg.dec_layers)]
        log_probs, present = m.step_rows(named["tokens"], named["positions"], named.get("row_sentence"),
                                         groups, named["row_slot"], classes, past)
        return (log_probs, *(t for kv in present for t in kv), block_maxima(log_probs))


def multiview_memories(m: Seq2Seq, views: list[torch.Tensor]) -> list[torch.Tensor]:
    """M_i per decoder layer (docs/MODEL.md): LN_i(g_i(S) + S_N), or g_i(S) for direct replacement, or
    S_N without multi-view; from MultiViewMemory's parts, whose LayerNorms trace with static shapes."""
    mv = m.multiview
    if mv is None:
        return [views[-1]] * m.cfg.dec_layers
    stacked = torch.stack(views)
    views_i = [mv.view(i, stacked) for i in range(m.cfg.dec_layers)]
    return [mv.norms[i](g + views[-1]) for i, g in enumerate(views_i)] if mv.soft else views_i


def decoder_inputs(tokens: torch.Tensor, positions: torch.Tensor, row_sentence: torch.Tensor,
                   enc: EncoderState | tuple[EncoderState, ...], cache: list) -> dict[str, torch.Tensor]:
    """The decoder step's inputs by name (a superset of any one model's spec)."""
    return {"tokens": tokens, "positions": positions} | layout_inputs(row_sentence, enc, cache)


def layout_inputs(row_sentence: torch.Tensor, enc: EncoderState | tuple[EncoderState, ...],
                  cache: list) -> dict[str, torch.Tensor]:
    """The step's inputs other than its tokens and positions: what the rows' layout decides. A row
    whose row_sentence is -1 is an empty slot of the caller's cache: computed, in no sentence's group.
    enc: one state, or a tuple of length classes (Seq2Seq.step), for the decoder graph of as many."""
    classes = enc if isinstance(enc, tuple) else (enc,)
    sizes = [c.src_pad.shape[0] for c in classes]
    sentence, row_slot, group_rows = row_groups(row_sentence, sum(sizes))
    inputs = {"row_sentence": sentence, "row_slot": row_slot}
    for c, (state, rows) in enumerate(zip(classes, group_rows.split(sizes))):
        inputs[class_name(c, "group_rows")] = rows
        inputs |= {class_name(c, n): t for n, t in zip(state_names(state), flatten_state(state))}
    for i, (k, v) in enumerate(cache):
        inputs |= dict(zip(past_names(i), (k, v)))
    return inputs


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
