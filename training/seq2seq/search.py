"""Greedy and batched beam search over Seq2Seq.encode / decode_step (PyTorch reference); the
search rule and the output-length limit are training.seq2seq.beam's, shared with the server."""
from __future__ import annotations

import torch

from .beam import NEG_INF, Hypothesis, candidates, force_prefix, output_limit, select
from .model import Seq2Seq


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
    max_len = _max_lengths(src, cfg.pad_id, max_len_a, max_len_b, cfg.max_positions)
    finished: list[list[Hypothesis]] = [[] for _ in range(n_sent)]
    alive = torch.arange(n_sent)  # sentence ids still searching
    # Row b*beam + k is beam k of alive sentence b. Only beam 0 is live at step 0.
    scores = torch.full((n_sent, beam), NEG_INF)
    scores[:, 0] = 0.0
    held = torch.zeros(n_sent, dtype=torch.long)  # finished hypotheses per alive sentence
    tokens = torch.full((n_sent * beam,), cfg.bos_id, dtype=torch.long)
    history = torch.empty((n_sent * beam, 0), dtype=torch.long)
    cache = None
    for step in range(int(max_len.max())):
        log_probs, cache = model.decode_step(tokens, step, enc, cache, beam)
        n = len(alive)
        for b, sentence in enumerate(alive.tolist()) if prefixes else ():
            if step < len(prefixes[sentence]):
                force_prefix(log_probs, slice(b * beam, (b + 1) * beam), prefixes[sentence][step])
        beams = torch.full((n,), beam)
        top = log_probs.topk(min(2 * beam, log_probs.shape[-1]), dim=1)
        cand = candidates(scores.flatten(), *top, beams, 2 * beam)
        pick = select(cand.scores, cand.tokens == cfg.eos_id, step + 1 >= max_len[alive], beams, held)
        ends = pick.finishing
        for b, row, t, s in zip(ends.nonzero()[:, 0].tolist(), cand.rows[ends].tolist(), cand.tokens[ends].tolist(),
                                cand.scores[ends].tolist()):
            finished[int(alive[b])].append(Hypothesis.ending(history[row].tolist(), t, s, length_penalty, cfg.eos_id))
        keep = (~pick.done).nonzero()[:, 0]
        if not len(keep):
            break
        # each sentence's kept candidates, in rank order, fill its beam; the rest stay dead (-inf)
        take = (~pick.kept).to(torch.uint8).argsort(dim=1, stable=True)[keep, :beam]
        filled = pick.kept[keep].gather(1, take)
        rows = cand.rows[keep].gather(1, take).masked_fill(~filled, 0).flatten()
        tokens = cand.tokens[keep].gather(1, take).masked_fill(~filled, cfg.eos_id).flatten()
        scores = cand.scores[keep].gather(1, take).masked_fill(~filled, NEG_INF)
        alive, held = alive[keep], held[keep] + pick.finishing[keep].sum(1)
        history = torch.cat([history.index_select(0, rows), tokens[:, None]], 1)
        cache = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in cache]
        if len(keep) < enc.src_pad.shape[0]:
            enc = enc.select(keep)
    return [sorted(h, key=lambda x: -x.score)[:n_best] for h in finished]
