"""Graph-Transformer encoder (docs/MODEL.md): each layer attends within and across the previous (A)
and incremental (N) representations and fuses the subgraph groups."""
from __future__ import annotations

import math

import torch
from torch import nn

from .layers import FeedForward, MultiHeadAttention


class GraphLayer(nn.Module):
    def __init__(self, cfg, first: bool):
        super().__init__()
        d, h = cfg.d_model, cfg.n_heads
        inner = d // 2 if cfg.graph_half_dim else d
        self.first, self.fusion, self.shared = first, cfg.graph_fusion, cfg.graph_shared_qkv
        self.norm_a, self.norm_n, self.norm_f = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.high = MultiHeadAttention(d, h, cfg.attn_dropout, inner)  # q=N, kv=N
        if not first:
            self.mid_na = MultiHeadAttention(d, h, cfg.attn_dropout, inner)  # q=N, kv=A
            self.mid_an = MultiHeadAttention(d, h, cfg.attn_dropout, inner)  # q=A, kv=N
            if self.shared:  # one Q/K/V set per representation kind: 6 projections, not 9
                del self.mid_na.q, self.mid_an.k, self.mid_an.v  # read N's from `high`
        if self.fusion == "weight_gate" and cfg.graph_gate_proj:
            self.gate = nn.Linear(2 * d, d)
        self.ffn = FeedForward(d, cfg.d_ff)
        self.drop = nn.Dropout(cfg.dropout)

    def fuse(self, groups: list[torch.Tensor], low: torch.Tensor) -> torch.Tensor:
        new = sum(groups)
        if self.fusion == "sum":
            return new + low
        if self.fusion == "weight_gate":
            w = torch.sigmoid(self.gate(torch.cat([new, low], -1)) if hasattr(self, "gate") else new + low)
            return new * w + low * (1 - w)
        # self-gate (eq. 7): parameter-free attention across the 4 group vectors of each token
        r = torch.stack(groups + [torch.zeros_like(low)] * (3 - len(groups)) + [low], -2)  # (B,S,4,D)
        weights = torch.softmax(r @ r.transpose(-1, -2) / math.sqrt(r.shape[-1]), -1) / 4
        return (weights @ r).sum(-2)

    def forward(self, a: torch.Tensor, n: torch.Tensor, pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n_hat = self.norm_n(n)
        q_n, kv_n = self.high.split(self.high.q(n_hat)), self.high.keys_values(n_hat)
        groups = [self.high.attend(q_n, *kv_n, key_pad=pad)]
        if not self.first:
            a_hat = self.norm_a(a)
            q_na = q_n if self.shared else self.mid_na.split(self.mid_na.q(n_hat))
            kv_an = kv_n if self.shared else self.mid_an.keys_values(n_hat)
            groups += [self.mid_na.attend(q_na, *self.mid_na.keys_values(a_hat), key_pad=pad),
                       self.mid_an.attend(self.mid_an.split(self.mid_an.q(a_hat)), *kv_an, key_pad=pad)]
        groups = [self.drop(g) for g in groups]
        low = a + n
        full = self.fuse(groups, low)
        full = full + self.drop(self.ffn(self.norm_f(full)))
        return low, full - low


class GraphEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList(GraphLayer(cfg, first=i == 0) for i in range(cfg.enc_layers))
        self.norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> list[torch.Tensor]:
        """Views: the full representation A + N after each layer; the last is LN_final(A + N)."""
        a, n = torch.zeros_like(x), x
        views = []
        for layer in self.layers:
            a, n = layer(a, n, pad)
            views.append(a + n)
        views[-1] = self.norm(views[-1])
        return views
