"""The online-softmax update shared by the attention-shaped kernels (routing R1, grouped
cross-attention): one tile of scores folded into a running max, sum and weighted accumulator."""
import triton
import triton.language as tl


@triton.jit
def online_softmax_update(scores, keep, values, run_max, run_sum, acc, PRECISION: tl.constexpr):
    """scores (M, N) for a tile of N keys, keep (N,) which of them count, values (N, D)."""
    scores = tl.where(keep[None, :], scores, float("-inf"))
    new_max = tl.maximum(run_max, tl.max(scores, 1))
    rescale = tl.exp(run_max - new_max)
    p = tl.exp(scores - new_max[:, None])
    run_sum = run_sum * rescale + tl.sum(p, 1)
    acc = acc * rescale[:, None] + tl.dot(p.to(values.dtype), values, input_precision=PRECISION)
    return new_max, run_sum, acc
