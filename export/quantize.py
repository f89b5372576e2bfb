"""--quantize int8: dynamic quantization of the MatMul weights (ONNX Runtime's quantize_dynamic).

Weights become int8 with one scale per output column (per_channel), activations are quantized
per call at run time. The quantizer rewrites Gemm (a Linear on 2-D input, e.g. GRET's GRU cell)
as MatMul + Add and quantizes those too, and the capsule projection is one 2-D weight (the
exported encoder builds the routing's votes, kernels/routing.py). LayerNorm, softmax, attention
scores and the embedding lookup stay fp32.

Where the checkpoint names its target pieces (training.target_pieces), the int8 decoders' output
layer keeps only their columns (trim_output): the step's log-probabilities and block maxima are
over those pieces, in their order, and the runtime maps a column back to its piece
(export.onnx_runtime.OnnxModel). Its quality is checked with the int8 graphs' own (verify_build).

The int8 graphs sit beside the fp32 ones in the same repository (encoder.int8.onnx,
decoder.int8.onnx, global.int8.onnx; model.json lists them under onnx.precisions), so one
repository serves both and the fp32 reference is always there to compare against.
"""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from training.seq2seq.beam import TOP_K_BLOCK

QUANTIZATIONS = ("int8",)


def quantized_name(path: Path, precision: str) -> Path:
    return path.with_name(f"{path.stem}.{precision}{path.suffix}")


def pretranspose_gemm_weights(model: onnx.ModelProto) -> None:
    """Gemm(A, B, transB=1) -> Gemm(A, B^T, transB=0), one B^T per initializer. The quantizer's own
    Gemm -> MatMul rewrite transposes B in place once per node, so a weight shared by several
    Gemms (the GRU cell, applied once per encoder layer) would be transposed twice."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    transposed: dict[str, str] = {}
    for node in graph.node:
        attrs = {a.name: a for a in node.attribute}
        if node.op_type != "Gemm" or node.input[1] not in initializers or attrs.get("transB") is None:
            continue
        if onnx.helper.get_attribute_value(attrs["transB"]) != 1:
            continue
        name = node.input[1]
        if name not in transposed:
            t = numpy_helper.from_array(numpy_helper.to_array(initializers[name]).T.copy(), f"{name}.T")
            graph.initializer.append(t)
            transposed[name] = t.name
        node.input[1] = transposed[name]
        node.attribute.remove(attrs["transB"])
    still_used = {i for n in graph.node for i in n.input}
    for name in transposed:
        if name not in still_used:
            graph.initializer.remove(initializers[name])


def trim_output(model: onnx.ModelProto, pieces: list[int]) -> None:
    """The decoder's output layer over `pieces` only (a whole number of TOP_K_BLOCK columns): the
    projection's weight keeps their columns, and the block maxima's reshape counts their blocks.
    The graph, as graphs.DecoderGraph traces it: MatMul(hidden, W (d, V)) -> Flatten -> LogSoftmax
    -> log_probs; Reshape(log_probs, (-1, V / TOP_K_BLOCK, TOP_K_BLOCK)) -> ReduceMax -> block_max."""
    if len(pieces) % TOP_K_BLOCK:
        raise ValueError(f"{len(pieces)} target pieces: not a whole number of {TOP_K_BLOCK}-column blocks")
    graph = model.graph
    made = {o: n for n in graph.node for o in n.output}
    initializers = {t.name: t for t in graph.initializer}
    softmax = next(n for n in graph.node if n.op_type == "LogSoftmax" and n.output[0] == "log_probs")
    flatten = made[softmax.input[0]]
    projection = made[flatten.input[0]] if flatten.op_type == "Flatten" else flatten
    weight = initializers.get(projection.input[1]) if projection.op_type == "MatMul" else None
    reshape = next(n for n in graph.node if n.op_type == "Reshape" and n.input[0] == "log_probs")
    shape = made.get(reshape.input[1])
    if weight is None or shape is None or shape.op_type != "Constant":
        raise ValueError("the decoder's output layer is not MatMul(hidden, weight) -> LogSoftmax -> block maxima")
    w = numpy_helper.to_array(weight)
    weight.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(w[:, pieces]), weight.name))
    blocks = np.array([-1, len(pieces) // TOP_K_BLOCK, TOP_K_BLOCK], np.int64)
    shape.attribute[0].t.CopyFrom(numpy_helper.from_array(blocks, shape.output[0]))
    widths = {"log_probs": len(pieces), "block_max": len(pieces) // TOP_K_BLOCK}
    for output in graph.output:  # the declared shapes, which the runtime checks (server.backends)
        if output.name in widths:
            output.type.tensor_type.shape.dim[1].dim_value = widths[output.name]
    stale = {projection.output[0], flatten.output[0], reshape.output[0]}  # inferred at the old width
    kept = [v for v in graph.value_info if v.name not in stale]
    del graph.value_info[:]
    graph.value_info.extend(kept)


def quantize_int8(src: Path, dst: Path, pieces: list[int] | None = None) -> None:
    """`pieces`: the target pieces a decoder graph's output layer keeps (trim_output)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic  # heavy import: only when asked

    model = onnx.load(str(src))
    pretranspose_gemm_weights(model)
    if pieces is not None:
        trim_output(model, pieces)
    root = logging.getLogger()
    level = root.level
    # the quantizer logs a line per tensor on the root logger, and a warning advising its
    # pre-processing pass on every call: neither is the user's to act on
    root.setLevel(max(level, logging.ERROR))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            prepared = Path(tmp) / src.name
            onnx.save(model, str(prepared))
            # ONNX shape inference cannot type what follows the decoder's GroupQueryAttention (a
            # com.microsoft op); every tensor the quantizer meets there is float32
            quantize_dynamic(str(prepared), str(dst), op_types_to_quantize=["MatMul"], per_channel=True,
                             weight_type=QuantType.QInt8,
                             extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    finally:
        root.setLevel(level)
