"""GRET (docs/GRET.md): capsule routing over encoder layers, attentive pooling, layer-wise GRU,
and the context gate at the output layer."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kernels.context_gate import context_gate_reference
from kernels.routing import capsule_routing, masked_mean

from .layers import FeedForward


class GlobalState(nn.Module):
    """Encoder layer states H^1..H^M -> the global representation s^M (B, D)."""

    def __init__(self, cfg):
        super().__init__()
        d, dc = cfg.d_model, cfg.capsule_dim
        self.cfg = cfg
        if cfg.capsule:
            w = torch.empty(cfg.capsules, d, dc)
            for k in range(cfg.capsules):
                nn.init.xavier_normal_(w[k])
            self.capsule_w = nn.Parameter(w)
            if cfg.pooling == "attentive":
                self.pool_query = FeedForward(dc, 4 * dc, cfg.dropout)
            self.pool_out = FeedForward(dc, cfg.d_ff, cfg.dropout, d_out=d)
            if cfg.global_zero_bias:
                for ffn in (getattr(self, "pool_query", None), self.pool_out):
                    if ffn is not None:
                        nn.init.zeros_(ffn.w1.bias)
                        nn.init.zeros_(ffn.w2.bias)
        if cfg.global_norm:
            self.vector_norm = nn.LayerNorm(d)  # every x^m
            self.state_norm = nn.LayerNorm(d)  # s^M
        if cfg.pre_norm and cfg.aggregate:
            self.layer_norm = nn.LayerNorm(d)  # routed residual streams of layers 1..M-1
        if cfg.aggregate:
            self.gru = nn.GRUCell(d, d)
            for weight in (self.gru.weight_ih, self.gru.weight_hh):
                for block in weight.split(d):
                    nn.init.orthogonal_(block)
            nn.init.zeros_(self.gru.bias_ih)
            nn.init.zeros_(self.gru.bias_hh)


    def pool(self, u: torch.Tensor) -> torch.Tensor:
        """ATP (eqs. 7-9): query from the mean capsule, unscaled attention over K, FFN_o."""
        if self.cfg.pooling == "mean":
            return self.pool_out(u.mean(1))
        query = self.pool_query(u.mean(1))
        a = torch.softmax((u @ query[:, :, None]).squeeze(2), -1)  # (B, K): matmuls, not einsum (kernels.routing)
        return self.pool_out((a[:, None] @ u).squeeze(1))

    def routed_views(self, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """The encoder layers that are routed, each as the routing reads it."""
        if not self.cfg.aggregate:
            return views[-1:]
        if self.cfg.pre_norm:  # the last view is already the encoder's final-LN output
            return [self.layer_norm(v) for v in views[:-1]] + views[-1:]
        return views

    def routing_input(self, views: list[torch.Tensor], pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed layers of B sentences as M*B sentences (routing is independent per layer),
        layer-major, and their padding."""
        return torch.cat(self.routed_views(views)), pad.repeat(self.cfg.routed_layers, 1)

    def capsule_vectors(self, u: torch.Tensor) -> list[torch.Tensor]:
        """x^m for the routed layers from their capsules U (M*B, K, d_c)."""
        xs = list(self.pool(u).chunk(self.cfg.routed_layers))  # chunk, not a reshape: the traced graph keeps B dynamic
        return self.normed(xs)

    def normed(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self.vector_norm(x) for x in xs] if self.cfg.global_norm else xs

    def aggregate(self, xs: list[torch.Tensor]) -> torch.Tensor:
        """s^M from the layer vectors x^1..x^M: the layer-wise GRU, or the last one alone."""
        if self.cfg.aggregate:
            s = torch.zeros_like(xs[0])
            for x in xs:
                s = self.gru(x, s)
        else:
            s = xs[-1]
        s = self.state_norm(s) if self.cfg.global_norm else s
        return F.dropout(s, self.cfg.global_dropout, self.training)

    def forward(self, views: list[torch.Tensor], pad: torch.Tensor) -> torch.Tensor:
        if not self.cfg.capsule:
            return self.aggregate(self.normed([masked_mean(v, pad) for v in self.routed_views(views)]))
        h, routed_pad = self.routing_input(views, pad)
        u = capsule_routing(h, routed_pad, self.capsule_w, self.cfg.routing_iters, self.cfg.routing_detach,
                            self.cfg.routing_logit_scale)
        return self.aggregate(self.capsule_vectors(u))


class ContextGate(nn.Module):
    """r_bar = r + sigmoid(W_gr r + W_gs s + b_g) * s (the paper's eqs. 12-13 as fixed in docs/GRET.md)."""

    def __init__(self, cfg):
        super().__init__()
        self.w_r = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.w_s = nn.Linear(cfg.d_model, cfg.d_model)
        nn.init.constant_(self.w_s.bias, cfg.gate_bias_init)

    def source_part(self, s: torch.Tensor) -> torch.Tensor:
        """Gs = W_gs s + b_g: once per sentence, cached for every decode step."""
        return self.w_s(s)

    def forward(self, r: torch.Tensor, s: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
        """r: (B, beam, T, D); s, gs: (B, D) read by every beam of the sentence."""
        return context_gate_reference(r, self.w_r.weight, s, gs)
