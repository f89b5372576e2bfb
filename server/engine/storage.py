"""Two kept storages that a growing, reshaped tensor alternates between (the batch's self-attention
cache, the encoder slots): a new layout is written into the spare and the two are swapped, so a
layout never takes fresh memory once both have seen the largest (fresh memory costs a page fault
per page and its zeroing, several times the copy). The former layout stays readable until the next
one, for the caller to copy from. Both hold only finite numbers (zeros at first, then what the
layouts wrote), which the callers' masked reads of columns they never wrote rely on (0 x NaN is NaN)."""
from __future__ import annotations

import math

import torch


class TwoStorages:
    def __init__(self, device: torch.device):
        self.device = device
        self.live: torch.Tensor | None = None  # flat: what the current layout is a view of
        self.spare: torch.Tensor | None = None  # flat: the former layout's, for the next

    def next_layout(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A view of `shape` on the spare storage (replaced only when too small, so each stays at
        most the largest layout needed), which becomes the live one."""
        size = math.prod(shape)
        if self.spare is None or self.spare.numel() < size:
            self.spare = torch.zeros(size, device=self.device)
        self.live, self.spare = self.spare, self.live
        return self.live[:size].view(shape)
