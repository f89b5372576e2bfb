"""Real data from ../shared/data: loaders, SentencePiece, token-based batches."""
from __future__ import annotations

import gzip
import io
import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm
import torch

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = Path(os.environ.get("SHARED_DATA", PROJECT_ROOT.parent / "shared" / "data"))

LANGS = ("de", "en", "fr")
SPLITS = {
    "multi30k": ("train", "val", "test_2016_flickr", "test_2017_flickr"),
    "gigaword": ("train", "valid"),
    "aeslc": ("train", "dev"),
}
PAD, UNK, BOS, EOS = 0, 1, 2, 3


@dataclass
class Example:
    source: str
    refs: list[str]  # the first is the training target; AESLC dev has four

    @property
    def target(self) -> str:
        return self.refs[0]


def _lines(path: Path) -> list[str]:
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: the data must be at {DATA_DIR} (set SHARED_DATA)")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def load_examples(dataset: str, split: str, src_lang: str = "de", tgt_lang: str = "en") -> list[Example]:
    if dataset not in SPLITS:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {sorted(SPLITS)}")
    if split not in SPLITS[dataset]:
        raise ValueError(f"{dataset} has no split {split!r}; choose from {SPLITS[dataset]}")
    if dataset == "multi30k":
        if src_lang not in LANGS or tgt_lang not in LANGS or src_lang == tgt_lang:
            raise ValueError(f"multi30k directions are two different languages among {LANGS}")
        src = _lines(DATA_DIR / "multi30k" / f"{split}.{src_lang}.gz")
        tgt = _lines(DATA_DIR / "multi30k" / f"{split}.{tgt_lang}.gz")
        return [Example(s, [t]) for s, t in zip(src, tgt, strict=True)]
    if dataset == "gigaword":
        src = _lines(DATA_DIR / "gigaword10k" / f"{split}.article.gz")
        tgt = _lines(DATA_DIR / "gigaword10k" / f"{split}.title.gz")
        return [Example(s, [t]) for s, t in zip(src, tgt, strict=True)]
    rows = [json.loads(line) for line in _lines(DATA_DIR / "aeslc" / f"{split}.jsonl.gz")]
    return [Example(r["email"], [r["subject"]] + [r[k] for k in ("ann0", "ann1", "ann2") if k in r])
            for r in rows]


RARE_WORD = "<unk>"  # Gigaword's stand-in for a rare word, a token of its text


def normalize_gigaword(text: str) -> str:
    """Plain English in the style of the Gigaword corpus (Rush et al.'s preparation), which is all a
    Gigaword model has seen: lower case, every digit '#', Penn Treebank tokens (-lrb- -rrb-, `` '',
    &amp;, \\/, 's and n't split off, punctuation apart except inside numbers such as #,###).
    The corpus's own lines come back unchanged."""
    t = text.lower().replace("’", "'").replace("‘", "'").replace("“", '"').replace("”", '"')
    t = re.sub(r"\d", "#", t)
    t = re.sub(r"&(?!amp;)", " &amp; ", t)
    t = re.sub(r"(?<!\\)/", r"\\/", t)
    t = t.replace("(", " -lrb- ").replace(")", " -rrb- ")
    quoted = t.split('"')  # straight double quotes open, then close
    t = "".join(part + ("" if i == len(quoted) - 1 else " `` " if i % 2 == 0 else " '' ") for i, part in enumerate(quoted))
    t = re.sub(r"(\w)(n't)\b", r"\1 \2", t)
    t = re.sub(r"(\w)('s|'re|'ve|'ll|'d|'m)\b", r"\1 \2", t)
    t = re.sub(r"(?<!#)(?<!&amp)([,;:!?])|(?<!&amp)([,;:!?])(?!#)", r" \1\2 ", t)
    t = re.sub(r"(?<!\.)\.\s*$", " .", t)  # the closing full stop, not an abbreviation's
    return " ".join(t.split())


INPUT_STYLES = {"gigaword": normalize_gigaword}  # dataset -> what turns plain text into its style


def input_style(dataset: str) -> str | None:
    """The name of the normalisation a model trained on `dataset` needs on plain input, if any."""
    return dataset if dataset in INPUT_STYLES else None


def normalize_input(style: str | None, text: str) -> str:
    return INPUT_STYLES[style](text) if style else text


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


def load_sentencepiece(path_or_bytes) -> spm.SentencePieceProcessor:
    sp = spm.SentencePieceProcessor()
    if isinstance(path_or_bytes, bytes):
        sp.load_from_serialized_proto(path_or_bytes)
    else:
        sp.load(str(path_or_bytes))
    return sp


def encode_source(sp, text: str, max_len: int) -> list[int]:
    return sp.encode(text)[: max_len - 1] + [EOS]


def length_filter(examples: list[Example], sp, max_src_len: int, max_tgt_len: int,
                  truncate_source: bool) -> list[Example]:
    """Training pairs that fit: over-long targets are dropped; over-long sources are dropped for
    translation and truncated for summarisation (articles and e-mails run long; the lead matters)."""
    return [e for e in examples if len(sp.encode(e.target)) + 2 <= max_tgt_len
            and (truncate_source or len(sp.encode(e.source)) + 1 <= max_src_len)]


def encode_target(sp, text: str, max_len: int) -> list[int]:
    """BOS + pieces + EOS; the model reads [:-1] and predicts [1:]."""
    return [BOS] + sp.encode(text)[: max_len - 2] + [EOS]


def align_tags(tags: list[list[int]], src: list[list[int]]) -> list[list[int]]:
    """One POS tag per source id: truncated like the pieces, the EOS gets the PAD tag (0)."""
    return [t[: len(s) - 1] + [0] * (len(s) - len(t[: len(s) - 1])) for t, s in zip(tags, src)]


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


def pad(seqs: list[list[int]], value: int = PAD) -> torch.Tensor:
    out = torch.full((len(seqs), max(len(s) for s in seqs)), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


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
