"""Declarative description of the ONNX graphs of a model repository: encoder, decoder step, and
for capsule models the global state between them.

A spec says, for one model config, which tensors go in and out of each graph (name, element
type, axes: a name for a dynamic axis, an int for a fixed one) and which of the model's weights
each graph carries. Export is checked against it twice: before tracing (every parameter of the
model is claimed by some graph, so a module the exporter does not know about is an error rather
than a silently missing weight) and after writing (the ONNX signature is exactly the spec's).
The runtime wrapper reads the same spec, so the names live in one place.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from training.seq2seq.beam import TOP_K_BLOCK
from training.seq2seq.config import ModelConfig

OPSET = 17  # LayerNormalization is a native op from 17 on
# The decoder step reads its sentences' encoder states in up to this many length classes, each
# padded to its own longest source (server/engine/source_slots.py says how sentences are classed):
# one graph per class count, so a step over one class pays for no empty other.
SOURCE_CLASSES = 2


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # int64 | float32 | bool
    shape: tuple[str | int, ...]


@dataclass(frozen=True)
class GraphSpec:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    weights: tuple[str, ...]  # parameter-name prefixes whose weights live in this graph

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        """In the form torch.onnx.export wants: tensor name -> {axis: axis name}."""
        axes = {}
        for t in self.inputs + self.outputs:
            named = {i: d for i, d in enumerate(t.shape) if isinstance(d, str)}
            if named:
                axes[t.name] = named
        return axes

    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]


# Everything of a DecoderLayer except the cross-attention K/V projections (those run in the encoder).
DECODER_LAYER_PARTS = ("self_attn", "cross_attn.q", "cross_attn.o", "ffn", "res_self", "res_cross", "res_ffn")


def cross_names(layer: int) -> tuple[str, str]:
    return f"cross_key.{layer}", f"cross_value.{layer}"


def past_names(layer: int) -> tuple[str, str]:
    return f"past_key.{layer}", f"past_value.{layer}"


def present_names(layer: int) -> tuple[str, str]:
    """The past K/V with this step's column written: the runtime binds them to the past's memory."""
    return f"present_key.{layer}", f"present_value.{layer}"


def per_sentence(cfg: ModelConfig) -> list[TensorSpec]:
    """What the encoder computes once per sentence and every decoder step reads (docs/MODEL.md)."""
    heads, d_head = cfg.n_heads, cfg.d_model // cfg.n_heads
    out = [TensorSpec("src_pad", "bool", ("batch", "src_len"))]
    out += global_outputs(cfg)
    for i in range(cfg.dec_layers):
        out += [TensorSpec(n, "float32", ("batch", heads, "src_len", d_head)) for n in cross_names(i)]
    return out


def class_inputs(cfg: ModelConfig, c: int) -> list[TensorSpec]:
    """Length class c's inputs to the decoder step: its sentences' row groups and per_sentence
    tensors, named and sized as its own (class_name)."""
    renamed = lambda t: TensorSpec(class_name(c, t.name), t.dtype,  # noqa: E731
                                   tuple(class_name(c, d) if d in ("batch", "src_len") else d for d in t.shape))
    groups = TensorSpec("group_rows", "int64", ("batch", "group_width"))
    return [renamed(t) for t in [groups, *per_sentence(cfg)]]


def class_name(c: int, name: str) -> str:
    """A per_sentence tensor's (or an axis's) name in length class c: class 0's are the plain names."""
    return f"class{c}.{name}" if c else name


def global_outputs(cfg: ModelConfig) -> list[TensorSpec]:
    """GRET's per-sentence s^M and Gs, where the model has them."""
    out = [TensorSpec("global_state", "float32", ("batch", cfg.d_model))] if cfg.gret else []
    return out + ([TensorSpec("gate_source", "float32", ("batch", cfg.d_model))] if cfg.gate else [])


def encoder_spec(cfg: ModelConfig) -> GraphSpec:
    """The source's pass. With capsule routing it stops at the routing's votes (u_hat of the real
    tokens, no padding: the M routed layers one after another, in each the tokens of B sentences in
    order, every capsule's d_c values side by side; routed_tokens = M * the tokens); the host routes
    them (kernels.routing.route_votes) and the global graph takes the capsules from there."""
    inputs = [TensorSpec("src_ids", "int64", ("batch", "src_len"))]
    if cfg.pos_tags:
        inputs.append(TensorSpec("src_tags", "int64", ("batch", "src_len")))
    outputs = per_sentence(cfg)
    weights = ["embed.", "tag_embed.", "src_in.", "encoder.", "multiview."]
    weights += [f"decoder.{i}.cross_attn.{p}." for i in range(cfg.dec_layers) for p in "kv"]
    if cfg.capsule:
        routed_on = global_outputs(cfg)  # computed after the host's routing, by the global graph
        outputs = [t for t in outputs if t not in routed_on]
        outputs.append(TensorSpec("capsule_votes", "float32", ("routed_tokens", cfg.capsules * cfg.capsule_dim)))
        weights += ["global_state.capsule_w", "global_state.layer_norm."]
    else:
        weights += ["global_state.", "context_gate.w_s."]
    return GraphSpec("encoder", tuple(inputs), tuple(outputs), tuple(weights))


def global_spec(cfg: ModelConfig) -> GraphSpec:
    """Capsule models only: the routed capsules U (M*B, K, d_c) -> s^M (and Gs): pooling, the
    layer-wise GRU, the norms."""
    inputs = (TensorSpec("capsules", "float32", ("groups", cfg.capsules, cfg.capsule_dim)),)
    return GraphSpec("global", inputs, tuple(global_outputs(cfg)), ("global_state.", "context_gate.w_s."))


def decoder_name(classes: int) -> str:
    """The decoder step's graph over `classes` length classes."""
    return "decoder" if classes == 1 else f"decoder{classes}"


def decoder_spec(cfg: ModelConfig, classes: int = 1, columns: int | None = None) -> GraphSpec:
    """`columns`: the output layer's, where it writes only a model's target pieces
    (training.target_pieces; export.quantize.trim_output); else the whole vocabulary."""
    heads, d_head = cfg.n_heads, cfg.d_model // cfg.n_heads
    columns = columns or cfg.vocab_size
    inputs = [TensorSpec("tokens", "int64", ("rows",)),
              TensorSpec("positions", "int64", ("rows",))]
    if cfg.gret:  # only GRET's per-sentence s^M and Gs are gathered per row
        inputs.append(TensorSpec("row_sentence", "int64", ("rows",)))
    inputs.append(TensorSpec("row_slot", "int64", ("rows",)))
    inputs += [t for c in range(classes) for t in class_inputs(cfg, c)]
    outputs = [TensorSpec("log_probs", "float32", ("rows", columns))]
    for i in range(cfg.dec_layers):
        inputs += [TensorSpec(n, "float32", ("rows", heads, "past_len", d_head)) for n in past_names(i)]
        outputs += [TensorSpec(n, "float32", ("rows", heads, "past_len", d_head)) for n in present_names(i)]
    # The maxima of the log-probabilities' blocks (training.seq2seq.beam.block_maxima): one vectorised
    # pass inside the step, after which each row's best tokens are looked for in a few blocks only.
    outputs.append(TensorSpec("block_max", "float32", ("rows", -(-columns // TOP_K_BLOCK))))
    weights = ["embed.", "dec_norm.", "context_gate.w_r."]
    weights += [f"decoder.{i}.{part}." for i in range(cfg.dec_layers) for part in DECODER_LAYER_PARTS]
    return GraphSpec(decoder_name(classes), tuple(inputs), tuple(outputs), tuple(weights))


def model_specs(cfg: ModelConfig, columns: int | None = None) -> tuple[GraphSpec, ...]:
    """The graphs of a repository, in the order a source goes through them (`columns`: decoder_spec's)."""
    decoders = tuple(decoder_spec(cfg, classes, columns) for classes in range(1, SOURCE_CLASSES + 1))
    return (encoder_spec(cfg),) + ((global_spec(cfg),) if cfg.capsule else ()) + decoders


def export_digest(cfg: ModelConfig, pieces: list[int] | None = None) -> str:
    """8 hex digits that change with the graphs' signature, the target pieces the int8 decoders
    write (training.target_pieces) or the code that builds them: exported repositories are cached
    under it, so new code never serves an old export."""
    shapes = [(g.name, [(t.name, t.dtype, t.shape) for t in g.inputs + g.outputs]) for g in model_specs(cfg)]
    digest = hashlib.sha256(json.dumps([shapes, pieces]).encode())
    for path in export_sources():
        digest.update(path.read_bytes())
    return digest.hexdigest()[:8]


def export_sources() -> list[Path]:
    """The code the exported graphs are traced from: the exporter's own, and all of the model's,
    kernels' references included (every architecture's modules and their dispatch)."""
    import kernels
    from training import seq2seq

    sources = [Path(__file__).parent / m for m in ("graphs.py", "onnx_export.py", "quantize.py", "manifest.py")]
    for package in (seq2seq, kernels):
        sources += sorted(Path(package.__file__).parent.glob("*.py"))
    return sources


def unclaimed_weights(parameter_names: list[str], specs: tuple[GraphSpec, ...]) -> list[str]:
    """Parameters that no graph says it carries: exporting would drop them."""
    prefixes = tuple(p for s in specs for p in s.weights)
    return [n for n in parameter_names if not n.startswith(prefixes)]
