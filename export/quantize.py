"""--quantize int8: dynamic quantization of the MatMul weights (ONNX Runtime's quantize_dynamic).

Weights become int8 with one scale per output column (per_channel), activations are quantized
per call at run time. The quantizer rewrites Gemm (a Linear on 2-D input, e.g. GRET's GRU cell)
as MatMul + Add and quantizes those too, and the capsule projection is one 2-D weight (the
exported encoder builds the routing's votes, kernels/routing.py). LayerNorm, softmax, attention
scores and the embedding lookup stay fp32.

The int8 graphs sit beside the fp32 ones in the same repository (encoder.int8.onnx,
decoder.int8.onnx, global.int8.onnx; model.json lists them under onnx.precisions), so one
repository serves both and the fp32 reference is always there to compare against.
"""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import onnx
from onnx import numpy_helper

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


def quantize_int8(src: Path, dst: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic  # heavy import: only when asked

    model = onnx.load(str(src))
    pretranspose_gemm_weights(model)
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
