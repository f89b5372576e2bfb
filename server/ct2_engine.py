"""CTranslate2 behind the engine's interface, with request-level batching.

CTranslate2 runs its own beam search over whole batches, so texts cannot join a batch mid-way:
the loop takes the waiting texts that fit the budget, makes one CTranslate2 call per group of
texts with the same options and output limit, and answers them. Everything else (queue bound,
cancellation, deadlines, draining, metrics) is the stepping engine's."""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace

from training.seq2seq.beam import Hypothesis

from .engine.engine import Engine


class Ct2Engine(Engine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seconds = {"translate": 0.0}  # one CTranslate2 call is both passes and the search

    def _turn(self) -> None:
        with self._cond:
            self._drop_doomed()
            seqs = self.scheduler.admit([])
            self.observer.queue_depth(self.queued())
        if not seqs:
            return
        start = time.monotonic()
        for s in seqs:
            s.admitted = s.encoded = start
        groups = defaultdict(list)  # CT2 takes one length limit per call, and a prefix per text
        for s in seqs:
            groups[replace(s.options, prefix=()), s.max_len].append(s)
        try:
            for (options, limit), members in groups.items():
                self._translate(options, limit, members)
        except Exception as e:  # a backend failure fails these texts, never the server
            self._fail_all(seqs, "failed", f"decoding failed: {type(e).__name__}: {e}")
            return
        self.steps += 1
        seconds = time.monotonic() - start
        self.seconds["translate"] += seconds
        self.observer.stepped(sum(s.options.beam for s in seqs), seconds)
        for s in seqs:
            self._answer(s)

    def _translate(self, options, limit, seqs) -> None:
        """One CT2 call; the texts' own output limit (Sequence.max_len, as the stepping engine's)
        is passed as CT2's absolute limit, so both engines stop at the same length."""
        results = self.backend.translate(
            [s.src for s in seqs], beam=options.beam, length_penalty=options.length_penalty, max_length=limit,
            min_length=options.min_length, n_best=options.n_best, no_repeat_ngram_size=options.no_repeat_ngram,
            prefixes=[list(s.options.prefix) for s in seqs] if any(s.options.prefix for s in seqs) else None)
        for s, n_best in zip(seqs, results):
            for t in n_best:
                length = len(t.tokens) + 1  # EOS counts, as in the stepping engine
                s.finished.append(Hypothesis(t.tokens, t.score, t.score * length ** options.length_penalty))
