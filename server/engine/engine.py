"""The engine loop: one thread per model that admits, encodes, steps and answers.

    while there is work:
        drop cancelled / expired sequences (their rows leave before the next step)
        admit waiting sequences (scheduler policy), encode them (encoder cache first), join the batch
        one decoder step for every row of every sequence; advance each sequence's beam search
        answer every sequence that finished

Requests are submitted from any thread (the gRPC event loop); each sequence's on_done runs on
this thread, so it must only hand the result over (e.g. loop.call_soon_threadsafe).
"""
from __future__ import annotations

import logging
import threading
import time

import torch

from kernels.encoder_cache import EncoderCache, cache_key, encode_cached

from .batch import Batch
from .scheduler import Scheduler
from .sequence import CANCELLED, DEADLINE, FAILED, OK, UNAVAILABLE, Sequence

log = logging.getLogger("server.engine")


class Draining(Exception):
    pass


class Observer:
    """What the engine reports; server.metrics implements it for Prometheus."""

    def queue_depth(self, n: int) -> None: ...
    def encoded(self, n_sequences: int, seconds: float) -> None: ...
    def stepped(self, rows: int, seconds: float) -> None: ...
    def finished(self, seq: Sequence) -> None: ...


class Engine:
    def __init__(self, backend, version: str, scheduler: Scheduler, cache: EncoderCache | None = None,
                 observer: Observer | None = None, name: str = "model"):
        self.backend, self.version, self.scheduler = backend, version, scheduler
        self.cache = cache if cache is not None else EncoderCache(0)
        self.observer = observer or Observer()
        self.name = name
        cfg = backend.cfg
        self.batch = Batch(cfg, cfg.n_heads, cfg.d_model // cfg.n_heads, torch.device("cpu"))
        self._cond = threading.Condition()
        self._accepting = True
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)
        self.steps = 0  # decoder steps run (tests and benchmarks read it)

    # ---- API for other threads ---------------------------------------------------------------
    def start(self) -> "Engine":
        self._thread.start()
        return self

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue a request's sequences (all or none). Raises QueueFull or Draining."""
        with self._cond:
            if not self._accepting:
                raise Draining(f"model {self.name} is shutting down")
            self.scheduler.add(seqs)
            self.observer.queue_depth(len(self.scheduler))
            self._cond.notify()

    def wake(self) -> None:
        """Re-check cancellations now (a waiting sequence may have been cancelled)."""
        with self._cond:
            self._cond.notify()

    def drain(self) -> None:
        """Refuse new work; what is queued or running still completes."""
        with self._cond:
            self._accepting = False
            self._cond.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new work, fail what is left with UNAVAILABLE, and end the thread."""
        with self._cond:
            self._accepting = False
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def idle(self) -> bool:
        with self._cond:
            return not self.scheduler.waiting and not len(self.batch)

    # ---- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self.scheduler.waiting and not len(self.batch):
                    self._cond.wait()
                if self._stop:
                    break
            self.iterate()
        self._fail_all([], UNAVAILABLE, f"model {self.name} stopped before this text was decoded")

    def iterate(self) -> None:
        """One turn of the loop: drop, admit + encode, one decoder step. The thread calls it;
        so can a caller that drives the engine itself (tests, the offline benchmark)."""
        with self._cond:
            self._drop_doomed()
            admitted = self.scheduler.admit(len(self.batch), self.batch.budget_used())
            self.observer.queue_depth(len(self.scheduler))
        try:
            if admitted:
                self._admit(admitted)
            if len(self.batch):
                self._step()
        except Exception as e:  # a backend failure fails the batch, never the server
            log.exception("engine %s: step failed", self.name)
            self._fail_all(admitted, FAILED, f"decoding failed: {type(e).__name__}: {e}")

    def run_until_idle(self) -> None:
        """Drive the engine on the calling thread until nothing is queued or running."""
        while not self.idle():
            self.iterate()

    def _drop_doomed(self) -> None:
        now = time.monotonic()
        doomed = lambda s: s.cancelled or s.expired(now)  # noqa: E731
        for seq in self.scheduler.drop(doomed):
            self._finish_doomed(seq)
        dropped = {i for i, s in enumerate(self.batch.seqs) if doomed(s)}
        if dropped:
            seqs = [self.batch.seqs[i] for i in dropped]
            self.batch.remove(dropped)
            for seq in seqs:
                self._finish_doomed(seq)

    def _finish_doomed(self, seq: Sequence) -> None:
        if seq.cancelled:
            seq.finish(CANCELLED, "the client cancelled the call", self.observer.finished)
        else:
            seq.finish(DEADLINE, f"the deadline passed after {seq.step} decoding steps", self.observer.finished)

    def _admit(self, seqs: list[Sequence]) -> None:
        start = time.monotonic()
        for s in seqs:
            s.admitted = start
            s.cache_hit = cache_key(self.version, s.src, s.tags) in self.cache
        tags = [s.tags for s in seqs] if self.backend.cfg.pos_tags else None
        enc = encode_cached(self.backend, self.cache, self.version, [s.src for s in seqs], tags)
        done = time.monotonic()
        for s in seqs:
            s.encoded = done
        self.observer.encoded(len(seqs), done - start)
        self.batch.join(seqs, enc)

    @torch.no_grad()
    def _step(self) -> None:
        start = time.monotonic()
        rows = self.batch.rows
        log_probs, cache = self.backend.step(*self.batch.step_inputs())
        finished = self.batch.advance(log_probs, cache)
        self.steps += 1
        self.observer.stepped(rows, time.monotonic() - start)
        for seq in finished:
            seq.finish(OK, observe=self.observer.finished)

    def _fail_all(self, extra: list[Sequence], status: str, message: str) -> None:
        with self._cond:
            seqs = list(self.batch.seqs) + list(self.scheduler.waiting) + extra
            self.scheduler.waiting.clear()
        self.batch = Batch(self.batch.cfg, self.batch.n_heads, self.batch.d_head, self.batch.device)
        for seq in seqs:
            seq.finish(status, message, self.observer.finished)
