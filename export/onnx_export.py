"""Trace a Seq2Seq into encoder.onnx, decoder.onnx (and global.onnx for capsule models) and check
each against its spec.

The TorchScript-based exporter (torch.onnx.export(dynamo=False)) is used on purpose: it exports
a tiny model in about a second (the torch.export path takes many times that, which the test
suite cannot afford for every architecture) and its symbolic shapes accept a past length of 0,
so the first decoder step needs no special graph.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import onnx
import torch

from training.seq2seq.model import EncoderState, Seq2Seq

from .graphs import DecoderGraph, EncoderGraph, GlobalGraph, decoder_inputs
from .spec import OPSET, SOURCE_CLASSES, GraphSpec, decoder_name, decoder_spec, model_specs, unclaimed_weights

ONNX_TYPES = {"int64": onnx.TensorProto.INT64, "float32": onnx.TensorProto.FLOAT, "bool": onnx.TensorProto.BOOL}

# Sample sizes for tracing: all different from each other and > 1, so that no axis is mistaken for
# another or specialised to a constant. The decoder's sample has SAMPLE_ROWS rows in groups of at
# most 2 over two length classes of sentences (SAMPLE_CLASSES: sentences x columns each).
SAMPLE_BATCH, SAMPLE_SRC_LEN, SAMPLE_ROWS, SAMPLE_PAST, SAMPLE_WIDTH = 2, 7, 8, 4, 6
SAMPLE_CLASSES = ((3, 5), (4, SAMPLE_SRC_LEN))  # (the one-class graph's sample: all of them, padded)


class ExportError(ValueError):
    pass


def sample_source(model: Seq2Seq) -> tuple[torch.Tensor, ...]:
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, cfg.vocab_size, (SAMPLE_BATCH, SAMPLE_SRC_LEN), generator=g)
    src[1, SAMPLE_SRC_LEN - 2:] = cfg.pad_id  # a padded sentence, so the mask is traced as data
    if not cfg.pos_tags:
        return (src,)
    return src, torch.randint(1, cfg.n_pos_tags, src.shape, generator=g)


def sample_capsules(model: Seq2Seq) -> torch.Tensor:
    """Capsules U of the sample batch's M routed layers (M * SAMPLE_BATCH groups, layer-major)."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    groups = cfg.routed_layers * SAMPLE_BATCH
    return torch.randn(groups, cfg.capsules, cfg.capsule_dim, generator=g) * 0.1


def sample_step(model: Seq2Seq, classes: int) -> tuple[torch.Tensor, ...]:
    cfg = model.cfg
    heads, d_head = cfg.n_heads, cfg.d_model // cfg.n_heads
    tokens = torch.full((SAMPLE_ROWS,), cfg.bos_id)
    row_sentence = torch.tensor([0, 1, 1, 2, 3, 4, 5, 6])  # unequal beams: nothing may assume rows = batch * beam
    positions = torch.tensor([SAMPLE_PAST, SAMPLE_PAST, 1, 0, 2, 3, 1, 0])  # rows that joined at different steps
    past = [torch.randn(SAMPLE_ROWS, heads, SAMPLE_WIDTH, d_head) for _ in range(2 * cfg.dec_layers)]  # room to spare
    states = sample_classes(model)
    states = states if classes == len(states) else (EncoderState.stack(list(states)),)  # one class: all, padded
    inputs = decoder_inputs(tokens, positions, row_sentence, states, list(zip(past[::2], past[1::2])))
    return tuple(inputs[name] for name in decoder_spec(cfg, classes).input_names())


def sample_classes(model: Seq2Seq) -> tuple[EncoderState, ...]:
    """SAMPLE_CLASSES' sentences encoded, each class padded to its own width; the last sentence of
    each is a piece shorter, so that the masks are traced as data."""
    g = torch.Generator().manual_seed(1)
    lengths = [width - (k == n - 1) for n, width in SAMPLE_CLASSES for k in range(n)]
    src = torch.randint(4, model.cfg.vocab_size, (len(lengths), SAMPLE_SRC_LEN), generator=g)
    src[torch.arange(SAMPLE_SRC_LEN) >= torch.tensor(lengths)[:, None]] = model.cfg.pad_id
    tags = torch.randint(1, model.cfg.n_pos_tags, src.shape, generator=g) if model.cfg.pos_tags else None
    sentences = model.encode(src, tags).split([width for n, width in SAMPLE_CLASSES for _ in range(n)])
    ends = [sum(n for n, _ in SAMPLE_CLASSES[: c + 1]) for c in range(len(SAMPLE_CLASSES))]
    return tuple(EncoderState.stack(sentences[end - n: end]) for (n, _), end in zip(SAMPLE_CLASSES, ends))


def _export(module: torch.nn.Module, args: tuple, spec: GraphSpec, path: Path) -> None:
    with warnings.catch_warnings():
        # the deprecation notice of the TorchScript exporter, and tracer notes about Python ints
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), dynamo=False, opset_version=OPSET,
                          input_names=spec.input_names(), output_names=spec.output_names(),
                          dynamic_axes=spec.dynamic_axes(), do_constant_folding=True)


def declare_uninferred(path: Path, spec: GraphSpec) -> None:
    """Axes of the graph's outputs that ONNX shape inference could not follow get the spec's size or
    name. It has no rule for com.microsoft ops (the decoder's GroupQueryAttention), and it loses the
    axes behind the encoder's packing (training.seq2seq.layers.Packing: the token count comes from
    NonZero), so the exporter names those axes after an op; every axis it did infer is left for
    check_graph to compare."""
    model = onnx.load(str(path))
    axis_names = {d for t in spec.inputs + spec.outputs for d in t.shape if isinstance(d, str)}
    for value, t in zip(model.graph.output, spec.outputs):
        for axis, want in zip(value.type.tensor_type.shape.dim, t.shape):
            if axis.dim_param and axis.dim_param not in axis_names:
                if isinstance(want, int):
                    axis.dim_value = want
                else:
                    axis.dim_param = want
    onnx.save(model, str(path))


def signature_errors(graph: onnx.GraphProto, spec: GraphSpec) -> list[str]:
    """Differences between an ONNX graph's inputs/outputs and the spec (empty = they match)."""
    errors = []
    for kind, actual, expected in (("input", graph.input, spec.inputs), ("output", graph.output, spec.outputs)):
        names = [v.name for v in actual]
        if names != [t.name for t in expected]:
            errors.append(f"{spec.name} {kind}s are {names}, the spec says {[t.name for t in expected]}")
            continue
        for value, t in zip(actual, expected):
            tensor_type = value.type.tensor_type
            dims = tuple(d.dim_param or d.dim_value for d in tensor_type.shape.dim)
            if tensor_type.elem_type != ONNX_TYPES[t.dtype] or dims != t.shape:
                errors.append(f"{spec.name} {kind} {t.name}: {onnx.TensorProto.DataType.Name(tensor_type.elem_type)}"
                              f"{list(dims)}, the spec says {t.dtype}{list(t.shape)}")
    return errors


def check_graph(path: Path, spec: GraphSpec) -> None:
    onnx.checker.check_model(str(path))
    errors = signature_errors(onnx.load(str(path), load_external_data=False).graph, spec)
    if errors:
        raise ExportError("exported graph does not match its spec:\n  " + "\n  ".join(errors))


@torch.no_grad()
def export_onnx(model: Seq2Seq, directory: Path) -> dict[str, Path]:
    """Writes encoder.onnx, [global.onnx,] decoder.onnx (fp32) into `directory`; returns {graph name: path}."""
    model = model.eval()
    specs = {s.name: s for s in model_specs(model.cfg)}
    unclaimed = unclaimed_weights([n for n, _ in model.named_parameters()], tuple(specs.values()))
    if unclaimed:
        raise ExportError(f"no ONNX graph carries these parameters (the exporter does not know their "
                          f"module): {unclaimed}")
    src = sample_source(model)
    paths = {name: Path(directory) / f"{name}.onnx" for name in specs}
    _export(EncoderGraph(model), src, specs["encoder"], paths["encoder"])
    if "global" in specs:
        _export(GlobalGraph(model), (sample_capsules(model),), specs["global"], paths["global"])
    for classes in range(1, SOURCE_CLASSES + 1):
        name = decoder_name(classes)
        _export(DecoderGraph(model, classes), sample_step(model, classes), specs[name], paths[name])
    for name, spec in specs.items():
        declare_uninferred(paths[name], spec)
        check_graph(paths[name], spec)
    return paths
