"""Opt-in GRET diagnostics for a finished text, from the model's own PyTorch modules.

  gate               per output piece: the mean over dimensions of the context gate
                     g_t = sigmoid(W_gr r_t + W_gs s + b_g) (docs/GRET.md): how much of the global
                     sentence state the output layer let in for that piece
  routing_agreement  mean over routed encoder layers and capsules of the largest coupling
                     coefficient c_ki of the last routing iteration: 1 = each capsule routes
                     from one source piece, 1/S = uniform over the source

They are computed after decoding by a teacher-forced pass over the chosen output (so they cost
nothing unless asked for, on any backend), which needs the model's checkpoint."""
from __future__ import annotations

import torch

from kernels.context_gate import gate_values
from kernels.routing import capsule_routing_reference
from training.seq2seq.model import Seq2Seq


@torch.no_grad()
def gret_diagnostics(model: Seq2Seq, src: list[int], tokens: list[int],
                     tags: list[int] | None = None) -> tuple[list[float], float]:
    cfg = model.cfg
    src_t = torch.tensor([src])
    tag_t = None if tags is None else torch.tensor([tags])
    pad = src_t.eq(cfg.pad_id)
    views = model.encoder(model.embed_source(src_t, tag_t), pad)
    enc = model.encode(src_t, tag_t)
    gate = []
    if model.context_gate is not None:
        x = model.embed_tokens(torch.tensor([[cfg.bos_id] + tokens]))
        for layer, memory in zip(model.decoder, enc.memory):
            x = layer(x, memory, enc.src_pad)
        r = model.dec_norm(x[0, : len(tokens)])
        g = gate_values(r, model.context_gate.w_r.weight, enc.gate_source)
        gate = g.mean(-1).tolist()
    agreement = 0.0
    if cfg.capsule:
        h, routed_pad = model.global_state.routing_input(views, pad)
        _, c = capsule_routing_reference(h, routed_pad, model.global_state.capsule_w, cfg.routing_iters,
                                         coupling=True, scale=cfg.routing_logit_scale)
        agreement = float(c.max(-1).values.mean())
    return gate, agreement

