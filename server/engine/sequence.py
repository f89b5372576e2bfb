"""One source text in the engine: its input, options, search results and timings.

A Sequence is created by the service, waits in the scheduler, then lives in the running batch
as 1..beam rows until it finishes. `on_done` is called exactly once, from the engine thread,
with the sequence itself: status "ok" (hypotheses filled), or an error status and message."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from training.seq2seq.beam import Hypothesis

from .options import DecodingOptions

_ids = itertools.count()

OK, CANCELLED, DEADLINE, UNAVAILABLE, FAILED = "ok", "cancelled", "deadline_exceeded", "unavailable", "failed"

@dataclass(eq=False)
class Sequence:
    src: list[int]  # source piece ids, EOS included
    options: DecodingOptions
    max_len: int  # output tokens the search may generate (EOS included)
    on_done: Callable[["Sequence"], None]
    tags: list[int] | None = None  # source POS-tag ids for POS models
    deadline: float | None = None  # time.monotonic() value
    priority: int = 0  # its call's: higher is admitted first (server.engine.scheduler)
    call: int | None = None  # which call's line it waited in: set by the scheduler, counted by its per-call cap
    bulk: bool = False  # its call has several texts: set by the scheduler, whose bulk share counts it
    id: int = field(default_factory=lambda: next(_ids))
    # search state
    step: int = 0  # decoding steps it took: set when it leaves the batch
    joined: int = 0  # the engine's step count when it joined the batch: steps left = max_len - (now - joined)
    finished: list[Hypothesis] = field(default_factory=list)
    cancelled: bool = False  # set from another thread; the engine drops the rows at its next step
    # outcome
    status: str | None = None
    message: str = ""
    hypotheses: list[Hypothesis] = field(default_factory=list)
    # timings (time.monotonic): created, admitted into the batch, encoded, done
    created: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    encoded: float | None = None
    done: float | None = None
    cache_hit: bool = False  # the encoder did not run for it (encoder cache or result cache)
    result_cache_hit: bool = False  # answered from the result cache: no decoding either

    @property
    def rows_budget(self) -> int:
        """Its own size in beam x tokens: beam x (source + output limit). Admission charges a batch by
        its longest output limit instead (scheduler.batch_cost); the per-call cap counts this."""
        return self.options.beam * (len(self.src) + self.max_len)

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def finish(self, status: str, message: str = "", observe: Callable[["Sequence"], None] | None = None) -> None:
        """Settle the outcome, let `observe` record it (metrics), then hand it over (on_done): in
        this order, so that a client never sees a result its metrics do not yet count."""
        if self.status is not None:
            return
        self.status, self.message, self.done = status, message, time.monotonic()
        if status == OK:
            self.hypotheses = sorted(self.finished, key=lambda h: -h.score)[: self.options.n_best]
        if observe is not None:
            observe(self)
        self.on_done(self)
