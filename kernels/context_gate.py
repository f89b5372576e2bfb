"""GRET's output layer (docs/GRET.md), run at every decode step:

    r     = LN_out(x)                         x: the last decoder layer's output, one row per beam
    g     = sigmoid(r W_gr^T + Gs[sent])      Gs = W_gs s^M + b_g, cached once per sentence
    r_bar = r + g * s^M[sent]                 sent = row // (beam * T)

Reference: `gated_output_reference` (what `Seq2Seq.output` computes, via `context_gate_reference`,
which `ContextGate.forward` also uses). Triton: one kernel, grid (cdiv(rows, BLOCK_R),
cdiv(D, BLOCK_N)). The prologue computes each row's LayerNorm mean/variance; the K-loop
normalises x on the fly into the tl.dot against W_gr^T; the epilogue adds Gs[sent], applies the
sigmoid, recomputes r for its column block and writes r + g * s^M[sent]. s^M and Gs are read
per sentence (row // group), never tiled per beam. It is not fused into the vocabulary GEMM:
every vocabulary tile would redo the D x D gate GEMM.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dispatch import block, dot_precision, use_triton

LayerNormParams = tuple[torch.Tensor, torch.Tensor, float]  # (gamma, beta, eps)


# ---- reference (the model's own math) ---------------------------------------------------
def gate_values(r: torch.Tensor, w_r: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """g = sigmoid(r W_gr^T + Gs), with Gs already shaped to broadcast against r."""
    return torch.sigmoid(F.linear(r, w_r) + gs)


def context_gate_reference(r: torch.Tensor, w_r: torch.Tensor, s: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """r: (B, beam, T, D) normalised states; s, gs: (B, D) read by every beam of a sentence."""
    return r + gate_values(r, w_r, gs[:, None, None]) * s[:, None, None]


def gated_output_reference(h: torch.Tensor, w_r: torch.Tensor, s: torch.Tensor, gs: torch.Tensor, beam: int,
                           norm: LayerNormParams | None = None) -> torch.Tensor:
    """h: (R, T, D) with R = B*beam; norm None for post-norm models (no final LayerNorm)."""
    r = h if norm is None else F.layer_norm(h, h.shape[-1:], *norm)
    return context_gate_reference(r.unflatten(0, (-1, beam)), w_r, s, gs).flatten(0, 1)


# ---- dispatcher ---------------------------------------------------------------------------
def gated_output(h: torch.Tensor, w_r: torch.Tensor, s: torch.Tensor, gs: torch.Tensor, beam: int,
                 norm: LayerNormParams | None = None) -> torch.Tensor:
    """r_bar (R, T, D): Triton on CUDA at inference, the reference otherwise."""
    params = () if norm is None else norm[:2]
    if use_triton(h, w_r, s, gs, *params):
        return gated_output_triton(h, w_r, s, gs, beam, norm)
    return gated_output_reference(h, w_r, s, gs, beam, norm)


# ---- Triton -------------------------------------------------------------------------------
@triton.jit
def _context_gate_kernel(x_ptr, gamma_ptr, beta_ptr, w_ptr, gs_ptr, s_ptr, out_ptr,
                         ROWS, D, GROUP, EPS, stride_x, stride_w, stride_gs, stride_s, stride_o,
                         HAS_NORM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok, n_ok = offs_r < ROWS, offs_n < D
    mean = tl.zeros([BLOCK_R], tl.float32)
    rstd = tl.full([BLOCK_R], 1.0, tl.float32)
    if HAS_NORM:  # two passes like LayerNorm itself: mean, then the centred variance
        total = tl.zeros([BLOCK_R], tl.float32)
        for k0 in range(0, D, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_r[:, None] * stride_x + offs_k[None, :],
                        mask=r_ok[:, None] & (offs_k < D)[None, :], other=0.0)
            total += tl.sum(x.to(tl.float32), 1)
        mean = total / D
        sq = tl.zeros([BLOCK_R], tl.float32)
        for k0 in range(0, D, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            ok = r_ok[:, None] & (offs_k < D)[None, :]
            x = tl.load(x_ptr + offs_r[:, None] * stride_x + offs_k[None, :], mask=ok, other=0.0)
            centred = tl.where(ok, x.to(tl.float32) - mean[:, None], 0.0)
            sq += tl.sum(centred * centred, 1)
        rstd = 1.0 / tl.sqrt(sq / D + EPS)
    acc = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < D
        x = tl.load(x_ptr + offs_r[:, None] * stride_x + offs_k[None, :],
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        r = x.to(tl.float32)
        if HAS_NORM:
            gamma = tl.load(gamma_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            beta = tl.load(beta_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            r = (r - mean[:, None]) * rstd[:, None] * gamma[None, :] + beta[None, :]
        # W_gr is an nn.Linear weight (out, in): this tile is W_gr^T[k, n] = W_gr[n, k]
        w_t = tl.load(w_ptr + offs_n[None, :] * stride_w + offs_k[:, None],
                      mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.dot(r.to(w_t.dtype), w_t, input_precision=PRECISION)
    sent = offs_r // GROUP
    ok = r_ok[:, None] & n_ok[None, :]
    gs = tl.load(gs_ptr + sent[:, None] * stride_gs + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + sent[:, None] * stride_s + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
    gate = 1.0 / (1.0 + tl.exp(-(acc + gs)))
    r = tl.load(x_ptr + offs_r[:, None] * stride_x + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_NORM:
        gamma = tl.load(gamma_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        r = (r - mean[:, None]) * rstd[:, None] * gamma[None, :] + beta[None, :]
    out = r + gate * s
    tl.store(out_ptr + offs_r[:, None] * stride_o + offs_n[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


def gated_output_triton(h: torch.Tensor, w_r: torch.Tensor, s: torch.Tensor, gs: torch.Tensor, beam: int,
                        norm: LayerNormParams | None = None) -> torch.Tensor:
    n_rows, t, d = h.shape
    x = h.reshape(-1, d).contiguous()
    w_r, s, gs = w_r.to(x.dtype).contiguous(), s.contiguous(), gs.contiguous()
    gamma, beta, eps = norm if norm is not None else (x, x, 0.0)  # placeholders, unused without HAS_NORM
    out = torch.empty_like(x)
    rows = x.shape[0]
    block_r, block_n = block(rows, hi=32), block(d, hi=64)
    _context_gate_kernel[(triton.cdiv(rows, block_r), triton.cdiv(d, block_n))](
        x, gamma, beta, w_r, gs, s, out, rows, d, beam * t, eps,
        x.stride(0), w_r.stride(0), gs.stride(0), s.stride(0), out.stride(0),
        HAS_NORM=norm is not None, BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_K=block(d, hi=64),
        PRECISION=dot_precision())
    return out.view(n_rows, t, d)
