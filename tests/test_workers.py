"""Engine loops in worker processes (server.engine.workers), on a tiny model served for real
(the vanilla checkpoint, exported on first start; the GRET model runs in worker processes in
tests/test_reliability.py, whose `python -m server` runs take the defaults):
the same answers as one loop, the parent's metrics and result cache, cancellation, deadlines,
a worker killed mid-call, drain and stop, and the defaults that pick them."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from proto import gret_serve_pb2 as pb
from proto import gret_serve_pb2_grpc as pb_grpc
from server.catalog import VERIFY_FILE, from_repository, load_entry
from server.config import ServerConfig
from server.engine.engine import PHASES, Draining
from server.engine.options import DecodingOptions
from server.engine.scheduler import QueueFull
from server.engine.sequence import CANCELLED, DEADLINE, OK
from server.engine.workers import BURST_TEXTS, HUGE_PAGES, huge_pages_in_workers
from server.pipeline import build_pipeline, resolve_precision
from tests.served import RunningServer, config_for
from training.corpora import load_examples

CODE = grpc.StatusCode
MODEL = "tiny-en-de"
# 128 steps whatever the source (the offset lifts every text's limit to 128, so min_length fits it)
LONG = dict(max_length_ratio=10, max_length_offset=128, max_length=128, min_length=128)


def english(n: int, offset: int) -> list[str]:
    return [e.source for e in load_examples("multi30k", "val", "en", "de")[offset: offset + n]]


def request(texts, beam, **options):
    return pb.TranslateRequest(texts=texts, target_language="de", options=pb.DecodingOptions(beam_size=beam, **options))


def best(response) -> list[str]:
    return [r.hypotheses[0].text for r in response.results]


def wait_until(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class Recorder:
    """Wraps the group's observer: what the parent hears from its workers, in arrival order."""

    def __init__(self, observer):
        self.observer, self.events, self.lock = observer, [], threading.Lock()

    def stepped(self, rows, seconds):
        self.observer.stepped(rows, seconds)
        with self.lock:
            self.events.append(("stepped", rows))

    def finished(self, seq):
        self.observer.finished(seq)
        with self.lock:
            self.events.append(("finished", seq))

    def __getattr__(self, name):
        return getattr(self.observer, name)


@pytest.fixture(scope="module")
def build_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("build-cache")


@pytest.fixture(scope="module")
def servers(served_models, build_cache):
    """(worker processes: 2, result cache on; one thread loop: the reference)"""
    processes = RunningServer(config_for(served_models, build_cache, models=[MODEL], workers=2, replicas="process",
                                         result_cache=1000))
    thread = RunningServer(config_for(served_models, build_cache, models=[MODEL]))
    yield processes, thread
    processes.stop()
    thread.stop()


@pytest.fixture
def group(servers):
    return servers[0].registry.pipelines[MODEL].engine


@pytest.fixture
def recorder(group):
    group.observer = recorder = Recorder(group.observer)
    yield recorder
    group.observer = recorder.observer


def stub(server: RunningServer):
    return pb_grpc.InferenceStub(grpc.insecure_channel(server.address))


def sample(server: RunningServer, name: str, **labels) -> float:
    return server.metrics.registry.get_sample_value(name, {"model": MODEL, **labels}) or 0


def test_worker_processes_answer_as_one_thread_loop_does_and_the_parent_counts_their_work(servers, group):
    processes, thread = servers
    texts = english(12, offset=100)
    counters = ("gret_serve_decoded_rows_total", "gret_serve_encoder_cache_misses_total",
                "gret_serve_worker_cpu_seconds_total")
    before = {name: sample(processes, name) for name in counters}
    phases = {phase: sample(processes, "gret_serve_engine_seconds_total", phase=phase) for phase in PHASES}
    got = stub(processes).Translate(request(texts, beam=3), timeout=120)
    assert best(got) == best(stub(thread).Translate(request(texts, beam=3), timeout=120))
    assert all(w.steps > 0 for w in group.workers)  # the call was spread over both processes
    assert len({w.process.pid for w in group.workers} | {os.getpid()}) == 3
    assert sample(processes, "gret_serve_texts_total", status=OK) >= 12
    assert sample(processes, "gret_serve_decoded_rows_total") > before["gret_serve_decoded_rows_total"]
    assert sample(processes, "gret_serve_encoder_cache_misses_total") >= \
        before["gret_serve_encoder_cache_misses_total"] + 12
    assert sample(processes, "gret_serve_queue_depth") == 0 and group.idle()
    # where the workers' time went: every phase ran, and their CPU is counted beside the parent's
    assert all(sample(processes, "gret_serve_engine_seconds_total", phase=p) > phases[p] for p in PHASES)
    assert sample(processes, "gret_serve_worker_cpu_seconds_total") > before["gret_serve_worker_cpu_seconds_total"]


def test_a_repeated_request_is_answered_in_the_parent_and_never_reaches_a_worker(servers, group):
    processes, _ = servers
    call = request(english(4, offset=120), beam=2)
    first = stub(processes).Translate(call, timeout=60)
    steps = [w.steps for w in group.workers]
    hits = sample(processes, "gret_serve_result_cache_hits_total")
    again = stub(processes).Translate(call, timeout=60)
    assert best(again) == best(first) and all(r.result_cache_hit for r in again.results)
    assert [w.steps for w in group.workers] == steps
    assert sample(processes, "gret_serve_result_cache_hits_total") == hits + 4


def test_the_pipes_the_parent_reads_on_uvloops_loop_stay_blocking(servers, group):
    """uvloop's add_reader makes a watched fd non-blocking; the parent reads each batch of reports
    with multiprocessing's Connection, which needs the whole message, so one larger than the pipe's
    buffer would fail half-read and pass for the worker's exit (a live worker then waits forever)."""
    processes, _ = servers
    assert type(processes.loop).__module__.startswith("uvloop")
    stub(processes).Translate(request(english(2, offset=130), beam=1), timeout=60)  # the loop reads both pipes
    assert all(w.ready.is_set() and os.get_blocking(w.conn.fileno()) for w in group.workers)


def test_worker_processes_take_their_memory_in_huge_pages(servers, group):
    """The live workers' own environment asks glibc for huge pages (beside any other tunables)."""
    for w in group.workers:
        environ = dict(entry.split("=", 1) for entry in
                       Path(f"/proc/{w.process.pid}/environ").read_text().split("\0") if "=" in entry)
        assert HUGE_PAGES in environ["GLIBC_TUNABLES"].split(":")


def test_a_users_own_glibc_tunables_are_kept_and_their_own_huge_pages_setting_wins(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    huge_pages_in_workers()
    assert os.environ["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{HUGE_PAGES}"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
    huge_pages_in_workers()
    assert os.environ["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"


def test_a_busy_worker_reports_its_steps_in_batches_not_at_every_step(servers, group, recorder, monkeypatch):
    """Each pipe write wakes the parent: a worker sends its step reports together (at most
    REPORT_EVERY_S late), and a finished text at the end of its turn; every step is still counted."""
    processes, _ = servers
    batches = []
    for w in group.workers:
        monkeypatch.setattr(w, "_receive", lambda receive=w._receive: (batches.append(1), receive()))
    before = sum(w.steps for w in group.workers)
    stub(processes).Translate(request(english(1, offset=145), beam=1, **LONG), timeout=120)
    wait_until(lambda: group.idle() and sum(w.steps for w in group.workers) - before == 128)
    assert sum(1 for kind, rows in recorder.events if kind == "stepped") == 128  # the histogram sees each step
    assert len(batches) <= 128 // 4


def test_a_worker_running_many_texts_sends_the_ones_that_finish_together(servers, group, monkeypatch):
    """With BURST_TEXTS texts or more running, finished texts wait as the step reports do (at most
    REPORT_EVERY_S) and leave in one write: far fewer batches than texts. Each is answered."""
    processes, _ = servers
    answers_per_batch = []
    for w in group.workers:
        def receive(receive=w._receive):
            answers_per_batch.append(0)
            receive()

        def handle(kind, body, handle=w._handle):
            if kind == "done":
                answers_per_batch[-1] += 1
            handle(kind, body)
        monkeypatch.setattr(w, "_receive", receive)
        monkeypatch.setattr(w, "_handle", handle)
    texts = english(4 * BURST_TEXTS * len(group.workers), offset=200)
    response = stub(processes).Translate(request(texts, beam=1), timeout=120)
    assert len(response.results) == len(texts) and all(r.hypotheses[0].text for r in response.results)
    with_answers = [n for n in answers_per_batch if n]
    assert sum(with_answers) == len(texts)
    assert len(with_answers) <= len(texts) // 3


def test_a_cancelled_call_leaves_the_workers_batches_and_the_other_call_is_unaffected(servers, recorder):
    processes, _ = servers
    other = request(english(1, offset=140), beam=1, **LONG)
    alone = stub(processes).Translate(other, timeout=120)
    running = stub(processes).Translate.future(other, timeout=120)
    cancelled = stub(processes).Translate.future(request(english(32, offset=150), beam=8, **LONG), timeout=120)
    wait_until(lambda: any(kind == "stepped" and rows > 8 for kind, rows in list(recorder.events)))
    cancelled.cancel()

    def gone() -> list:
        return [s for kind, s in list(recorder.events) if kind == "finished" and s.status == CANCELLED]

    wait_until(lambda: len(gone()) == 32)
    assert best(running.result()) == best(alone)
    events = list(recorder.events)
    assert all(s.step < s.max_len for s in gone()) and any(s.step > 0 for s in gone())  # dropped mid-decode
    last = max(i for i, (kind, s) in enumerate(events) if kind == "finished" and s.status == CANCELLED)
    assert {rows for kind, rows in events[last:] if kind == "stepped"} <= {1}  # only the other call's row


def test_an_expired_call_leaves_the_workers_batches(servers, recorder):
    processes, _ = servers
    call = request(english(256, offset=300), beam=8, **LONG)  # many rounds of 128 steps: seconds of work
    with pytest.raises(grpc.RpcError) as info:
        stub(processes).Translate(call, timeout=1.5)
    assert info.value.code() == CODE.DEADLINE_EXCEEDED
    wait_until(lambda: sum(1 for kind, s in list(recorder.events) if kind == "finished") == 256)
    ended = [s for kind, s in recorder.events if kind == "finished"]
    gone = [s for s in ended if s.status != OK]  # texts of the first rounds may finish in time
    assert gone and {s.status for s in gone} <= {CANCELLED, DEADLINE} and all(s.step < s.max_len for s in gone)


def test_a_worker_that_dies_fails_its_texts_with_unavailable_and_is_started_again(servers, group, recorder):
    processes, thread = servers
    call = stub(processes).Translate.future(request(english(16, offset=230), beam=8, **LONG), timeout=120)
    wait_until(lambda: any(kind == "stepped" and rows > 8 for kind, rows in list(recorder.events)))
    victim = group.workers[0]
    pid = victim.process.pid
    steps, cpu = victim.steps, victim.cpu_seconds
    os.kill(pid, signal.SIGKILL)
    error = call.exception(60)
    assert error.code() == CODE.UNAVAILABLE and "exited (exit code -9)" in error.details()
    wait_until(lambda: victim.ready.is_set() and victim.process.pid != pid, timeout=120)
    texts = english(6, offset=250)
    assert best(stub(processes).Translate(request(texts, beam=2), timeout=120)) == \
        best(stub(thread).Translate(request(texts, beam=2), timeout=120))
    # the new process counts from zero; the slot's totals (the metrics' counters) never go back
    assert victim.steps >= steps and victim.cpu_seconds >= cpu


def test_drain_finishes_the_queued_texts_and_refuses_new_ones_and_stop_ends_the_workers(served_models, build_cache,
                                                                                       servers):
    entry = load_entry(served_models / MODEL, "onnx", build_cache)
    pipeline = build_pipeline(entry, "onnx", workers=2, replicas="process", max_queue=8)
    group = pipeline.engine.start()
    try:
        options = DecodingOptions(beam=2)
        with pytest.raises(QueueFull, match="admits at most 8; this request has 9"):
            group.submit(pipeline.sequences(english(9, offset=500), options, on_done=lambda s: None))
        seqs = pipeline.sequences(english(4, offset=500), options, on_done=lambda s: None)  # fits however spread
        group.submit(seqs)
        group.drain()
        with pytest.raises(Draining):
            group.submit(pipeline.sequences(english(1, offset=510), options, on_done=lambda s: None))
        group.run_until_idle()
        assert [s.status for s in seqs] == [OK] * 4
        expected = build_pipeline(entry, "onnx").decode(english(4, offset=500), options)
        assert [pipeline.entry.sp.decode(s.hypotheses[0].tokens) for s in seqs] == expected
    finally:
        group.stop(30)
    assert [w.process.exitcode for w in group.workers] == [0, 0]


def test_with_no_flags_a_server_runs_a_worker_process_per_core_with_one_thread_each():
    config = ServerConfig()
    assert (config.replicas, config.threads, config.precision) == ("process", 1, "auto")
    assert config.loops() == len(os.sched_getaffinity(0))
    assert ServerConfig(workers=3).loops() == 3
    on_gpu = ServerConfig(backend="torch", device="cuda")  # not checked: this machine needs no GPU to say so
    assert (on_gpu.loops(), on_gpu.replica_kind(), ServerConfig().replica_kind()) == (1, "thread", "process")


def test_auto_precision_is_int8_only_where_the_build_verified_the_int8_graphs(served_models, tmp_path):
    repo = shutil.copytree(served_models / "tiny-de-en", tmp_path / "tiny-de-en")
    assert resolve_precision(from_repository(repo, "onnx"), "auto") == "fp32"  # never verified
    for verified, chosen in ((False, "fp32"), (True, "int8")):
        (repo / VERIFY_FILE).write_text(json.dumps({"verified": True, "int8": {"verified": verified}}))
        assert resolve_precision(from_repository(repo, "onnx"), "auto") == chosen
    assert resolve_precision(from_repository(repo, "onnx"), "fp32") == "fp32"


FIRST_CALLS = """
import json, sys
from pathlib import Path
from numba.core.registry import CPUDispatcher
import server.engine.batch, training.seq2seq.beam, training.seq2seq.pos_tags
from server.catalog import load_entry
from server.engine.options import DecodingOptions
from server.pipeline import build_pipeline

def compiled():
    modules = (server.engine.batch, training.seq2seq.beam, training.seq2seq.pos_tags)
    return {f"{m.__name__}.{n}": len(f.signatures) for m in modules for n, f in vars(m).items()
            if isinstance(f, CPUDispatcher)}

pipeline = build_pipeline(load_entry(Path(sys.argv[1]), "onnx", Path(sys.argv[2])), "onnx")
at_start = compiled()
texts = sys.argv[3:]
for options in (DecodingOptions(), DecodingOptions(beam=1), DecodingOptions(beam=6, n_best=3, return_scores=True),
                DecodingOptions(min_length=3, no_repeat_ngram=2)):
    pipeline.decode(texts, options)
pipeline.decode(texts[:1], DecodingOptions(), prefixes=["Ein"])
print(json.dumps([at_start, compiled()]))
"""


def test_a_model_is_compiled_and_run_once_before_it_serves_so_no_call_waits_for_the_compiler(served_models,
                                                                                             build_cache):
    """A process's first decode compiles the beam search (Numba) and, for a POS model, the tagger's
    search: seconds, which the first client would wait. build_pipeline (and each worker process,
    before it says it is ready) decodes a made-up text first; after that, calls with any options
    compile nothing new. In a fresh interpreter, where nothing was compiled before."""
    texts = [e.source for e in load_examples("multi30k", "val", "de", "en")[:6]]
    out = subprocess.run([sys.executable, "-c", FIRST_CALLS, str(served_models / "tiny-de-en"), str(build_cache),
                          *texts], capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    at_start, after_calls = json.loads(out.stdout.strip().splitlines()[-1])
    for kernel in ("server.engine.batch.decide", "server.engine.batch.next_rows", "server.engine.batch.copy_columns",
                   "training.seq2seq.pos_tags._tag_sentence"):
        assert at_start[kernel] >= 1, kernel
    assert after_calls == at_start
