"""Greedy and batched beam search over Seq2Seq.encode / decode_step (PyTorch reference)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import Seq2Seq


@dataclass
class Hypothesis:
    tokens: list[int]  # without BOS/EOS
    score: float  # length-normalised log-probability
    log_prob: float


@torch.no_grad()
def greedy(model: Seq2Seq, src: torch.Tensor, src_tags: torch.Tensor | None = None,
           max_len_a: float = 1.5, max_len_b: int = 10) -> list[list[int]]:
    cfg = model.cfg
    enc = model.encode(src, src_tags)
    rows = src.shape[0]
    max_len = _max_lengths(src, cfg.pad_id, max_len_a, max_len_b, cfg.max_positions)
    tokens = torch.full((rows,), cfg.bos_id, dtype=torch.long, device=src.device)
    out = [[] for _ in range(rows)]
    alive = torch.arange(rows, device=src.device)
    cache = None
    for step in range(int(max_len.max())):
        log_probs, cache = model.decode_step(tokens, step, enc, cache)
        tokens = log_probs.argmax(-1)
        done = tokens.eq(cfg.eos_id) | (step + 1 >= max_len[alive])
        for row, tok in zip(alive.tolist(), tokens.tolist()):
            if tok != cfg.eos_id:
                out[row].append(tok)
        if done.all():
            break
        if done.any():
            keep = (~done).nonzero().squeeze(1)
            alive, tokens = alive[keep], tokens[keep]
            enc = enc.select(keep)
            cache = [(k.index_select(0, keep), v.index_select(0, keep)) for k, v in cache]
    return out


def _max_lengths(src, pad_id, a, b, limit):
    src_len = src.ne(pad_id).sum(1)
    return (src_len.float() * a + b).long().clamp(max=limit - 1)


@torch.no_grad()
def beam_search(model: Seq2Seq, src: torch.Tensor, src_tags: torch.Tensor | None = None, beam: int = 4,
                length_penalty: float = 1.0, max_len_a: float = 1.5, max_len_b: int = 10,
                n_best: int = 1) -> list[list[Hypothesis]]:
    """Batched beam search. A sentence is finished once it holds `beam` finished hypotheses
    (or hits its max length); finished sentences leave the batch, so later steps get cheaper.
    Scores are log P / len^length_penalty (len counts EOS)."""
    if not 1 <= n_best <= beam:
        raise ValueError("n_best must be between 1 and beam")
    cfg = model.cfg
    n_sent = src.shape[0]
    enc = model.encode(src, src_tags)
    max_len = _max_lengths(src, cfg.pad_id, max_len_a, max_len_b, cfg.max_positions)
    finished: list[list[Hypothesis]] = [[] for _ in range(n_sent)]
    alive = torch.arange(n_sent)  # sentence ids still searching
    # Row b*beam + k is beam k of alive sentence b. Only beam 0 is live at step 0.
    scores = torch.full((n_sent, beam), float("-inf"))
    scores[:, 0] = 0.0
    tokens = torch.full((n_sent * beam,), cfg.bos_id, dtype=torch.long)
    history = torch.empty((n_sent * beam, 0), dtype=torch.long)
    cache = None
    for step in range(int(max_len.max())):
        log_probs, cache = model.decode_step(tokens, step, enc, cache, beam)
        vocab = log_probs.shape[-1]
        cand = (scores[:, :, None] + log_probs.view(-1, beam, vocab)).view(-1, beam * vocab)
        top_scores, top_ids = cand.topk(2 * beam, dim=1)  # enough to refill beam after EOS picks
        origin, token = (top_ids // vocab).tolist(), (top_ids % vocab).tolist()
        top_scores = top_scores.tolist()
        length = step + 1
        last_step = (length >= max_len[alive]).tolist()
        new_scores = torch.full((len(alive), beam), float("-inf"))
        new_origin = torch.zeros((len(alive), beam), dtype=torch.long)
        new_token = torch.full((len(alive), beam), cfg.eos_id, dtype=torch.long)
        still = []
        for b, sent in enumerate(alive.tolist()):
            filled = 0
            for j in range(2 * beam):
                s, o, t = top_scores[b][j], origin[b][j], token[b][j]
                if s == float("-inf"):
                    break
                if t == cfg.eos_id or last_step[b]:
                    if j < beam:  # only candidates that rank inside the beam may finish
                        prefix = history[b * beam + o].tolist() + ([] if t == cfg.eos_id else [t])
                        norm = s / (length ** length_penalty)
                        finished[sent].append(Hypothesis(prefix, norm, s))
                    continue
                if filled < beam:
                    new_scores[b, filled], new_origin[b, filled], new_token[b, filled] = s, o, t
                    filled += 1
            if len(finished[sent]) < beam and not last_step[b] and filled > 0:
                still.append(b)
        if not still:
            break
        keep = torch.tensor(still)
        rows = (keep[:, None] * beam + new_origin[keep]).flatten()  # source rows of the kept beams
        alive, scores = alive[keep], new_scores[keep]
        tokens = new_token[keep].flatten()
        history = torch.cat([history.index_select(0, rows), tokens[:, None]], 1)
        cache = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in cache]
        if len(keep) < enc.src_pad.shape[0]:
            enc = enc.select(keep)
    return [sorted(h, key=lambda x: -x.score)[:n_best] for h in finished]
