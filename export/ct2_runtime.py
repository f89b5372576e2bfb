"""CTranslate2 backend: a ct2 model repository behind one call that translates a batch of source
token-id lists with CT2's own beam search (the server hands it whole requests).

The options are mapped so that CT2 searches exactly as training.seq2seq.search.beam_search does, and fp32
outputs match the PyTorch reference token for token (tests/test_ct2.py):
  - both keep the 2*beam best candidates per step; those ranked inside the beam that end in EOS
    finish, the best non-EOS candidates refill the beam; a sentence is done when `beam`
    hypotheses have finished or at its last step;
  - scores are log P / len^length_penalty with len counting EOS, so CT2 is asked to return the
    end token (return_end_token) and it is stripped here;
  - min_length defaults to 0 (CT2's own default of 1 forbids EOS at the first step; ours does not);
  - CT2 takes one max_decoding_length per call, while ours is per sentence (a * src_len + b,
    at most max_positions - 1), so sentences are grouped by their limit and each group is one
    CT2 call (an absolute max_length makes it a single call).
  - a target prefix is CT2's target_prefix (its pieces, returned with the output): forced with
    log-probability 0, counted in the length limits and the length penalty (training.seq2seq.beam.force_prefix).
One known difference: with length_penalty 0 CT2 stops a sentence as soon as its best beam has
finished (nothing can beat it then), ours waits for `beam` finished hypotheses; the best output
is the same, n-best entries after the first may differ. A second: at the first step after a
target prefix CT2 lets only the best candidate end the sentence (its issue #277), ours any
candidate inside the beam; with beam 1 the two are the same.

Token ids cross as SentencePiece pieces: the model folder's shared_vocabulary.json lists the
pieces in id order, so CT2's token index is our id and the mapping is read from the very file
CT2 loads.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import ctranslate2

from training.seq2seq.beam import output_limit
from training.seq2seq.config import ModelConfig

from .ct2_export import VOCABULARY
from .manifest import read_manifest


def max_lengths(cfg: ModelConfig, src_lengths: list[int], a: float, b: int, absolute: int | None = None) -> list[int]:
    """Output limit per sentence (EOS counted), training.seq2seq.beam.output_limit as training.seq2seq.search uses
    it: a * src_len + b, at most max_positions - 1 (the position table's size); or `absolute`
    (at most the same) for all."""
    cap = cfg.max_positions - 1
    if absolute is not None:
        return [min(absolute, cap)] * len(src_lengths)
    return [output_limit(n, a, b, cap) for n in src_lengths]


class Translation(NamedTuple):
    tokens: list[int]  # without BOS/EOS
    score: float | None  # log P / len^length_penalty; None unless return_scores


class Ct2Translator:
    """precision picks the model folder ("fp32": ct2/, "int8": ct2.int8/ when exported with
    --quantize int8); device is "cpu" or "cuda"; compute_type is CTranslate2's: "default" computes
    in the type the weights are stored in, another type converts them at load time (e.g. "int8"
    on the fp32 folder, "int8_float16" on a GPU); threads are CT2's intra-op threads, replicas its
    inter_threads (calls from that many threads run in parallel)."""

    def __init__(self, directory: Path, precision: str = "fp32", device: str = "cpu",
                 compute_type: str = "default", threads: int = 1, replicas: int = 1, verify: bool = True):
        directory = Path(directory)
        self.manifest = read_manifest(directory, verify)
        if self.manifest["backend"] != "ct2":
            raise ValueError(f"{directory} is a {self.manifest['backend']} repository, not ct2")
        folders = self.manifest["ct2"]["precisions"]
        if precision not in folders:
            raise ValueError(f"{directory} has no {precision} CT2 model; it has {sorted(folders)}")
        self.cfg = ModelConfig.from_dict(self.manifest["model_config"])
        self.device = device
        folder = directory / folders[precision]
        self.pieces = json.loads((folder / VOCABULARY).read_text(encoding="utf-8"))
        if len(self.pieces) != self.cfg.vocab_size:
            raise ValueError(f"{folder / VOCABULARY} has {len(self.pieces)} pieces, the model {self.cfg.vocab_size}")
        self.ids = {piece: i for i, piece in enumerate(self.pieces)}
        self.translator = ctranslate2.Translator(str(folder), device=device, compute_type=compute_type,
                                                 intra_threads=threads, inter_threads=replicas)

    def translate(self, sources: list[list[int]], *, beam: int = 4, length_penalty: float = 1.0,
                  max_len_a: float = 1.5, max_len_b: int = 10, max_length: int | None = None,
                  min_length: int = 0, n_best: int = 1, no_repeat_ngram_size: int = 0,
                  return_scores: bool = True, max_batch_size: int = 0,
                  prefixes: list[list[int]] | None = None) -> list[list[Translation]]:
        """sources: token ids as the model reads them (training.seq2seq.inputs.encode_source: pieces + EOS,
        no padding). Returns, per source, its n_best translations, best first. Output lengths
        count EOS: at most max_length (or a * src_len + b) tokens, at least min_length before EOS.
        max_batch_size > 0 cuts the call into sub-batches, which CTranslate2's replicas decode in
        parallel. `prefixes`: per source, target ids its outputs begin with (empty: none)."""
        if beam < 1 or not 1 <= n_best <= beam:
            raise ValueError(f"need beam >= 1 and 1 <= n_best <= beam (got beam {beam}, n_best {n_best})")
        if min_length < 0 or no_repeat_ngram_size < 0:
            raise ValueError("min_length and no_repeat_ngram_size must be >= 0")
        tokens = [self._pieces(i, ids) for i, ids in enumerate(sources)]
        limits = max_lengths(self.cfg, [len(s) for s in sources], max_len_a, max_len_b, max_length)
        if limits and min(limits) < max(min_length, 1):
            raise ValueError(f"the max output length ({min(limits)}) must be >= max(min_length, 1) = "
                             f"{max(min_length, 1)}")
        if prefixes is not None and len(prefixes) != len(sources):
            raise ValueError(f"{len(prefixes)} prefixes for {len(sources)} sources")
        prefix_pieces = [[self.pieces[t] for t in p] or None for p in prefixes] if prefixes else None
        groups = defaultdict(list)
        for i, limit in enumerate(limits):
            groups[limit].append(i)
        out: list[list[Translation]] = [[] for _ in sources]
        for limit, members in groups.items():
            results = self.translator.translate_batch(
                [tokens[i] for i in members], beam_size=beam, num_hypotheses=n_best,
                length_penalty=length_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                max_decoding_length=limit, min_decoding_length=min_length, max_input_length=0,
                return_scores=return_scores, return_end_token=True, max_batch_size=max_batch_size,
                target_prefix=[prefix_pieces[i] for i in members] if prefix_pieces else None)
            for i, result in zip(members, results):
                scores = result.scores if return_scores else [None] * len(result.hypotheses)
                out[i] = [Translation(self._ids(h), s) for h, s in zip(result.hypotheses, scores)]
        return out

    def _pieces(self, index: int, ids: list[int]) -> list[str]:
        if not ids:
            raise ValueError(f"source {index} is empty (a source holds at least its EOS)")
        if len(ids) > self.cfg.max_positions:
            raise ValueError(f"source {index} has {len(ids)} tokens, the model at most {self.cfg.max_positions}")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size or t == self.cfg.pad_id]
        if bad:
            raise ValueError(f"source {index} holds ids outside 1..{self.cfg.vocab_size - 1} "
                             f"(padding is not part of a source): {bad[:5]}")
        return [self.pieces[t] for t in ids]

    def _ids(self, pieces: list[str]) -> list[int]:
        ids = [self.ids[p] for p in pieces]
        return ids[:-1] if ids and ids[-1] == self.cfg.eos_id else ids
