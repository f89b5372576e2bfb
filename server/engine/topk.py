"""Row-wise top-k of a step's log-probabilities (R, V): the search's largest operation per step.

On CPU it runs as ONNX Runtime's TopK on the tensor's own memory (no copy), which at one thread is
several times faster than torch.topk over a vocabulary-sized row. Like torch.topk(sorted=True),
values come best first; of equal values the lower index comes first (ONNX's rule).
"""
from __future__ import annotations

import functools

import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper


class RowTopK:
    def __init__(self):
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", "vocab"])
        k = helper.make_tensor_value_info("k", TensorProto.INT64, [1])
        values = helper.make_tensor_value_info("values", TensorProto.FLOAT, ["rows", "k"])
        indices = helper.make_tensor_value_info("indices", TensorProto.INT64, ["rows", "k"])
        graph = helper.make_graph([helper.make_node("TopK", ["x", "k"], ["values", "indices"], axis=1)],
                                  "row_topk", [x, k], [values, indices])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        onnx.checker.check_model(model)
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # it runs on the engine loop's own thread, between steps
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def __call__(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, indices), each (R, k), of a float32 (R, V) tensor; k <= V."""
        if x.device.type != "cpu" or x.dtype != torch.float32 or not len(x):
            return x.topk(k, dim=1)
        x = x.contiguous()
        kk = torch.tensor([k], dtype=torch.int64)
        values = torch.empty(x.shape[0], k, dtype=torch.float32)
        indices = torch.empty(x.shape[0], k, dtype=torch.int64)
        bind = self.session.io_binding()
        bind.bind_input("x", "cpu", 0, "float32", tuple(x.shape), x.data_ptr())
        bind.bind_input("k", "cpu", 0, "int64", (1,), kk.data_ptr())
        bind.bind_output("values", "cpu", 0, "float32", tuple(values.shape), values.data_ptr())
        bind.bind_output("indices", "cpu", 0, "int64", tuple(indices.shape), indices.data_ptr())
        self.session.run_with_iobinding(bind)
        return values, indices


@functools.cache
def row_topk() -> RowTopK:
    """One for the process: an InferenceSession may be run from several threads at once."""
    return RowTopK()
