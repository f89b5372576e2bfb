"""Prometheus metrics, served on their own port. Labels carry model names, methods and status
codes only: never request text."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .engine.engine import Observer
from .engine.sequence import OK, Sequence

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
PIECES = (4, 8, 16, 32, 64, 128, 256, 512, 1024)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("gret_serve_requests", "Calls by model, method and gRPC status code",
                                ["model", "method", "code"], registry=r)
        self.request_seconds = Histogram("gret_serve_request_seconds", "Call latency, end to end, whatever the outcome",
                                         ["model", "method"], buckets=LATENCY, registry=r)
        self.queue_seconds = Histogram("gret_serve_queue_seconds", "Per sentence: waiting before admission",
                                       ["model"], buckets=LATENCY, registry=r)
        self.encode_seconds = Histogram("gret_serve_encode_seconds", "Per admitted group: the encoder pass",
                                        ["model"], buckets=LATENCY, registry=r)
        self.decode_seconds = Histogram("gret_serve_decode_seconds", "Per sentence: from encoded to finished",
                                        ["model"], buckets=LATENCY, registry=r)
        self.text_seconds = Histogram("gret_serve_text_seconds", "Per sentence: from queued to finished",
                                      ["model"], buckets=LATENCY, registry=r)
        self.step_seconds = Histogram("gret_serve_step_seconds", "One decoder step of the running batch",
                                      ["model"], buckets=LATENCY, registry=r)
        self.rows_per_step = Histogram("gret_serve_rows_per_step", "Rows (beams of all sentences) per decoder step",
                                       ["model"], buckets=ROWS, registry=r)
        self.batch_rows = Gauge("gret_serve_batch_rows", "Rows in the last decoder step", ["model"], registry=r)
        self.decoded_rows = Counter("gret_serve_decoded_rows", "Rows run through the decoder (one token each)",
                                    ["model"], registry=r)
        self.generated_tokens = Counter("gret_serve_generated_tokens", "Output tokens of the returned best hypotheses",
                                        ["model"], registry=r)
        # A text of a call is decoded as one or more sentences (server.documents): both are counted.
        self.texts = Counter("gret_serve_texts", "Texts finished, by outcome", ["model", "status"], registry=r)
        self.sentences = Counter("gret_serve_sentences", "Sentences (engine sequences) finished, by outcome",
                                 ["model", "status"], registry=r)
        self.queue_depth = Gauge("gret_serve_queue_depth", "Sentences waiting for admission", ["model"], registry=r)
        self.model_info = Gauge("gret_serve_model_info", "Loaded models (value 1)",
                                ["model", "version", "task", "backend", "precision", "architecture"], registry=r)
        self.input_pieces = Histogram("gret_serve_input_pieces", "Per decoded sequence (a text, or a sentence of a document): source pieces, end of sentence included",
                                      ["model"], buckets=PIECES, registry=r)
        self._caches: dict[str, object] = {}
        self._results: dict[str, object] = {}
        self._engines: dict[str, object] = {}
        self._children: dict[tuple, object] = {}
        r.register(_CacheCollector(self._caches, self._results))
        r.register(_EngineCollector(self._engines))
        ProcessCollector(registry=r)  # resident memory, CPU seconds, open files of this process

    def of(self, metric, *labels: str):
        """metric.labels(*labels), kept from call to call: prometheus_client checks the values and
        takes a lock on every labels() (~7 us), and a call records a dozen samples. The labels are
        model names, methods and statuses: a bounded set."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def call_ended(self, model: str, method: str, code: str, seconds: float) -> None:
        """Every call of every RPC, whatever its outcome: counted by status, and timed."""
        self.of(self.requests, model, method, code).inc()
        self.of(self.request_seconds, model, method).observe(seconds)

    def submitted(self, model: str, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.of(self.input_pieces, model).observe(len(s.src))

    def text_finished(self, model: str, status: str) -> None:
        self.of(self.texts, model, status).inc()

    def observer(self, model: str) -> Observer:
        return _ModelObserver(self, model)

    def add_model(self, pipeline) -> None:
        e = pipeline.entry
        self.of(self.model_info, e.name, e.version, e.task, pipeline.backend, pipeline.precision, e.architecture).set(1)
        self._caches[e.name] = pipeline.engine.cache
        self._results[e.name] = pipeline.engine.results
        self._engines[e.name] = pipeline.engine  # one Engine, thread Replicas or worker processes

    def serve(self, port: int, host: str = "0.0.0.0"):
        """Starts the HTTP exporter on a daemon thread; returns the HTTP server (for shutdown)."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server


class _ModelObserver(Observer):
    def __init__(self, m: Metrics, model: str):
        self.m, self.model = m, model

    def queue_depth(self, n: int) -> None:
        self.m.of(self.m.queue_depth, self.model).set(n)

    def encoded(self, n_sequences: int, seconds: float) -> None:
        self.m.of(self.m.encode_seconds, self.model).observe(seconds)

    def stepped(self, rows: int, seconds: float) -> None:
        self.m.of(self.m.step_seconds, self.model).observe(seconds)
        self.m.of(self.m.rows_per_step, self.model).observe(rows)
        self.m.of(self.m.batch_rows, self.model).set(rows)
        self.m.of(self.m.decoded_rows, self.model).inc(rows)

    def finished(self, seq: Sequence) -> None:
        m, model = self.m, self.model
        m.of(m.sentences, model, seq.status).inc()
        if seq.admitted is not None:
            m.of(m.queue_seconds, model).observe(seq.admitted - seq.created)
        if seq.status == OK:
            m.of(m.decode_seconds, model).observe(seq.done - seq.encoded)
            m.of(m.text_seconds, model).observe(seq.done - seq.created)
            if seq.hypotheses:
                m.of(m.generated_tokens, model).inc(len(seq.hypotheses[0].tokens))


# (metric type, name, help) per key of a cache's stats()
ENCODER_CACHE = {
    "hits": (CounterMetricFamily, "gret_serve_encoder_cache_hits", "Sources found in the encoder cache"),
    "misses": (CounterMetricFamily, "gret_serve_encoder_cache_misses", "Sources the encoder had to run on"),
    "evictions": (CounterMetricFamily, "gret_serve_encoder_cache_evictions", "Entries evicted (LRU)"),
    "bytes": (GaugeMetricFamily, "gret_serve_encoder_cache_bytes", "Bytes held by the encoder cache"),
}
RESULT_CACHE = {
    "hits": (CounterMetricFamily, "gret_serve_result_cache_hits", "Sentences answered from the result cache"),
    "misses": (CounterMetricFamily, "gret_serve_result_cache_misses", "Sentences the result cache did not hold"),
    "entries": (GaugeMetricFamily, "gret_serve_result_cache_entries", "Results held by the result cache"),
}


class _CacheCollector:
    """The encoder and result caches' own counters, read at scrape time."""

    def __init__(self, caches: dict, results: dict):
        self.caches, self.results = caches, results

    def collect(self):
        yield from cache_families(self.caches, ENCODER_CACHE)
        yield from cache_families(self.results, RESULT_CACHE)


class _EngineCollector:
    """Read from the engines themselves at scrape time (a gauge kept by the engine's events would
    drift with every path that admits or ends a text):
    - texts in the running batches; CTranslate2 decodes a whole batch inside one call and keeps no
      running batch: 0;
    - the engine loops' time by phase, summed over a model's loops: where its decoding time goes;
    - the CPU time of a model's worker processes, which the process metrics (this process only)
      do not see."""

    def __init__(self, engines: dict):
        self.engines = engines

    def collect(self):
        running = GaugeMetricFamily("gret_serve_running_sequences", "Texts in the running batch, being decoded",
                                    labels=["model"])
        phases = CounterMetricFamily(
            "gret_serve_engine_seconds", "Engine-loop time by phase: encode (encoder passes), decoder (decoder "
            "steps), search (beam search between steps), cache (rows moved into the next step's state); "
            "translate for CTranslate2, whose one call does all of them", labels=["model", "phase"])
        cpu = CounterMetricFamily("gret_serve_worker_cpu_seconds",
                                  "CPU time of the model's engine worker processes", labels=["model"])
        for model, engine in self.engines.items():
            running.add_metric([model], engine.running())
            for phase, seconds in engine.seconds.items():
                phases.add_metric([model, phase], seconds)
            if hasattr(engine, "cpu_seconds"):
                cpu.add_metric([model], engine.cpu_seconds)
        yield from (running, phases, cpu)


def cache_families(caches: dict, metrics: dict) -> list:
    families = {key: kind(name, doc, labels=["model"]) for key, (kind, name, doc) in metrics.items()}
    for model, cache in caches.items():
        stats = cache.stats()
        for key, family in families.items():
            family.add_metric([model], stats[key])
    return list(families.values())
