"""Capsule dynamic routing (docs/GRET.md) over G sentences: the M encoder layers of a batch of B
sentences are routed as one group of G = B*M independent sentences.

Three exact forms of the same math, each where it is cheapest:
- `capsule_routing_reference`, factorised, the one the model trains with: the transformed inputs
  u_hat (G, K, S, d_c) are never built. The agreement b_ki = h_i . Z_k with Z_k = W_k sum_t u_k^(t),
  so each iteration is a K-query attention over h plus two per-capsule GEMMs.
- the votes form, Algorithm 1 as printed, the one the ONNX backend runs: `capsule_votes` builds
  u_hat of the real tokens (no padding) as one 2-D GEMM h @ [W_1 .. W_K] inside the exported
  encoder graph (ONNX Runtime prepacks that weight and the int8 export quantizes it, one scale
  per capsule column), and `route_votes`
  runs the r iterations over it on the host, compiled by Numba, between the encoder graph and the
  graph of the global state (export/graphs.py). Per iteration that is a softmax over S per
  capsule, a weighted sum and an agreement dot, G*K*S*d_c multiply-adds each: too few for ONNX
  Runtime's batched matmuls, which paid their fixed cost G*K times per op. The factorised form
  does S/(2r-1) times fewer multiply-adds, but as ONNX operators its per-capsule GEMMs of a few
  rows each stay fp32 and cost more than the one int8 GEMM.
- the Triton kernels, on CUDA, below.

Triton (2r launches for r iterations, all buffers in the input dtype, fp32 accumulation):
  iteration 1   masked mean          grid (G, cdiv(D, BLOCK_D))    Hb = mean of the non-pad h
                (Z = 0 makes the softmax uniform, so the logits are skipped)
  iteration >1  R1 routing attention grid (G, cdiv(K, BLOCK_K))    Hb = softmax_S(Z h^T) h
                logits by tl.dot, pads -inf, online softmax in fp32 while streaming S tiles
  every one     R2 transform+squash  grid (K, cdiv(G, BLOCK_R))    U = squash(Hb_k W_k);
                if another iteration follows, Z_k += U W_k^T instead of writing U
R2 gives each capsule k one program per block of sentences, so W_k is read G/BLOCK_R times,
not G times. The routing logits stay per sentence (never mixed across the group).
"""
from __future__ import annotations

import numba
import numpy as np
import torch
import triton
import triton.language as tl

from .dispatch import block, dot_precision, use_triton
from .online_softmax import online_softmax_update

SQUASH_EPS = 1e-8


# ---- reference (the model's own math) ---------------------------------------------------
def squash(t: torch.Tensor, eps: float = SQUASH_EPS) -> torch.Tensor:
    """Vector squash over the last axis, in fp32: |q| = n2 / (1 + n2) < 1."""
    t32 = t.float()
    n2 = (t32 * t32).sum(-1, keepdim=True)
    return (n2 / (1 + n2) * t32 / torch.sqrt(n2 + eps)).to(t.dtype)


def masked_mean(h: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    keep = (~pad).to(h.dtype)[..., None]
    return (h * keep).sum(-2) / keep.sum(-2).clamp(min=1)


def capsule_routing_reference(h: torch.Tensor, pad: torch.Tensor, w: torch.Tensor, iters: int,
                              detach: bool = False, coupling: bool = False, scale: float = 1.0):
    """h: (G, S, D), pad: (G, S) True = pad, w: (K, D, d_c). Returns capsules U: (G, K, d_c), and
    with `coupling` also the last iteration's coupling coefficients c (G, K, S) (diagnostics).
    `scale` multiplies the routing logits (a temperature; 1 is the paper's form)."""
    n_caps = w.shape[0]
    pooled = masked_mean(h, pad)[:, None, :].expand(-1, n_caps, -1)  # iteration 1: uniform c
    c = (~pad).float()[:, None, :].expand(-1, n_caps, -1) / (~pad).sum(-1).clamp(min=1)[:, None, None]
    z = None
    # Batched matmuls over sentences (g) or capsules (k), never einsum: the exported encoder runs this
    # code, and ONNX Runtime's Einsum on these small shapes was 41% of the GRET encoder at batch 1.
    for t in range(iters):
        if t > 0:
            logits = ((z @ h.transpose(1, 2)).float() * scale).masked_fill(pad[:, None, :], float("-inf"))
            c = torch.softmax(logits, -1)  # (G, K, S)
            pooled = c.to(h.dtype) @ h  # (G, K, D)
        u = squash((pooled.transpose(0, 1) @ w).transpose(0, 1))  # per capsule: (K, G, D) @ (K, D, d_c)
        if t < iters - 1:
            step = ((u.detach() if detach else u).transpose(0, 1) @ w.transpose(1, 2)).transpose(0, 1)
            z = step if z is None else z + step
    return (u, c) if coupling else u


def capsule_votes(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """u_hat with the capsules side by side, (..., K*d_c) for h (..., D): one GEMM by w as a plain
    2-D weight (D, K*d_c), which the exporter folds into one constant and the int8 quantizer takes."""
    k, d, c = w.shape  # from w, not h: the reshaped weight folds into one constant
    return h @ w.transpose(0, 1).reshape(d, k * c)


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz"})
def route_votes(votes: np.ndarray, lengths: np.ndarray, capsules: int, iters: int, scale: float) -> np.ndarray:
    """Algorithm 1 over capsule_votes' u_hat of the real tokens only (T, K*d_c), float32,
    C-contiguous: G groups one after another, group g's lengths[g] tokens (for B sentences' M
    routed layers, G = M*B, layer-major, as export/graphs.py's encoder lays them out). Returns the
    capsules U (G, K, d_c) as the reference does, up to float32 summation order (`reassoc` lets
    the dot products vectorise). The inner loops index `base + j`: the form Numba vectorises."""
    width = votes.shape[1]
    dim, temperature = width // capsules, np.float32(scale)  # float32 throughout, as the reference
    out = np.zeros((len(lengths), capsules, dim), np.float32)
    logits = np.empty((votes.shape[0], capsules), np.float32)
    coupling = np.empty((votes.shape[0], capsules), np.float32)
    top = np.empty(capsules, np.float32)
    norm = np.empty(capsules, np.float32)
    total = np.empty(width, np.float32)
    begin = 0
    for g in range(len(lengths)):
        n = lengths[g]
        x, begin = votes[begin: begin + n], begin + n
        if n == 0:  # the reference's squashed masked mean of nothing is 0
            continue
        for t in range(iters):
            if t == 0:  # all logits 0: the coupling is uniform
                logits[:n] = 0
                coupling[:n] = np.float32(1.0) / n
            else:  # c_ki = softmax over the group's tokens of scale * b_ki, per capsule
                top[:] = -np.inf
                for s in range(n):
                    for k in range(capsules):
                        top[k] = max(top[k], logits[s, k])
                norm[:] = 0
                for s in range(n):
                    for k in range(capsules):
                        e = np.exp(temperature * (logits[s, k] - top[k]))
                        coupling[s, k] = e
                        norm[k] += e
                for k in range(capsules):
                    norm[k] = 1 / norm[k]
                for s in range(n):
                    for k in range(capsules):
                        coupling[s, k] *= norm[k]
            total[:] = 0  # s_k = sum_i c_ki u_hat_k|i
            for s in range(n):
                for k in range(capsules):
                    c, base = coupling[s, k], k * dim
                    for j in range(dim):
                        total[base + j] += c * x[s, base + j]
            for k in range(capsules):  # u_k = squash(s_k)
                base, n2 = k * dim, np.float32(0)
                for j in range(dim):
                    n2 += total[base + j] * total[base + j]
                f = n2 / (1 + n2) / np.sqrt(n2 + np.float32(SQUASH_EPS))
                for j in range(dim):
                    out[g, k, j] = total[base + j] * f
            if t < iters - 1:  # b_ki += u_hat_k|i . u_k
                for s in range(n):
                    for k in range(capsules):
                        a, base = np.float32(0), k * dim
                        for j in range(dim):
                            a += x[s, base + j] * out[g, k, j]
                        logits[s, k] += a
    return out


def capsule_routing_votes(h: torch.Tensor, pad: torch.Tensor, w: torch.Tensor, iters: int,
                          scale: float = 1.0) -> torch.Tensor:
    """The votes form end to end on CPU tensors (the reference's contract): what the ONNX backend
    computes, capsule_votes of the real tokens in its graph and route_votes on the graph's output."""
    votes = capsule_votes(h[~pad], w).float().contiguous().numpy()
    return torch.from_numpy(route_votes(votes, (~pad).sum(1).numpy(), w.shape[0], iters, scale))


# ---- dispatcher ---------------------------------------------------------------------------
def capsule_routing(h: torch.Tensor, pad: torch.Tensor, w: torch.Tensor, iters: int,
                    detach: bool = False, scale: float = 1.0) -> torch.Tensor:
    """Triton on CUDA at inference, the factorised reference otherwise (`detach` only matters for
    gradients). The exported encoder does not come here: it builds capsule_votes."""
    if use_triton(h, w):
        return capsule_routing_triton(h, pad, w, iters, scale)
    return capsule_routing_reference(h, pad, w, iters, detach, scale=scale)


# ---- Triton -------------------------------------------------------------------------------
@triton.jit
def _masked_mean_kernel(h_ptr, pad_ptr, out_ptr, S, D, stride_hg, stride_hs, stride_pg, stride_og,
                        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    g = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    total = tl.zeros([BLOCK_D], tl.float32)
    count = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        keep = (offs_s < S) & (tl.load(pad_ptr + g * stride_pg + offs_s, mask=offs_s < S, other=1) == 0)
        h = tl.load(h_ptr + g * stride_hg + offs_s[:, None] * stride_hs + offs_d[None, :],
                    mask=keep[:, None] & d_ok[None, :], other=0.0)
        total += tl.sum(h.to(tl.float32), 0)
        count += keep.to(tl.float32)
    mean = total / tl.maximum(tl.sum(count, 0), 1.0)
    tl.store(out_ptr + g * stride_og + offs_d, mean.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _routing_attention_kernel(h_ptr, pad_ptr, z_ptr, out_ptr, S, D, K, SCALE,
                              stride_hg, stride_hs, stride_pg, stride_zg, stride_zk, stride_og, stride_ok,
                              BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                              PRECISION: tl.constexpr):
    """R1: Hb[g, k] = sum_s softmax_s(SCALE * Z[g, k] . h[g, s]) h[g, s], pads excluded."""
    g = tl.program_id(0)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)  # D whole: the output row block (BLOCK_K, D) lives in registers
    k_ok, d_ok = offs_k < K, offs_d < D
    z = tl.load(z_ptr + g * stride_zg + offs_k[:, None] * stride_zk + offs_d[None, :],
                mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    # Finite start for the running max: a tile of pads only gives exp(-inf - (-1e30)) = 0, not NaN.
    run_max = tl.full([BLOCK_K], -1e30, tl.float32)
    run_sum = tl.zeros([BLOCK_K], tl.float32)
    acc = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        keep = (offs_s < S) & (tl.load(pad_ptr + g * stride_pg + offs_s, mask=offs_s < S, other=1) == 0)
        h = tl.load(h_ptr + g * stride_hg + offs_s[:, None] * stride_hs + offs_d[None, :],
                    mask=keep[:, None] & d_ok[None, :], other=0.0)
        logits = tl.dot(z, tl.trans(h), input_precision=PRECISION) * SCALE  # (BLOCK_K, BLOCK_S)
        run_max, run_sum, acc = online_softmax_update(logits, keep, h, run_max, run_sum, acc, PRECISION)
    out = acc / run_sum[:, None]
    tl.store(out_ptr + g * stride_og + offs_k[:, None] * stride_ok + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=k_ok[:, None] & d_ok[None, :])


@triton.jit
def _capsule_transform_kernel(hb_ptr, w_ptr, z_ptr, u_ptr, G, D, C,
                              stride_hg, stride_hk, stride_wk, stride_wd, stride_zg, stride_zk,
                              stride_ug, stride_uk, EPS,
                              ADD_Z: tl.constexpr, WRITE_Z: tl.constexpr,
                              BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
                              PRECISION: tl.constexpr):
    """R2: U[g, k] = squash(Hb[g, k] W_k); then either Z[g, k] (+)= U W_k^T or write U."""
    k = tl.program_id(0)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.arange(0, BLOCK_C)  # d_c whole: the squash needs the full capsule vector
    r_ok, c_ok = offs_r < G, offs_c < C
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        hb = tl.load(hb_ptr + offs_r[:, None] * stride_hg + k * stride_hk + offs_d[None, :],
                     mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(w_ptr + k * stride_wk + offs_d[:, None] * stride_wd + offs_c[None, :],
                    mask=d_ok[:, None] & c_ok[None, :], other=0.0)
        acc += tl.dot(hb, w, input_precision=PRECISION)
    n2 = tl.sum(acc * acc, 1)  # padded columns are 0, so this is the norm over d_c
    u = (acc * (n2 / (1 + n2) / tl.sqrt(n2 + EPS))[:, None]).to(u_ptr.dtype.element_ty)
    if WRITE_Z:
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            d_ok = offs_d < D
            w = tl.load(w_ptr + k * stride_wk + offs_d[:, None] * stride_wd + offs_c[None, :],
                        mask=d_ok[:, None] & c_ok[None, :], other=0.0)
            step = tl.dot(u, tl.trans(w), input_precision=PRECISION)  # (BLOCK_R, BLOCK_D)
            z_at = z_ptr + offs_r[:, None] * stride_zg + k * stride_zk + offs_d[None, :]
            z_ok = r_ok[:, None] & d_ok[None, :]
            if ADD_Z:
                step += tl.load(z_at, mask=z_ok, other=0.0).to(tl.float32)
            tl.store(z_at, step.to(z_ptr.dtype.element_ty), mask=z_ok)
    else:
        tl.store(u_ptr + offs_r[:, None] * stride_ug + k * stride_uk + offs_c[None, :], u,
                 mask=r_ok[:, None] & c_ok[None, :])


def capsule_routing_triton(h: torch.Tensor, pad: torch.Tensor, w: torch.Tensor, iters: int,
                           scale: float = 1.0) -> torch.Tensor:
    """Same contract as the reference (every sentence needs at least one non-pad position)."""
    g, s, d = h.shape
    k, _, c = w.shape
    h, w = h.contiguous(), w.to(h.dtype).contiguous()
    pad = pad.contiguous().view(torch.uint8)
    precision = dot_precision()
    mean = torch.empty(g, d, dtype=h.dtype, device=h.device)
    hb = torch.empty(g, k, d, dtype=h.dtype, device=h.device)
    z = torch.empty(g, k, d, dtype=h.dtype, device=h.device)
    u = torch.empty(g, k, c, dtype=h.dtype, device=h.device)
    mean_block = block(d, hi=128)
    _masked_mean_kernel[(g, triton.cdiv(d, mean_block))](
        h, pad, mean, s, d, h.stride(0), h.stride(1), pad.stride(0), mean.stride(0),
        BLOCK_S=block(s, hi=32), BLOCK_D=mean_block)
    # R1 keeps Z, the h tile and the accumulator (each rows x D) in registers: smaller tiles and
    # more warps once D is large. Untuned guesses: compiled and timed once on an H200 (kernels/README.md), not tuned.
    wide = d > 256
    block_r, block_k, block_s = block(g, hi=64), block(k, hi=16 if wide else 32), block(s, hi=16 if wide else 32)
    for t in range(iters):
        if t > 0:
            _routing_attention_kernel[(g, triton.cdiv(k, block_k))](
                h, pad, z, hb, s, d, k, scale, h.stride(0), h.stride(1), pad.stride(0), z.stride(0), z.stride(1),
                hb.stride(0), hb.stride(1),
                BLOCK_K=block_k, BLOCK_S=block_s, BLOCK_D=block(d), PRECISION=precision,
                num_warps=8 if wide else 4)
        # iteration 1 reads the per-sentence mean for every capsule (k stride 0)
        src, stride_g, stride_k = (mean, mean.stride(0), 0) if t == 0 else (hb, hb.stride(0), hb.stride(1))
        _capsule_transform_kernel[(k, triton.cdiv(g, block_r))](
            src, w, z, u, g, d, c, stride_g, stride_k, w.stride(0), w.stride(1), z.stride(0), z.stride(1),
            u.stride(0), u.stride(1), SQUASH_EPS,
            ADD_Z=t > 0, WRITE_Z=t < iters - 1,
            BLOCK_R=block_r, BLOCK_D=block(d, hi=64), BLOCK_C=block(c), PRECISION=precision)
    return u
