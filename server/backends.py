"""Backends of the stepping engine, behind one small interface:

    cfg                                   the ModelConfig
    encode(src (B, S), tags | None)       -> EncoderState, one entry per sentence
    step_top(tokens, positions, row_sentence, enc, cache, top_k)
                                          -> log-probabilities (R, columns), each row's top_k best
                                             (log-probabilities, tokens) (R, top_k) as NumPy arrays
                                             on the host (where the search runs), valid until the
                                             next step; this step's keys and values are written into
                                             the cache in place
    vocabulary(log_probs)                 -> the log-probabilities over the whole vocabulary (R, V):
                                             an int8 ONNX decoder writes only the model's target
                                             pieces (training.target_pieces), the others have -inf

ONNX Runtime (the default; export/onnx_runtime.py; CPU) and PyTorch (the reference: the model's own
modules, eager; on the CPU, or on a GPU with the Triton kernels through kernels.dispatch). A backend's
`device` is where the engine keeps its batch (server.engine.batch). Their step is the same
function, training.seq2seq.model.Seq2Seq.step, traced for one and called for the other; both pick
the top_k with training.seq2seq.beam.row_top_k (from the graph's block maxima, or from their own),
so they agree on ties.
CTranslate2 batches whole requests itself and is served by server/ct2_engine.py.
"""
from __future__ import annotations

from pathlib import Path

import torch

from export.onnx_runtime import OnnxModel
from training.seq2seq.beam import host_top_k
from training.seq2seq.model import EncoderState, Seq2Seq


BACKENDS = ("onnx", "torch", "ct2")


class TorchBackend:
    """The model where it is: the engine's batch follows it to its device, and the engine's small
    per-step inputs, made on the host, are moved there here."""

    def __init__(self, model: Seq2Seq, threads: int | None = None):
        self.model = model.eval()
        self.cfg = model.cfg
        self.device = next(model.parameters()).device
        if threads:
            torch.set_num_threads(threads)

    @torch.no_grad()
    def encode(self, src: torch.Tensor, src_tags: torch.Tensor | None = None) -> EncoderState:
        return self.model.encode(src.to(self.device), None if src_tags is None else src_tags.to(self.device))

    @torch.no_grad()
    def step_top(self, tokens, positions, row_sentence, enc: EncoderState, cache, top_k: int) -> tuple:
        on = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731  (a no-op on the CPU)
        log_probs = self.model.step(on(tokens), on(positions), on(row_sentence), enc, cache)
        return log_probs, host_top_k(log_probs.float(), top_k)

    @staticmethod
    def vocabulary(log_probs: torch.Tensor) -> torch.Tensor:
        return log_probs  # every piece has its column already


class OnnxBackend(OnnxModel):
    """export.onnx_runtime.OnnxModel already has the interface. Always on the CPU provider: the engine
    keeps its cache and encoder slots in host memory (server.engine.batch), and OnnxModel's own default
    (CUDA wherever onnxruntime-gpu and torch see a GPU) would refuse that cache at every step."""

    def __init__(self, repository: Path, precision: str = "fp32", threads: int = 1):
        super().__init__(repository, precision=precision, device="cpu", threads=threads)
        for graph in self.graphs.values():
            check_signature(graph, Path(repository))


def check_signature(graph, repository: Path) -> None:
    """The graph's tensors must have the names and fixed sizes that model.json's model_config implies:
    a model.json that disagrees with its graphs must stop the start, not fail every request."""
    session = graph.session
    shapes = {t.name: t.shape for t in session.get_inputs() + session.get_outputs()}
    for t in graph.spec.inputs + graph.spec.outputs:
        shape = shapes.get(t.name)
        if shape is None or len(shape) != len(t.shape) or any(
                isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(shape, t.shape)):
            raise ValueError(f"{repository / 'model.json'}: its model_config does not match the {graph.spec.name} "
                             f"graph: {t.name} should have shape {list(t.shape)}, the graph has {shape}")
