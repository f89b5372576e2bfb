"""Greedy and batched beam search over Seq2Seq.encode / decode_step (PyTorch reference); the
search rule and the output-length limit are training.seq2seq.beam's, shared with the server."""
from __future__ import annotations

import numpy as np
import torch

from .beam import NEG_INF, Hypothesis, candidates, force_prefix, output_limit, select
from .model import Seq2Seq


@torch.no_grad()
def greedy(model: Seq2Seq, src: torch.Tensor, src_tags: torch.Tensor | None = None,
           max_len_a: float = 1.5, max_len_b: int = 10) -> list[list[int]]:
    cfg = model.cfg
    enc = model.encode(src, src_tags)
    rows = src.shape[0]
    max_len = _max_lengths(src, cfg.pad_id, max_len_a, max_len_b, cfg.max_positions).to(src.device)
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


def _max_lengths(src, pad_id, a, b, max_positions) -> torch.Tensor:
    """Each sentence's output limit: at most max_positions - 1 (the position table's size)."""
    return torch.tensor([output_limit(n, a, b, max_positions - 1) for n in src.ne(pad_id).sum(1).tolist()])


@torch.no_grad()
def beam_search(model: Seq2Seq, src: torch.Tensor, src_tags: torch.Tensor | None = None, beam: int = 4,
                length_penalty: float = 1.0, max_len_a: float = 1.5, max_len_b: int = 10,
                n_best: int = 1, prefixes: list[list[int]] | None = None) -> list[list[Hypothesis]]:
    """Batched beam search. A sentence is finished once it holds `beam` finished hypotheses
    (or hits its max length); finished sentences leave the batch, so later steps get cheaper.
    Scores are log P / len^length_penalty (len counts EOS). `prefixes`: per sentence, target
    tokens its output must begin with (training.seq2seq.beam.force_prefix)."""
    if not 1 <= n_best <= beam:
        raise ValueError("n_best must be between 1 and beam")
    cfg = model.cfg
    n_sent = src.shape[0]
    enc = model.encode(src, src_tags)
    max_len = _max_lengths(src, cfg.pad_id, max_len_a, max_len_b, cfg.max_positions).numpy()
    finished: list[list[Hypothesis]] = [[] for _ in range(n_sent)]
    # The search's own state is NumPy, as the rule's (training.seq2seq.beam); the model gets torch.
    alive = np.arange(n_sent)  # sentence ids still searching
    # Row b*beam + k is beam k of alive sentence b. Only beam 0 is live at step 0.
    scores = np.full((n_sent, beam), NEG_INF, np.float32)
    scores[:, 0] = 0.0
    held = np.zeros(n_sent, np.int64)  # finished hypotheses per alive sentence
    tokens = torch.full((n_sent * beam,), cfg.bos_id, dtype=torch.long, device=src.device)
    history = np.empty((n_sent * beam, 0), np.int64)
    cache = None
    for step in range(int(max_len.max())):
        log_probs, cache = model.decode_step(tokens, step, enc, cache, beam)
        n = len(alive)
        for b, sentence in enumerate(alive.tolist()) if prefixes else ():
            if step < len(prefixes[sentence]):
                force_prefix(log_probs, slice(b * beam, (b + 1) * beam), prefixes[sentence][step])
        beams = np.full(n, beam)
        top = log_probs.topk(min(2 * beam, log_probs.shape[-1]), dim=1)
        cand = candidates(scores.reshape(-1), top.values.float().cpu().numpy(), top.indices.cpu().numpy(), beams,
                          2 * beam)
        pick = select(cand.scores, cand.tokens == cfg.eos_id, step + 1 >= max_len[alive], beams, held)
        ends = pick.finishing
        for b, row, t, s in zip(ends.nonzero()[0].tolist(), cand.rows[ends].tolist(), cand.tokens[ends].tolist(),
                                cand.scores[ends].tolist()):
            finished[int(alive[b])].append(Hypothesis.ending(history[row].tolist(), t, s, length_penalty, cfg.eos_id))
        keep = np.flatnonzero(~pick.done)
        if not len(keep):
            break
        # each sentence's kept candidates, in rank order, fill its beam; the rest stay dead (-inf)
        take = np.argsort(~pick.kept[keep], axis=1, kind="stable")[:, :beam]
        filled = np.take_along_axis(pick.kept[keep], take, 1)
        rows = np.where(filled, np.take_along_axis(cand.rows[keep], take, 1), 0).reshape(-1)
        picked = np.where(filled, np.take_along_axis(cand.tokens[keep], take, 1), cfg.eos_id).reshape(-1)
        scores = np.where(filled, np.take_along_axis(cand.scores[keep], take, 1), np.float32(NEG_INF))
        alive, held = alive[keep], held[keep] + pick.finishing[keep].sum(1)
        history = np.concatenate([history[rows], picked[:, None]], 1)
        tokens, moved = torch.from_numpy(picked).to(src.device), torch.from_numpy(rows).to(src.device)
        cache = [(k.index_select(0, moved), v.index_select(0, moved)) for k, v in cache]
        if len(keep) < enc.src_pad.shape[0]:
            enc = enc.select(torch.from_numpy(keep).to(src.device))
    return [sorted(h, key=lambda x: -x.score)[:n_best] for h in finished]
