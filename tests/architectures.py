"""Every architecture the model family offers, as tiny configs for tests."""
from __future__ import annotations

import torch

from training.seq2seq.config import PRESETS, ModelConfig

ARCHITECTURES: dict[str, dict] = {
    "vanilla": {},
    "post_norm": dict(pre_norm=False),
    "gret_capsule": dict(capsule=True),
    "gret_capsule_aggregate": dict(capsule=True, aggregate=True),
    "gret_capsule_gate": dict(capsule=True, gate=True),
    "gret_full": dict(capsule=True, aggregate=True, gate=True),
    "gret_full_mean_pool": dict(capsule=True, aggregate=True, gate=True, pooling="mean"),
    "gret_full_scaled": dict(capsule=True, aggregate=True, gate=True, global_norm=True, global_zero_bias=True,
                             routing_scale=True, gate_bias_init=0.0),
    "gret_aggregate_gate_post_norm": dict(aggregate=True, gate=True, pre_norm=False),
    "multiview_gca": dict(multiview="gca", dec_layers=3),
    "multiview_gpa": dict(multiview="gpa"),
    "multiview_fga": dict(multiview="fga"),
    "multiview_fma": dict(multiview="fma"),
    "multiview_ama": dict(multiview="ama"),
    "multiview_gca_replace": dict(multiview="gca", multiview_soft=False),
    "mvpe": dict(pe_k=7),
    "mvpe_pos": dict(pe_k=7, pos_tags=True),
    "pos_learned_proj": dict(pos_tags=True, pos_embedding="learned", pos_proj=True),
    "graph_sum": dict(encoder="graph", enc_layers=3),
    "graph_weight_gate_half": dict(encoder="graph", graph_fusion="weight_gate", graph_half_dim=True),
    "graph_weight_gate_literal": dict(encoder="graph", graph_fusion="weight_gate", graph_gate_proj=False),
    "graph_self_gate_shared": dict(encoder="graph", graph_fusion="self_gate", graph_shared_qkv=True),
}


def tiny_config(name: str, vocab_size: int = 40, **overrides) -> ModelConfig:
    return ModelConfig(**{**PRESETS["tiny"], "vocab_size": vocab_size, "max_positions": 64,
                          **ARCHITECTURES[name], **overrides}).validate()


def perturb(model: torch.nn.Module, scale: float = 0.2, seed: int = 0) -> torch.nn.Module:
    """Move zero-initialised modules (FMA/AMA weights, biases) off their start so tests see them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model.eval()


def random_batch(cfg: ModelConfig, lengths: list[int], seed: int = 0):
    """Source ids (B, S) padded at the end with EOS last, and POS tags when the model uses them."""
    g = torch.Generator().manual_seed(seed)
    src = torch.full((len(lengths), max(lengths)), cfg.pad_id)
    tags = torch.zeros_like(src)
    for i, n in enumerate(lengths):
        src[i, : n - 1] = torch.randint(4, cfg.vocab_size, (n - 1,), generator=g)
        src[i, n - 1] = cfg.eos_id
        tags[i, : n - 1] = torch.randint(1, cfg.n_pos_tags, (n - 1,), generator=g)
    return src, (tags if cfg.pos_tags else None)


def length_classes(enc, classes: list[list[int]]) -> tuple:
    """enc's sentences in length classes (the serving engine's layout: server/engine/source_slots.py):
    each class the given sentences, in that order, padded to the longest of them."""
    from training.seq2seq.model import EncoderState

    sentences = enc.split((~enc.src_pad).sum(1).tolist())  # each cut to its own length
    return tuple(EncoderState.stack([sentences[i] for i in c]) for c in classes)


def step_case(cfg: ModelConfig, row_sentence: list[int], width: int = 6, seed: int = 0):
    """Tokens, positions (below width) and a random cache (per layer (R, H, width, d)) for rows of
    sentences row_sentence: the inputs of one Seq2Seq.step."""
    g = torch.Generator().manual_seed(seed)
    rows = len(row_sentence)
    shape = (rows, cfg.n_heads, width, cfg.d_model // cfg.n_heads)
    cache = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(cfg.dec_layers)]
    return (torch.randint(4, cfg.vocab_size, (rows,), generator=g), torch.randint(0, width, (rows,), generator=g),
            cache)
