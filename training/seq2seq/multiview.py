"""Layer-wise multi-view decoding (docs/MODEL.md): decoder layer i cross-attends to
M_i = LN_i(g_i(S) + S_N) (soft integration) or M_i = g_i(S) (direct replacement)."""
from __future__ import annotations

import math

import torch
from torch import nn

from kernels.cross_attention import memories_reference


def _round(x: float) -> int:
    return int(math.floor(x + 0.5))


def view_index(strategy: str, i: int, n_enc: int, n_dec: int) -> int:
    """The encoder layer j (1-based) that decoder layer i (1-based) reads for GCA/GPA/FGA."""
    frac = (i - 1) * (n_enc - 1) / (n_dec - 1) if n_dec > 1 else 0.0
    if strategy == "gca":
        return n_enc - _round(frac)
    if strategy == "gpa":
        return 1 + _round(frac)
    if strategy == "fga":
        return 1
    raise ValueError(f"{strategy} does not pick a single view")


class MultiViewMemory(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.strategy, self.soft = cfg.multiview, cfg.multiview_soft
        n_enc, n_dec, d = cfg.enc_layers, cfg.dec_layers, cfg.d_model
        self.n_enc, self.n_dec = n_enc, n_dec
        if self.soft:
            self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_dec))
        if self.strategy == "fma":  # zero-init: M_i = LN_i(S_N) at the start of continued learning
            self.fma_w = nn.Parameter(torch.zeros(n_dec, n_enc, d, d))
            self.fma_b = nn.Parameter(torch.zeros(n_dec, n_enc, d))
        if self.strategy == "ama":  # zero-init: a uniform average at the start
            self.ama_v = nn.Parameter(torch.zeros(n_dec, n_enc, d))

    def view(self, i: int, stacked: torch.Tensor) -> torch.Tensor:
        """g_i(S) for decoder layer i (0-based); stacked: (N_e, B, S, D)."""
        if self.strategy == "fma":
            return torch.einsum("jbsd,jed->bse", stacked, self.fma_w[i]) + self.fma_b[i].sum(0)
        if self.strategy == "ama":  # alpha depends on the source only, so K/V stay cacheable
            scores = torch.einsum("jbsd,jd->jbs", stacked, self.ama_v[i]) / math.sqrt(stacked.shape[-1])
            return (torch.softmax(scores, 0)[..., None] * stacked).sum(0)
        return stacked[view_index(self.strategy, i + 1, self.n_enc, self.n_dec) - 1]

    def sources(self, views: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        """(candidates (V, B, S, D), index): decoder layer i reads g_i(S) = candidates[index[i]].
        GCA/GPA/FGA pick a view; FMA/AMA's mixtures are computed here, one per layer."""
        stacked = torch.stack(views)
        if self.strategy in ("fma", "ama"):
            return torch.stack([self.view(i, stacked) for i in range(self.n_dec)]), list(range(self.n_dec))
        return stacked, [view_index(self.strategy, i + 1, self.n_enc, self.n_dec) - 1 for i in range(self.n_dec)]

    def norm_params(self) -> list[tuple[torch.Tensor, torch.Tensor, float]] | None:
        """LN_i's (gamma, beta, eps) for soft integration; None for direct replacement."""
        return [(n.weight, n.bias, n.eps) for n in self.norms] if self.soft else None

    def forward(self, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """M_i per decoder layer (the model itself goes through kernels.cross_attention.memory_kv,
        which fuses this with the K/V projections)."""
        sources, index = self.sources(views)
        return memories_reference(sources, index, views[-1], self.norm_params())
