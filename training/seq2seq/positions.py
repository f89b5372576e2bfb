"""Sinusoidal positions and mvPE (docs/MODEL.md): position p is encoded as PE(p*k)."""
from __future__ import annotations

import torch


def sinusoid_table(n_positions: int, dim: int, k: float = 1.0) -> torch.Tensor:
    """(n_positions, dim) table; mvPE(p,2i) = sin(p*k*w_i), mvPE(p,2i+1) = cos(p*k*w_i)."""
    pos = torch.arange(n_positions, dtype=torch.float64)[:, None] * k
    omega = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    table = torch.zeros(n_positions, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * omega)
    table[:, 1::2] = torch.cos(pos * omega[: dim // 2])
    return table.float()


def mvpe_objective(ks: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """Eq. 8's objective for each k: sum over 1<=i<j<L of ||PE(ik) - PE(jk)||."""
    omega = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    # The distance depends only on d = j - i, which occurs (L - 1 - d) times among 1..L-1.
    d = torch.arange(1, length - 1, dtype=torch.float64)
    count = (length - 1) - d
    # ||PE(a) - PE(b)||^2 = sum_w 2 - 2 cos((a-b) w) over the sin/cos pairs.
    phase = ks.to(torch.float64)[:, None, None] * d[None, :, None] * omega[None, None, :]
    return (torch.sqrt((2 - 2 * torch.cos(phase)).sum(-1)) * count).sum(-1)


def choose_mvpe_k(dim: int, length: int = 100, k_max: int = 3000, fraction: float = 0.99) -> int:
    """The smallest k whose objective reaches `fraction` of the max over k in [1, k_max]."""
    ks = torch.arange(1, k_max + 1)
    objective = mvpe_objective(ks, dim, length)
    return int(ks[objective >= fraction * objective.max()][0])
