"""What a Seq2Seq model reads, from text: the special ids, the SentencePiece model, the style a
dataset's model needs plain input in, source ids (pieces + EOS), their POS tags aligned and padded
batches. Written once for training, offline search and the server."""
from __future__ import annotations

import re

import sentencepiece as spm
import torch

PAD, UNK, BOS, EOS = 0, 1, 2, 3


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


def load_sentencepiece(path_or_bytes) -> spm.SentencePieceProcessor:
    sp = spm.SentencePieceProcessor()
    if isinstance(path_or_bytes, bytes):
        sp.load_from_serialized_proto(path_or_bytes)
    else:
        sp.load(str(path_or_bytes))
    return sp


def encode_source(sp, text: str, max_len: int) -> list[int]:
    return sp.encode(text)[: max_len - 1] + [EOS]


def align_tags(tags: list[list[int]], src: list[list[int]]) -> list[list[int]]:
    """One POS tag per source id: truncated like the pieces, the EOS gets the PAD tag (0)."""
    return [t[: len(s) - 1] + [0] * (len(s) - len(t[: len(s) - 1])) for t, s in zip(tags, src)]


def pad(seqs: list[list[int]], value: int = PAD) -> torch.Tensor:
    out = torch.full((len(seqs), max(len(s) for s in seqs)), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out
