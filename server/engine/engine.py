"""The engine loop: one thread per model that admits, encodes, steps and answers.

    while there is work:
        drop cancelled / expired sequences (their rows leave before the next step)
        admit waiting sequences (scheduler policy), encode them (encoder cache first), join the batch
        one decoder step for every row of every sequence; each sequence's beam-search step (search);
        the rows, their caches included, moved on to the next step (advance)
        answer every sequence that finished

Requests are submitted from any thread (the gRPC event loop); each sequence's on_done runs on
this thread, so it must only hand the result over (e.g. loop.call_soon_threadsafe).

Replicas runs several such loops over one model (CTranslate2's inter_threads, Triton's instance
count): each has its own running batch and thread, the backend and the encoder cache are shared.
They share the GIL too; server.engine.workers runs each loop in its own process instead.
"""
from __future__ import annotations

import gc
import logging
import threading
import time

import torch


from .batch import Batch
from .encoder_cache import EncoderCache, EncoderState, cache_key, encode_cached
from .options import DecodingOptions
from .result_cache import ResultCache, result_key
from .scheduler import QueueFull, Scheduler
from .sequence import CANCELLED, DEADLINE, FAILED, OK, UNAVAILABLE, Sequence

log = logging.getLogger("server.engine")

# Where an engine loop's time goes: encoder passes, decoder steps (the backend), the search between
# them, and moving rows into their next step's state (forked beams' cache slots, encoder state; the
# admitted texts' encoder state written into the batch).
PHASES = ("encode", "decoder", "search", "cache")
TOP_K_PHASE = "decoder-blocks"  # each row's top-k is the backend's step's, from its block maxima (benchmarks record it)

# Padded source pieces per encoder pass (texts x the longest of them). A step may admit hundreds of
# texts; encoded at once, their activations would set ONNX Runtime's memory arena, which keeps its
# peak, to hundreds of MB per model (bench memory), and they grow with length as much as with
# count (the exported GRET routing's votes alone are 8 KB per piece and routed layer). In passes
# of this size the encoder costs the same and holds a fraction.
ENCODE_PIECES = 1024


def encoder_passes(seqs: list[Sequence]) -> list[list[Sequence]]:
    """seqs in order, cut into runs whose padded size stays within ENCODE_PIECES (a text longer
    than that goes alone)."""
    passes, longest = [], 0
    for s in seqs:
        grown = max(longest, len(s.src))
        if passes and grown * (len(passes[-1]) + 1) <= ENCODE_PIECES:
            passes[-1].append(s)
            longest = grown
        else:
            passes.append([s])
            longest = len(s.src)
    return passes


# Steps between admissions under load (Scheduler.admit's pacing) for capsule-routing GRET models,
# whose encoder pass adds the routing on the host and a second graph to the encoder's. Served with
# defaults under 64 callers (the closed loop of bench speed, servers taking turns, 6 rounds, ad hoc):
# every 3rd step gave 1.047x texts/s (1.028-1.074) and 4.4% less worker CPU per text than every step
# (3515669, before pacing); a vanilla model's every 2nd or 3rd step was no faster (0.99x, within noise).
CAPSULE_ADMISSION_INTERVAL = 3


def admission_interval(cfg) -> int:
    """How often, in steps, a loaded engine of this model admits waiting texts."""
    return CAPSULE_ADMISSION_INTERVAL if cfg.capsule else 1


class Draining(Exception):
    pass


class Observer:
    """What the engine reports; server.metrics implements it for Prometheus."""

    def queue_depth(self, n: int) -> None: ...
    def encoded(self, n_sequences: int, seconds: float) -> None: ...
    def stepped(self, rows: int, seconds: float) -> None: ...
    def finished(self, seq: Sequence) -> None: ...
    def turn_ended(self) -> None: ...  # after each turn of the loop: what it reported may leave together


class Engine:
    def __init__(self, backend, version: str, scheduler: Scheduler, cache: EncoderCache | None = None,
                 observer: Observer | None = None, name: str = "model", results: ResultCache | None = None):
        self.backend, self.version, self.scheduler = backend, version, scheduler
        self.cache = cache if cache is not None else EncoderCache(0)
        self.results = results if results is not None else ResultCache(0)
        self.observer = observer or Observer()
        self.name = name
        cfg = backend.cfg
        self.batch = Batch(cfg, cfg.n_heads, cfg.d_model // cfg.n_heads, torch.device(backend.device))
        self.admit_every = admission_interval(cfg)
        self._cond = threading.Condition()
        self._cancels = False  # a client cancelled since the last look at the waiting texts (wake)
        self.accepting = True
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)
        self.steps = 0  # decoder steps run (tests and benchmarks read it)
        self.seconds = dict.fromkeys(PHASES, 0.0)  # wall seconds of this loop's thread, by phase
        self.replicas: Replicas | None = None  # the group this loop belongs to, if any

    def queued(self) -> int:
        """Texts waiting for this model (all replicas'): what the queue-depth metric reports."""
        return self.replicas.queued() if self.replicas else len(self.scheduler)

    def running(self) -> int:
        """Texts in the running batch (what the running-sequences gauge reports)."""
        return len(self.batch)

    def load(self) -> int:
        """Budget waiting and running here: where a replica group sends the next text."""
        return sum(s.rows_budget for s in list(self.scheduler.waiting)) + self.batch.budget_used()

    # ---- API for other threads ---------------------------------------------------------------
    def start(self) -> "Engine":
        self._thread.start()
        return self

    def submit(self, seqs: list[Sequence]) -> None:
        """Answer what the result cache holds; queue the rest (all or none: QueueFull or Draining
        leaves every sequence of the request unanswered)."""
        if not self.accepting:
            raise Draining(f"model {self.name} is shutting down")
        hits, misses = split_cached(self.results, self.version, seqs)
        if misses:
            self.enqueue(misses)
        answer_cached(hits, self.observer)

    def enqueue(self, seqs: list[Sequence]) -> None:
        with self._cond:
            if not self.accepting:
                raise Draining(f"model {self.name} is shutting down")
            self.scheduler.add(seqs)
            self.observer.queue_depth(self.queued())
            self._cond.notify()

    def wake(self) -> None:
        """Re-check cancellations now (a waiting sequence may have been cancelled)."""
        with self._cond:
            self._cancels = True
            self._cond.notify()

    def drain(self) -> None:
        """Refuse new work; what is queued or running still completes."""
        with self._cond:
            self.accepting = False
            self._cond.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new work, fail what is left with UNAVAILABLE, and end the thread (an engine that
        its caller drives, never started, fails what is left here)."""
        with self._cond:
            self.accepting = False
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif self._thread.ident is None:
            self._fail_left()

    def _fail_left(self) -> None:
        self._fail_all([], UNAVAILABLE, f"model {self.name} stopped before this text was decoded")

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
        self._fail_left()

    def iterate(self) -> None:
        """One turn of the loop: drop, admit + encode, one decoder step. The thread calls it;
        so can a caller that drives the engine itself (tests, the offline benchmark)."""
        self._turn()
        self.observer.turn_ended()

    @torch.inference_mode()  # the batch's tensors never need autograd; each small op costs ~12% less
    def _turn(self) -> None:
        with self._cond:
            self._drop_doomed()
            admitted = self.scheduler.admit(self.batch.seqs, self.steps, self.admit_every)
            self.observer.queue_depth(self.queued())
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
        if self._cancels or now >= self.scheduler.waiting.earliest:  # else no waiting text is doomed
            self._cancels = False
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
            s.admitted, s.joined = start, self.steps
            s.cache_hit = cache_key(self.version, s.src, s.tags) in self.cache
        parts = []
        for chunk in encoder_passes(seqs):
            tags = [s.tags for s in chunk] if self.backend.cfg.pos_tags else None
            parts.append(encode_cached(self.backend, self.cache, self.version, [s.src for s in chunk], tags))
        enc = parts[0] if len(parts) == 1 else EncoderState.stack(parts)
        done = time.monotonic()
        for s in seqs:
            s.encoded = done
        self.seconds["encode"] += done - start
        self.observer.encoded(len(seqs), done - start)
        self.batch.join(seqs, enc)
        self.seconds["cache"] += time.monotonic() - done  # their encoder state written into the batch's slots

    def _step(self) -> None:
        start = time.monotonic()
        rows = self.batch.rows
        log_probs, top = self.backend.step_top(*self.batch.step_inputs())
        if self.batch.constrained:  # the options' constraints force and ban pieces by id
            log_probs = self.backend.vocabulary(log_probs)
        stepped = time.monotonic()
        choice = self.batch.search(log_probs, top)
        searched = time.monotonic()
        finished = self.batch.advance(choice)
        end = time.monotonic()
        self.steps += 1
        self.seconds["decoder"] += stepped - start
        self.seconds["search"] += searched - stepped
        self.seconds["cache"] += end - searched
        self.observer.stepped(rows, end - start)
        for seq in finished:
            self._answer(seq)

    def _answer(self, seq: Sequence) -> None:
        def record(s: Sequence) -> None:  # before the client hears of it: its next call may repeat it
            self.results.put(result_key(self.version, s), s.hypotheses)
            self.observer.finished(s)

        seq.finish(OK, observe=record)

    def _fail_all(self, extra: list[Sequence], status: str, message: str) -> None:
        with self._cond:
            seqs = list(self.batch.seqs) + list(self.scheduler.waiting) + extra
            self.scheduler.waiting.clear()
        self.batch = Batch(self.batch.cfg, self.batch.n_heads, self.batch.d_head, self.batch.device)
        for seq in seqs:
            seq.finish(status, message, self.observer.finished)


def warm_up(backend) -> None:
    """Decode one made-up text on a throwaway engine over `backend` (no caches, no observer), so
    that a process pays its first decode's costs before it serves, not in a client's first call:
    Numba compiles the beam search's kernels on their first call (seconds; far less where its
    on-disk cache holds them) and ONNX Runtime sizes its memory on its first runs.
    One text covers every kernel: the argument types do not change with the options or the load,
    and its min_length takes it through the constrained options' path too. A model that cannot
    decode it fails here, at start."""
    cfg = backend.cfg
    src = [4 + i % max(1, cfg.vocab_size - 4) for i in range(8)] + [cfg.eos_id]  # ids past the special ones
    seq = Sequence(src, DecodingOptions(min_length=1), 6, lambda s: None,
                   tags=[0] * len(src) if cfg.pos_tags else None)
    engine = Engine(backend, "warm-up", Scheduler(), name="warm-up")
    engine.enqueue([seq])
    engine.run_until_idle()
    if seq.status != OK:
        raise RuntimeError(f"the warm-up decode failed: {seq.message}")


def freeze_loaded() -> None:
    """Keep the collector off what a process loaded before it serves. Modules, models, tokenizers
    and compiled kernels live as long as the process, yet a full collection, which the garbage of
    calls and decoder steps triggers now and then, walks all of them: in an engine process one
    walked 226k objects in 77 ms, a stall of the loop that every text in flight waits out (ad hoc,
    in-process closed loop, vanilla int8, 32 texts in flight). Frozen, they are left out of every
    collection. The garbage goes first: an unreachable cycle that is frozen (an export's, a
    verification's) would never be freed. Full collections are rare, so throughput hardly moves:
    servers whose workers froze and did not, taking turns (64 callers, 6 rounds of 12 s, ad hoc),
    gave 1.04x and 0.98x texts/s in two runs, within this machine's noise."""
    gc.collect()
    gc.freeze()


def split_cached(results: ResultCache, version: str, seqs: list[Sequence]
                 ) -> tuple[list[tuple[Sequence, list]], list[Sequence]]:
    """(sequences the result cache answers, with their hypotheses), (the sequences to decode)."""
    hits, misses = [], []
    for seq in seqs:
        found = results.get(result_key(version, seq))
        if found is None:
            misses.append(seq)
        else:
            hits.append((seq, found))
    return hits, misses


def answer_cached(hits: list[tuple[Sequence, list]], observer: Observer) -> None:
    for seq, hypotheses in hits:
        seq.admitted = seq.encoded = time.monotonic()
        seq.cache_hit = seq.result_cache_hit = True
        seq.finished = list(hypotheses)
        seq.finish(OK, observe=observer.finished)


def spread(seqs: list[Sequence], loads: list[int]) -> list[list[Sequence]]:
    """One share per replica: each text goes to the replica with the least budget waiting and
    running (`loads`, plus what this request already gave it), so one large request uses them all."""
    loads = list(loads)
    shares: list[list[Sequence]] = [[] for _ in loads]
    for seq in seqs:
        i = loads.index(min(loads))
        shares[i].append(seq)
        loads[i] += seq.rows_budget
    return shares


class Replicas:
    """`len(engines)` engine loops serving one model, on threads of this process. A request's texts
    are spread over the replicas (spread). The same interface as one Engine."""

    def __init__(self, engines: list[Engine]):
        self.engines = engines
        self.cache, self.results = engines[0].cache, engines[0].results
        self._lock = threading.Lock()  # one submission at a time: all of a request's texts, or none
        for e in engines:
            e.replicas = self

    @property
    def steps(self) -> int:
        return sum(e.steps for e in self.engines)

    @property
    def seconds(self) -> dict[str, float]:  # thread-seconds, summed over the loops
        return {k: sum(e.seconds[k] for e in self.engines) for k in self.engines[0].seconds}

    def queued(self) -> int:
        return sum(len(e.scheduler) for e in self.engines)

    def running(self) -> int:
        return sum(e.running() for e in self.engines)

    def start(self) -> "Replicas":
        for e in self.engines:
            e.start()
        return self

    def submit(self, seqs: list[Sequence]) -> None:
        with self._lock:
            if not self.engines[0].accepting:
                raise Draining(f"model {self.engines[0].name} is shutting down")
            hits, seqs = split_cached(self.results, self.engines[0].version, seqs)
            shares = spread(seqs, [e.load() for e in self.engines])
            waiting = [len(e.scheduler) for e in self.engines]
            if any(n + len(share) > e.scheduler.max_waiting for e, n, share in zip(self.engines, waiting, shares)):
                capacity = sum(e.scheduler.max_waiting for e in self.engines)
                raise QueueFull(f"the queue holds {sum(waiting)} texts and admits at most {capacity}; "
                                f"this request has {len(seqs)}: retry later")
            for e, share in zip(self.engines, shares):
                if share:
                    e.enqueue(share)
        answer_cached(hits, self.engines[0].observer)

    def wake(self) -> None:
        for e in self.engines:
            e.wake()

    def drain(self) -> None:
        with self._lock:  # never between two replicas' shares of one request
            for e in self.engines:
                e.drain()

    def stop(self, timeout: float | None = None) -> None:
        for e in self.engines:
            e.stop(timeout)

    def idle(self) -> bool:
        return all(e.idle() for e in self.engines)

    def run_until_idle(self) -> None:
        """Offline: every replica drives its own batch on its own thread until all are idle."""
        threads = [threading.Thread(target=e.run_until_idle) for e in self.engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
