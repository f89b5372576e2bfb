"""Translate a list of texts with a Seq2Seq model: batching by length, order restored."""
from __future__ import annotations

import torch

from .data import source_batches
from .seq2seq.inputs import align_tags, encode_source
from .seq2seq.model import Seq2Seq
from .seq2seq.search import beam_search, greedy


@torch.no_grad()
def corpus_translate(model: Seq2Seq, sp, texts: list[str], beam: int = 4, length_penalty: float = 1.0,
                     max_src_len: int = 128, batch_tokens: int = 3000, tags: list[list[int]] | None = None,
                     src_lang: str | None = None, max_len_a: float = 1.5, max_len_b: int = 10) -> list[str]:
    """One detokenised output per input text, in input order."""
    model.eval()
    src, tags = source_inputs(model, sp, texts, src_lang, max_src_len, tags)
    out: list[str] = [""] * len(texts)
    device = model.embed.weight.device
    for ids, src_batch, tag_batch in source_batches(src, batch_tokens, tags):
        src_batch, tag_batch = src_batch.to(device), None if tag_batch is None else tag_batch.to(device)
        if beam == 1:
            results = greedy(model, src_batch, tag_batch, max_len_a, max_len_b)
        else:
            results = [h[0].tokens for h in beam_search(model, src_batch, tag_batch, beam, length_penalty,
                                                        max_len_a, max_len_b)]
        for i, tokens in zip(ids, results):
            out[i] = sp.decode(tokens)
    return out


def source_inputs(model: Seq2Seq, sp, texts: list[str], src_lang: str | None, max_src_len: int,
                  tags: list[list[int]] | None = None) -> tuple[list[list[int]], list[list[int]] | None]:
    """Each text's piece ids (EOS included) and, for a model that reads them, its POS tags (given
    per word, or tagged here) aligned to the ids; None for a model that does not."""
    ids = [encode_source(sp, t, max_src_len) for t in texts]
    tags = source_tags(model, sp, texts, src_lang) if tags is None else tags
    return ids, None if tags is None else align_tags(tags, ids)


def source_tags(model: Seq2Seq, sp, texts: list[str], src_lang: str | None) -> list[list[int]] | None:
    """The texts' POS tags (per word, align_tags fits them to the pieces) for a model that reads
    them; None for one that does not."""
    if not model.cfg.pos_tags:
        return None
    if src_lang is None:
        raise ValueError("a POS-tag model needs the source language to tag its input")
    from .seq2seq.pos_tags import tag_corpus  # slow import: only POS models need it

    return tag_corpus(texts, src_lang, sp)
