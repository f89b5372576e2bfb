"""Training data: SentencePiece trained on a corpus, the pairs that fit, target ids, token-based
batches (and length-sorted inference batches for offline decoding)."""
from __future__ import annotations

import io
import random
from dataclasses import dataclass

import sentencepiece as spm
import torch

from .corpora import Example
from .seq2seq.inputs import BOS, EOS, PAD, UNK, pad

RARE_WORD = "<unk>"  # Gigaword's stand-in for a rare word, a token of its text


def train_sentencepiece(texts: list[str], vocab_size: int) -> bytes:
    """A unigram model trained on the given (training-split) texts; returns its bytes. Where the
    texts use RARE_WORD, it is one piece that decodes to itself (else '<' and '>' are unknown
    characters and an output reads ' ⁇ unk ⁇ '); the unknown piece is then named <unknown>."""
    marked = any(RARE_WORD in t for t in texts)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(t for t in texts if t.strip()), model_writer=model,
        vocab_size=vocab_size, model_type="unigram", character_coverage=1.0,
        pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS, input_sentence_size=2_000_000,
        shuffle_input_sentence=False, seed_sentencepiece_size=1_000_000,
        num_threads=2, minloglevel=2,
        **({"unk_piece": "<unknown>", "user_defined_symbols": [RARE_WORD]} if marked else {}))
    return model.getvalue()


def length_filter(examples: list[Example], sp, max_src_len: int, max_tgt_len: int,
                  truncate_source: bool) -> list[Example]:
    """Training pairs that fit: over-long targets are dropped; over-long sources are dropped for
    translation and truncated for summarisation (articles and e-mails run long; the lead matters)."""
    return [e for e in examples if len(sp.encode(e.target)) + 2 <= max_tgt_len
            and (truncate_source or len(sp.encode(e.source)) + 1 <= max_src_len)]


def encode_target(sp, text: str, max_len: int) -> list[int]:
    """BOS + pieces + EOS; the model reads [:-1] and predicts [1:]."""
    return [BOS] + sp.encode(text)[: max_len - 2] + [EOS]


@dataclass
class Batch:
    src: torch.Tensor  # (B, S) padded with PAD
    tgt: torch.Tensor  # (B, T+1): BOS ... EOS, padded
    src_tags: torch.Tensor | None = None
    index: torch.Tensor | None = None  # positions in the original example list

    @property
    def n_tokens(self) -> int:
        return int((self.tgt[:, 1:] != PAD).sum())

    def to(self, device: torch.device) -> Batch:
        return Batch(*(None if t is None else t.to(device) for t in (self.src, self.tgt, self.src_tags, self.index)))


class TokenBatcher:
    """Length-bucketed batches of at most `max_tokens` (padded) tokens, reshuffled every epoch.

    Deterministic given (seed, epoch), so a resumed run sees the same batches.
    """

    def __init__(self, src: list[list[int]], tgt: list[list[int]], max_tokens: int, seed: int = 1,
                 tags: list[list[int]] | None = None):
        self.src, self.tgt, self.tags = src, tgt, tags
        self.max_tokens, self.seed = max_tokens, seed

    def batches(self, epoch: int) -> list[list[int]]:
        rng = random.Random(self.seed * 100_003 + epoch)
        order = list(range(len(self.src)))
        rng.shuffle(order)  # random tie-breaks inside a length
        order.sort(key=lambda i: (len(self.src[i]), len(self.tgt[i])))
        batches, current, longest = [], [], 0
        for i in order:
            size = max(len(self.src[i]), len(self.tgt[i]))
            if current and max(longest, size) * (len(current) + 1) > self.max_tokens:
                batches.append(current)
                current, longest = [], 0
            current.append(i)
            longest = max(longest, size)
        if current:
            batches.append(current)
        rng.shuffle(batches)
        return batches

    def shard(self, ids: list[int], rank: int, parts: int) -> list[int]:
        """Process `rank`'s share of a batch split `parts` ways: longest examples first, each to
        the share with the fewest tokens so far (ties to the lowest rank), so the shares carry
        about equal work. Deterministic, so every process derives the same split."""
        size = {i: len(self.src[i]) + len(self.tgt[i]) for i in ids}
        owner, tokens = {}, [0] * parts
        for i in sorted(ids, key=size.get, reverse=True):
            owner[i] = tokens.index(min(tokens))
            tokens[owner[i]] += size[i]
        return [i for i in ids if owner[i] == rank]

    def collate(self, ids: list[int]) -> Batch:
        tags = pad([self.tags[i] for i in ids]) if self.tags is not None else None
        return Batch(pad([self.src[i] for i in ids]), pad([self.tgt[i] for i in ids]), tags,
                     torch.tensor(ids))


def source_batches(src: list[list[int]], max_tokens: int, tags: list[list[int]] | None = None):
    """Inference batches sorted by length (fewer pads); yields (original indices, Batch-like)."""
    order = sorted(range(len(src)), key=lambda i: len(src[i]))
    current: list[int] = []
    for i in order + [None]:
        if i is not None and (not current or len(src[i]) * (len(current) + 1) <= max_tokens):
            current.append(i)
            continue
        if current:
            yield current, pad([src[j] for j in current]), (pad([tags[j] for j in current])
                                                             if tags is not None else None)
        current = [i] if i is not None else []
