"""When to run a Triton kernel instead of its PyTorch reference.

Rule: Triton when every tensor is on CUDA and no gradient is being recorded (the kernels have
no backward, so training always takes the reference). Two overrides, both for tests and benches:
- `force_triton()` / KERNELS_FORCE_TRITON=1: Triton on any device. On CPU this only works under
  the interpreter, i.e. TRITON_INTERPRET=1 set before `kernels` is first imported (the
  `@triton.jit` decorator reads it once, at import).
- `use_reference()` / KERNELS_REFERENCE=1: the reference everywhere (kernel-vs-eager benches).
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch

_state = threading.local()  # per thread, so a test forcing Triton does not leak into a server thread


def _mode() -> str | None:
    mode = getattr(_state, "mode", None)
    if mode is not None:
        return mode
    if os.environ.get("KERNELS_REFERENCE") == "1":
        return "reference"
    if os.environ.get("KERNELS_FORCE_TRITON") == "1":
        return "triton"
    return None


@contextlib.contextmanager
def _set_mode(mode: str):
    previous = getattr(_state, "mode", None)
    _state.mode = mode
    try:
        yield
    finally:
        _state.mode = previous


def force_triton():
    """Run the Triton kernels whatever the device (CPU needs TRITON_INTERPRET=1, see above)."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        raise RuntimeError("force_triton() without CUDA needs TRITON_INTERPRET=1 before importing kernels")
    return _set_mode("triton")


def use_reference():
    """Run the PyTorch references even on CUDA."""
    return _set_mode("reference")


def use_triton(*tensors: torch.Tensor | None) -> bool:
    """Whether a dispatcher should launch its kernel for these operands."""
    present = [t for t in tensors if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in present):
        return False
    mode = _mode()
    if mode is not None:
        return mode == "triton"
    return all(t.is_cuda for t in present)


def dot_precision() -> str:
    """fp32 tl.dot precision that matches what the reference's torch matmul does on CUDA."""
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def block(n: int, lo: int = 16, hi: int | None = None) -> int:
    """A power-of-two block size >= n (tl.dot wants every dimension >= 16), capped at hi."""
    size = max(lo, 1 << max(0, n - 1).bit_length())
    return size if hi is None else min(size, hi)
