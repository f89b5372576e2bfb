"""ONNX Runtime backend: a model repository's graphs behind the interface of
training.seq2seq.model.Seq2Seq (encode, decode_step, cfg) plus reorder, so training.seq2seq.search's greedy and
beam search run on it unchanged.

Tensors cross into ONNX Runtime as torch tensors bound by pointer (IO binding), outputs are
written straight into torch tensors allocated here: with the CUDA provider CUDA tensors stay on
the device between steps. A binding is kept from run to run: large inputs (the caches, the
encoder state) stay where they are, small ones are copied into tensors of the binding's own, and
the decoder step writes its outputs into kept tensors, so a step runs on the memory of the step
before (OnnxGraph.run); a step whose row layout is unchanged copies in its tokens and positions and
reruns the binding as it stands (OnnxGraph.rerun). On the CPU, a graph whose outputs are fresh
every run (the encoder's, the global state's) is run plainly instead: ONNX Runtime allocates its
outputs and torch takes them over. Every CPU run flushes denormals on its thread for its duration
(flushed).
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from kernels.routing import route_votes
from training.seq2seq import search
from training.seq2seq.beam import host_top_k, top_k_arrays
from training.seq2seq.config import ModelConfig
from training.seq2seq.model import EncoderState, grown_step

from .graphs import layout_inputs, unflatten_state
from .manifest import read_manifest
from .spec import SOURCE_CLASSES, GraphSpec, class_name, decoder_name, model_specs, per_sentence, present_names

NUMPY_TYPES = {"int64": np.int64, "float32": np.float32, "bool": np.bool_}
TORCH_TYPES = {"int64": torch.int64, "float32": torch.float32, "bool": torch.bool}
SMALL_INPUT_BYTES = 4096  # an input this small is copied into a kept tensor rather than bound anew (OnnxGraph.run)
OWNED_VIEWS = 256  # views of a kept tensor, by shape, held at most (OnnxGraph._owned)


def default_device() -> str:
    """CUDA when both ONNX Runtime's CUDA provider and torch's CUDA are there (the tensors are
    torch's), else CPU. onnxruntime-gpu lists its CUDA provider even on a machine without a GPU."""
    usable = "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()
    return "cuda" if usable else "cpu"


SUBNORMAL, ONE = 5e-324, 1.0  # module globals, so that SUBNORMAL * ONE is computed at run time, never folded


def flushed(run, *args):
    """run(*args) with denormal floats read and written as zero (DAZ, FTZ) on the calling thread,
    where ONNX Runtime runs a graph whose session has one intra-op thread; the thread's own mode
    comes back afterwards, so a caller's later float code (a test's Hypothesis, a user's NumPy)
    never inherits it. Masked attention makes denormals: a padded source position's score is -inf,
    and MLAS's exponential is slow for every result below float32's smallest normal. All ad hoc: a
    Softmax over padded rows ran about 4x slower than over unpadded ones (29 sources x 4 beams x
    4 heads x 20 positions: 72 against 18 us; a vocabulary LogSoftmax with 3% of its values 87
    below the row's maximum, 4x too); in bench step's engine loop (32 texts in flight) the
    cross-attention Softmax fell from 0.15 to 0.035 ms per text and texts/s rose 1.04x (vanilla)
    and 1.02x (GRET). ONNX Runtime's own setting (session.set_denormal_as_zero) is no substitute:
    it sets the mode for good on the thread that initialises the process's first session, and
    otherwise reaches only its intra-op pool threads. Those (--threads > 1) are left unflushed here.
    A flushed value is below 1.2e-38, nothing these graphs' outputs depend on (tests/test_export.py
    holds them to PyTorch's). Two calls of 45 ns each."""
    if SUBNORMAL * ONE == 0.0:  # this thread flushes already
        return run(*args)
    torch.set_flush_denormal(True)
    try:
        return run(*args)
    finally:
        torch.set_flush_denormal(False)


class OnnxGraph:
    """One InferenceSession, run on dicts of torch tensors named as in its GraphSpec."""

    def __init__(self, path: Path, spec: GraphSpec, device: str = "cpu", threads: int = 1):
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1  # the graphs are sequential chains: no use for more
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # Idle ONNX Runtime threads must not spin: between steps the engine's own (torch) work runs
        # on the same cores, and spinning threads take those cores from it.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.device = torch.device(device)
        providers = ["CPUExecutionProvider"]
        if self.device.type == "cuda":
            providers.insert(0, ("CUDAExecutionProvider", {"device_id": self.device.index or 0}))
        self.path = Path(path)
        self.session = ort.InferenceSession(str(path), options, providers=providers)
        if self.device.type == "cuda" and "CUDAExecutionProvider" not in self.session.get_providers():
            raise RuntimeError(f"{path}: ONNX Runtime could not start its CUDA provider")
        self.spec = spec
        self.output_names = spec.output_names()
        self.local = threading.local()  # thread replicas share the session; each thread binds its own
        # made once: the binding's public bind_input/bind_output make one at every call (_bind)
        self.ort_device = ort.OrtDevice.make(self.device.type, self.device.index or 0)._get_c_device()

    def _binding(self) -> tuple[ort.IOBinding, dict]:
        """This thread's binding, kept from run to run, and the tensor each name is bound to now."""
        if not hasattr(self.local, "binding"):
            self.local.binding, self.local.bound, self.local.owned = self.session.io_binding(), {}, {}
        return self.local.binding, self.local.bound

    def _bind(self, bind, bound: dict, t, tensor: torch.Tensor) -> None:
        """Bind a name to a tensor's memory unless it is bound to that tensor, or to the same address
        and shape, already: most of a decoder step's tensors (the cache, the encoder state) are the
        same objects from step to step, or views of the same memory. The tensor is kept (bound), so
        its memory outlives the binding. `bind`: the bind_input or bind_output of the binding's
        pybind object (binding._iobinding), which a step under load calls some twenty times."""
        last = bound.get(t.name)
        if last is tensor:
            return
        if last is None or last.data_ptr() != tensor.data_ptr() or last.shape != tensor.shape:
            bind(t.name, self.ort_device, NUMPY_TYPES[t.dtype], tuple(tensor.shape), tensor.data_ptr())
        bound[t.name] = tensor

    def _owned(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """This thread's own tensor for `name`: a view of storage that is kept and only ever grows, so
        that its address stays from run to run (and its binding too, while the shape does); the same
        view object for the same shape while the storage stays. The views are kept by shape: under
        load the rows change at almost every step, among a few dozen counts, and making a view is
        a torch call."""
        kept, views = self.local.owned.get(name, (None, {}))
        view = views.get(shape)
        if view is not None and view.dtype == dtype:
            return view
        size = math.prod(shape)
        if kept is None or kept.dtype != dtype or kept.numel() < size:
            grown = 0 if kept is None else 2 * kept.numel()
            kept, views = torch.empty(max(size, grown), dtype=dtype, device=self.device), {}
        elif len(views) >= OWNED_VIEWS:  # (the encoder's inputs come in many shapes)
            views = {}
        view = views[shape] = kept[:size].view(shape)
        self.local.owned[name] = kept, views
        return view

    def run(self, inputs: dict[str, torch.Tensor], output_shapes: dict[str, tuple[int, ...]],
            out: dict[str, torch.Tensor] | None = None, reuse: bool = False,
            unchanged: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
        """Outputs by name, written into `out`'s tensors where given (contiguous, of the right shape).

        A step's small inputs (tokens, positions, row groups) are new tensors every time: they are
        copied into tensors of this thread's own, unless `out` holds the same memory (an input
        updated in place). With `reuse`, the outputs not in `out` are this thread's own tensors
        too, overwritten by its next run of this graph: for a caller done with them by then (the
        engine's decoder step). A step that reads and writes the memory of the step before, bound
        once, runs faster than one given fresh tensors, most at small batches, where a step's
        fixed costs weigh most (python -m bench step measures the engine at each load). An input
        given as the very tensor it was bound to last run (the engine's cache and encoder state)
        costs nothing here, and so does one named in `unchanged`: the caller vouches that it is the
        tensor it gave last run, with the same values (it is not read).

        Fresh outputs on the CPU (no `out`, no `reuse`: the encoder's and the global graph's) are
        ONNX Runtime's own, which torch takes over as they are: fewer calls than a new tensor made
        and bound per output (an encoder pass of two texts, 16 pieces each: 0.75 -> 0.68 ms, ad hoc)."""
        if out is None and not reuse and self.device.type == "cpu":
            feeds = {t.name: inputs[t.name].to(TORCH_TYPES[t.dtype]).contiguous().numpy() for t in self.spec.inputs}
            arrays = flushed(self.session.run, self.output_names, feeds)
            return {name: torch.from_numpy(a) for name, a in zip(self.output_names, arrays)}
        binding, bound = self._binding()
        raw = binding._iobinding  # its pybind object: _bind's bind_input and bind_output
        aliased = {t.data_ptr() for t in (out or {}).values()}
        for t in self.spec.inputs:
            if t.name in unchanged:
                continue
            given = inputs[t.name]
            if bound.get(t.name) is given:  # bound by address last run, and still
                continue
            tensor = given.to(self.device, TORCH_TYPES[t.dtype]).contiguous()
            if tensor.nbytes <= SMALL_INPUT_BYTES and tensor.data_ptr() not in aliased:
                tensor = self._owned(t.name, tuple(tensor.shape), tensor.dtype).copy_(tensor)
            self._bind(raw.bind_input, bound, t, tensor)
        outputs = dict(out or {})
        for t in self.spec.outputs:
            if t.name not in outputs:
                shape, dtype = output_shapes[t.name], TORCH_TYPES[t.dtype]
                outputs[t.name] = self._owned(t.name, shape, dtype) if reuse else \
                    torch.empty(shape, dtype=dtype, device=self.device)
            self._bind(raw.bind_output, bound, t, outputs[t.name])
        self._run_bound(binding)
        return outputs

    def rerun(self, changed: dict[str, torch.Tensor]) -> bool:
        """Run again on this thread's binding as the last run left it, with only the `changed` inputs
        new: each is copied into the tensor its name is bound to, which must be this thread's own
        (a small input: run()) of the same shape; else nothing runs and the answer is False. The
        outputs are where the last run wrote them. A decoder step of an unchanged row layout needs
        no more, and run()'s per-name checks cost a one-text step as much as its search does."""
        bound, owned = getattr(self.local, "bound", {}), getattr(self.local, "owned", {})
        for name, tensor in changed.items():
            kept, views = bound.get(name), owned.get(name, (None, {}))[1]
            if kept is None or kept.shape != tensor.shape or views.get(kept.shape) is not kept:
                return False
        for name, tensor in changed.items():
            bound[name].copy_(tensor)
        self._run_bound(self.local.binding)
        return True

    def _run_bound(self, binding: ort.IOBinding) -> None:
        if self.device.type == "cpu":
            flushed(self.session.run_with_iobinding, binding)
        else:
            self.session.run_with_iobinding(binding)


def output_shapes(spec: GraphSpec, sizes: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Each output's shape: the spec's axes, the named ones given by `sizes`."""
    return {t.name: tuple(sizes.get(d, d) for d in t.shape) for t in spec.outputs}


# The step's inputs that only the row layout decides (OnnxModel._layout): a step of an unchanged
# layout gives ONNX Runtime its new tokens and positions and nothing else.
LAYOUT_INPUTS = frozenset({"row_sentence", "row_slot"} | {class_name(c, "group_rows") for c in range(SOURCE_CLASSES)})


@dataclass
class StepLayout:
    key: tuple  # (row_sentence, enc, cache): the caller's objects, compared by identity
    graph: OnnxGraph  # the decoder graph of as many length classes as enc has
    inputs: dict[str, torch.Tensor]  # every decoder input but tokens and positions
    shapes: dict[str, tuple[int, ...]]  # the outputs'
    present: dict[str, torch.Tensor]  # the cache, where the step writes its column
    outputs: dict[str, torch.Tensor] | None = None  # where its last step wrote, once one has run (a failed one has not)


class OnnxModel:
    """encode / decode_step / reorder over encoder.onnx, [global.onnx,] decoder.onnx and decoder2.onnx
    (the step over one and over two length classes of sentences), or their int8 twins."""

    def __init__(self, directory: Path, precision: str = "fp32", device: str | None = None, threads: int = 1,
                 verify: bool = True):
        directory = Path(directory)
        self.manifest = read_manifest(directory, verify)
        if self.manifest["backend"] != "onnx":
            raise ValueError(f"{directory} is a {self.manifest['backend']} repository, not onnx")
        precisions = self.manifest["onnx"]["precisions"]
        if precision not in precisions:
            raise ValueError(f"{directory} has no {precision} graphs; it has {sorted(precisions)}")
        self.cfg = ModelConfig.from_dict(self.manifest["model_config"])
        self.device = torch.device(device or default_device())
        files = precisions[precision]
        pieces = self.manifest["onnx"].get("output_pieces", {}).get(precision)
        # the pieces the decoders write, one per column (export.quantize.trim_output); None: every piece
        self.pieces = None if pieces is None else np.asarray(pieces, np.int64)
        columns = None if self.pieces is None else len(self.pieces)
        self.graphs = {spec.name: OnnxGraph(directory / files[spec.name], spec, self.device, threads)
                       for spec in model_specs(self.cfg, columns)}
        self.encoder, self.decoder = self.graphs["encoder"], self.graphs["decoder"]
        self.decoders = {c: self.graphs[decoder_name(c)] for c in range(1, SOURCE_CLASSES + 1)}  # by length classes
        self.local = threading.local()  # this thread's last StepLayout, as its bindings are its own
        self.global_graph = self.graphs.get("global")  # capsule models: s^M after the host's routing
        self.state_names = [t.name for t in per_sentence(self.cfg)]  # what encode gives, in unflatten_state's order
        self.n_heads, self.d_head = self.cfg.n_heads, self.cfg.d_model // self.cfg.n_heads
        self.step_shapes: dict[int, dict] = {}  # the decoder's outputs' shapes by rows

    def encode(self, src: torch.Tensor, src_tags: torch.Tensor | None = None) -> EncoderState:
        """The encoder graph; for a capsule model then its votes routed on the host
        (kernels.routing.route_votes) and the global graph on the capsules."""
        if self.cfg.pos_tags and src_tags is None:
            raise ValueError("this model needs source POS tags (config pos_tags=True)")
        batch, length = src.shape
        sizes = {"batch": batch, "src_len": length}
        if self.global_graph is not None:  # the votes hold the real tokens of every routed layer
            layers, lengths = self.cfg.routed_layers, src.ne(self.cfg.pad_id).sum(1).cpu().numpy()
            sizes["routed_tokens"] = layers * int(lengths.sum())
        inputs = {"src_ids": src} | ({"src_tags": src_tags} if self.cfg.pos_tags else {})
        outputs = self.encoder.run(inputs, output_shapes(self.encoder.spec, sizes))
        if self.global_graph is not None:
            capsules = route_votes(outputs["capsule_votes"].cpu().numpy(), np.tile(lengths, layers),
                                   self.cfg.capsules, self.cfg.routing_iters, self.cfg.routing_logit_scale)
            outputs |= self.global_graph.run({"capsules": torch.from_numpy(capsules)},
                                             output_shapes(self.global_graph.spec, sizes))
        return unflatten_state(self.cfg, [outputs[name] for name in self.state_names])

    def decode_step(self, tokens: torch.Tensor, step: int, enc: EncoderState, cache: list | None, beam: int = 1,
                    row_sentence: torch.Tensor | None = None) -> tuple[torch.Tensor, list]:
        """As Seq2Seq.decode_step (training.seq2seq.model.grown_step over this backend's step)."""
        return grown_step(self, tokens, step, enc, cache, beam, row_sentence)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, row_sentence: torch.Tensor,
             enc: EncoderState | tuple, cache: list) -> torch.Tensor:
        """One decoder step for rows at their own positions (continuous batching), as Seq2Seq.step:
        log-probabilities (R, V); this step's K/V are written into `cache` in place.
        A copy: the step's outputs last only until the next step."""
        log_probs = self._step(tokens, positions, row_sentence, enc, cache)["log_probs"]
        return log_probs.clone() if self.pieces is None else self.vocabulary(log_probs)

    def vocabulary(self, log_probs: torch.Tensor) -> torch.Tensor:
        """A step's log-probabilities over the whole vocabulary, indexed by piece: a piece the decoder
        does not write (self.pieces) has -inf. The search's constraints (a target prefix, min_length,
        no_repeat_ngram) ban or force pieces by id."""
        if self.pieces is None:
            return log_probs
        full = log_probs.new_full((len(log_probs), self.cfg.vocab_size), float("-inf"))
        full[:, torch.from_numpy(self.pieces)] = log_probs
        return full

    def step_top(self, tokens: torch.Tensor, positions: torch.Tensor, row_sentence: torch.Tensor,
                 enc: EncoderState | tuple, cache: list,
                 top_k: int) -> tuple[torch.Tensor, tuple[np.ndarray, np.ndarray]]:
        """The step's log-probabilities (R, columns: the pieces it writes, self.pieces, or the whole
        vocabulary; vocabulary() widens them), and each row's top_k best log-probabilities and pieces
        (R, top_k) as NumPy arrays, best first (training.seq2seq.beam.row_top_k, from the graph's
        block maxima: a few blocks of each row are read, not the whole row). All are this thread's
        own, overwritten by its next step."""
        outputs = self._step(tokens, positions, row_sentence, enc, cache)
        log_probs = outputs["log_probs"]
        if self.device.type != "cpu":
            top = host_top_k(log_probs, top_k)
        else:
            top = self._top(log_probs, outputs["block_max"], top_k)
        return log_probs, top if self.pieces is None else (top[0], self.pieces[top[1]])

    def _top(self, log_probs: torch.Tensor, maxima: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """top_k_arrays over NumPy views of the step's log_probs and block maxima, into arrays kept by
        rows and k while the step's outputs are the same tensors (OnnxGraph._owned gives the same
        view for the same rows). Made afresh at every step, the views and arrays cost a one-text step
        more than choosing its tokens does: its loop's memory is cold after the graph's run."""
        kept = self.local.__dict__.setdefault("top", {})
        rows = len(log_probs)
        entry = kept.get((rows, k))
        if entry is None or entry[0] is not log_probs or entry[1] is not maxima:
            if len(kept) >= OWNED_VIEWS:
                kept.clear()
            entry = kept[rows, k] = (log_probs, maxima, log_probs.numpy(), maxima.numpy(),
                                     (np.empty((rows, k), np.float32), np.empty((rows, k), np.int64)))
        _, _, x, x_maxima, out = entry
        return top_k_arrays(x, x_maxima, k, out)

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor, row_sentence: torch.Tensor,
              enc: EncoderState | tuple, cache: list) -> dict[str, torch.Tensor]:
        """The decoder graph's outputs. Its present K/V are bound to the cache's own memory, which its
        attention then updates in place (GroupQueryAttention with a shared buffer): the cache must be
        contiguous float32 on this backend's device, or the step's column would land in a copy. The
        outputs are this thread's own tensors, overwritten by its next step (OnnxGraph.run's `reuse`)."""
        layout = self._layout(row_sentence, enc, cache)
        if layout.outputs is not None and layout.graph.rerun({"tokens": tokens, "positions": positions}):
            return layout.outputs  # the layout's own binding, only its tokens and positions new
        inputs = dict(layout.inputs, tokens=tokens, positions=positions)
        bound = LAYOUT_INPUTS if layout.outputs is not None else frozenset()  # by a run of this layout
        layout.outputs = layout.graph.run(inputs, layout.shapes, out=layout.present, reuse=True, unchanged=bound)
        return layout.outputs

    def _layout(self, row_sentence: torch.Tensor, enc: EncoderState | tuple, cache: list) -> StepLayout:
        """What a decoder step needs besides its tokens and positions, kept while the caller hands
        the very row_sentence, encoder state and cache objects again (the engine's batch does at
        every step in which no row joins, leaves or moves to another sentence's slot): the row
        groups are not grouped again, and OnnxGraph.run neither copies nor binds them. This
        thread's own, as the binding is. The graph is the decoder of as many length classes as enc
        holds (one state: one class)."""
        key = (row_sentence, enc, cache)
        last = getattr(self.local, "layout", None)
        if last is not None and all(a is b for a, b in zip(last.key, key)):
            return last
        graph = self.decoders.get(len(enc) if isinstance(enc, tuple) else 1)
        if graph is None:
            raise ValueError(f"{len(enc)} length classes; the decoder graphs take 1 to {SOURCE_CLASSES}")
        for t in (t for kv in cache for t in kv):
            if not t.is_contiguous() or t.dtype != torch.float32 or t.device != self.device:
                raise ValueError(f"the cache must be contiguous float32 on {self.device}, got {t.dtype} on "
                                 f"{t.device}{'' if t.is_contiguous() else ', not contiguous'}")
        inputs = layout_inputs(row_sentence, enc, cache)
        rows = row_sentence.shape[0]
        shapes = self.step_shapes.get(rows)
        if shapes is None:  # a few dozen distinct row counts: worked out once each
            shapes = self.step_shapes[rows] = output_shapes(graph.spec, {"rows": rows})  # (every decoder's)
        present = {n: t for i, kv in enumerate(cache) for n, t in zip(present_names(i), kv)}
        self.local.layout = StepLayout(key, graph, inputs, shapes, present)
        return self.local.layout

    @staticmethod
    def reorder(cache: list, rows: torch.Tensor) -> list:
        """Beam search's only reordered state (docs/MODEL.md): cache row j <- old row rows[j]."""
        return [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in cache]


def greedy(model: OnnxModel, src: torch.Tensor, src_tags: torch.Tensor | None = None, **options) -> list[list[int]]:
    """training.seq2seq.search.greedy, which needs only encode / decode_step / cfg: the same code path."""
    return search.greedy(model, src, src_tags, **options)


def beam_search(model: OnnxModel, src: torch.Tensor, src_tags: torch.Tensor | None = None,
                **options) -> list[list[search.Hypothesis]]:
    """training.seq2seq.search.beam_search on the ONNX graphs (same options, same outputs)."""
    return search.beam_search(model, src, src_tags, **options)
