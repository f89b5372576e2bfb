"""The model family: one encoder-decoder whose config switches on GRET, multi-view decoding,
mvPE + POS tags or the Graph-Transformer encoder.

encode() runs once per source batch and returns everything the decoder needs for any number
of steps (cross-attention K/V, GRET's s^M and Gs). step() is the one decoder step of inference,
for rows at their own positions with their own caches (continuous batching), grouped by sentence
so that the per-sentence tensors are read without tiling them per row: the serving engine runs
it, export traces it (step_rows, export/graphs.py) and training's search runs it through
decode_step() (every row at the same step, the cache grown by concatenation)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels.context_gate import gated_output
from kernels.cross_attention import memory_kv

from .config import ModelConfig
from .gret import ContextGate, GlobalState
from .graph_encoder import GraphEncoder
from .layers import KV, DecoderLayer, TransformerEncoder
from .multiview import MultiViewMemory
from .positions import sinusoid_table


@dataclass
class EncoderState:
    memory: list[KV]  # per decoder layer: cross-attention (K, V), each (B, H, S, d_h)
    src_pad: torch.Tensor  # (B, S) True = pad
    global_state: torch.Tensor | None = None  # GRET s^M (B, D)
    gate_source: torch.Tensor | None = None  # GRET Gs = W_gs s^M + b_g (B, D)

    def select(self, sentences: torch.Tensor) -> "EncoderState":
        """Keep only some sentences (beam search drops finished ones)."""
        pick = lambda t: None if t is None else t.index_select(0, sentences)  # noqa: E731
        return EncoderState([(pick(k), pick(v)) for k, v in self.memory], pick(self.src_pad),
                            pick(self.global_state), pick(self.gate_source))

    @property
    def nbytes(self) -> int:
        tensors = [t for kv in self.memory for t in kv] + [self.src_pad, self.global_state, self.gate_source]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def split(self, lengths: list[int]) -> list["EncoderState"]:
        """One state per sentence, cut to its length. Cloned: a view would keep the whole batch's
        storage alive (and a cache's byte count would be a lie)."""
        def one(i: int, n: int) -> EncoderState:
            row = lambda t: None if t is None else t[i: i + 1].clone()  # noqa: E731
            return EncoderState([(k[i: i + 1, :, :n].clone(), v[i: i + 1, :, :n].clone()) for k, v in self.memory],
                                self.src_pad[i: i + 1, :n].clone(), row(self.global_state), row(self.gate_source))
        return [one(i, n) for i, n in enumerate(lengths)]

    @staticmethod
    def stack(states: list["EncoderState"]) -> "EncoderState":
        """Batch states, padding keys/values with zeros and src_pad with True: the padded keys are
        masked out of every softmax exactly like a batch encoded together."""
        width = max(s.src_pad.shape[1] for s in states)
        padded = lambda t: F.pad(t, (0, 0, 0, width - t.shape[2]))  # noqa: E731  (1, H, S_i, d) -> (1, H, width, d)
        memory = [(torch.cat([padded(s.memory[i][0]) for s in states]), torch.cat([padded(s.memory[i][1]) for s in states]))
                  for i in range(len(states[0].memory))]
        src_pad = torch.cat([F.pad(s.src_pad, (0, width - s.src_pad.shape[1]), value=True) for s in states])
        cat = lambda ts: None if ts[0] is None else torch.cat(ts)  # noqa: E731
        return EncoderState(memory, src_pad, cat([s.global_state for s in states]), cat([s.gate_source for s in states]))


class Seq2Seq(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg.validate()
        d = cfg.d_model
        d_word = d if not cfg.pos_tags or cfg.pos_proj else d - cfg.pos_dim
        self.embed = nn.Embedding(cfg.vocab_size, d, padding_idx=cfg.pad_id)  # tied with the output
        nn.init.normal_(self.embed.weight, std=d ** -0.5)
        with torch.no_grad():
            self.embed.weight[cfg.pad_id].zero_()
        self.register_buffer("positions", sinusoid_table(cfg.max_positions, d, cfg.pe_k), persistent=False)
        if cfg.pos_tags:
            self.register_buffer("src_positions", sinusoid_table(cfg.max_positions, d_word, cfg.pe_k),
                                 persistent=False)
            if cfg.pos_embedding == "learned":
                self.tag_embed = nn.Embedding(cfg.n_pos_tags, cfg.pos_dim, padding_idx=0)
            else:
                table = sinusoid_table(cfg.n_pos_tags, cfg.pos_dim)
                table[0] = 0  # PAD tag -> zero vector
                self.register_buffer("tag_table", table, persistent=False)
            self.src_in = nn.Linear(d_word + cfg.pos_dim, d) if cfg.pos_proj else None
        self.drop = nn.Dropout(cfg.dropout)
        self.encoder = GraphEncoder(cfg) if cfg.encoder == "graph" else TransformerEncoder(cfg)
        self.multiview = MultiViewMemory(cfg) if cfg.multiview else None
        self.global_state = GlobalState(cfg) if cfg.gret else None
        self.context_gate = ContextGate(cfg) if cfg.gate else None
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.dec_layers))
        self.dec_norm = nn.LayerNorm(d) if cfg.pre_norm else nn.Identity()

    # ---- embeddings -------------------------------------------------------------------
    def embed_source(self, src: torch.Tensor, tags: torch.Tensor | None) -> torch.Tensor:
        if not self.cfg.pos_tags:
            return self.embed_tokens(src)
        if tags is None:
            raise ValueError("this model needs source POS tags (config pos_tags=True)")
        # The source words stay tied to the shared table: with d_emb = D - 64 they read its first d_emb columns
        # (an own, untied table trailed mvPE alone by about 10 validation BLEU on Multi30K).
        d_word = self.src_positions.shape[1]
        words = F.embedding(src, self.embed.weight[:, :d_word], padding_idx=self.cfg.pad_id)
        x = words * math.sqrt(d_word) + self.src_positions[: src.shape[1]]
        t = self.tag_embed(tags) if self.cfg.pos_embedding == "learned" else self.tag_table[tags]
        x = torch.cat([x, t], -1)
        return self.drop(self.src_in(x) if self.src_in is not None else x)

    def embed_tokens(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings x sqrt(D) plus their position encodings: positions 0..T-1 along the last
        axis, or (1-D tokens, the decoder step's rows) each token's own position."""
        pos = self.positions[: tokens.shape[-1]] if positions is None else self.positions.index_select(0, positions)
        return self.drop(self.embed(tokens) * math.sqrt(self.cfg.d_model) + pos)

    # ---- encoder: once per source -------------------------------------------------------
    def encode(self, src: torch.Tensor, src_tags: torch.Tensor | None = None) -> EncoderState:
        pad = src.eq(self.cfg.pad_id)
        views = self.encoder(self.embed_source(src, src_tags), pad)
        kv = self.cross_keys_values(views)
        s = gs = None
        if self.global_state is not None:
            s = self.global_state(views, pad)
            gs = self.context_gate.source_part(s) if self.context_gate is not None else None
        return EncoderState(kv, pad, s, gs)

    def cross_keys_values(self, views: list[torch.Tensor]) -> list[KV]:
        """Each decoder layer's cross-attention (K, V) over its memory M_i (docs/MODEL.md; M_i = S_N
        without multi-view), computed once per sentence by kernels.cross_attention.memory_kv."""
        if self.multiview is not None:
            sources, index = self.multiview.sources(views)
            norms = self.multiview.norm_params()
        else:
            sources, index, norms = views[-1][None], [0] * self.cfg.dec_layers, None
        projections = [(a.k.weight, a.k.bias, a.v.weight, a.v.bias) for a in (d.cross_attn for d in self.decoder)]
        return memory_kv(sources, index, views[-1] if norms is not None else None, norms, projections,
                         self.cfg.n_heads)

    # ---- decoder ------------------------------------------------------------------------
    def output(self, h: torch.Tensor, enc: EncoderState, beam: int, kernels: bool = True) -> torch.Tensor:
        """Final hidden states (R, T, D) -> logits (R, T, V), with GRET's global state added.
        kernels=True: LN_out + context gate as one kernel on CUDA (kernels.context_gate.gated_output);
        False: the same math in plain torch ops, which tracing follows. The projection multiplies by
        the table's transpose, which export folds into a (D, V) constant (gathering columns of one
        transposed copy cost ONNX Runtime as much as all the LayerNorms of a step)."""
        if enc.global_state is not None and self.context_gate is not None and kernels:
            norm = self.dec_norm
            params = (norm.weight, norm.bias, norm.eps) if isinstance(norm, nn.LayerNorm) else None
            r = gated_output(h, self.context_gate.w_r.weight, enc.global_state, enc.gate_source, beam, params)
            return r @ self.embed.weight.t()
        r = self.dec_norm(h)
        if self.context_gate is not None and enc.global_state is not None:
            r = self.context_gate(r.unflatten(0, (-1, beam)), enc.global_state, enc.gate_source).flatten(0, 1)
        elif enc.global_state is not None:
            r = (r.unflatten(0, (-1, beam)) + enc.global_state[:, None, None]).flatten(0, 1)
        return r @ self.embed.weight.t()

    def decode(self, tgt_in: torch.Tensor, enc: EncoderState) -> torch.Tensor:
        """Teacher-forced: all T positions at once. Returns logits (B, T, V)."""
        x = self.embed_tokens(tgt_in)
        for layer, memory in zip(self.decoder, enc.memory):
            x = layer(x, memory, enc.src_pad)
        return self.output(x, enc, beam=1)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, row_sentence: torch.Tensor,
             enc: EncoderState | tuple[EncoderState, ...], cache: list[KV], kernels: bool = True) -> torch.Tensor:
        """One decoder step for rows at their own positions: row r holds token tokens[r] at
        position positions[r], reads sentence row_sentence[r] of enc (-1: an empty row, computed
        and read by nobody) and its own cached keys and values (cache: per layer (R, H, T, d),
        T > positions[r]; the row's are columns 0..positions[r] - 1). This step's K/V are written
        into the cache in place, at column positions[r]. Returns log-probabilities (R, V).
        enc may be a tuple of states, length classes (each padded to its own longest source, as
        the serving engine keeps them), whose sentences row_sentence numbers one class after
        another: a row's cross-attention reads only its class's columns."""
        classes = enc if isinstance(enc, tuple) else (enc,)
        sizes = [c.src_pad.shape[0] for c in classes]
        sentence, row_slot, group_rows = row_groups(row_sentence, sum(sizes))
        return self.step_rows(tokens, positions, sentence, group_rows.split(sizes), row_slot, classes, cache,
                              kernels)[0]

    def step_rows(self, tokens: torch.Tensor, positions: torch.Tensor, row_sentence: torch.Tensor | None,
                  group_rows: tuple[torch.Tensor, ...], row_slot: torch.Tensor, classes: tuple[EncoderState, ...],
                  cache: list[KV], kernels: bool = False) -> tuple[torch.Tensor, list[KV]]:
        """step() with the row grouping given (row_groups(), its group_rows split by class): the form
        export traces (kernels=False; row_sentence may be None when no per-sentence tensor is read
        per row, i.e. without GRET). Also returns the cache per layer: the same memory, which
        tracing turns into the graph's present K/V."""
        def per_row(name: str) -> torch.Tensor | None:  # a per-sentence tensor of every class, per row
            tensors = [getattr(c, name) for c in classes]
            return None if tensors[0] is None else torch.cat(tensors).index_select(0, row_sentence)

        x = self.embed_tokens(tokens, positions)  # (R, D)
        pads, present = [c.src_pad for c in classes], []
        for i, (layer, past) in enumerate(zip(self.decoder, cache)):
            memories = [c.memory[i] for c in classes]
            x, kv = layer.step(x, memories, pads, (group_rows, row_slot), past, positions, kernels)
            present.append(kv)
        rows = EncoderState([], pads[0], per_row("global_state"), per_row("gate_source"))
        # flatten(1), not [:, 0] or squeeze(1), and no .float() on float32: exported, each copies the (R, V)
        # logits (Gather; an If where the shapes past GroupQueryAttention are not inferred; Cast)
        logits = self.output(x[:, None], rows, 1, kernels).flatten(1)
        return torch.log_softmax(logits if logits.dtype == torch.float32 else logits.float(), -1), present

    def decode_step(self, tokens: torch.Tensor, step: int, enc: EncoderState, cache: list[KV] | None,
                    beam: int = 1, row_sentence: torch.Tensor | None = None) -> tuple[torch.Tensor, list[KV]]:
        """grown_step() on this model: training.seq2seq.search's step."""
        return grown_step(self, tokens, step, enc, cache, beam, row_sentence)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, src_tags: torch.Tensor | None = None,
                with_global_state: bool = False):
        """Teacher-forced logits (B, T, V); with `with_global_state` also s^M (B, D), which the
        training loop's bag-of-words loss reads."""
        enc = self.encode(src, src_tags)
        logits = self.decode(tgt_in, enc)
        return (logits, enc.global_state) if with_global_state else logits

    def bag_of_words_logits(self, s: torch.Tensor) -> torch.Tensor:
        """s^M read through the tied output embedding (B, V): the space GRET's output term adds s^M in."""
        return F.linear(s, self.embed.weight)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def grown_step(model, tokens: torch.Tensor, step: int, enc: EncoderState, cache: list[KV] | None, beam: int = 1,
               row_sentence: torch.Tensor | None = None) -> tuple[torch.Tensor, list[KV]]:
    """One step of model.step (any backend with that method) for rows all at `step`: rows read
    sentence row // beam (or row_sentence[row]), the cache (None at the first step) comes back
    grown by the step's column. Returns log-probabilities (R, V) and the grown cache."""
    rows, cfg = tokens.shape[0], model.cfg
    if row_sentence is None:
        row_sentence = torch.arange(rows, device=tokens.device) // beam
    column = torch.zeros(rows, cfg.n_heads, 1, cfg.d_model // cfg.n_heads, device=tokens.device)
    cache = cache or [(column[:, :, :0], column[:, :, :0])] * cfg.dec_layers
    cache = [(torch.cat([k, column], 2), torch.cat([v, column], 2)) for k, v in cache]  # the step writes the last
    positions = torch.full((rows,), step, dtype=torch.long, device=tokens.device)
    return model.step(tokens, positions, row_sentence, enc, cache), cache


def row_groups(row_sentence: torch.Tensor, n_sentences: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sentence (R,), row_slot (R,), group_rows (B, W)) for rows in any order: row r is slot w of
    its sentence's group (its w-th row), row_slot[r] = sentence * W + w, group_rows[b, w] = that
    row, or R where sentence b has fewer than W rows. Rows of sentence -1 join no group (row_slot
    0) and read sentence 0's per-sentence tensors (sentence: row_sentence with -1 as 0). Computed
    on the host in one compiled call (a few hundred numbers; the engine's layout changes at most
    steps, where a dozen NumPy calls and a torch clamp cost some 75 us) and handed back on
    row_sentence's device."""
    arrays = group_layout(row_sentence.cpu().numpy(), n_sentences)
    return tuple(torch.from_numpy(a).to(row_sentence.device) for a in arrays)


@numba.njit(cache=True, nogil=True)
def group_layout(row_sentence: np.ndarray, n_sentences: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """row_groups on NumPy arrays."""
    rows = len(row_sentence)
    sentence = np.maximum(row_sentence, 0)
    counts = np.zeros(n_sentences, np.int64)
    for r in range(rows):
        if row_sentence[r] >= n_sentences:  # compiled code does not check its indices
            raise IndexError("a row's sentence is past the last sentence")
        if row_sentence[r] >= 0:
            counts[row_sentence[r]] += 1
    width = max(1, counts.max()) if n_sentences else 1
    row_slot = np.zeros(rows, np.int64)
    group_rows = np.full((n_sentences, width), rows, np.int64)
    seen = np.zeros(n_sentences, np.int64)  # each sentence's rows placed so far
    for r in range(rows):
        b = row_sentence[r]
        if b >= 0:
            row_slot[r] = b * width + seen[b]
            group_rows[b, seen[b]] = r
            seen[b] += 1
    return sentence, row_slot, group_rows
