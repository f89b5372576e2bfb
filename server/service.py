"""The gRPC service (proto/gret_serve.proto) on grpc.aio.

A call becomes one Document per text (server.pipeline: a translation's sentences, a summary's
whole text), each decoded as one Sequence per segment, all of them in the model's engine at once;
the handler awaits the documents. Each sequence's on_done hands the result to the event loop (or
runs there, where the loop reads worker processes' reports), where a document is done once all its
sequences are. A client that cancels, or a deadline that passes, marks the sequences so the engine
drops their rows at its next step. Status codes: INVALID_ARGUMENT (texts, options, priority),
NOT_FOUND (model), RESOURCE_EXHAUSTED (queue full), UNAVAILABLE (draining), DEADLINE_EXCEEDED,
CANCELLED; INTERNAL only when decoding itself failed.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field

import grpc
from grpc._cython.cygrpc import ExecuteBatchError  # what a write raises once the client has gone

from proto import gret_serve_pb2 as pb
from proto import gret_serve_pb2_grpc as pb_grpc

from .engine.engine import Draining
from .engine.options import DecodingOptions, OptionError
from .engine.scheduler import MAX_PRIORITY, MIN_PRIORITY, QueueFull
from .engine.sequence import CANCELLED, DEADLINE, OK, UNAVAILABLE, Sequence
from .languages import AUTO, normalize
from .logs import HEADER, REQUEST_ID, request_id
from .markup import text_of
from .metrics import Metrics
from .pipeline import Document, InputError, Pipeline
from .registry import ModelNotFound, Registry

log = logging.getLogger("server.service")

DEADLINE_SLACK_S = 0.25
# POS tagging (HanTa's model, pure Python) of a short sentence costs about what handing the call to
# the executor costs in thread switches. Requests up to this many characters (a few sentences) are
# tagged on the event loop; longer ones, whose tagging would stall every other call, in the executor.
INLINE_TAGGING_CHARS = 256
FAILURE_CODES = {DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED, CANCELLED: grpc.StatusCode.CANCELLED,
                 UNAVAILABLE: grpc.StatusCode.UNAVAILABLE}
TEXT_FORMATS = frozenset(pb.TextFormat.values())  # protobuf builds the list anew on every values()


class CallError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def decoding_options(msg: pb.DecodingOptions) -> DecodingOptions:
    """Proto options -> DecodingOptions; unset fields keep the defaults."""
    fields = {"beam_size": "beam", "length_penalty": "length_penalty", "max_length": "max_length",
              "max_length_ratio": "max_len_a", "max_length_offset": "max_len_b", "min_length": "min_length",
              "n_best": "n_best", "no_repeat_ngram_size": "no_repeat_ngram"}
    values = {ours: getattr(msg, theirs) for theirs, ours in fields.items() if msg.HasField(theirs)}
    return DecodingOptions(**values, return_scores=msg.return_scores, diagnostics=msg.return_diagnostics)


def model_limits(pipeline: Pipeline) -> pb.Limits:
    limits = pipeline.limits
    return pb.Limits(max_beam_size=limits.max_beam, max_n_best=limits.max_n_best,
                     max_output_tokens=min(limits.max_output_tokens, pipeline.entry.cfg.max_positions - 1),
                     max_texts=limits.max_texts, max_text_chars=limits.max_text_chars,
                     max_no_repeat_ngram_size=limits.max_no_repeat_ngram)


@dataclass
class Call:
    """One call in the handler: its metrics labels and start, and its texts once submitted."""
    model: str  # the metrics label
    start: float = field(default_factory=time.monotonic)
    pipeline: Pipeline | None = None
    docs: list[Document] = field(default_factory=list)
    # stream_sentences: (text, its finished sentence) as each sentence ends before its text,
    # (text, None) once the text is done
    sentences: asyncio.Queue | None = None

    @property
    def seqs(self) -> list[Sequence]:
        return [s for d in self.docs for s in d.sequences]

    def release(self) -> None:
        """Its unfinished texts leave the engine at the next step. A call that ends answered has none,
        and wakes no engine."""
        unfinished = [s for s in self.seqs if s.status is None]
        for s in unfinished:
            s.cancelled = True
        if unfinished:
            self.pipeline.engine.wake()


class InferenceService(pb_grpc.InferenceServicer):
    def __init__(self, registry: Registry, metrics: Metrics, log_text: bool = False):
        self.registry, self.metrics, self.log_text = registry, metrics, log_text
        self.draining = False

    # ---- RPCs -------------------------------------------------------------------------------------
    async def Translate(self, request, context):
        return await self._unary("Translate", "translate", request, context,
                                 request.source_language, request.target_language)

    async def Summarize(self, request, context):
        return await self._unary("Summarize", "summarize", request, context)

    # The streams write with context.write rather than yield from a generator: a client that goes
    # while a write waits for its flow-control window must reach the handler's own cancel path.
    async def TranslateStream(self, request, context):
        await self._stream("TranslateStream", "translate", request, context,
                           request.source_language, request.target_language)

    async def SummarizeStream(self, request, context):
        await self._stream("SummarizeStream", "summarize", request, context)

    async def ListModels(self, request, context):
        async with self._accounted("ListModels", context, Call("")):
            models = []
            for p in self.registry:
                e = p.entry
                models.append(pb.ModelInfo(name=e.name, version=e.version, task=e.task,
                                           source_language=e.source_language, target_language=e.target_language,
                                           architecture=e.architecture, backend=p.backend, precision=p.precision,
                                           parameters=e.parameters, is_default=self.registry.is_default(p),
                                           max_input_pieces=e.max_src_len - 1, limits=model_limits(p)))
            return pb.ListModelsResponse(models=models)

    # ---- one call -----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _accounted(self, method: str, context, call: Call):
        """However the call ends, its texts are released and it is counted exactly once, with the
        status the client sees: a CallError becomes that status; a client gone (a cancel or the
        deadline, raised by grpc as CancelledError, or as a failed write while we waited for its
        window) becomes CancelledError, which grpc expects of a cancelled handler and logs no
        traceback for; anything else is the UNKNOWN that grpc answers. The call's request id
        (server/logs.py) is in its log lines and goes back in the trailing metadata."""
        code = grpc.StatusCode.UNKNOWN
        given = REQUEST_ID.get() or dict(context.invocation_metadata() or ()).get(HEADER, "")
        rid = request_id(given)
        known = REQUEST_ID.set(rid)
        context.set_trailing_metadata(((HEADER, rid),))
        try:
            yield call
            code = grpc.StatusCode.OK
        except CallError as e:
            code = e.code
            await context.abort(e.code, e.message, ((HEADER, rid),))
        except (asyncio.CancelledError, ExecuteBatchError):
            code = self._gone(context)
            raise asyncio.CancelledError from None
        finally:
            call.release()
            self.metrics.call_ended(call.model, method, code.name, time.monotonic() - call.start)
            REQUEST_ID.reset(known)

    @staticmethod
    def _gone(context) -> grpc.StatusCode:
        """Why a client went: the client's timer fires first and its cancel arrives a moment before
        our own deadline (the timeout travels relative), so a cancel that close to it is the deadline."""
        remaining = context.time_remaining()
        expired = remaining is not None and remaining <= DEADLINE_SLACK_S
        return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED

    async def _unary(self, method, task, request, context, source="", target=""):
        async with self._accounted(method, context, Call(self._label(request.model))) as call:
            done = await self._submit(call, task, request, context, source, target)
            await asyncio.gather(*done)
            self._raise_failures(call.seqs)
            results = [await self._result(call.pipeline, i, d) for i, d in enumerate(call.docs)]
            return self._response(call.pipeline, results)

    async def _stream(self, method, task, request, context, source="", target=""):
        async with self._accounted(method, context, Call(self._label(request.model))) as call:
            if task == "translate" and request.stream_sentences:
                call.sentences = asyncio.Queue()
                await self._submit(call, task, request, context, source, target)
                await self._stream_sentences(call, context)
                return
            done = await self._submit(call, task, request, context, source, target)
            docs = call.docs
            index = {id(f): i for i, f in enumerate(done)}
            pending = set(done)
            while pending:
                finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for f in sorted(finished, key=lambda f: index[id(f)]):
                    i = index[id(f)]
                    self._raise_failures(docs[i].sequences)
                    await context.write(self._response(call.pipeline, [await self._result(call.pipeline, i, docs[i])]))

    async def _stream_sentences(self, call: Call, context) -> None:
        """Each sentence as it ends (partial), each text once all its sentences have (as _stream)."""
        remaining = len(call.docs)
        while remaining:
            i, seq = await call.sentences.get()
            doc = call.docs[i]
            if seq is None:
                remaining -= 1
                self._raise_failures(doc.sequences)
                await context.write(self._response(call.pipeline, [await self._result(call.pipeline, i, doc)]))
            else:
                await context.write(self._response(call.pipeline, [self._partial(call.pipeline, i, doc, seq)]))

    @staticmethod
    def _partial(pipeline: Pipeline, index: int, doc: Document, seq: Sequence) -> pb.TextResult:
        k = doc.sequences.index(seq)
        scores = seq.options.return_scores
        hyps = [pb.Hypothesis(text=o.text, tokens=o.tokens, score=o.score if scores else 0.0,
                              log_prob=o.log_prob if scores else 0.0,
                              finish_reason=pb.LENGTH if o.at_limit else pb.END_OF_SENTENCE)
                for o in pipeline.sentence_outputs(doc, k)]
        return pb.TextResult(index=index, hypotheses=hyps, source_tokens=len(seq.src), partial=True, sentence=k,
                             sentences=len(doc.sequences), encoder_cache_hit=seq.cache_hit,
                             result_cache_hit=seq.result_cache_hit, truncated=doc.cut[k])

    async def _submit(self, call: Call, task, request, context, source, target) -> list[asyncio.Future]:
        """Checks the request and queues its texts (recorded in `call`); one future per text, done
        when all the text's sequences are."""
        if self.draining:
            raise CallError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another replica")
        if task == "translate" and not request.model and normalize(source) == AUTO:
            texts = [text_of(t) for t in request.texts] if request.format == pb.HTML else list(request.texts)
            source = await asyncio.get_running_loop().run_in_executor(None, self.registry.detect_source, texts, target)
        try:
            pipeline = self.registry.find(task, request.model, source, target)
        except ModelNotFound as e:
            raise CallError(grpc.StatusCode.NOT_FOUND, str(e)) from None
        if not MIN_PRIORITY <= request.priority <= MAX_PRIORITY:
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"priority={request.priority} is out of range: {MIN_PRIORITY}..{MAX_PRIORITY} (0 by "
                            "default; a higher priority is admitted first)")
        try:
            options = decoding_options(request.options).check(pipeline.limits)
            if options.diagnostics:
                pipeline.check_diagnostics()
            if task == "translate" and request.format not in TEXT_FORMATS:
                raise InputError(f"format {request.format} is not a TextFormat: use one of "
                                 f"{', '.join(pb.TextFormat.keys())}")
        except (OptionError, InputError) as e:
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        loop, loop_thread = asyncio.get_running_loop(), threading.get_ident()
        texts = list(request.texts)
        split = task == "translate" and not request.as_one_sequence
        markup = task == "translate" and request.format == pb.HTML
        prefixes = list(request.options.target_prefix)
        futures = [loop.create_future() for _ in texts]
        owner: dict[int, int] = {}  # sequence id -> its text's index

        def on_done(seq: Sequence) -> None:  # an engine thread, or the loop where it reads the workers' reports
            if threading.get_ident() == loop_thread:
                settle(owner[seq.id], seq)
            else:
                loop.call_soon_threadsafe(settle, owner[seq.id], seq)

        def settle(i: int, seq: Sequence) -> None:  # event loop
            doc = call.docs[i]
            if futures[i].done():
                return
            if all(s.status is not None for s in doc.sequences):
                status = next((s.status for s in doc.sequences if s.status != OK), OK)
                self.metrics.text_finished(pipeline.entry.name, status)
                futures[i].set_result(None)
                if call.sentences is not None:
                    call.sentences.put_nowait((i, None))
            elif call.sentences is not None and seq.status == OK:
                call.sentences.put_nowait((i, seq))

        try:
            if pipeline.entry.cfg.pos_tags and sum(map(len, texts)) > INLINE_TAGGING_CHARS:
                docs = await loop.run_in_executor(None, pipeline.documents, texts, options, on_done, deadline, split,
                                                  None, markup, prefixes)
            else:
                docs = pipeline.documents(texts, options, on_done, deadline, split, markup=markup, prefixes=prefixes)
        except InputError as e:
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        owner.update({s.id: i for i, d in enumerate(docs) for s in d.sequences})
        call.model, call.pipeline, call.docs = pipeline.entry.name, pipeline, docs
        for s in call.seqs:
            s.priority = request.priority
        self.metrics.submitted(call.model, call.seqs)
        if self.log_text:
            log.debug("model %s: %d texts: %r", pipeline.entry.name, len(texts), texts)
        try:
            pipeline.engine.submit(call.seqs)
        except QueueFull as e:
            raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except Draining as e:
            raise CallError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        return futures

    @staticmethod
    def _response(pipeline: Pipeline, results: list[pb.TextResult]) -> pb.GenerateResponse:
        e = pipeline.entry
        return pb.GenerateResponse(model=e.name, model_version=e.version, results=results,
                                   source_language=e.source_language)

    @staticmethod
    def _raise_failures(seqs: list[Sequence]) -> None:
        for s in seqs:
            if s.status != OK:
                raise CallError(FAILURE_CODES.get(s.status, grpc.StatusCode.INTERNAL), s.message)

    @staticmethod
    async def _result(pipeline: Pipeline, index: int, doc: Document) -> pb.TextResult:
        options, seqs = doc.sequences[0].options, doc.sequences
        scores = options.return_scores
        hyps = [pb.Hypothesis(text=o.text, tokens=o.tokens, score=o.score if scores else 0.0,
                              log_prob=o.log_prob if scores else 0.0,
                              finish_reason=pb.LENGTH if o.at_limit else pb.END_OF_SENTENCE)
                for o in pipeline.outputs(doc)]
        result = pb.TextResult(index=index, hypotheses=hyps, source_tokens=sum(len(s.src) for s in seqs),
                               encoder_cache_hit=all(s.cache_hit for s in seqs),
                               result_cache_hit=all(s.result_cache_hit for s in seqs),
                               truncated=doc.truncated, sentences=len(seqs))
        if options.diagnostics:  # a PyTorch pass: off the event loop
            gate, agreement = await asyncio.get_running_loop().run_in_executor(None, pipeline.diagnostics, doc)
            result.diagnostics.CopyFrom(pb.Diagnostics(gate=gate, routing_agreement=agreement))
        return result

    def _label(self, name: str) -> str:
        """The model label of a call's metrics: a loaded model's name, else "" (a label per string a
        client sends would grow the metrics without bound and publish request data)."""
        return name if name in self.registry.pipelines else ""
