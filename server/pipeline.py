"""A served model: texts -> engine sequences -> texts.

Pipeline checks and tokenises input exactly as training did (training.data.encode_source: pieces
then EOS; POS tags aligned to pieces for POS models), hands sequences to the model's engine and
turns finished sequences back into text. It is used by the gRPC service and, driving the engine
on the calling thread, by offline decoding (build verification, the engine benchmark)."""
from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Callable

from export.ct2_runtime import Ct2Translator
from export.manifest import read_manifest
from export.quality import TARGETS
from .engine.encoder_cache import EncoderCache
from training.checkpoint import load_checkpoint
from training.config import Checkpoint
from training.data import EOS, normalize_input

from .backends import OnnxBackend, TorchBackend
from .ct2_engine import Ct2Engine
from .diagnostics import gret_diagnostics
from .engine.engine import Engine, Observer, Replicas
from .engine.options import DecodingOptions, Limits, OptionError
from .engine.result_cache import ResultCache
from .engine.scheduler import Scheduler
from .engine.sequence import OK, Sequence
from .engine.workers import WorkerReplicas, WorkerSpec
from .models import VERIFY_FILE, ModelEntry, ModelError, from_repository

log = logging.getLogger("server.pipeline")
VERIFY_TOLERANCE = 0.5  # BLEU/ROUGE points: fp16 checkpoint -> fp32 graphs moves scores a little


class InputError(ValueError):
    """Bad texts (-> INVALID_ARGUMENT); the message says which text and which limit."""


def make_backend(entry: ModelEntry | WorkerSpec, backend: str, precision: str = "fp32", threads: int = 1,
                 workers: int = 1):
    """One backend for all of a model's thread replicas: an ONNX Runtime session and a PyTorch
    module may run from several threads at once; CTranslate2 needs a replica per thread. A worker
    process builds its own from its WorkerSpec (the same name, repository and checkpoint)."""
    if backend == "onnx":
        return OnnxBackend(entry.repository, precision=precision, threads=threads)
    if backend == "ct2":
        return Ct2Translator(entry.repository, precision=precision, threads=threads, replicas=workers)
    if backend == "torch":
        if entry.checkpoint is None:
            raise ModelError(f"model {entry.name}: the torch backend needs the checkpoint, not a repository")
        return TorchBackend(load_checkpoint(entry.checkpoint)[0], threads)
    raise ModelError(f"unknown backend {backend!r}")


class Pipeline:
    def __init__(self, entry: ModelEntry, engine: Engine | Replicas | WorkerReplicas, limits: Limits, backend: str,
                 precision: str):
        self.entry, self.engine, self.limits = entry, engine, limits
        self.backend, self.precision = backend, precision
        self.summarize = entry.task == "summarize"
        self._tagger = None
        self._torch_model = None  # loaded on the first diagnostics request
        self._torch_lock = threading.Lock()

    # ---- text -> sequences -------------------------------------------------------------------
    def sequences(self, texts: list[str], options: DecodingOptions, on_done: Callable[[Sequence], None],
                  deadline: float | None = None, truncate: bool | None = None) -> list[Sequence]:
        """One Sequence per text, or InputError naming the first bad text. Sources longer than the
        model's limit are refused for translation and truncated for summarisation (as in training)."""
        limits, e = self.limits, self.entry
        if not texts:
            raise InputError("no texts: send at least one")
        if len(texts) > limits.max_texts:
            raise InputError(f"{len(texts)} texts in one call; the limit is {limits.max_texts}")
        truncate = self.summarize if truncate is None else truncate
        max_pieces = e.max_src_len - 1  # room for EOS
        seqs = []
        for i, text in enumerate(texts):
            if not text.strip():
                raise InputError(f"text {i} is empty or only whitespace")
            if len(text) > limits.max_text_chars:
                raise InputError(f"text {i} has {len(text)} characters; the limit is {limits.max_text_chars}")
            text = normalize_input(e.input_style, text)  # plain text into the style the model was trained on
            pieces = e.sp.encode(text)
            if len(pieces) > max_pieces and not truncate:
                raise InputError(f"text {i} is {len(pieces)} pieces long; model {e.name} accepts at most {max_pieces}")
            src = pieces[:max_pieces] + [EOS]
            tags = self._tags(text, src) if e.cfg.pos_tags else None
            try:
                limit = options.output_limit(len(src), e.cfg.max_positions - 1, limits)
            except OptionError as error:
                raise InputError(f"text {i}: {error}") from None
            seqs.append(Sequence(src, options, limit, on_done, tags=tags, deadline=deadline))
        return seqs

    def _tags(self, text: str, src: list[int]) -> list[int]:
        from training.data import align_tags  # POS models only: the taggers load slowly
        from training.pos_tags import get_tagger, subword_tags

        if self._tagger is None:
            self._tagger = get_tagger(self.entry.source_language)
        return align_tags([subword_tags(text, self.entry.source_language, self.entry.sp, self._tagger)], [src])[0]

    # ---- GRET diagnostics -------------------------------------------------------------------
    def check_diagnostics(self) -> None:
        e = self.entry
        if not e.cfg.gret:
            raise InputError(f"model {e.name} is not a GRET model (no global sentence state): no diagnostics")
        if e.checkpoint is None:
            raise InputError(f"model {e.name} was loaded from an exported repository; diagnostics need its checkpoint")

    def diagnostics(self, seq: Sequence) -> tuple[list[float], float]:
        """server.diagnostics for the best hypothesis (blocking: call it off the event loop)."""
        with self._torch_lock:
            if self._torch_model is None:
                self._torch_model = load_checkpoint(self.entry.checkpoint)[0]
        tokens = seq.hypotheses[0].tokens if seq.hypotheses else []
        return gret_diagnostics(self._torch_model, seq.src, tokens, seq.tags)

    # ---- sequences -> text ------------------------------------------------------------------
    def texts(self, seq: Sequence) -> list[str]:
        return [self.entry.sp.decode(h.tokens) for h in seq.hypotheses]

    def decode(self, texts: list[str], options: DecodingOptions = DecodingOptions(),
               truncate: bool | None = None) -> list[str]:
        """Offline: best hypothesis per text, driving the (not started) engine on this thread."""
        seqs = self.sequences(texts, options, on_done=lambda s: None, truncate=truncate)
        self.engine.submit(seqs)
        self.engine.run_until_idle()
        failed = [s for s in seqs if s.status != OK]
        if failed:
            raise RuntimeError(f"{len(failed)} texts failed: {failed[0].message}")
        return [self.texts(s)[0] if s.hypotheses else "" for s in seqs]


def build_pipeline(entry: ModelEntry, backend: str = "onnx", precision: str = "fp32", threads: int = 1,
                   policy: str = "continuous", max_batch_tokens: int = 16384, max_queue: int = 1024,
                   cache_bytes: int = 256 << 20, limits: Limits = Limits(),
                   observer: Observer | None = None, workers: int = 1, result_cache: int = 0,
                   replicas: str = "thread") -> Pipeline:
    """`workers` engine loops of `threads` intra-op threads each: threads of this process sharing
    one backend (Replicas), or worker processes with a backend each (WorkerReplicas; the encoder
    cache split between them). The batch budget and the queue are per loop, the queue split so
    that the model still queues max_queue. The result cache stays here, in front of the loops."""
    precision = resolve_precision(entry, precision)
    queue = -(-max_queue // workers)
    results = ResultCache(result_cache)
    if replicas == "process" and backend != "ct2":
        make_backend(entry, backend, precision, threads)  # opened once here: a broken model stops the start
        spec = WorkerSpec(entry.name, entry.version, entry.repository, entry.checkpoint, backend, precision, threads,
                          policy, max_batch_tokens, queue, cache_bytes // workers)
        return Pipeline(entry, WorkerReplicas(spec, workers, results, observer), limits, backend, precision)
    model = make_backend(entry, backend, precision, threads, workers)
    if backend == "ct2":  # CTranslate2 decodes whole batches: request-level batching, no encoder cache
        cache = EncoderCache(0)
        engines = [Ct2Engine(model, entry.version, Scheduler("request", max_batch_tokens, queue), cache, observer,
                             entry.name, results) for _ in range(workers)]
    else:
        cache = EncoderCache(cache_bytes)
        engines = [Engine(model, entry.version, Scheduler(policy, max_batch_tokens, queue), cache, observer,
                          entry.name, results) for _ in range(workers)]
    return Pipeline(entry, engines[0] if workers == 1 else Replicas(engines), limits, backend, precision)


def resolve_precision(entry: ModelEntry, precision: str) -> str:
    """auto: int8 where the build's verification found the int8 graphs as good as fp32
    (verified.json, see verify_build), else fp32: an unchecked quantisation is never a default."""
    if precision != "auto":
        return precision
    verified = entry.repository / VERIFY_FILE if entry.repository else None
    if verified is not None and verified.exists() and json.loads(verified.read_text()).get("int8", {}).get("verified"):
        return "int8"
    return "fp32"


def verify_build(checkpoint: Path, repo: Path, threads: int = 2) -> dict:
    """The exported repository, served by this engine, must reproduce the validation score that
    training.ship recorded for the checkpoint (metrics.json: first split, beam 4). Its int8 graphs
    are scored too; they are verified (and `--precision auto` serves them) if they lose at most
    export.quality's int8 target against fp32."""
    from training.data import load_examples  # evaluation-only imports
    from training.metrics import bleu, rouge

    recorded_path = Path(checkpoint) / "metrics.json"
    if not recorded_path.exists():
        log.warning("model %s: no metrics.json, the ONNX build is not verified", checkpoint.name)
        return {"verified": False, "reason": "the checkpoint records no metrics"}
    recorded = json.loads(recorded_path.read_text())
    data = Checkpoint.load(checkpoint).data
    split, expected = next(iter(recorded["splits"].items()))
    metric = "bleu" if data.task == "translate" else "rouge1"
    examples = load_examples(data.dataset, split, data.src_lang, data.tgt_lang)
    offline = Limits(max_texts=len(examples), max_text_chars=1 << 20)  # a whole split, long articles too
    manifest = read_manifest(repo, verify=False)
    backend = manifest["backend"]
    entry = from_repository(repo, backend, checkpoint)
    refs = [e.refs for e in examples]

    def score(precision: str) -> float:
        pipeline = build_pipeline(entry, backend, precision, threads=threads, limits=offline)
        hyps = pipeline.decode([e.source for e in examples], DecodingOptions(beam=recorded.get("beam", 4)),
                               truncate=True)
        return round(bleu(hyps, refs) if metric == "bleu" else rouge(hyps, refs)[metric], 2)

    start = time.monotonic()
    measured = score("fp32")
    result = {"verified": True, "split": split, "metric": metric, "recorded": expected[metric],
              "measured": measured, "tolerance": VERIFY_TOLERANCE, "seconds": round(time.monotonic() - start, 1)}
    if "int8" in manifest[backend]["precisions"]:
        int8 = score("int8")
        result["int8"] = {"measured": int8, "verified": int8 >= measured - TARGETS["int8_bleu_drop"]}
    log.info("model %s: ONNX build verified on %s: %s %.2f (recorded %.2f), %.0f s", checkpoint.name, split, metric,
             result["measured"], result["recorded"], result["seconds"])
    if abs(result["measured"] - result["recorded"]) > VERIFY_TOLERANCE:
        raise ModelError(f"{repo}: served through ONNX the model scores {metric} {result['measured']} on {split}; "
                         f"the checkpoint recorded {result['recorded']} (tolerance {VERIFY_TOLERANCE})")
    return result
