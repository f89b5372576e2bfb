"""Engine loops in worker processes: replicas that do not share a GIL.

Thread replicas (engine.Replicas) share one interpreter, so the beam search between decoder
steps, which is Python, runs one loop at a time. Here each replica is a process, started with
`spawn` (the parent runs gRPC threads; a fork would copy their locks), that loads the model
repository itself (the ONNX files are read-only) and drives an unchanged Engine on its one thread.
Parent and worker exchange small messages over a pipe, never a model:

    parent -> worker   ("submit", [Job])   ("cancel", [sequence id])   ("stop", None)
    worker -> parent   ("ready", None)   ("queued", n)   ("encoded", (n, seconds, cache stats))
                       ("stepped", (rows, seconds, Totals))   ("done", Outcome)

A submit carries one call's texts for this worker (its line in the worker's scheduler). The
parent keeps what the service sees: the Sequences (their on_done runs where the reports are
read: the server's event loop, else the worker's supervisor thread), the result cache
(consulted before dispatch, so repeats never reach a worker) and the metrics observer (fed with
the workers' reports). A worker that exits fails its texts with UNAVAILABLE and is started
again. time.monotonic is the system-wide CLOCK_MONOTONIC on Linux, so deadlines and timings
cross the process boundary unchanged.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import select
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .engine import PHASES, Draining, Observer, answer_cached, split_cached, spread
from .options import DecodingOptions
from .result_cache import ResultCache, result_key
from .scheduler import QueueFull
from .sequence import OK, UNAVAILABLE, Hypothesis, Sequence

log = logging.getLogger("server.engine.workers")

RESTART_DELAY_S = 1.0  # a worker that dies at once must not be restarted in a tight loop
REPORT_EVERY_S = 0.05  # a busy worker's step, queue and encoder reports wait at most this long (Reporter)
BURST_TEXTS = 16  # with this many texts running, finished texts wait as the other reports do (Reporter)
HUGE_PAGES = "glibc.malloc.hugetlb=1"  # the workers' memory in transparent huge pages (huge_pages_in_workers)


class NoWorker(Draining):
    """Every worker of the model is (re)starting: UNAVAILABLE, like draining, so clients retry."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its own backend and engine: paths and settings."""
    name: str
    version: str
    repository: Path | None
    checkpoint: Path | None
    backend: str
    precision: str
    threads: int
    policy: str
    max_batch_tokens: int
    max_queue: int  # per worker
    cache_bytes: int  # per worker
    call_share: float = 1.0  # the scheduler's per-call cap
    bulk_share: float = 1.0  # the scheduler's part of the budget for calls of several texts


@dataclass(frozen=True)
class Job:
    id: int
    src: list[int]
    options: DecodingOptions
    max_len: int
    tags: list[int] | None
    deadline: float | None
    priority: int


@dataclass(frozen=True)
class Totals:
    """A worker process's running totals, sent with each step's report."""
    steps: int = 0
    seconds: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))  # by phase
    cpu_seconds: float = 0.0  # time.process_time(): all of the process's threads


@dataclass(frozen=True)
class Outcome:
    id: int
    status: str
    message: str
    hypotheses: list[Hypothesis]  # the n best, best first: all the parent answers with (not the whole beam's)
    step: int
    admitted: float | None
    encoded: float | None
    cache_hit: bool


# ---- the parent's side ----------------------------------------------------------------------------
class WorkerReplicas:
    """`count` worker processes serving one model, with the interface of one Engine. A request's
    texts are spread over the workers as engine.Replicas spreads them over threads; the queue
    bound counts every text a worker holds, waiting or decoding."""

    def __init__(self, spec: WorkerSpec, count: int, results: ResultCache | None = None,
                 observer: Observer | None = None):
        self.spec, self.name, self.version = spec, spec.name, spec.version
        self.results = results if results is not None else ResultCache(0)
        self.observer = observer or Observer()
        huge_pages_in_workers()
        self.workers = [Worker(self, i) for i in range(count)]
        self.cache = ReportedCache(self.workers)
        self.accepting = True
        self.stopping = False
        self.lock = threading.Lock()  # pending texts and the pipes: one submission at a time
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop that reads the pipes, if any
        self.loop_thread: int | None = None

    @property
    def steps(self) -> int:
        return sum(w.steps for w in self.workers)

    @property
    def seconds(self) -> dict[str, float]:  # the engine loops' seconds by phase, summed over the workers
        return {k: sum(w.seconds[k] for w in self.workers) for k in PHASES}

    @property
    def cpu_seconds(self) -> float:
        """CPU seconds of the worker processes (the parent's own are the process metrics')."""
        return sum(w.cpu_seconds for w in self.workers)

    def queued(self) -> int:
        return sum(w.waiting for w in self.workers)

    def running(self) -> int:
        """Texts the workers hold and have admitted into their batches."""
        with self.lock:
            return sum(max(0, len(w.pending) - w.waiting) for w in self.workers)

    def start(self, timeout: float = 300) -> "WorkerReplicas":
        """Starts every worker and waits until each has loaded the model. Started on an event loop
        (the server's), the loop reads the workers' reports once they are ready: while it is busy,
        a report waits in the pipe for its next turn and wakes no thread. Else each worker's
        supervisor thread reads them."""
        with contextlib.suppress(RuntimeError):
            self.loop, self.loop_thread = asyncio.get_running_loop(), threading.get_ident()
        for w in self.workers:
            w.thread.start()
        for w in self.workers:
            if not w.started.wait(timeout) or w.error:
                self.stop(0)
                raise RuntimeError(w.error or f"engine worker {w.index} of model {self.name} did not start "
                                   f"within {timeout:.0f} s")
        return self

    def submit(self, seqs: list[Sequence]) -> None:
        with self.lock:
            if not self.accepting:
                raise Draining(f"model {self.name} is shutting down")
            hits, seqs = split_cached(self.results, self.version, seqs)
            live = [w for w in self.workers if w.ready.is_set()]
            if seqs and not live:
                raise NoWorker(f"model {self.name}: every engine worker is restarting; retry shortly")
            shares = spread(seqs, [w.load() for w in live])
            held = [len(w.pending) for w in live]
            if any(n + len(share) > self.spec.max_queue for n, share in zip(held, shares)):
                capacity = self.spec.max_queue * len(live)
                raise QueueFull(f"the queue holds {sum(held)} texts and admits at most {capacity}; "
                                f"this request has {len(seqs)}: retry later")
            for w, share in zip(live, shares):
                if share:
                    w.hold(share)
                    w.send("submit", [Job(s.id, s.src, s.options, s.max_len, s.tags, s.deadline, s.priority)
                                        for s in share])
        answer_cached(hits, self.observer)

    def wake(self) -> None:
        """Tell the workers which of their texts were cancelled: they leave at the next step."""
        with self.lock:
            for w in self.workers:
                cancelled = [i for i, s in w.pending.items() if s.cancelled]
                if cancelled:
                    w.send("cancel", cancelled)

    def drain(self) -> None:
        with self.lock:
            self.accepting = False

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new work; each worker fails what it holds with UNAVAILABLE and exits."""
        with self.lock:
            self.accepting, self.stopping = False, True
            for w in self.workers:
                if w.conn is not None:
                    w.send("stop", None)
        if self.loop_thread == threading.get_ident():  # the loop that would read their last reports waits here
            for w in self.workers:
                w.read_to_end(timeout)
        for w in self.workers:
            if w.thread.is_alive():
                w.thread.join(timeout)
            if w.process is not None and w.process.is_alive():
                w.process.kill()

    def idle(self) -> bool:
        with self.lock:
            return not any(w.pending for w in self.workers)

    def run_until_idle(self) -> None:
        """Offline: wait (the workers decode) until nothing is queued or running."""
        while not self.idle():
            time.sleep(0.002)

    def finish(self, seq: Sequence, outcome: Outcome) -> None:
        """Settle a parent-side sequence with its worker's outcome: recorded (result cache, metrics)
        before the client hears of it, as the engine does."""
        seq.step, seq.admitted, seq.encoded, seq.cache_hit = (outcome.step, outcome.admitted, outcome.encoded,
                                                              outcome.cache_hit)
        seq.finished = list(outcome.hypotheses)

        def record(s: Sequence) -> None:
            if s.status == OK:
                self.results.put(result_key(self.version, s), s.hypotheses)
            self.observer.finished(s)

        seq.finish(outcome.status, outcome.message, record)


class Worker:
    """One worker slot: the process, the parent's view of it (texts it holds, what it last
    reported), and a supervisor thread that starts the process, reads its reports, and starts it
    again when it exits."""

    def __init__(self, group: WorkerReplicas, index: int):
        self.group, self.index = group, index
        self.pending: dict[int, Sequence] = {}  # by id; changed under group.lock
        self.budget = 0  # the pending texts' rows_budget, summed: what spread() balances
        self.waiting = 0
        # totals over every process this slot has run (counters never go back when one restarts)
        self.steps, self.seconds, self.cpu_seconds = 0, dict.fromkeys(PHASES, 0.0), 0.0
        self.reported = Totals()  # what the running process last reported
        self.cache_stats: dict[str, int] = {}
        self.process = self.conn = None
        self.poller: select.poll | None = None  # the pipe's, once the event loop reads it (_listen)
        self.ready = threading.Event()  # the worker takes texts
        self.started = threading.Event()  # the first start succeeded or failed (error)
        self.closed = threading.Event()  # the event loop read the pipe to its end
        self.error = ""
        self.thread = threading.Thread(target=self._supervise, daemon=True, name=f"worker-{group.name}-{index}")

    def load(self) -> int:
        return self.budget

    def hold(self, seqs: list[Sequence]) -> None:
        """Under group.lock: texts sent to this worker."""
        self.pending.update((s.id, s) for s in seqs)
        self.budget += sum(s.rows_budget for s in seqs)

    def send(self, kind: str, body) -> None:
        """Under group.lock. A dead worker's pipe refuses: its supervisor fails what it held."""
        try:
            self.conn.send((kind, body))
        except OSError:
            pass

    def _supervise(self) -> None:
        while not self.group.stopping:
            context = multiprocessing.get_context("spawn")
            self.conn, child = context.Pipe()
            self.reported = Totals()
            self.process = context.Process(target=serve, args=(self.group.spec, child), daemon=True,
                                           name=f"engine-{self.group.name}-{self.index}")
            self.process.start()
            child.close()  # so that the worker's exit reads as EOF here
            try:
                while not self.ready.is_set():  # here, not on the loop: start() may be holding it
                    self._receive()
                if self._hand_to_loop():
                    self.closed.wait()
                else:
                    while True:
                        self._receive()
            except (EOFError, OSError):
                pass
            self.process.join()
            self.conn.close()
            self._lost(self.process.exitcode)
            if not self.started.is_set():  # it never loaded: a broken setup, not a crash to retry
                self.error = (f"engine worker {self.index} of model {self.group.name} failed to start "
                              f"(exit code {self.process.exitcode}); its log is above")
                self.started.set()
                return
            if not self.group.stopping:
                time.sleep(RESTART_DELAY_S)

    def _receive(self) -> None:
        for message in self.conn.recv():  # the worker sends its reports in batches
            self._handle(*message)

    def _hand_to_loop(self) -> bool:
        """From now on the group's event loop reads the pipe; False: there is none (or it has closed)."""
        loop = self.group.loop
        if loop is None:
            return False
        self.closed.clear()
        try:
            loop.call_soon_threadsafe(self._listen)
        except RuntimeError:
            return False
        return True

    def _listen(self) -> None:
        if not self.closed.is_set():  # else read_to_end ran first: the pipe is done with
            fd = self.conn.fileno()
            self.group.loop.add_reader(fd, self._readable)
            # uvloop's add_reader makes the fd non-blocking, and Connection reads and writes a message
            # whole: a batch of reports larger than the pipe's buffer would fail half-read
            os.set_blocking(fd, True)
            self.poller = pipe_poller(self.conn)  # is more waiting?

    def _readable(self) -> None:
        """On the loop: every report waiting in the pipe. Its end (the worker exited) goes to the
        supervisor thread, which fails what the worker held and starts another."""
        try:
            while self.poller.poll(0):  # asked first: a read with nothing there would block the loop
                self._receive()
        except (EOFError, OSError):
            self.group.loop.remove_reader(self.conn.fileno())
            self.closed.set()

    def read_to_end(self, timeout: float | None) -> None:
        """On the loop's thread, after the worker was told to stop: its last reports, read here
        since the loop cannot run while its thread waits for the worker."""
        if self.closed.is_set() or not self.ready.is_set() or self.group.loop.is_closed():
            return
        self.group.loop.remove_reader(self.conn.fileno())
        end = None if timeout is None else time.monotonic() + timeout
        try:
            while self.conn.poll(None if end is None else max(0.0, end - time.monotonic())):
                self._receive()
        except (EOFError, OSError):
            pass
        self.closed.set()

    def _lost(self, exitcode: int | None) -> None:
        group = self.group
        with group.lock:
            self.ready.clear()
            lost, self.pending, self.budget = list(self.pending.values()), {}, 0
            self.waiting = 0
        if group.stopping:
            message = f"model {group.name} stopped before this text was decoded"
        else:
            message = (f"engine worker {self.index} of model {group.name} exited (exit code {exitcode}) "
                       "before this text was decoded; it is being restarted: retry")
            log.error("engine worker %d of model %s exited (exit code %s): %d texts failed with UNAVAILABLE",
                      self.index, group.name, exitcode, len(lost))
        for seq in lost:
            seq.finish(UNAVAILABLE, message, group.observer.finished)
        group.observer.queue_depth(group.queued())

    def _handle(self, kind: str, body) -> None:
        group = self.group
        if kind == "done":
            with group.lock:
                seq = self.pending.pop(body.id, None)
                if seq is not None:
                    self.budget -= seq.rows_budget
            if seq is not None:
                group.finish(seq, body)
        elif kind == "stepped":
            rows, seconds, totals = body
            last, self.reported = self.reported, totals
            self.steps += totals.steps - last.steps
            self.cpu_seconds += totals.cpu_seconds - last.cpu_seconds
            for k in PHASES:
                self.seconds[k] += totals.seconds[k] - last.seconds[k]
            group.observer.stepped(rows, seconds)
        elif kind == "encoded":
            n, seconds, self.cache_stats = body
            group.observer.encoded(n, seconds)
        elif kind == "queued":
            self.waiting = body
            group.observer.queue_depth(group.queued())
        elif kind == "ready":
            self.ready.set()
            self.started.set()


class ReportedCache:
    """The workers' encoder caches as the metrics read one: the sum of what each last reported."""

    def __init__(self, workers: list[Worker]):
        self.workers = workers

    def stats(self) -> dict[str, int]:
        total = Counter({"entries": 0, "bytes": 0, "hits": 0, "misses": 0, "evictions": 0})
        for w in self.workers:
            total.update(w.cache_stats)
        return dict(total)


def huge_pages_in_workers() -> None:
    """Worker processes started from now on take their memory from glibc in transparent huge pages
    (glibc 2.35 and later read the tunable at start, older ones ignore it; the kernel grants them
    where its THP mode is `madvise` or `always`). A decoder step reads tens of MB spread over the
    self-attention cache, the encoder slots and ONNX Runtime's weights and arena: with 4 KB pages
    that is thousands of TLB misses a step, each a page walk, and in a virtual machine a walk of
    two page tables. Resident memory stays the same (ad hoc, the closed loop at 32 texts: 638 and
    642 MB, 268 MB of it in huge pages). Servers with and without it, taking turns (64 callers, 6
    rounds, ad hoc): 1.013x texts/s. The variable is this process's environment, which the
    spawned workers inherit; a GLIBC_TUNABLES that already sets the tunable is left as it is."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" not in tunables:
        os.environ["GLIBC_TUNABLES"] = ":".join(filter(None, (tunables, HUGE_PAGES)))


def pipe_poller(conn) -> select.poll:
    """A poll object watching the pipe's end for a message (or its close): made once per pipe, where
    Connection.poll builds a selector at every call, on both sides' hot paths."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    return poller


# ---- the worker's side ----------------------------------------------------------------------------
class Reporter(Observer):
    """The worker engine's reports, sent to the parent (whose observer feeds the metrics).
    Finished texts are reported by on_done instead: the parent records them itself. Reports are
    held and leave together, in one pipe write and one wake-up of the parent: at the end of a
    turn that finished a text (its caller waits for it) or left the engine idle, else once the
    oldest has waited REPORT_EVERY_S. A turn is one decoder step: sent at every turn, the reports
    of a worker serving one caller woke the parent at every step of every text, some third of the
    parent's CPU per call. The metrics lag by REPORT_EVERY_S at most.

    A worker running BURST_TEXTS texts or more holds its finished texts too, up to REPORT_EVERY_S:
    the few that each turn finishes then leave together, and their answers go out together
    through the parent and the gRPC socket, where each wake-up and each write is paid per batch
    rather than per text. Under that load a text takes a few hundred milliseconds to serve, and
    the wait is small beside it; docs/BENCHMARKS.md gives the parent's and the client's CPU per
    text (python -m bench speed)."""

    def __init__(self, conn):
        self.conn, self.held, self.engine, self.waiting = conn, [], None, None
        self.since = 0.0  # when the oldest held report was made
        self.answers = False  # a finished text is held

    def send(self, kind: str, body) -> None:
        if not self.held:
            self.since = time.monotonic()
        self.held.append((kind, body))
        self.answers |= kind == "done"

    def turn_ended(self) -> None:
        answer = self.answers and self.engine.running() < BURST_TEXTS
        due = answer or self.engine.idle() or time.monotonic() - self.since >= REPORT_EVERY_S
        if self.held and due:
            self.flush()

    def flush(self) -> None:
        if self.held:
            self.conn.send(self.held)
            self.held, self.answers = [], False

    def queue_depth(self, n: int) -> None:
        if n != self.waiting:  # it is reported at every step: send changes only
            self.waiting = n
            self.send("queued", n)

    def encoded(self, n_sequences: int, seconds: float) -> None:
        self.send("encoded", (n_sequences, seconds, self.engine.cache.stats()))

    def stepped(self, rows: int, seconds: float) -> None:
        self.send("stepped", (rows, seconds, Totals(self.engine.steps, dict(self.engine.seconds), time.process_time())))


def serve(spec: WorkerSpec, conn) -> None:
    """The worker process: load the model, then, on its one thread, alternate between the parent's
    messages and turns of the engine loop until the parent says stop or goes away.

    One thread, not a reader and an engine thread: a message that arrives while the engine works
    waits in the pipe for the end of the turn (where the engine would take it anyway), so neither
    the parent's write nor the hand-over wakes a sleeping thread. Each wake-up is a futex or pipe
    round trip through the kernel, paid per text. Only an idle worker sleeps, in the pipe's read."""
    import torch

    from .encoder_cache import EncoderCache

    from ..pipeline import make_backend
    from .engine import Engine, freeze_loaded, warm_up
    from .scheduler import Scheduler

    torch.set_num_threads(1)  # torch only does the engine's bookkeeping (server/__main__.py)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent drains and stops us

    def on_done(seq: Sequence) -> None:
        live.pop(seq.id, None)
        reporter.send("done", Outcome(seq.id, seq.status, seq.message, seq.hypotheses, seq.step,
                                      seq.admitted, seq.encoded, seq.cache_hit))

    def handle(kind: str, body) -> bool:
        """One message from the parent; False: stop."""
        if kind == "submit":
            seqs = [Sequence(j.src, j.options, j.max_len, on_done, tags=j.tags, deadline=j.deadline, priority=j.priority,
                             id=j.id) for j in body]
            live.update((s.id, s) for s in seqs)
            engine.enqueue(seqs)
        elif kind == "cancel":
            for seq in filter(None, map(live.get, body)):
                seq.cancelled = True  # its rows leave at the next turn
            engine.wake()  # and a waiting one is looked for
        return kind != "stop"

    reporter = Reporter(conn)
    backend = make_backend(spec, spec.backend, spec.precision, spec.threads)
    warm_up(backend)  # before "ready": the first call sent here must not wait for the compiler
    engine = Engine(backend, spec.version,
                    Scheduler(spec.policy, spec.max_batch_tokens, spec.max_queue, spec.call_share, spec.bulk_share),
                    EncoderCache(spec.cache_bytes),
                    reporter, spec.name)
    reporter.engine = engine
    live: dict[int, Sequence] = {}
    freeze_loaded()
    conn.send([("ready", None)])
    waiting = pipe_poller(conn)  # a message in the pipe?
    going = True
    while going:
        wait = None if engine.idle() else 0  # block only when there is nothing to decode
        try:
            while going and waiting.poll(wait):
                going, wait = handle(*conn.recv()), 0
        except (EOFError, OSError):  # the parent is gone
            break
        if going and not engine.idle():
            engine.iterate()
    engine.stop()  # never started: it fails what it still holds
    reporter.flush()  # the texts it failed
