"""Triton kernels for the model's hot paths, each beside the PyTorch reference of the same math.

routing.py          capsule dynamic routing (encode time)
cross_attention.py  multi-view memory build (encode time) + beam-grouped attention (every step)
context_gate.py     LN_out + GRET context gate (every step)
bench.py            `python -m kernels.bench`

The model calls the dispatchers; see dispatch.py for when Triton runs.
"""
from .dispatch import force_triton, use_reference, use_triton

__all__ = ["force_triton", "use_reference", "use_triton"]
