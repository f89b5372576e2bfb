"""Transformer building blocks: attention (with beam-grouped cross-attention), FFN, layers."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cross_attention import grouped_attention_reference, grouped_cross_attention

KV = tuple[torch.Tensor, torch.Tensor]  # (K, V), each (B, H, S, d_h)


def absent(g):
    """An optional ONNX input left out (its name empty)."""
    from torch.onnx._internal.torchscript_exporter.symbolic_helper import _optional_input_placeholder_tensor

    return _optional_input_placeholder_tensor(g)


class CachedSelfAttention(torch.autograd.Function):
    """One position per row attending to its own cache, the cache written in place (step_self).

    qkv (R, 3D): the new position's query, key and value side by side. Eager: the K/V scatter into
    column lengths[r], then attention masked past that column. Exported: ONNX Runtime's
    GroupQueryAttention (com.microsoft; K/V heads = query heads) on them packed, which does the same
    when its past and present K/V are one buffer (export.onnx_runtime binds them so) and reads only
    each row's own columns: a step's attention costs what the rows hold, not the cache's width."""

    @staticmethod
    def forward(ctx, qkv, past_k, past_v, lengths, n_heads: int):
        q, k, v = qkv.chunk(3, -1)
        rows, d_head = torch.arange(q.shape[0], device=q.device), q.shape[1] // n_heads
        past_k[rows, :, lengths] = k.view(-1, n_heads, d_head)
        past_v[rows, :, lengths] = v.view(-1, n_heads, d_head)
        columns = int(lengths.max()) + 1 if len(lengths) else 0  # the longest row's: the rest no row reads
        keys, values = past_k[:, :, :columns], past_v[:, :, :columns]
        q = q.view(-1, n_heads, 1, d_head) * d_head ** -0.5
        later = torch.arange(columns, device=q.device) > lengths[:, None]  # (R, columns): not the row's yet
        weights = (q @ keys.transpose(-1, -2)).masked_fill(later[:, None, None, :], float("-inf")).softmax(-1)
        return (weights @ values).flatten(1), past_k.detach(), past_v.detach()  # the cache itself, updated

    @staticmethod
    def symbolic(g, qkv, past_k, past_v, lengths, n_heads: int):
        int32, axis = 6, g.op("Constant", value_t=torch.tensor([1]))  # 6: onnx.TensorProto.INT32
        total = g.op("Add", g.op("ReduceMax", lengths, keepdims_i=0), g.op("Constant", value_t=torch.tensor(1)))
        out, present_k, present_v = g.op("com.microsoft::GroupQueryAttention",
                                         g.op("Unsqueeze", qkv, axis), absent(g), absent(g),  # packed: (R, 1, 3D)
                                         past_k, past_v, g.op("Cast", lengths, to_i=int32),
                                         g.op("Cast", total, to_i=int32),
                                         num_heads_i=n_heads, kv_num_heads_i=n_heads, outputs=3)
        return g.op("Squeeze", out, axis), present_k, present_v


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
        return x.view(x.shape[0], x.shape[1], self.n_heads, self.d_head).transpose(1, 2)

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
        out = out.transpose(1, 2)
        return self.o(out.reshape(out.shape[0], out.shape[1], -1))

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None,
                key_pad: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        k, v = self.keys_values(x if memory is None else memory)
        return self.attend(self.split(self.q(x)), k, v, key_pad, causal)

    def packed_self(self, x: torch.Tensor, packing: Packing) -> torch.Tensor:
        """Self-attention of a packed batch's tokens x (N, D) -> (N, D): the projections run on the
        tokens, the attention on the padded layout (Packing). Three projections, each unpacked on
        its own: one by the weights side by side would need its output split, which ONNX Runtime
        copies (measured: as long as the projection itself); the int8 graph quantizes x once for
        all three anyway."""
        q, k, v = (self.split(packing.unpack(f(x))) for f in (self.q, self.k, self.v))
        dropout_p = self.dropout if self.training else 0.0
        out = grouped_attention_reference(q, k, v, packing.pad, 1, dropout_p)
        return self.o(packing.pack(out.transpose(1, 2)).flatten(1))  # (N, H, d) -> (N, H * d)

    # ---- one decoder step for rows at their own positions (continuous batching) ---------------
    def one_position(self, x: torch.Tensor) -> torch.Tensor:
        """(R, H*d) -> (R, H, 1, d) for a single position: a reshape, where split() is a transpose."""
        return x.view(x.shape[0], self.n_heads, 1, self.d_head)

    def step_self(self, x: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor, lengths: torch.Tensor
                  ) -> tuple[torch.Tensor, KV]:
        """Self-attention of one new position per row x (R, D) over the row's cache (R, H, T, d):
        the new position's K/V are written into the cache in place, at column lengths[r] (the keys
        the row holds), and the row attends to columns 0..lengths[r]. Returns (R, D) and the cache
        (the same memory; traced, the graph's present K/V). Writing in place, never growing the
        cache, is what lets a served step cost the same at any width."""
        # One projection by the three weights side by side: exported, they fold into one initializer
        # and the int8 step quantizes x once, not three times (eager, it costs what three Linears do).
        qkv = F.linear(x, torch.cat([self.q.weight, self.k.weight, self.v.weight]),
                       torch.cat([self.q.bias, self.k.bias, self.v.bias]))
        out, present_k, present_v = CachedSelfAttention.apply(qkv, past_k, past_v, lengths,
                                                              self.n_heads)
        return self.o(out), (present_k, present_v)

    def step_cross(self, x: torch.Tensor, memories: list[KV], src_pads: list[torch.Tensor],
                   group_rows: tuple[torch.Tensor, ...], row_slot: torch.Tensor, kernel: bool = False) -> torch.Tensor:
        """Cross-attention of rows x (R, D) over per-sentence K/V (B, H, S, d), grouped by sentence
        (row_groups): queries (R, D) -> per head (R + 1, H, d), row R a zero query (padding) ->
        groups (B, W, H, d), one gather -> attention per sentence, reading its K/V once -> back to
        rows (R, D). Copying K/V per row instead would move rows x source x D floats per layer and
        step; the gather moves R x D. The sentences come in length classes (memories, src_pads and
        group_rows: one each), each padded to its own longest source and attended on its own, their
        groups one class after another (row_slot indexes them so): one width for all would read
        the columns of the longest source for every sentence. Every reshape is to a fixed shape
        (-1 and constants), so the exported step computes no shapes at run time: a one-text step is
        mostly such fixed costs. kernel=True: the Triton kernel on CUDA (the W slots of a group are
        its `beam`)."""
        q = F.pad(self.q(x).view(-1, self.n_heads, self.d_head), (0, 0, 0, 0, 0, 1))  # (R + 1, H, d)
        outs = [self._grouped(q[rows], memory, pad, kernel) for memory, pad, rows in zip(memories, src_pads, group_rows)
                if not kernel or len(rows)]  # (the kernel launches no empty grid)
        out = torch.cat(outs) if len(outs) > 1 else outs[0]
        return self.o(out.index_select(0, row_slot))

    def _grouped(self, q: torch.Tensor, memory: KV, src_pad: torch.Tensor, kernel: bool) -> torch.Tensor:
        """Groups' queries (B, W, H, d) over their sentences' K/V (B, H, S, d) -> (B * W, H * d)."""
        if kernel:
            out = grouped_cross_attention(q.flatten(0, 1)[:, :, None], *memory, src_pad, q.shape[1])
        else:  # spelled out: scaled_dot_product_attention's exported form scales and transposes all of K
            scores = (q.transpose(1, 2) * self.d_head ** -0.5) @ memory[0].transpose(-1, -2)
            out = scores.masked_fill(src_pad[:, None, None, :], float("-inf")).softmax(-1) @ memory[1]
            out = out.transpose(1, 2)  # (B, W, H, d)
        return out.reshape(-1, self.n_heads * self.d_head)


class Packing:
    """The real tokens of a padded batch (pad: (B, S), True = padding) as rows (N, ...).

    The encoder runs its position-wise work (LayerNorms, projections, FFNs) on these N rows and
    reads them in the padded layout (B, S, ...) for attention alone. A batch of unequal sentences
    is largely padding, whose outputs nothing reads (docs/MODEL.md, Base Transformer). Index ops
    only, so the exported graph packs too."""

    def __init__(self, pad: torch.Tensor):
        self.pad, self.keep = pad, ~pad
        keep = self.keep.flatten()
        # each slot's row; padding reads row 0, whose copy every reader of padding masks
        counts = keep.long().cumsum(0)  # (ONNX has no CumSum of booleans)
        self.slots = torch.where(keep, counts - 1, 0).view_as(pad)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, ...) -> (N, ...), in the batch's order."""
        return x[self.keep]

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(N, D) -> (B, S, D); padding holds row 0's values (masked wherever padding is read)."""
        return x[self.slots]  # one gather by (B, S) indices: no reshape to trace


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

    def forward(self, x: torch.Tensor, packing: Packing) -> torch.Tensor:
        """x: the batch's tokens (N, D), packed (Packing)."""
        x = self.res_attn(x, lambda h: self.self_attn.packed_self(h, packing))
        return self.res_ffn(x, self.ffn)


class TransformerEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.enc_layers))
        self.norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> list[torch.Tensor]:
        """Returns the views S_1..S_M (B, S, D): each layer's output (padding: Packing.unpack); the
        last is what the decoder sees. The layers see the real tokens only (Packing)."""
        packing = Packing(pad)
        x, views = packing.pack(x), []
        for layer in self.layers:
            x = layer(x, packing)
            views.append(x)
        views[-1] = self.norm(x)
        return [packing.unpack(v) for v in views]


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

    def step(self, x: torch.Tensor, memories: list[KV], src_pads: list[torch.Tensor],
             groups: tuple[tuple[torch.Tensor, ...], torch.Tensor], past: KV, lengths: torch.Tensor,
             kernel: bool = False) -> tuple[torch.Tensor, KV]:
        """The inference form of forward(): one new position per row x (R, D), each row at its own
        position lengths[r] with its own cache (past K/V (R, H, T, d), written in place: step_self),
        rows grouped by sentence (groups = (group_rows per length class, row_slot)) for the
        cross-attention over each class's K/V (memories) and padding (src_pads). Returns (R, D) and
        the cache. Training's search, the export and the serving engine all run this."""
        present = []

        def self_attention(h):
            out, kv = self.self_attn.step_self(h, *past, lengths)
            present.append(kv)
            return out

        x = self.res_self(x, self_attention)
        x = self.res_cross(x, lambda h: self.cross_attn.step_cross(h, memories, src_pads, *groups, kernel))
        return self.res_ffn(x, self.ffn), present[0]
