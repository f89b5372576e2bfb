"""A served model: texts -> documents of segments (server.documents) -> engine sequences -> texts.

Pipeline checks and tokenises input exactly as training did (training.seq2seq.inputs.encode_source: pieces
then EOS; POS tags aligned to pieces for POS models), hands sequences to the model's engine and
turns finished sequences back into text. It is used by the gRPC service and, driving the engine
on the calling thread, by offline decoding (build verification, the engine benchmark)."""
from __future__ import annotations

import functools
import json
import logging
import threading
import time
from pathlib import Path
from dataclasses import dataclass, field, replace
from typing import Callable

from export.ct2_runtime import Ct2Translator
from export.manifest import read_manifest
from export.quality import TARGETS
from .engine.encoder_cache import EncoderCache
from training.seq2seq.beam import Hypothesis
from training.seq2seq.checkpoint import load_checkpoint
from training.seq2seq.config import Checkpoint
from training.seq2seq.inputs import EOS, align_tags, normalize_input
from training.seq2seq.pos_tags import encode_with_spans, get_tagger, subword_tags

from .backends import OnnxBackend, TorchBackend
from .catalog import VERIFY_FILE, ModelEntry, ModelError, from_repository
from .ct2_engine import Ct2Engine
from .diagnostics import gret_diagnostics
from .documents import Layout, segment, whole
from .markup import HtmlLayout, segment_html
from .unknowns import Alphabet, Protected, protect, restore
from .engine.engine import Engine, Observer, Replicas, warm_up
from .engine.options import DecodingOptions, Limits, OptionError
from .engine.result_cache import ResultCache
from .engine.scheduler import Scheduler
from .engine.sequence import OK, Sequence
from .engine.workers import WorkerReplicas, WorkerSpec

log = logging.getLogger("server.pipeline")
VERIFY_TOLERANCE = 0.5  # BLEU/ROUGE points: fp16 checkpoint -> fp32 graphs moves scores a little


class InputError(ValueError):
    """Bad texts (-> INVALID_ARGUMENT); the message says which text and which limit."""


@dataclass
class Document:
    """One text of a call: where its segments sit (server.documents.Layout) and a Sequence each."""
    layout: Layout | HtmlLayout
    sequences: list[Sequence]
    protected: list[Protected]  # per segment: the characters taken out for the model (server.unknowns)
    truncated: bool  # a segment's source was cut to the model's limit
    prefix: str = ""  # the target prefix as sent: the first segment's output begins with it
    head: str = ""  # the prefix as the model writes it (its pieces decoded), which the output begins with
    cut: list[bool] = field(default_factory=list)  # per segment: its source was cut to the model's limit


@dataclass
class Source:
    """A segment as the model reads it."""
    protected: Protected
    pieces: list[int]
    spans: list[tuple[int, int]] | None = None  # POS models: each piece's characters in protected.text


@dataclass
class Output:
    """One hypothesis for a whole text."""
    text: str
    tokens: int
    score: float
    log_prob: float
    at_limit: bool  # a segment stopped at its output length limit, not at an end of sentence


def make_backend(entry: ModelEntry | WorkerSpec, backend: str, precision: str = "fp32", threads: int = 1,
                 workers: int = 1, device: str = "cpu"):
    """One backend for all of a model's thread replicas: an ONNX Runtime session and a PyTorch
    module may run from several threads at once; CTranslate2 needs a replica per thread. A worker
    process builds its own from its WorkerSpec (the same name, repository and checkpoint). Only the
    PyTorch backend leaves the CPU (`device`; ServerConfig.check refuses the others there)."""
    if backend == "onnx":
        return OnnxBackend(entry.repository, precision=precision, threads=threads)
    if backend == "ct2":
        return Ct2Translator(entry.repository, precision=precision, threads=threads, replicas=workers)
    if backend == "torch":
        if entry.checkpoint is None:
            raise ModelError(f"model {entry.name}: the torch backend needs the checkpoint, not a repository")
        return TorchBackend(load_checkpoint(entry.checkpoint)[0].to(device), threads)
    raise ModelError(f"unknown backend {backend!r}")


class Pipeline:
    def __init__(self, entry: ModelEntry, engine: Engine | Replicas | WorkerReplicas, limits: Limits, backend: str,
                 precision: str):
        self.entry, self.engine, self.limits = entry, engine, limits
        self.backend, self.precision = backend, precision
        self.summarize = entry.task == "summarize"
        self.alphabet = Alphabet(entry.sp)
        self._tagger = None
        if entry.cfg.pos_tags:  # POS models only: the taggers load slowly
            self._tagger = get_tagger(entry.source_language)
            self._tags("Warm-up.", entry.sp.encode("Warm-up.") + [EOS])  # compiles its search now, not in a call
        self._torch_model = None  # loaded on the first diagnostics request
        self._torch_lock = threading.Lock()

    # ---- text -> sequences -------------------------------------------------------------------
    def documents(self, texts: list[str], options: DecodingOptions, on_done: Callable[[Sequence], None],
                  deadline: float | None = None, split: bool | None = None,
                  truncate: bool | None = None, markup: bool = False,
                  prefixes: list[str] | None = None) -> list[Document]:
        """One Document per text, or InputError naming the first bad text and the limit it breaks.
        Translation splits each text into sentences (server.documents); summaries, and `split=False`,
        read each text whole; `markup` texts are HTML (server.markup: always split). A segment over
        the model's limit is truncated (and the document says so) where `truncate`, by default when
        splitting or summarising (as in training); otherwise it is refused. A summary of a text over
        the limit reads the text's first sentence (server.documents; cut to the limit if that alone
        is longer) and says `truncated`; with `truncate` given, the first pieces that fit instead.
        `prefixes` (the request's target_prefix: none, one for every text, or one per text) begin
        each text's first segment."""
        limits = self.limits
        if not texts:
            raise InputError("no texts: send at least one")
        if len(texts) > limits.max_texts:
            raise InputError(f"{len(texts)} texts in one call; the limit is {limits.max_texts}")
        prefixes = self._prefixes(prefixes or [], len(texts))
        split = not self.summarize if split is None else split
        leads = self.summarize and truncate is None
        truncate = split or self.summarize if truncate is None else truncate
        reading = functools.cache(self._source)  # this call only: a segment is read once, to fit and to decode

        def fits(part: str) -> bool:
            return not self._cut(reading(part))

        for i, text in enumerate(texts):  # all checked before any is read: a bad call is refused at once
            if not text.strip():
                raise InputError(f"text {i} is empty or only whitespace")
            if len(text) > limits.max_text_chars:
                raise InputError(f"text {i} has {len(text)} characters; the limit is {limits.max_text_chars}")
        docs = []
        for i, text in enumerate(texts):
            if markup:
                layout = segment_html(text, self.entry.source_language, fits)
            else:
                layout = segment(text, self.entry.source_language, fits) if split else whole(text)
            if not layout.segments:
                raise InputError(f"text {i} has no text outside its markup")
            sources = [reading(part) for part in layout.segments]
            lead = leads and self._cut(sources[0])
            if lead:  # a text over the window is summarised from its lead sentence (measured: docs/DOCUMENTS.md)
                sources = [reading(segment(text, self.entry.source_language, fits).segments[0])]
            pieces = self._prefix_pieces(prefixes[i])
            seqs = [self._sequence(i, source, replace(options, prefix=tuple(pieces)) if k == 0 and pieces else options,
                                   on_done, deadline, truncate) for k, source in enumerate(sources)]
            cut = [lead or self._cut(s) for s in sources]
            docs.append(Document(layout, seqs, [s.protected for s in sources], any(cut),
                                 prefixes[i] if prefixes[i].strip() else "", self.entry.sp.decode(pieces), cut))
        return docs

    def _prefixes(self, prefixes: list[str], n: int) -> list[str]:
        """One target prefix per text ("" for none), or InputError."""
        if len(prefixes) not in (0, 1, n):
            raise InputError(f"option target_prefix has {len(prefixes)} entries for {n} texts: send one for every "
                             f"text, or one per text")
        for i, prefix in enumerate(prefixes):
            if len(prefix) > self.limits.max_text_chars:
                raise InputError(f"option target_prefix {i} has {len(prefix)} characters; the limit is "
                                 f"{self.limits.max_text_chars}")
        return prefixes * n if len(prefixes) == 1 else prefixes or [""] * n

    def _prefix_pieces(self, prefix: str) -> list[int]:
        """A target prefix as the model writes it: in its output style (the input style: a summariser's
        headlines are written as its articles are read), without the characters it cannot write (the
        output gets the prefix as sent: Pipeline.outputs; one of those alone forces nothing)."""
        if not prefix.strip():
            return []
        return self.entry.sp.encode(protect(normalize_input(self.entry.input_style, prefix), self.alphabet).text)

    def sequences(self, texts: list[str], options: DecodingOptions, on_done: Callable[[Sequence], None],
                  deadline: float | None = None, truncate: bool | None = None) -> list[Sequence]:
        """One Sequence per text, each read whole (offline decoding of sentence-level data)."""
        return [d.sequences[0] for d in self.documents(texts, options, on_done, deadline, False, truncate)]

    def _source(self, text: str) -> Source:
        """What the model reads of a segment: the text in the style it was trained on, then, for
        translation, without the characters the model cannot write (server.unknowns puts them
        back; a summary leaves out what it likes, so it has none to put back)."""
        text = normalize_input(self.entry.input_style, text)
        protected = Protected(text, []) if self.summarize else protect(text, self.alphabet)
        if self._tagger is not None:  # the tags go by the pieces' spans: both from one encoding
            return Source(protected, *encode_with_spans(self.entry.sp, protected.text))
        return Source(protected, self.entry.sp.encode(protected.text))

    def _fits(self, text: str) -> bool:
        return not self._cut(self._source(text))

    def _cut(self, source: Source) -> bool:
        return len(source.pieces) > self.entry.max_src_len - 1  # room for EOS

    def _sequence(self, i: int, source: Source, options: DecodingOptions, on_done: Callable[[Sequence], None],
                  deadline: float | None, truncate: bool) -> Sequence:
        """The Sequence for one segment of text i."""
        e = self.entry
        max_pieces = e.max_src_len - 1
        if self._cut(source) and not truncate:
            raise InputError(f"text {i} is {len(source.pieces)} pieces long; model {e.name} accepts at most "
                             f"{max_pieces}")
        src = source.pieces[:max_pieces] + [EOS]
        tags = self._tags(source.protected.text, src, source.spans) if e.cfg.pos_tags else None
        try:
            limit = options.output_limit(len(src), e.cfg.max_positions - 1, self.limits)
        except OptionError as error:
            raise InputError(f"text {i}: {error}") from None
        return Sequence(src, options, limit, on_done, tags=tags, deadline=deadline)

    def _tags(self, text: str, src: list[int], spans: list[tuple[int, int]] | None = None) -> list[int]:
        tags = subword_tags(text, self.entry.source_language, self.entry.sp, self._tagger, spans)
        return align_tags([tags], [src])[0]

    # ---- GRET diagnostics -------------------------------------------------------------------
    def check_diagnostics(self) -> None:
        e = self.entry
        if not e.cfg.gret:
            raise InputError(f"model {e.name} is not a GRET model (no global sentence state): no diagnostics")
        if e.checkpoint is None:
            raise InputError(f"model {e.name} was loaded from an exported repository; diagnostics need its checkpoint")

    def diagnostics(self, doc: Document) -> tuple[list[float], float]:
        """server.diagnostics for each segment's best hypothesis: the gates one segment after
        another, the routing agreement averaged (blocking: call it off the event loop)."""
        with self._torch_lock:
            if self._torch_model is None:
                self._torch_model = load_checkpoint(self.entry.checkpoint)[0]
        parts = [gret_diagnostics(self._torch_model, s.src, s.hypotheses[0].tokens if s.hypotheses else [], s.tags)
                 for s in doc.sequences]
        return [g for gates, _ in parts for g in gates], sum(agreement for _, agreement in parts) / len(parts)

    # ---- sequences -> text ------------------------------------------------------------------
    def outputs(self, doc: Document) -> list[Output]:
        """The document's n-best outputs, best first: output k puts each segment's k-th hypothesis
        (or its last, where it has fewer) back in the text's layout. Score = total log P / total
        length ** length_penalty, each sentence's end counted: for one sentence, its own score."""
        per_segment = [self._segment(doc, k) for k in range(len(doc.sequences))]
        penalty = doc.sequences[0].options.length_penalty
        outputs = []
        for k in range(max(map(len, per_segment))):
            picked = [hyps[min(k, len(hyps) - 1)] for hyps in per_segment]
            log_prob = sum(h.log_prob for _, h, _ in picked)
            length = sum(len(h.tokens) + (not at_limit) for _, h, at_limit in picked)
            outputs.append(Output(doc.layout.join([text for text, _, _ in picked]),
                                  sum(len(h.tokens) for _, h, _ in picked),
                                  log_prob / max(1, length) ** penalty, log_prob,
                                  any(at_limit for _, _, at_limit in picked)))
        return sorted(outputs, key=lambda o: -o.score)

    def sentence_outputs(self, doc: Document, k: int) -> list[Output]:
        """Segment k's own n-best outputs (a sentence streamed ahead of its text), best first."""
        return [Output(text, len(h.tokens), h.score, h.log_prob, at_limit)
                for text, h, at_limit in self._segment(doc, k)]

    def _segment(self, doc: Document, k: int) -> list[tuple[str, Hypothesis, bool]]:
        """Segment k's hypotheses as (text, hypothesis, stopped at its length limit): the characters
        the model cannot write put back, the first segment beginning with the prefix as sent."""
        seq, protected = doc.sequences[k], doc.protected[k]

        def text(tokens: list[int]) -> str:
            if not (k == 0 and doc.prefix):
                return restore(self.entry.sp.decode(tokens), protected)
            output = restore(self.entry.sp.decode(tokens), protected, keep=len(doc.head), given=doc.prefix)
            return begin_with(doc.prefix, doc.head, output)

        return ([(text(h.tokens), h, len(h.tokens) >= seq.max_len) for h in seq.hypotheses]
                or [(text([]), Hypothesis([], 0.0, 0.0), False)])

    def decode(self, texts: list[str], options: DecodingOptions = DecodingOptions(), truncate: bool | None = None,
               split: bool = False, markup: bool = False, prefixes: list[str] | None = None) -> list[str]:
        """Offline: best hypothesis per text (read whole unless `split`), driving the (not started)
        engine on this thread."""
        docs = self.documents(texts, options, lambda s: None, None, split, truncate, markup, prefixes)
        seqs = [s for d in docs for s in d.sequences]
        self.engine.submit(seqs)
        self.engine.run_until_idle()
        failed = [s for s in seqs if s.status != OK]
        if failed:
            raise RuntimeError(f"{len(failed)} texts failed: {failed[0].message}")
        return [self.outputs(d)[0].text for d in docs]


def begin_with(prefix: str, head: str, output: str) -> str:
    """The output with its beginning `head` (the prefix as the model wrote it, normalised) replaced
    by the prefix as sent: the text begins with exactly what the client asked for."""
    rest = output[len(head):] if head and output.startswith(head) else f" {output}" if output else ""
    return prefix + (rest.lstrip() if prefix[-1].isspace() else rest)


def build_pipeline(entry: ModelEntry, backend: str = "onnx", precision: str = "fp32", threads: int = 1,
                   policy: str = "continuous", max_batch_tokens: int = 16384, max_queue: int = 1024,
                   cache_bytes: int = 256 << 20, limits: Limits = Limits(),
                   observer: Observer | None = None, workers: int = 1, result_cache: int = 0,
                   replicas: str = "thread", call_share: float = 1.0, device: str = "cpu",
                   bulk_share: float = 1.0) -> Pipeline:
    """`workers` engine loops of `threads` intra-op threads each: threads of this process sharing
    one backend (Replicas), or worker processes with a backend each (WorkerReplicas; the encoder
    cache split between them). The batch budget, the per-call cap (call_share of it), the part for
    calls of several texts (bulk_share of it) and the queue are per loop, the queue split so that the
    model still queues max_queue. The result cache stays here, in front of the loops. Worker
    processes decode on the CPU."""
    precision = resolve_precision(entry, precision)
    queue = -(-max_queue // workers)
    results = ResultCache(result_cache)
    if replicas == "process" and backend != "ct2":
        if device != "cpu":
            raise ModelError(f"device {device}: the engine loops must be threads of this process, not worker processes")
        make_backend(entry, backend, precision, threads)  # opened once here: a broken model stops the start
        spec = WorkerSpec(entry.name, entry.version, entry.repository, entry.checkpoint, backend, precision, threads,
                          policy, max_batch_tokens, queue, cache_bytes // workers, call_share, bulk_share)
        return Pipeline(entry, WorkerReplicas(spec, workers, results, observer), limits, backend, precision)
    model = make_backend(entry, backend, precision, threads, workers, device)

    def scheduler(policy: str) -> Scheduler:
        return Scheduler(policy, max_batch_tokens, queue, call_share, bulk_share)

    if backend == "ct2":  # CTranslate2 decodes whole batches: request-level batching, no encoder cache
        cache = EncoderCache(0)
        engines = [Ct2Engine(model, entry.version, scheduler("request"), cache, observer, entry.name, results)
                   for _ in range(workers)]
    else:
        warm_up(model)
        cache = EncoderCache(cache_bytes)
        engines = [Engine(model, entry.version, scheduler(policy), cache, observer, entry.name, results)
                   for _ in range(workers)]
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
    from training.corpora import load_examples  # evaluation-only imports
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
