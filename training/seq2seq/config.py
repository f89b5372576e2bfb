"""One config dataclass for the whole model family (every switch; the math: docs/MODEL.md, docs/GRET.md)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

STRATEGIES = ("gca", "gpa", "fga", "fma", "ama")
FUSIONS = ("sum", "weight_gate", "self_gate")


@dataclass
class ModelConfig:
    vocab_size: int = 8000
    d_model: int = 256
    n_heads: int = 4
    d_ff: int = 1024
    enc_layers: int = 3
    dec_layers: int = 3
    dropout: float = 0.1
    attn_dropout: float = 0.0
    pre_norm: bool = True
    max_positions: int = 512
    pad_id: int = 0
    bos_id: int = 2
    eos_id: int = 3

    # mvPE (docs/MODEL.md): positions encoded as PE(p*k); k = 1 is the standard table.
    pe_k: int = 1
    # Source-side POS-tag embeddings (docs/MODEL.md): x = [sqrt(d_emb) E[w] + PE ; V_PoST(tag)].
    pos_tags: bool = False
    pos_dim: int = 64
    pos_embedding: str = "sinusoidal"  # sinusoidal | learned
    pos_proj: bool = False  # Linear(d_emb + pos_dim -> D) instead of d_emb = D - pos_dim
    n_pos_tags: int = 18  # 17 Universal POS tags + PAD (id 0)

    # GRET (docs/GRET.md): any of the three switches turns the global state on.
    capsule: bool = False
    aggregate: bool = False
    gate: bool = False
    capsules: int = 32
    routing_iters: int = 3
    capsule_dim: int = 64
    routing_detach: bool = False
    pooling: str = "attentive"  # attentive | mean
    gate_bias_init: float = -3.0
    # Scale switches (docs/GRET.md): the paper's form leaves s^M a near-constant vector far smaller
    # than the decoder state it is added to. Each is off in the paper's form.
    global_norm: bool = False  # LayerNorm on every layer vector x^m and on s^M: ||s^M|| ~ sqrt(D), like r
    global_zero_bias: bool = False  # FFN_q / FFN_o biases start at 0, so the pooled capsules, not a constant, set x^m
    routing_scale: bool = False  # routing logits divided by sqrt(D): soft coupling instead of token selection
    global_dropout: float = 0.0  # dropout on s^M while training: the decoder cannot lean on any one of its features

    # Layer-wise multi-view decoding (docs/MODEL.md).
    multiview: str | None = None  # gca | gpa | fga | fma | ama
    multiview_soft: bool = True  # soft integration LN_i(g_i(S) + S_N); False = direct replacement

    # Graph-Transformer encoder (docs/MODEL.md).
    encoder: str = "transformer"  # transformer | graph
    graph_fusion: str = "sum"
    graph_half_dim: bool = False
    graph_shared_qkv: bool = False
    graph_gate_proj: bool = True

    @property
    def gret(self) -> bool:
        return self.capsule or self.aggregate or self.gate

    @property
    def routed_layers(self) -> int:
        """GRET's M: the encoder layers it routes, all of them with `aggregate`, else the last only."""
        return self.enc_layers if self.aggregate else 1

    @property
    def routing_logit_scale(self) -> float:
        """The routing logits' temperature: 1/sqrt(D) with routing_scale, else 1 (the paper's form)."""
        return self.d_model ** -0.5 if self.routing_scale else 1.0

    def validate(self) -> "ModelConfig":
        checks = [
            (self.d_model % self.n_heads == 0, "d_model must be divisible by n_heads"),
            (self.multiview is None or self.multiview in STRATEGIES, f"multiview must be one of {STRATEGIES}"),
            (self.encoder in ("transformer", "graph"), "encoder must be transformer or graph"),
            (self.graph_fusion in FUSIONS, f"graph_fusion must be one of {FUSIONS}"),
            (self.pooling in ("attentive", "mean"), "pooling must be attentive or mean"),
            (self.pos_embedding in ("sinusoidal", "learned"), "pos_embedding must be sinusoidal or learned"),
            (not self.pos_tags or self.pos_proj or self.pos_dim < self.d_model, "pos_dim must be < d_model"),
            (self.pe_k >= 1, "pe_k must be >= 1"),
            (self.routing_iters >= 1 and self.capsules >= 1, "capsules and routing_iters must be >= 1"),
            (0.0 <= self.global_dropout < 1.0, "global_dropout must be in [0, 1)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"invalid model config: {message}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model config fields: {sorted(unknown)}")
        return cls(**d).validate()


PRESETS: dict[str, dict] = {
    "tiny": dict(d_model=64, n_heads=4, d_ff=128, enc_layers=2, dec_layers=2, dropout=0.0,
                 capsules=5, capsule_dim=16, pos_dim=16),
    "small": dict(d_model=256, n_heads=4, d_ff=1024, enc_layers=3, dec_layers=3, dropout=0.2,
                  capsules=32, capsule_dim=64),
    "base": dict(d_model=512, n_heads=8, d_ff=2048, enc_layers=6, dec_layers=6, dropout=0.1,
                 capsules=32, capsule_dim=64),
}


@dataclass
class DataConfig:
    """What the model was trained on; stored in config.json beside the model."""
    task: str = "translate"  # translate | summarize
    dataset: str = "multi30k"  # multi30k | gigaword | aeslc
    src_lang: str = "de"
    tgt_lang: str = "en"
    vocab_size: int = 8000
    max_src_len: int = 128
    max_tgt_len: int = 128


@dataclass
class Checkpoint:
    """config.json of a checkpoint directory: model + data + training record."""
    model: ModelConfig
    data: DataConfig
    training: dict = field(default_factory=dict)

    def save(self, directory: Path) -> None:
        payload = {"model": self.model.to_dict(), "data": dataclasses.asdict(self.data),
                   "training": self.training}
        (Path(directory) / "config.json").write_text(json.dumps(payload, indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> "Checkpoint":
        path = Path(directory) / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{path}: not a checkpoint directory (config.json missing)")
        payload = json.loads(path.read_text())
        return cls(ModelConfig.from_dict(payload["model"]), DataConfig(**payload["data"]),
                   payload.get("training", {}))
