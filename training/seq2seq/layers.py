"""Transformer building blocks: attention (with beam-grouped cross-attention), FFN, layers."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cross_attention import grouped_attention_reference, grouped_cross_attention

KV = tuple[torch.Tensor, torch.Tensor]  # (K, V), each (B, H, S, d_h)


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, inner: int | None = None):
        super().__init__()
        inner = inner or d_model
        self.n_heads, self.d_head, self.dropout = n_heads, inner // n_heads, dropout
        self.q = nn.Linear(d_model, inner)
        self.k = nn.Linear(d_model, inner)
        self.v = nn.Linear(d_model, inner)
        self.o = nn.Linear(inner, d_model)

    def split(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, H*d) -> (B, H, T, d)
        return x.unflatten(-1, (self.n_heads, self.d_head)).transpose(1, 2)

    def keys_values(self, memory: torch.Tensor) -> KV:
        return self.split(self.k(memory)), self.split(self.v(memory))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_pad: torch.Tensor | None = None,
               causal: bool = False, beam: int = 1, kernel: bool = False) -> torch.Tensor:
        """q: (R, H, T, d) projected queries. With beam > 1, K/V hold one entry per sentence and
        row r reads sentence r // beam: the beams are folded into the query axis, never tiled.
        kernel=True (the decoder's cross-attention) goes through the dispatcher: the Triton kernel
        on CUDA at decode time, the same reference math otherwise."""
        dropout_p = self.dropout if self.training else 0.0
        if causal:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
        else:
            attention = grouped_cross_attention if kernel else grouped_attention_reference
            out = attention(q, k, v, key_pad, beam, dropout_p)
        return self.o(out.transpose(1, 2).flatten(2))

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None,
                key_pad: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        k, v = self.keys_values(x if memory is None else memory)
        return self.attend(self.split(self.q(x)), k, v, key_pad, causal)

    # ---- one decoder step for rows at their own positions (continuous batching) ---------------
    def one_position(self, x: torch.Tensor) -> torch.Tensor:
        """(R, H*d) -> (R, H, 1, d) for a single position: a reshape, where split() is a transpose."""
        return x.view(x.shape[0], self.n_heads, 1, self.d_head)

    def step_self(self, x: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor, past_pad: torch.Tensor
                  ) -> tuple[torch.Tensor, KV]:
        """Self-attention of one new position per row x (R, D) over the row's cached keys (R, H, T, d)
        (columns where past_pad (R, T) is True are not the row's) plus itself. Returns (R, D) and
        the new position's K/V (R, H, 1, d), never the grown cache: appending would copy it all."""
        k, v = self.one_position(self.k(x)), self.one_position(self.v(x))
        q = self.one_position(self.q(x)) * self.d_head ** -0.5
        past = (q @ past_k.transpose(-1, -2)).masked_fill(past_pad[:, None, None, :], float("-inf"))  # (R, H, 1, T)
        weights = torch.cat([past, (q * k).sum(-1, keepdim=True)], -1).softmax(-1)
        out = weights[..., :-1] @ past_v + weights[..., -1:] * v
        return self.o(out.flatten(1)), (k, v)

    def step_cross(self, x: torch.Tensor, memory: KV, src_pad: torch.Tensor, group_rows: torch.Tensor,
                   row_slot: torch.Tensor, kernel: bool = False) -> torch.Tensor:
        """Cross-attention of rows x (R, D) over per-sentence K/V (B, H, S, d), grouped by sentence
        (row_groups): queries (R, D) -> groups (B, W, D) (slot R is a zero query: padding) ->
        attention per sentence, reading its K/V once -> back to rows (R, D). Copying K/V per row
        instead would move rows x source x D floats per layer and step; the gather moves R x D.
        kernel=True: the Triton kernel on CUDA (the W slots of a group are its `beam`)."""
        q = self.q(x)
        q = torch.cat([q, torch.zeros_like(q[:1])]).index_select(0, group_rows.flatten())
        q = self.split(q.view(group_rows.shape[0], group_rows.shape[1], -1))  # (B, H, W, d)
        if kernel:
            out = grouped_cross_attention(q.transpose(1, 2).flatten(0, 1)[:, :, None], *memory, src_pad,
                                          group_rows.shape[1])
            out = out.flatten(1)  # (B * W, D)
        else:  # spelled out: scaled_dot_product_attention's exported form scales and transposes all of K
            scores = (q * self.d_head ** -0.5) @ memory[0].transpose(-1, -2)
            out = scores.masked_fill(src_pad[:, None, None, :], float("-inf")).softmax(-1) @ memory[1]
            out = out.transpose(1, 2).flatten(2).flatten(0, 1)  # (B * W, D)
        return self.o(out.index_select(0, row_slot))


class FeedForward(nn.Module):
    """W2 ReLU(W1 x); `dropout` acts on the hidden activations (0 in Transformer layers, where
    it would cost more time than it gives: the residual dropout regularises them)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, d_out: int | None = None):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff)
        self.w2 = nn.Linear(d_ff, d_out or d_model)
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.drop(F.relu(self.w1(x))))


class Residual(nn.Module):
    """x + f(LN(x)) (pre-norm) or LN(x + f(x)) (post-norm), with dropout on f's output."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.drop = nn.Dropout(dropout)
        self.pre_norm = pre_norm

    def forward(self, x: torch.Tensor, f) -> torch.Tensor:
        if self.pre_norm:
            return x + self.drop(f(self.norm(x)))
        return self.norm(x + self.drop(f(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attn_dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff)
        self.res_attn = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)
        self.res_ffn = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        x = self.res_attn(x, lambda h: self.self_attn(h, key_pad=pad))
        return self.res_ffn(x, self.ffn)


class TransformerEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.enc_layers))
        self.norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> list[torch.Tensor]:
        """Returns the views S_1..S_M: each layer's output; the last is what the decoder sees."""
        views = []
        for layer in self.layers:
            x = layer(x, pad)
            views.append(x)
        views[-1] = self.norm(x)
        return views


class DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attn_dropout)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attn_dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff)
        self.res_self = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)
        self.res_cross = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)
        self.res_ffn = Residual(cfg.d_model, cfg.dropout, cfg.pre_norm)

    def forward(self, x: torch.Tensor, memory: KV, src_pad: torch.Tensor) -> torch.Tensor:
        """Teacher-forced over all T positions (causal); step() is the one-position form."""
        x = self.res_self(x, lambda h: self.self_attn(h, causal=h.shape[1] > 1))
        x = self.res_cross(x, lambda h: self.cross_attn.attend(
            self.cross_attn.split(self.cross_attn.q(h)), *memory, key_pad=src_pad, kernel=True))
        return self.res_ffn(x, self.ffn)

    def step(self, x: torch.Tensor, memory: KV, src_pad: torch.Tensor, groups: tuple[torch.Tensor, torch.Tensor],
             past: KV, past_pad: torch.Tensor, kernel: bool = False) -> tuple[torch.Tensor, KV]:
        """The inference form of forward(): one new position per row x (R, D), each row at its own
        position with its own cache (past K/V (R, H, T, d), past_pad), rows grouped by sentence
        (groups = (group_rows, row_slot)) for the cross-attention. Returns (R, D) and the new
        position's K/V. Training's search, the export and the serving engine all run this."""
        new = []

        def self_attention(h):
            out, kv = self.self_attn.step_self(h, *past, past_pad)
            new.append(kv)
            return out

        x = self.res_self(x, self_attention)
        x = self.res_cross(x, lambda h: self.cross_attn.step_cross(h, memory, src_pad, *groups, kernel))
        return self.res_ffn(x, self.ffn), new[0]
