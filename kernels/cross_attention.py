"""Cross-attention memory: built once per sentence, read by every beam at every step.

(a) Memory build (docs/MODEL.md), once per source batch, for every decoder layer i:
        M_i = LN_i(g_i(S) + S_N)   (soft integration)   or   M_i = g_i(S)   (replacement, vanilla)
        K_i, V_i = heads(M_i W_K^i + b_K^i), heads(M_i W_V^i + b_V^i)          (B, H, S, d_h)
    g_i(S) is a pick among `sources` (the encoder views for GCA/GPA/FGA; FMA/AMA's mixtures are
    computed by the model beforehand). Triton: one launch for all decoder layers, grid
    (N_dec, cdiv(B*S, BLOCK_M), cdiv(2*inner, BLOCK_N)); add and LayerNorm are applied on the fly
    in the K-loop of the GEMM against [W_K | W_V], and the epilogue writes K_i and V_i straight
    into the (B, H, S, d_h) layout the attention kernel reads - one copy per sentence, no beam.

(b) Beam-grouped attention, every decode step and layer: K/V hold one entry per sentence
    (B, H, S, d) and query row r reads sentence r // beam. Triton: grid (B, H); a program loads
    the beam*T query rows of its sentence and streams K/V tiles once with an online softmax,
    key padding masked, so K/V bytes per step scale with sentences, not beams.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dispatch import block, dot_precision, use_triton
from .online_softmax import online_softmax_update

KV = tuple[torch.Tensor, torch.Tensor]
LayerNormParams = tuple[torch.Tensor, torch.Tensor, float]  # (gamma, beta, eps)
Projection = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # (W_K, b_K, W_V, b_V)
MAX_QUERY_ROWS = 64  # beam * T above this (teacher forcing, encoder self-attention) keeps the reference


# ---- (a) memory build: reference -----------------------------------------------------------
def memories_reference(sources: torch.Tensor, index: list[int], last: torch.Tensor | None,
                       norms: list[LayerNormParams] | None) -> list[torch.Tensor]:
    """M_i per decoder layer i. sources: (V, B, S, D); layer i reads sources[index[i]]; with
    `norms` (soft integration) M_i = LN_i(g_i + last), else M_i = g_i."""
    if norms is None:
        return [sources[j] for j in index]
    return [F.layer_norm(sources[j] + last, last.shape[-1:], *norm) for j, norm in zip(index, norms)]


def memory_kv_reference(sources: torch.Tensor, index: list[int], last: torch.Tensor | None,
                        norms: list[LayerNormParams] | None, projections: list[Projection],
                        n_heads: int) -> list[KV]:
    def heads(x):  # (B, S, H*d) -> (B, H, S, d)
        return x.unflatten(-1, (n_heads, -1)).transpose(1, 2)

    return [(heads(F.linear(m, wk, bk)), heads(F.linear(m, wv, bv)))
            for m, (wk, bk, wv, bv) in zip(memories_reference(sources, index, last, norms), projections)]


# ---- (a) memory build: dispatcher ------------------------------------------------------------
def memory_kv(sources: torch.Tensor, index: list[int], last: torch.Tensor | None,
              norms: list[LayerNormParams] | None, projections: list[Projection], n_heads: int) -> list[KV]:
    """Per decoder layer (K_i, V_i), each (B, H, S, d_h): Triton on CUDA at inference."""
    params = [p for proj in projections for p in proj] + [p for n in norms or () for p in n[:2]]
    if use_triton(sources, last, *params):
        return memory_kv_triton(sources, index, last, norms, projections, n_heads)
    return memory_kv_reference(sources, index, last, norms, projections, n_heads)


# ---- (a) memory build: Triton ----------------------------------------------------------------
@triton.jit
def _memory_tile(src, last_ptr, offs_m, offs_k, ok, stride_src_r, stride_last_r):
    """The fp32 tile g_i(S) + S_N of soft integration (rows offs_m, columns offs_k)."""
    x = tl.load(src + offs_m[:, None] * stride_src_r + offs_k[None, :], mask=ok, other=0.0).to(tl.float32)
    return x + tl.load(last_ptr + offs_m[:, None] * stride_last_r + offs_k[None, :], mask=ok, other=0.0)


@triton.jit
def _memory_kv_kernel(src_ptr, index_ptr, last_ptr, gamma_ptr, beta_ptr, w_ptr, bias_ptr, out_ptr,
                      ROWS, S, D, INNER, DH, EPS,
                      stride_src_v, stride_src_r, stride_last_r, stride_w_l, stride_w_n, stride_b_l,
                      stride_o_l, stride_o_kv, stride_o_b, stride_o_h, stride_o_s,
                      SOFT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PRECISION: tl.constexpr):
    layer = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # flattened (sentence, position)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)  # column of [K | V]
    m_ok, n_ok = offs_m < ROWS, offs_n < 2 * INNER
    src = src_ptr + tl.load(index_ptr + layer).to(tl.int64) * stride_src_v
    mean = tl.zeros([BLOCK_M], tl.float32)
    rstd = tl.full([BLOCK_M], 1.0, tl.float32)
    if SOFT:  # LayerNorm statistics of g_i + S_N, two passes
        total = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, D, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            ok = m_ok[:, None] & (offs_k < D)[None, :]
            x = _memory_tile(src, last_ptr, offs_m, offs_k, ok, stride_src_r, stride_last_r)
            total += tl.sum(x, 1)
        mean = total / D
        sq = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, D, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            ok = m_ok[:, None] & (offs_k < D)[None, :]
            x = _memory_tile(src, last_ptr, offs_m, offs_k, ok, stride_src_r, stride_last_r)
            centred = tl.where(ok, x - mean[:, None], 0.0)
            sq += tl.sum(centred * centred, 1)
        rstd = 1.0 / tl.sqrt(sq / D + EPS)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_layer = w_ptr + layer * stride_w_l
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < D
        ok = m_ok[:, None] & k_ok[None, :]
        if SOFT:
            x = _memory_tile(src, last_ptr, offs_m, offs_k, ok, stride_src_r, stride_last_r)
            gamma = tl.load(gamma_ptr + layer * D + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            beta = tl.load(beta_ptr + layer * D + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            x = (x - mean[:, None]) * rstd[:, None] * gamma[None, :] + beta[None, :]
        else:  # direct replacement: g_i(S) as it is
            x = tl.load(src + offs_m[:, None] * stride_src_r + offs_k[None, :], mask=ok, other=0.0)
        w_t = tl.load(w_layer + offs_n[None, :] * stride_w_n + offs_k[:, None],  # [W_K; W_V]^T tile
                      mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.dot(x.to(w_t.dtype), w_t, input_precision=PRECISION)
    acc += tl.load(bias_ptr + layer * stride_b_l + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    # scatter column n to K (n < INNER) or V, head (n % INNER) // DH, lane n % DH
    which, col = offs_n // INNER, offs_n % INNER
    head, lane = col // DH, col % DH
    sent, pos = offs_m // S, offs_m % S
    out = (out_ptr + layer * stride_o_l + which[None, :] * stride_o_kv + sent[:, None] * stride_o_b
           + head[None, :] * stride_o_h + pos[:, None] * stride_o_s + lane[None, :])
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


_stacks: OrderedDict[tuple[int, ...], tuple] = OrderedDict()
_stacks_lock = threading.Lock()


def _stacked_projections(projections: list[Projection]) -> tuple[torch.Tensor, torch.Tensor]:
    """([W_K; W_V] per layer (N_dec, 2*inner, D), [b_K; b_V] (N_dec, 2*inner)), memoised while the
    weights are unchanged, so serving stacks them once rather than at every encode. An entry keeps
    its source tensors alive, so their ids cannot be reused; `_version` catches in-place updates."""
    params = [p for proj in projections for p in proj]
    key, versions = tuple(id(p) for p in params), tuple(p._version for p in params)
    with _stacks_lock:
        hit = _stacks.get(key)
        if hit is None or hit[1] != versions:
            w = torch.stack([torch.cat([wk, wv]) for wk, _, wv, _ in projections]).detach()
            bias = torch.stack([torch.cat([bk, bv]) for _, bk, _, bv in projections]).detach()
            hit = _stacks[key] = (params, versions, w, bias)
            while len(_stacks) > 8:
                _stacks.popitem(last=False)
        _stacks.move_to_end(key)
        return hit[2], hit[3]


def memory_kv_triton(sources: torch.Tensor, index: list[int], last: torch.Tensor | None,
                     norms: list[LayerNormParams] | None, projections: list[Projection], n_heads: int) -> list[KV]:
    n_src, b, s, d = sources.shape
    n_dec, inner = len(index), projections[0][0].shape[0]
    dh = inner // n_heads
    src = sources.reshape(n_src, b * s, d).contiguous()
    w, bias = _stacked_projections(projections)
    w = w.to(src.dtype)
    soft = norms is not None
    if soft:
        last2 = last.reshape(b * s, d).contiguous()
        gamma, beta = torch.stack([n[0] for n in norms]), torch.stack([n[1] for n in norms])  # small: N_dec x D
        eps = norms[0][2]
    else:
        last2, gamma, beta, eps = src, bias, bias, 0.0  # placeholders, unused without SOFT
    out = torch.empty(n_dec, 2, b, n_heads, s, dh, dtype=src.dtype, device=src.device)
    rows = b * s
    block_m, block_n, block_k = block(rows, hi=64), block(2 * inner, hi=64), block(d, hi=64)
    index_t = torch.tensor(index, dtype=torch.int32, device=src.device)
    _memory_kv_kernel[(n_dec, triton.cdiv(rows, block_m), triton.cdiv(2 * inner, block_n))](
        src, index_t, last2, gamma, beta, w, bias, out, rows, s, d, inner, dh, eps,
        src.stride(0), src.stride(1), last2.stride(0), w.stride(0), w.stride(1), bias.stride(0),
        out.stride(0), out.stride(1), out.stride(2), out.stride(3), out.stride(4),
        SOFT=soft, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=dot_precision())
    return [(out[i, 0], out[i, 1]) for i in range(n_dec)]


# ---- (b) beam-grouped attention: reference ----------------------------------------------------
def grouped_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_pad: torch.Tensor | None,
                                beam: int = 1, dropout_p: float = 0.0) -> torch.Tensor:
    """q: (R, H, T, d) with R = B*beam; k, v: (B, H, S, d); key_pad: (B, S) True = pad.
    The beams are folded into the query axis, never tiled. Returns (R, H, T, d)."""
    rows, _, t, _ = q.shape
    if beam > 1:
        q = q.unflatten(0, (rows // beam, beam)).transpose(1, 2).flatten(2, 3)  # (B, H, beam*T, d)
    mask = None if key_pad is None else ~key_pad[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    if beam > 1:
        out = out.unflatten(2, (beam, t)).transpose(1, 2).flatten(0, 1)
    return out


# ---- (b) beam-grouped attention: dispatcher ---------------------------------------------------
def grouped_cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_pad: torch.Tensor | None,
                            beam: int = 1, dropout_p: float = 0.0) -> torch.Tensor:
    """Triton on CUDA at decode time (beam * T <= MAX_QUERY_ROWS, no dropout), else the reference."""
    small = beam * q.shape[2] <= MAX_QUERY_ROWS and dropout_p == 0.0
    if small and use_triton(q, k, v):
        return grouped_attention_triton(q, k, v, key_pad, beam)
    return grouped_attention_reference(q, k, v, key_pad, beam, dropout_p)


# ---- (b) beam-grouped attention: Triton -------------------------------------------------------
@triton.jit
def _grouped_attention_kernel(q_ptr, k_ptr, v_ptr, pad_ptr, o_ptr, S, T, QROWS, BEAM, DH, SCALE,
                              sq_r, sq_h, sq_t, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sp_b, so_r, so_h, so_t,
                              HAS_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr,
                              BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    i = tl.arange(0, BLOCK_Q)  # query i of the sentence = beam i // T, position i % T
    offs_d = tl.arange(0, BLOCK_D)
    i_ok, d_ok = i < QROWS, offs_d < DH
    row, t = b * BEAM + i // T, i % T
    q = tl.load(q_ptr + row[:, None] * sq_r + h * sq_h + t[:, None] * sq_t + offs_d[None, :],
                mask=i_ok[:, None] & d_ok[None, :], other=0.0)
    run_max = tl.full([BLOCK_Q], -1e30, tl.float32)  # finite: an all-pad tile adds exactly 0
    run_sum = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        keep = offs_s < S
        if HAS_PAD:
            keep = keep & (tl.load(pad_ptr + b * sp_b + offs_s, mask=offs_s < S, other=1) == 0)
        kv_ok = keep[:, None] & d_ok[None, :]
        kt = tl.load(k_ptr + b * sk_b + h * sk_h + offs_s[:, None] * sk_s + offs_d[None, :], mask=kv_ok, other=0.0)
        vt = tl.load(v_ptr + b * sv_b + h * sv_h + offs_s[:, None] * sv_s + offs_d[None, :], mask=kv_ok, other=0.0)
        scores = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * SCALE
        run_max, run_sum, acc = online_softmax_update(scores, keep, vt, run_max, run_sum, acc, PRECISION)
    out = acc / run_sum[:, None]
    tl.store(o_ptr + row[:, None] * so_r + h * so_h + t[:, None] * so_t + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=i_ok[:, None] & d_ok[None, :])


def grouped_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_pad: torch.Tensor | None,
                             beam: int = 1) -> torch.Tensor:
    rows, n_heads, t, dh = q.shape
    b, _, s, _ = k.shape
    # the kernel assumes unit stride on the head dimension only
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty(rows, n_heads, t, dh, dtype=q.dtype, device=q.device)
    pad = key_pad.contiguous().view(torch.uint8) if key_pad is not None else q  # placeholder when absent
    _grouped_attention_kernel[(b, n_heads)](
        q, k, v, pad, out, s, t, beam * t, beam, dh, 1.0 / math.sqrt(dh),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), pad.stride(0), out.stride(0), out.stride(1), out.stride(2),
        HAS_PAD=key_pad is not None, BLOCK_Q=block(beam * t), BLOCK_S=block(s, hi=64), BLOCK_D=block(dh),
        PRECISION=dot_precision())
    return out
