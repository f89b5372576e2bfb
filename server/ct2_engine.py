"""CTranslate2 behind the engine's interface, with request-level batching.

CTranslate2 runs its own beam search over whole batches, so texts cannot join a batch mid-way:
the loop takes the waiting texts that fit the budget, makes one CTranslate2 call per group of
texts with the same options, and answers them. Everything else (queue bound, cancellation,
deadlines, draining, metrics) is the stepping engine's."""
from __future__ import annotations

import time
from collections import defaultdict

from .engine.engine import Engine
from .engine.sequence import Hypothesis


class Ct2Engine(Engine):
    def iterate(self) -> None:
        with self._cond:
            self._drop_doomed()
            seqs = self.scheduler.admit(0, 0)
            self.observer.queue_depth(self.queued())
        if not seqs:
            return
        start = time.monotonic()
        for s in seqs:
            s.admitted = s.encoded = start
        groups = defaultdict(list)
        for s in seqs:
            groups[s.options].append(s)
        try:
            for options, members in groups.items():
                self._translate(options, members)
        except Exception as e:  # a backend failure fails these texts, never the server
            self._fail_all(seqs, "failed", f"decoding failed: {type(e).__name__}: {e}")
            return
        self.steps += 1
        self.observer.stepped(sum(s.options.beam for s in seqs), time.monotonic() - start)
        for s in seqs:
            self._answer(s)

    def _translate(self, options, seqs) -> None:
        results = self.backend.translate(
            [s.src for s in seqs], beam=options.beam, length_penalty=options.length_penalty,
            max_len_a=options.max_len_a, max_len_b=options.max_len_b, max_length=options.max_length or None,
            min_length=options.min_length, n_best=options.n_best, no_repeat_ngram_size=options.no_repeat_ngram)
        for s, n_best in zip(seqs, results):
            for t in n_best:
                length = len(t.tokens) + 1  # EOS counts, as in the stepping engine
                s.finished.append(Hypothesis(t.tokens, t.score, t.score * length ** options.length_penalty))
