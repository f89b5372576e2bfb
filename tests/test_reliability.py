"""Reliability of the real server on loopback, with the tiny models of tests/served.py.

Bad input: whatever a client sends (any Unicode, empty and blank texts, huge texts, thousands of
texts, any option value, unknown models, bytes that are no protobuf message at all), it gets a
correct result or the right status code, and the server keeps serving; hypothesis generates well
over 10,000 requests per run. Faults: a cancelled or expired call leaves the batch at the next
decoder step without disturbing the others; SIGTERM drains; SIGKILL and a restart lose nothing;
broken model files stop the start with a message naming the file; a full queue refuses at once.
"""
from __future__ import annotations

import collections
import contextlib
import json
import logging
import operator
import shutil
import signal
import threading
import time
import urllib.request
from dataclasses import dataclass

import grpc
import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto import gret_serve_pb2 as pb
from proto import gret_serve_pb2_grpc as pb_grpc
from server.__main__ import main as server_main
from server.client import Client
from server.engine.options import DecodingOptions
from server.documents import segment, whole
from server.engine.scheduler import batch_cost
from server.markup import segment_html, text_of
from server.engine.sequence import CANCELLED, DEADLINE
from server.languages import normalize
from server.unknowns import Alphabet, protect
from tests.served import RunningServer, ServerProcess, config_for, free_port
from training.corpora import load_examples
from training.seq2seq.inputs import normalize_input

torch.set_num_threads(1)
CODE = grpc.StatusCode

# The fuzzed server's limits are small so that every valid request is cheap to decode (at most
# 10 output tokens, beam 4, 64 texts) and every limit is easy to reach from both sides. (Not below
# 10 tokens: the default max_length_offset, 10, must stay within the limit.)
FUZZ_LIMITS = dict(max_beam=4, max_texts=64, max_text_chars=600, max_output_tokens=10, max_message_mb=1)
MAX_MESSAGE = FUZZ_LIMITS["max_message_mb"] << 20
METHODS = ("Translate", "TranslateStream", "Summarize", "SummarizeStream")
requests_sent = collections.Counter()  # by outcome: what the fuzz tests sent in this run


def german(n: int, offset: int = 0) -> list[str]:
    return [e.source for e in load_examples("multi30k", "val", "de", "en")[offset: offset + n]]


def outputs(response: pb.GenerateResponse) -> list:
    """What a response says about the texts (whether the encoder cache was hit aside)."""
    return [list(r.hypotheses) for r in response.results]


@pytest.fixture(scope="module")
def fuzzed(served_models):
    running = RunningServer(config_for(served_models, served_models.parent / "build-cache", **FUZZ_LIMITS))
    yield running
    running.stop()
    print(f"\nfuzzed requests by outcome: {dict(requests_sent)}; total {sum(requests_sent.values())}")


# ---- the specification of an answer ---------------------------------------------------------------
@dataclass(frozen=True)
class Expected:
    code: grpc.StatusCode
    model: str = ""  # OK: the model that must answer
    about: str = ""  # INVALID_ARGUMENT: what the status details must mention


def expected(server: RunningServer, method: str, request) -> Expected:
    """What the server must answer, from the API's documented rules: message size, then the model,
    then the priority, then the options, then the texts."""
    if request.ByteSize() > MAX_MESSAGE:
        return Expected(CODE.RESOURCE_EXHAUSTED)
    task = "translate" if method.startswith("Translate") else "summarize"
    models = {name: p.entry for name, p in server.registry.pipelines.items()}
    if request.model:
        if request.model not in models or models[request.model].task != task:
            return Expected(CODE.NOT_FOUND)
        name = request.model
    else:
        source, target = (normalize(request.source_language), normalize(request.target_language)) \
            if task == "translate" else ("", "")
        if source == "auto":  # detected among the sources of the models into the target, from text, not markup
            texts = [text_of(t) for t in request.texts] if markup(request) else list(request.texts)
            source = server.registry.detect_source(texts, target)
        fits = sorted(n for n, e in models.items() if e.task == task and source in ("", e.source_language)
                      and target in ("", e.target_language))
        if not fits:
            return Expected(CODE.NOT_FOUND)
        name = fits[0]
    problem = (priority_problem(request) or option_problem(request.options)
               or diagnostics_problem(models[name], request.options)
               or format_problem(request)
               or text_problem(models[name], task, request, options_of(request.options)))
    return Expected(CODE.INVALID_ARGUMENT, about=problem) if problem else Expected(CODE.OK, model=name)


def options_of(o: pb.DecodingOptions) -> dict:
    """The options with the documented defaults for unset fields."""
    defaults = dict(beam_size=4, length_penalty=1.0, max_length=0, max_length_ratio=1.5, max_length_offset=10,
                    min_length=0, n_best=1, no_repeat_ngram_size=0)
    return {f: getattr(o, f) if o.HasField(f) else d for f, d in defaults.items()}


def priority_problem(request) -> str:
    return "" if -10 <= request.priority <= 10 else f"priority={request.priority} is out of range"


def option_problem(options: pb.DecodingOptions) -> str:
    o, most = options_of(options), FUZZ_LIMITS["max_output_tokens"]
    checks = [("beam_size", 1 <= o["beam_size"] <= FUZZ_LIMITS["max_beam"]),
              ("n_best", 1 <= o["n_best"] <= min(o["beam_size"], FUZZ_LIMITS["max_beam"])),
              ("length_penalty", 0 <= o["length_penalty"] <= 10),  # NaN fails every comparison
              ("max_length_ratio", 0 <= o["max_length_ratio"] <= 10),
              ("max_length_offset", o["max_length_offset"] <= 10_000),  # only shapes the limit
              ("max_length", o["max_length"] <= most),
              ("no_repeat_ngram_size", o["no_repeat_ngram_size"] <= 8)]
    return next((f"option {name}=" for name, ok in checks if not ok), "")


def diagnostics_problem(entry, options: pb.DecodingOptions) -> str:
    """GRET diagnostics need a GRET model served from its checkpoint (none is, in the fuzzed server)."""
    return "diagnostics" if options.return_diagnostics and not (entry.cfg.gret and entry.checkpoint) else ""


def format_problem(request) -> str:
    """A translation's format is one of the TextFormat values (proto3 lets a client send any number)."""
    known = not isinstance(request, pb.TranslateRequest) or request.format in pb.TextFormat.values()
    return "" if known else f"format {request.format} is not a TextFormat"


alphabets: dict[str, Alphabet] = {}


def pieces(entry, text: str, protected: bool | None = None) -> int:
    """What the model reads of a segment: the text in its input style, and for translation its
    characters the model cannot write taken out (server.unknowns)."""
    text = normalize_input(entry.input_style, text)
    if entry.task == "translate" if protected is None else protected:
        text = protect(text, alphabets.setdefault(entry.name, Alphabet(entry.sp))).text
    return len(entry.sp.encode(text))


def prefix_pieces(entry, prefix: str) -> int:
    """A target prefix as the model writes it: in its style, without the characters it cannot write."""
    return pieces(entry, prefix, protected=True) if prefix.strip() else 0


def reads_whole(request) -> bool:
    """Summaries, and translations sent as_one_sequence, are decoded unsplit (HTML aside)."""
    return not isinstance(request, pb.TranslateRequest) or request.as_one_sequence


def markup(request) -> bool:
    return isinstance(request, pb.TranslateRequest) and request.format == pb.HTML


def refuses_long(request) -> bool:
    """Translations sent as_one_sequence refuse a segment over the model's limit; others truncate it."""
    return isinstance(request, pb.TranslateRequest) and request.as_one_sequence


def layout(entry, request, text: str):
    """How a text is decoded: an HTML document's sentences (server.markup: always split), a
    translation's sentences (server.documents, segments split to fit where they can be), or the
    whole text."""
    fits = lambda s: pieces(entry, s) <= entry.max_src_len - 1  # noqa: E731
    if markup(request):
        return segment_html(text, entry.source_language, fits)
    return whole(text) if reads_whole(request) else segment(text, entry.source_language, fits)


def segments(entry, request, text: str) -> list[str]:
    """What the model reads of a text: its layout's segments; a summary of a text over the window
    reads the text's first sentence."""
    if over_window(entry, request, text):
        return segment(text, entry.source_language, lambda s: pieces(entry, s) <= entry.max_src_len - 1).segments[:1]
    return layout(entry, request, text).segments


def over_window(entry, request, text: str) -> bool:
    return not isinstance(request, pb.TranslateRequest) and pieces(entry, text) > entry.max_src_len - 1


def prefixes_of(request) -> list[str]:
    """One target prefix per text: none, one for all, or one each."""
    sent, n = list(request.options.target_prefix), len(request.texts)
    return sent * n if len(sent) == 1 else sent or [""] * n


def source_tokens(entry, text: str) -> int:
    """What the model reads of a segment: its pieces in the model's input style (truncated to
    fit), plus EOS."""
    return min(pieces(entry, text), entry.max_src_len - 1) + 1


def output_limit(entry, o: dict, source: int) -> int:
    limit = int(source * o["max_length_ratio"] + o["max_length_offset"])
    for cap in (o["max_length"], entry.cfg.max_positions - 1, FUZZ_LIMITS["max_output_tokens"]):
        limit = min(limit, cap) if cap else limit
    return max(1, limit)


def text_problem(entry, task: str, request, o: dict) -> str:
    texts, sent = list(request.texts), list(request.options.target_prefix)
    if not texts:
        return "no texts"
    if len(texts) > FUZZ_LIMITS["max_texts"]:
        return f"{len(texts)} texts in one call"
    if len(sent) not in (0, 1, len(texts)):
        return f"option target_prefix has {len(sent)} entries for {len(texts)} texts"
    for i, prefix in enumerate(sent):
        if len(prefix) > FUZZ_LIMITS["max_text_chars"]:
            return f"option target_prefix {i} has {len(prefix)} characters"
    for i, text in enumerate(texts):  # every text's size first, before any is read
        if not text.strip():
            return f"text {i} is empty or only whitespace"
        if len(text) > FUZZ_LIMITS["max_text_chars"]:
            return f"text {i} has {len(text)} characters"
    for i, (text, prefix) in enumerate(zip(texts, prefixes_of(request))):
        parts = segments(entry, request, text)
        if not parts:
            return f"text {i} has no text outside its markup"
        for k, s in enumerate(parts):  # as the server makes their sequences: in order, each checked
            if refuses_long(request) and pieces(entry, s) > entry.max_src_len - 1:
                return f"text {i} is"  # ... N pieces long (summaries and split texts truncate instead)
            limit = output_limit(entry, o, source_tokens(entry, s))
            if k == 0 and prefix_pieces(entry, prefix) >= limit:
                return f"text {i}: option target_prefix is"
            if o["min_length"] > limit:
                return f"text {i}: option min_length="
    return ""


def check_results(server: RunningServer, request, model: str, results) -> None:
    """Every text has its result: the source as the model's tokenizer reads the text we sent, in
    the model's input style (so nothing was lost or mangled on the way), cut only where it says so,
    n_best hypotheses within the length limits of its segments, ordered, each with its finish reason,
    and a plain text's beginning with its target prefix exactly as sent (after the text's leading
    whitespace, when it is split into sentences)."""
    entry = server.registry.pipelines[model].entry
    o = options_of(request.options)
    assert [r.index for r in results] == list(range(len(request.texts)))
    for text, result, prefix in zip(request.texts, results, prefixes_of(request)):
        parts = segments(entry, request, text)
        assert (result.sentences, result.source_tokens) == (len(parts), sum(source_tokens(entry, s) for s in parts))
        assert result.truncated == (over_window(entry, request, text)
                                    or any(pieces(entry, s) > entry.max_src_len - 1 for s in parts))
        limits = [output_limit(entry, o, source_tokens(entry, s)) for s in parts]
        hyps = result.hypotheses
        assert len(hyps) == o["n_best"]
        assert all(o["min_length"] * len(parts) <= h.tokens <= sum(limits) for h in hyps)
        assert all(h.finish_reason in (pb.END_OF_SENTENCE, pb.LENGTH) for h in hyps)
        if len(parts) == 1:
            assert all((h.finish_reason == pb.LENGTH) == (h.tokens >= limits[0]) for h in hyps)
        if prefix.strip() and not markup(request):
            lead = layout(entry, request, text).gaps[0]
            assert all(h.text.startswith(lead + prefix) for h in hyps), (prefix, [h.text for h in hyps])
        scores = [h.score for h in hyps]
        assert scores == (sorted(scores, reverse=True) if request.options.return_scores else [0.0] * len(hyps))


def check_partial(request, sent: list) -> None:
    """Sentences streamed ahead of their texts: only when asked for, only of texts of several
    sentences, each once and before its text."""
    partial = [r for r in sent if r.partial]
    if not (isinstance(request, pb.TranslateRequest) and request.stream_sentences):
        assert not partial
    finals = {r.index: at for at, r in enumerate(sent) if not r.partial}
    for r in partial:
        assert r.sentences >= 2 and r.sentence < r.sentences and sent.index(r) < finals[r.index]
    assert len({(r.index, r.sentence) for r in partial}) == len(partial)


def check_answer(server: RunningServer, method: str, request, outcome) -> None:
    code, responses, details = outcome
    want = expected(server, method, request)
    requests_sent[code.name] += 1
    assert code == want.code, f"{method} answered {code.name} ({details}), expected {want.code.name}"
    if code == CODE.INVALID_ARGUMENT:
        assert want.about in details
    elif code == CODE.OK:
        assert all(r.model == want.model for r in responses)
        if method.endswith("Stream"):
            assert all(len(r.results) == 1 for r in responses)
            sent = [r.results[0] for r in responses]
            results = sorted((r for r in sent if not r.partial), key=lambda r: r.index)
            check_partial(request, sent)
        else:
            results = responses[0].results
        check_results(server, request, want.model, results)
    else:
        assert details  # every refusal says why


def start(call, streaming: bool, request):
    """Starts the call now; the returned function waits for (code, responses, details)."""
    pending = call(request, timeout=120) if streaming else call.future(request, timeout=120)

    def wait():
        try:
            return CODE.OK, list(pending) if streaming else [pending.result()], ""
        except grpc.RpcError as e:
            return e.code(), [], e.details()

    return wait


def assert_still_serving(server: RunningServer, reference) -> None:
    """Health says SERVING, every model still answers (the de-en reference exactly as before), all
    work is done, and no call ever ended in INTERNAL or UNKNOWN."""
    with Client(server.address, timeout=60) as c:
        assert c.health() == "SERVING"
        assert outputs(c.translate(*reference[0], **reference[1])) == outputs(reference[2])
        c.summarize(["the bank raised rates ."], beam_size=1, max_length=2)
        c.translate(["A dog runs."], target="de", beam_size=1, max_length=2)
    assert all(p.engine.idle() for p in server.registry)
    codes = {s.labels["code"] for m in server.metrics.registry.collect() for s in m.samples
             if s.name == "gret_serve_requests_total"}
    assert not codes & {"INTERNAL", "UNKNOWN"}


@pytest.fixture(scope="module")
def reference(fuzzed):
    """A translation taken before any fuzzing: the same call must answer the same after it."""
    args, options = (german(3), "en"), dict(beam_size=2, max_length=10)
    with Client(fuzzed.address, timeout=60) as c:
        return args, options, c.translate(*args, **options)


# ---- what hypothesis generates ------------------------------------------------------------------------
def weighted(*pairs):
    """one_of with weights: (weight, strategy) pairs."""
    return st.sampled_from([s for w, s in pairs for _ in range(w)]).flatmap(lambda s: s)


# Control and format characters, combining marks, emoji (with ZWJ and flags), right-to-left
# scripts and overrides, BOM, non-characters, Unicode whitespace, and a few ordinary words.
ODD = ["\x00", "\x01", "\t", "\n", "\r", "\x1b", "\x7f", "\x85", "\u00a0", "\u200b", "\u200d", "\u200e", "\u200f",
       "\u202e", "\u2066", "\u2028", "\u3000", "\ufeff", "\ufffd", "\uffff", "\U0010ffff", "\u0301", "\u0308",
       "\u20dd", "e\u0301", "\U0001f600", "\U0001f469\u200d\U0001f4bb", "\U0001f1e9\U0001f1ea",
       "\u05e9\u05dc\u05d5\u05dd", "\u0645\u0631\u062d\u0628\u0627", "\u4e2d\u6587", "Hund", "läuft", "Straße",
       " ", ".", "?"]
SENTENCES = german(30)
text = weighted(
    (3, st.sampled_from(SENTENCES)),
    (3, st.text(st.characters(codec="utf-8"), max_size=24)),  # any code point UTF-8 can carry
    (3, st.lists(st.sampled_from(ODD), max_size=10).map("".join)),
    (1, st.text(st.characters(categories=["Zs", "Zl", "Zp", "Cc"]), max_size=6)),  # blank or control only
    (1, st.builds(operator.mul, st.sampled_from(["Hund ", "ü", "\U0001f600", "e\u0301", "\u05d0\u05d1 "]),
                  st.integers(90, 700))),  # around the character and the piece limits
)
# Markup for format HTML (and as plain text): tags inline and block, entities, comments, scripts, stray < and &.
MARKUP = ["<p>", "</p>", "<b>", "</b>", '<a href="/x?a=1&amp;b=2">', "</a>", "<br/>", "&amp;", "&#x1F600;", "&nbsp;",
          "<!-- c -->", "<script>if (a < b) {}</script>", "<", ">", "&", "<div>", "</span>", "<!DOCTYPE html>"]
HTML = ["<p>Ein <b>Hund</b> läuft.</p>", "<p>Zwei Männer.</p>\n<p>Eine <a href='/'>Frau</a> liest &amp; lacht.</p>",
        "<ul><li>Hund</li><li>Katze</li></ul>", "<p><b></b></p>", "<!-- nur -->", "<p>Ein 😀 Hund.</p>"]
text = weighted(
    (6, text),
    (1, st.sampled_from(HTML)),
    (1, st.lists(st.sampled_from(MARKUP + ODD + SENTENCES[:5]), max_size=10).map("".join)),
    (1, st.lists(st.sampled_from(SENTENCES), min_size=2, max_size=12).map(" ".join)),  # documents, long ones
)
short_text = st.one_of(st.sampled_from(SENTENCES), st.lists(st.sampled_from(ODD), max_size=4).map("".join))
texts = weighted(  # a message over the size limit costs ~0.2 s on loopback: rare here, tested on its own too
    (50, st.lists(text, max_size=4)),
    (5, st.builds(operator.mul, st.lists(short_text, min_size=1, max_size=1), st.sampled_from([63, 64, 65, 3000]))),
    (1, st.just(["x" * (MAX_MESSAGE + 1)])),
)


def uint(low: int, high: int):
    return st.one_of(st.none(), st.integers(low, high))


def real(low: float, high: float):
    return st.one_of(st.none(), st.floats(low, high, width=32))


def options_message(**fields) -> pb.DecodingOptions:
    return pb.DecodingOptions(**{k: v for k, v in fields.items() if v is not None})


# Target prefixes: none, blank, words (most within the fuzzed 10-token limit, some not), odd characters,
# anything, and one over the character limit; as many as the texts or not.
prefix = weighted(
    (3, st.sampled_from(["", " ", "A", "A dog", "Ein Hund läuft über die Wiese", "the", "japan 's"])),
    (2, st.lists(st.sampled_from(ODD + MARKUP[:6]), max_size=4).map("".join)),
    (1, st.text(st.characters(codec="utf-8"), max_size=12)),
    (1, st.just("a " * 400)),
)
prefixes = weighted((6, st.just([])), (3, st.lists(prefix, min_size=1, max_size=1)), (2, st.lists(prefix, max_size=5)))


# Options either within the limits (unset or in range, so a valid request stays cheap) or anything.
options = st.one_of(
    st.builds(options_message, beam_size=uint(1, 4), length_penalty=real(0, 10), max_length=uint(1, 8),
              max_length_ratio=real(0, 10), max_length_offset=uint(0, 8), min_length=uint(0, 8), n_best=uint(1, 4),
              no_repeat_ngram_size=uint(0, 8), return_scores=st.booleans(), target_prefix=prefixes),
    st.builds(options_message, beam_size=uint(0, 2**32 - 1), length_penalty=st.floats(width=32),
              max_length=uint(0, 2**32 - 1), max_length_ratio=st.floats(width=32),
              max_length_offset=uint(0, 2**32 - 1), min_length=uint(0, 2**32 - 1), n_best=uint(0, 2**32 - 1),
              no_repeat_ngram_size=uint(0, 2**32 - 1), return_scores=st.booleans(),
              return_diagnostics=st.booleans(), target_prefix=prefixes),
)
model = st.one_of(st.just(""), st.sampled_from(["tiny-de-en", "tiny-en-de", "tiny-headlines"]), st.text(max_size=12))
priority = st.one_of(st.just(0), st.integers(-10, 10), st.integers(-2**31, 2**31 - 1))
language = st.one_of(st.sampled_from(["", "de", "en", "fr", "DE", "de-DE", "eng", "ger", "auto"]), st.text(max_size=4))


@st.composite
def any_call(draw):
    method = draw(st.sampled_from(METHODS))
    common = dict(texts=draw(texts), model=draw(model), options=draw(options), priority=draw(priority))
    if method.startswith("Translate"):
        return method, pb.TranslateRequest(source_language=draw(language), target_language=draw(language),
                                           as_one_sequence=draw(st.booleans()), stream_sentences=draw(st.booleans()),
                                           format=draw(weighted((6, st.just(pb.TEXT)), (3, st.just(pb.HTML)),
                                                                (1, st.integers(2, 2**31 - 1)))), **common)
    return method, pb.SummarizeRequest(**common)


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def flip(raw: bytes, edits: list[tuple[int, int]]) -> bytes:
    raw = bytearray(raw)
    for position, value in edits:
        if raw:
            raw[position % len(raw)] = value
    return bytes(raw)


# Bytes as a raw channel sends them: anything, a text field holding arbitrary bytes (mostly invalid
# UTF-8: lone surrogates encoded, overlong forms, stray continuation bytes), or a valid request
# with some bytes overwritten.
raw_requests = st.one_of(
    st.binary(max_size=64),
    st.binary(max_size=24).map(lambda b: b"\x0a" + varint(len(b)) + b),
    st.builds(flip, any_call().map(lambda c: c[1].SerializeToString()[:4096]),
              st.lists(st.tuples(st.integers(0, 4095), st.integers(0, 255)), min_size=1, max_size=3)),
)


# ---- bad input ---------------------------------------------------------------------------------------
def test_every_generated_request_gets_a_correct_result_or_the_right_status_code(fuzzed, reference):
    sent = []
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(fuzzed.address))

    @settings(max_examples=1600, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(any_call(), min_size=4, max_size=4))
    def any_four_calls_at_once(batch):
        waits = [start(getattr(stub, method), method.endswith("Stream"), request) for method, request in batch]
        for (method, request), wait in zip(batch, waits):
            check_answer(fuzzed, method, request, wait())
        sent.append(len(batch))

    any_four_calls_at_once()
    assert sum(sent) >= 6400
    assert_still_serving(fuzzed, reference)


def test_any_bytes_as_a_request_get_a_result_or_invalid_argument_never_internal(fuzzed, reference):
    channel = grpc.insecure_channel(fuzzed.address)
    raw_calls = {m: getattr(channel, "unary_stream" if m.endswith("Stream") else "unary_unary")(
        f"/gretserve.v1.Inference/{m}", response_deserializer=pb.GenerateResponse.FromString) for m in METHODS}
    sent = []

    @settings(max_examples=1000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.tuples(st.sampled_from(METHODS), raw_requests), min_size=4, max_size=4))
    def any_four_payloads_at_once(batch):
        waits = [start(raw_calls[method], method.endswith("Stream"), raw) for method, raw in batch]
        for (method, raw), wait in zip(batch, waits):
            kind = pb.TranslateRequest if method.startswith("Translate") else pb.SummarizeRequest
            try:
                request = kind.FromString(raw)
            except DecodeError:  # not a message of this type
                code, _, details = wait()
                requests_sent[code.name] += 1
                assert code == CODE.INVALID_ARGUMENT and "not a valid" in details
            else:
                check_answer(fuzzed, method, request, wait())
        sent.append(len(batch))

    any_four_payloads_at_once()
    assert sum(sent) >= 4000
    assert_still_serving(fuzzed, reference)


def test_the_python_client_refuses_lone_surrogates_before_sending():
    with pytest.raises(UnicodeEncodeError):
        pb.TranslateRequest(texts=["Hund \ud800"])


@pytest.mark.parametrize("raw", [b"\xed\xa0\x80", b"\xc0\xaf", b"\xe2\x82", b"\xff\xfe", b"ok\x80"],
                         ids=["surrogate", "overlong", "truncated", "not-utf8", "stray-continuation"])
def test_a_text_that_is_not_utf8_is_invalid_argument(fuzzed, raw):
    call = grpc.insecure_channel(fuzzed.address).unary_unary("/gretserve.v1.Inference/Translate")
    with pytest.raises(grpc.RpcError) as info:
        call(b"\x0a" + varint(len(raw)) + raw, timeout=30)
    assert info.value.code() == CODE.INVALID_ARGUMENT and "not a valid gretserve.v1.TranslateRequest" in \
        info.value.details()
    requests_sent[info.value.code().name] += 1


# ---- faults: cancellation and deadlines -------------------------------------------------------------
class StepLog:
    """The model's metrics observer, plus a record of the rows of every decoder step (what
    gret_serve_rows_per_step observes) and of every finished text. It can hold the engine thread
    after the first step with `hold` rows until `release` is set: the test then acts while the
    engine waits between two steps, so "the next step" is exact on however busy a machine."""

    def __init__(self, observer):
        self.observer = observer
        self.steps, self.done = [], []
        self.hold, self.held, self.release = None, threading.Event(), threading.Event()

    def stepped(self, rows: int, seconds: float) -> None:
        self.observer.stepped(rows, seconds)
        self.steps.append(rows)
        if rows == self.hold:
            self.hold = None
            self.held.set()
            self.release.wait(60)

    def finished(self, seq) -> None:
        self.observer.finished(seq)
        self.done.append(seq)

    def __getattr__(self, name):
        return getattr(self.observer, name)


@pytest.fixture(scope="module")
def roomy(served_models):
    """A server with the default limits (long outputs allowed) and one model; a budget that lets
    beside_a_running_call's 16 long beam-4 texts join the batch at once (the whole budget: no bulk share)."""
    running = RunningServer(config_for(served_models, served_models.parent / "build-cache", models=["tiny-de-en"],
                                       max_batch_tokens=16384, max_bulk_share=1.0))
    yield running
    running.stop()


@pytest.fixture
def step_log(roomy):
    engine = roomy.registry.pipelines["tiny-de-en"].engine
    log = engine.observer = StepLog(engine.observer)
    yield log
    log.release.set()
    engine.observer = log.observer


# These servers are kept busy with the same texts again and again: each must be decoded again.
DECODE_REPEATS = ("--result-cache", 0)

# Exactly 128 output tokens whatever the source (the offset lifts every text's limit to 128, so
# min_length fits it): the call stays in the batch for 128 steps.
LONG = dict(max_length_ratio=10, max_length_offset=128, max_length=128, min_length=128)


def request(texts, beam, **options):
    return pb.TranslateRequest(texts=texts, target_language="en", options=pb.DecodingOptions(beam_size=beam, **options))


def wait_until(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def ended_calls(server: RunningServer, code: str) -> float:
    return server.metrics.registry.get_sample_value(
        "gret_serve_requests_total", {"model": "tiny-de-en", "method": "Translate", "code": code}) or 0


def beside_a_running_call(roomy, step_log, offset: int):
    """A one-row call decoding in the engine (and its output when it ran alone); the engine will
    hold once a 16-text beam-4 call has joined it. Returns (stub, the running call, its output alone)."""
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(roomy.address))
    other = request(german(1, offset=offset), beam=1, **LONG)
    alone = stub.Translate(other, timeout=60)
    running = stub.Translate.future(other, timeout=60)
    wait_until(lambda: 1 in step_log.steps)
    step_log.hold = 1 + 16 * 4  # both calls decoding, every beam of the second one filled
    return stub, running, alone


def test_a_cancelled_call_leaves_the_batch_at_the_next_step_and_the_others_are_unaffected(roomy, step_log):
    stub, running, alone = beside_a_running_call(roomy, step_log, offset=40)
    cancelled = stub.Translate.future(request(german(16, offset=50), beam=4, **LONG), timeout=60)
    assert step_log.held.wait(60)
    before = ended_calls(roomy, "CANCELLED")
    cancelled.cancel()
    wait_until(lambda: ended_calls(roomy, "CANCELLED") > before)  # the server has seen it
    held_at = len(step_log.steps)
    step_log.release.set()
    assert outputs(running.result()) == outputs(alone)
    assert cancelled.cancelled()
    assert set(step_log.steps[held_at:]) == {1}  # from the very next step on, only the other call's row
    gone = [s for s in step_log.done if s.status == CANCELLED]
    assert len(gone) == 16 and all(0 < s.step < s.max_len for s in gone)  # dropped mid-decode
    assert roomy.metrics.registry.get_sample_value("gret_serve_batch_rows", {"model": "tiny-de-en"}) == 1


def test_an_expired_call_leaves_the_batch_at_the_next_step_and_the_others_are_unaffected(roomy, step_log):
    stub, running, alone = beside_a_running_call(roomy, step_log, offset=41)
    def ended() -> float:  # the server names a cancel that arrives at the deadline DEADLINE_EXCEEDED
        return ended_calls(roomy, "DEADLINE_EXCEEDED") + ended_calls(roomy, "CANCELLED")

    before = ended()
    expiring = stub.Translate.future(request(german(16, offset=70), beam=4, **LONG), timeout=3.0)
    assert step_log.held.wait(60)
    assert expiring.exception(60).code() == CODE.DEADLINE_EXCEEDED  # while the engine waits
    wait_until(lambda: ended() > before)  # the server has seen it
    held_at = len(step_log.steps)
    step_log.release.set()
    assert outputs(running.result()) == outputs(alone)
    assert set(step_log.steps[held_at:]) == {1}
    # grpc cancels the handler when the deadline passes, or the engine finds it expired: either way the rows go.
    gone = [s for s in step_log.done if s.status in (CANCELLED, DEADLINE)]
    assert len(gone) == 16 and all(0 < s.step < s.max_len for s in gone)


# The vanilla model: batches of any size (the exported GRET model's encoder refuses batches of
# more than one text at present: "invalid dimensions for output: global_state").
VANILLA = "tiny-en-de"


@pytest.fixture(scope="module")
def vanilla(served_models):
    """A server with the default limits and the vanilla model, its engine observed by a StepLog."""
    running = RunningServer(config_for(served_models, served_models.parent / "build-cache", models=[VANILLA]))
    engine = running.registry.pipelines[VANILLA].engine
    engine.observer = StepLog(engine.observer)
    yield running
    engine.observer.release.set()
    running.stop()


def to_german(texts, beam, priority=0, **options):
    return pb.TranslateRequest(texts=texts, target_language="de", priority=priority,
                               options=pb.DecodingOptions(beam_size=beam, **options))


def calls_ended(server: RunningServer, method: str, code: str) -> float:
    return server.metrics.registry.get_sample_value(
        "gret_serve_requests_total", {"model": VANILLA, "method": method, "code": code}) or 0


def test_a_stream_cancelled_while_its_write_waits_for_the_clients_window_stops_decoding(vanilla, caplog):
    """The chaos test's trigger: a small HTTP/2 window fills while the client reads nothing, so
    the server is blocked in a write when the cancel arrives. The call is counted as CANCELLED
    once, its texts leave the engine at the next step, and nothing is logged as an error."""
    engine = vanilla.registry.pipelines[VANILLA].engine
    step_log = engine.observer
    small_window = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(vanilla.address, options=small_window))
    counted = lambda: sum(calls_ended(vanilla, "TranslateStream", c.name) for c in CODE)  # noqa: E731
    before = calls_ended(vanilla, "TranslateStream", "CANCELLED"), counted()
    call = stub.TranslateStream(to_german(german(256, offset=400), beam=8, n_best=4, return_scores=True), timeout=120)
    next(call)
    time.sleep(0.5)  # the window fills; the server's next write waits for it
    call.cancel()
    wait_until(lambda: calls_ended(vanilla, "TranslateStream", "CANCELLED") > before[0])
    steps_at_cancel = len(step_log.steps)
    wait_until(engine.idle)
    assert len(step_log.steps) - steps_at_cancel <= 1  # at most the step already under way
    assert counted() == before[1] + 1
    statuses = collections.Counter(s.status for s in step_log.done)
    assert sum(statuses.values()) == 256 and statuses[CANCELLED] > 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# At most 8 output tokens at beam 1: a text's budget is its source + 8.
SHORT = dict(max_length_ratio=10, max_length=8, min_length=8)


@contextlib.contextmanager
def engine_held_behind_one_call(served_models, offset: int):
    """A server with the vanilla model and a small budget (two or three texts decode at a time),
    one one-text call decoding, and the engine held between two steps until log.release is set:
    what the test queues meanwhile is all waiting at once. Yields (server, stub, log, the call)."""
    server = RunningServer(config_for(served_models, served_models.parent / "build-cache", models=[VANILLA],
                                      max_batch_tokens=80))
    engine = server.registry.pipelines[VANILLA].engine
    log = engine.observer = StepLog(engine.observer)
    try:
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(server.address))
        log.hold = 1  # before the call: it may finish before this thread runs again
        running = stub.Translate.future(to_german(german(1, offset=offset), beam=1, **SHORT), timeout=120)
        assert log.held.wait(60)
        yield server, stub, log, running
    finally:
        log.release.set()
        server.stop()


def test_a_one_text_call_is_admitted_after_one_text_of_each_call_ahead_not_after_their_backlog(served_models):
    """Calls take turns at admission: behind 4 calls of 16 texts each, a one-text call is the
    fifth admitted (first come, first served by text, it would be the 65th)."""
    with engine_held_behind_one_call(served_models, offset=600) as (server, stub, log, running):
        engine = server.registry.pipelines[VANILLA].engine
        backlog = [stub.Translate.future(to_german(german(16, offset=610 + 16 * i), beam=1, **SHORT), timeout=120)
                   for i in range(4)]
        wait_until(lambda: engine.queued() == 64)
        small = stub.Translate.future(to_german(german(1, offset=700), beam=1, **SHORT), timeout=120)
        wait_until(lambda: engine.queued() == 65)
        log.release.set()
        for call in [running, small, *backlog]:
            call.result(120)
    source = lambda text: server.registry.pipelines[VANILLA].sequences([text], DecodingOptions(), None)[0].src  # noqa: E731
    first, small = source(german(1, offset=600)[0]), source(german(1, offset=700)[0])
    small_seq = next(s for s in log.done if s.src == small)
    backlog_seqs = [s for s in log.done if s.src not in (first, small)]
    assert len(backlog_seqs) == 64
    assert sum(s.admitted < small_seq.admitted for s in backlog_seqs) <= 4  # one text of each call ahead
    assert sum(s.admitted > small_seq.admitted for s in backlog_seqs) >= 64 - 8  # the backlog still waited


def test_a_higher_priority_call_is_admitted_before_any_waiting_text_of_a_lower_priority(served_models):
    """Priority is strict: behind a backlog at priorities 0 and -5, a one-text call at priority 5 is
    the first admitted once the engine admits again, and no text of priority -5 joins the batch
    while one of priority 0 waits."""
    with engine_held_behind_one_call(served_models, offset=800) as (server, stub, log, running):
        engine = server.registry.pipelines[VANILLA].engine
        backlog = [stub.Translate.future(to_german(german(8, offset=810 + 8 * i), beam=1, priority=p, **SHORT),
                                         timeout=120) for i, p in enumerate((-5, 0, 0))]
        wait_until(lambda: engine.queued() == 24)
        urgent = stub.Translate.future(to_german(german(1, offset=850), beam=1, priority=5, **SHORT), timeout=120)
        wait_until(lambda: engine.queued() == 25)
        log.release.set()
        for call in [running, urgent, *backlog]:
            assert len(call.result(120).results) in (1, 8)
    first = min(log.done, key=lambda s: s.admitted)  # the call that was running
    queued = [s for s in log.done if s is not first]
    by_priority = {p: [s for s in queued if s.priority == p] for p in (5, 0, -5)}
    assert [len(v) for v in by_priority.values()] == [1, 16, 8]
    assert by_priority[5][0].admitted <= min(s.admitted for s in queued)
    assert max(s.admitted for s in by_priority[0]) <= min(s.admitted for s in by_priority[-5])


@pytest.mark.parametrize("priority", [11, -11, 2**31 - 1])
def test_a_priority_out_of_range_is_invalid_argument_naming_the_range(vanilla, priority):
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(vanilla.address))
    calls = [lambda: stub.Translate(to_german(german(1), beam=1, priority=priority), timeout=60),
             lambda: list(stub.TranslateStream(to_german(german(1), beam=1, priority=priority), timeout=60))]
    for call in calls:
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == CODE.INVALID_ARGUMENT
        assert refused.value.details().startswith(f"priority={priority} is out of range: -10..10")


def held_while_others_waited(seqs, since: float, share: float) -> list[tuple[int, int]]:
    """Replays the batch from the texts' admission and finishing times: for every text admitted
    after `since` while another call still had texts waiting, (its call, the budget its call already
    held in the running batch). Texts admitted together are taken in their call's order."""
    found = []
    for t in sorted({s.admitted for s in seqs if s.admitted > since}):
        for call in sorted({s.call for s in seqs if s.admitted == t}):
            others_wait = any(s.admitted > t for s in seqs if s.call != call)
            if not others_wait:
                continue
            held = sum(s.rows_budget for s in seqs if s.call == call and s.admitted < t < s.done)
            for s in sorted((s for s in seqs if s.call == call and s.admitted == t), key=lambda s: s.id):
                found.append((call, held))
                held += s.rows_budget
    return found


def test_while_another_call_waits_a_call_holding_its_share_of_the_batch_gets_no_more_texts(served_models):
    """--max-call-share 0.5: a 24-text call fills the batch alone, then a second one queues. From
    then on, while the other has texts waiting, no call that holds half the admission budget or
    more is given another text: the room its finished texts free goes to the other call. (Calls of
    several texts may fill the whole budget here: --max-bulk-share 1.)"""
    budget = 1500
    server = RunningServer(config_for(served_models, served_models.parent / "build-cache", models=[VANILLA],
                                      max_batch_tokens=budget, max_call_share=0.5, max_bulk_share=1.0))
    pipeline = server.registry.pipelines[VANILLA]
    engine = pipeline.engine
    log = engine.observer = StepLog(engine.observer)
    first, second = german(24, offset=900), german(24, offset=930)  # outputs of many lengths: they leave one by one
    seqs = [s for d in pipeline.documents(first, DecodingOptions(beam=1), None) for s in d.sequences]
    fitting = next(i for i in range(len(seqs) + 1) if i == len(seqs) or batch_cost(seqs[: i + 1]) > budget)
    # the first call holds its share when the second comes
    assert fitting >= 6 and sum(s.rows_budget for s in seqs[:fitting]) >= budget / 2
    try:
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(server.address))
        calls = [stub.Translate.future(to_german(first, beam=1), timeout=120)]
        log.hold = fitting
        assert log.held.wait(60)  # the first call decodes alone, the batch full of its texts
        calls.append(stub.Translate.future(to_german(second, beam=1), timeout=120))
        wait_until(lambda: engine.queued() == 48 - fitting)
        released = time.monotonic()
        log.release.set()
        for call in calls:
            assert len(call.result(120).results) == 24
    finally:
        log.release.set()
        server.stop()
    assert len(log.done) == 48 and len({s.call for s in log.done}) == 2
    admitted = held_while_others_waited(log.done, released, budget * 0.5)
    assert len(admitted) >= 8  # the calls did wait for each other
    assert all(held < budget * 0.5 for _, held in admitted)


def test_a_min_length_above_a_texts_output_limit_is_invalid_argument_naming_both_numbers(vanilla):
    text = german(1, offset=500)[0]
    limit = int(1.5 * (len(vanilla.registry.pipelines[VANILLA].entry.sp.encode(text)) + 1) + 10)
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(vanilla.address))
    with pytest.raises(grpc.RpcError) as refused:
        stub.Translate(to_german([text], beam=2, min_length=256), timeout=60)
    assert refused.value.code() == CODE.INVALID_ARGUMENT
    assert f"min_length=256 is above the output limit of {limit} tokens" in refused.value.details()
    ok = stub.Translate(to_german([text], beam=2, min_length=limit), timeout=60)
    assert ok.results[0].hypotheses[0].tokens == limit


def test_every_call_of_every_rpc_is_counted_and_timed_whatever_its_outcome(vanilla):
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(vanilla.address))
    stub.ListModels(pb.ListModelsRequest(), timeout=30)
    list(stub.TranslateStream(to_german(german(2), beam=1), timeout=60))
    for bad in (to_german(german(1), beam=99), pb.TranslateRequest(texts=["x"], model="nonesuch")):
        with pytest.raises(grpc.RpcError):
            stub.Translate(bad, timeout=30)
    with pytest.raises(grpc.RpcError):
        grpc.insecure_channel(vanilla.address).unary_unary("/gretserve.v1.Inference/Translate")(b"\xff", timeout=30)
    counted, timed = collections.Counter(), collections.Counter()
    for family in vanilla.metrics.registry.collect():
        for sample in family.samples:
            key = sample.labels.get("model"), sample.labels.get("method")
            if sample.name == "gret_serve_requests_total":
                counted[key] += sample.value
            elif sample.name == "gret_serve_request_seconds_count":
                timed[key] += sample.value
    assert counted[("", "ListModels")] >= 1 and counted[("", "Translate")] >= 3
    assert counted == timed


# ---- faults: signals -----------------------------------------------------------------------------------
def metric(port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name + "{")]
    return sum(values)


def test_sigterm_flips_readiness_finishes_every_call_in_flight_refuses_new_ones_and_exits_0(served_models, tmp_path):
    metrics_port = free_port()
    server = ServerProcess("--models-dir", served_models, "--models", "tiny-de-en", "--host", "127.0.0.1",
                           "--port", 0, "--metrics-port", metrics_port, "--threads", 1, "--grace-seconds", 30,
                           "--max-batch-tokens", 6000, "--max-bulk-share", 1, "--workers", 1,
                           "--build-cache", tmp_path, *DECODE_REPEATS)
    try:
        address = server.wait_serving()
        texts = german(8, offset=100)
        with Client(address, timeout=120) as c:
            options = dict(beam_size=4, **LONG)
            alone = c.translate(texts, target="en", **options)
            # Three calls: one decoding, two queued behind it (the token budget fits one at a time).
            in_flight = [c.stub.Translate.future(request(texts, beam=4, **LONG), timeout=120) for _ in range(3)]
            deadline = time.monotonic() + 60
            while not (metric(metrics_port, "gret_serve_batch_rows") == 32
                       and metric(metrics_port, "gret_serve_queue_depth") == 16):
                assert time.monotonic() < deadline, server.log
                time.sleep(0.01)
            server.proc.send_signal(signal.SIGTERM)
            while c.health() == "SERVING":
                time.sleep(0.005)
            assert not any(f.done() for f in in_flight)  # readiness flipped before anything finished
            with pytest.raises(grpc.RpcError) as refused:
                c.translate(texts[:1], target="en")
            assert refused.value.code() == CODE.UNAVAILABLE
            assert all(outputs(f.result()) == outputs(alone) for f in in_flight)
        assert server.wait(60) == 0
        assert "shutting down" in server.log and "stopped" in server.log
    finally:
        server.kill()


def test_sigterm_while_a_stream_is_stalled_on_a_full_window_still_drains_and_exits_0_within_the_grace_period(
        served_models):
    """A client on a small HTTP/2 window reads one response and then nothing: every text is decoded,
    but the server's writes wait for a window that never opens. SIGTERM still drains: the server
    gives the stalled call the grace period, then ends it, and exits 0 with no error logged, in
    time for the kubelet (terminationGracePeriodSeconds allows the drain and a margin, then kills)."""
    grace = 3
    metrics_port = free_port()
    server = ServerProcess("--models-dir", served_models, "--models", VANILLA, "--host", "127.0.0.1", "--port", 0,
                           "--metrics-port", metrics_port, "--workers", 1, "--grace-seconds", grace,
                           "--build-cache", served_models.parent / "build-cache", *DECODE_REPEATS)
    try:
        small_window = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(server.wait_serving(), options=small_window))
        stream = stub.TranslateStream(to_german(german(256, offset=400), beam=8, n_best=4, return_scores=True),
                                      timeout=300)
        next(stream)  # ... and no more
        wait_until(lambda: metric(metrics_port, "gret_serve_texts_total") == 256, timeout=240)  # all decoded
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait(grace + 10) == 0  # 10: deploy/k8s's margin over preStop + grace
        with pytest.raises(grpc.RpcError):
            list(stream)  # the stalled call was ended, not completed
    finally:
        server.kill()
    assert "shutting down" in server.log and "stopped" in server.log
    assert "Traceback" not in server.log and " ERROR " not in server.log


def test_calls_still_running_when_the_grace_period_ends_get_unavailable_and_the_server_exits_0(served_models,
                                                                                                 tmp_path):
    server = ServerProcess("--models-dir", served_models, "--models", "tiny-de-en", "--host", "127.0.0.1",
                           "--port", 0, "--metrics-port", 0, "--threads", 1, "--grace-seconds", 1,
                           "--max-batch-tokens", 6000, "--workers", 1, "--build-cache", tmp_path,
                           *DECODE_REPEATS)
    try:
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(server.wait_serving()))
        work = request(german(16, offset=120), beam=4, **LONG)  # over the token budget: one call at a time
        alone = stub.Translate(work, timeout=120)
        # more than the grace period can finish on a fast machine (each call decodes 128 steps alone)
        in_flight = [stub.Translate.future(work, timeout=120) for _ in range(12)]
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        ended = []
        for call in in_flight:
            error = call.exception(60)
            ended.append(error.code() if error else outputs(call.result()) == outputs(alone))
        assert server.wait(60) == 0
    finally:
        server.kill()
    assert CODE.UNAVAILABLE in ended and set(ended) <= {True, CODE.UNAVAILABLE}  # full results, or UNAVAILABLE


def test_after_sigkill_the_server_restarts_on_the_same_port_and_serves_the_same(served_models, tmp_path):
    port = free_port()
    args = ("--models-dir", served_models, "--models", "tiny-de-en", "--host", "127.0.0.1", "--port", port,
            "--metrics-port", 0, "--threads", 1, "--build-cache", tmp_path)
    texts = german(3, offset=200)
    server = ServerProcess(*args)
    try:
        address = server.wait_serving()
        with Client(address, timeout=120) as c:
            before = c.translate(texts, target="en")
            # long enough to be decoding still at the kill, on every core (worker processes, the default)
            in_flight = c.stub.Translate.future(request(texts * 32, beam=4, **LONG), timeout=120)
            time.sleep(0.3)
            server.proc.send_signal(signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as lost:
                in_flight.result()
            assert lost.value.code() == CODE.UNAVAILABLE  # the client learns at once, it does not hang
        assert server.wait(30) == -signal.SIGKILL
    finally:
        server.kill()
    restarted = ServerProcess(*args)
    try:
        assert restarted.wait_serving() == address
        with Client(address, timeout=120) as c:
            assert c.health() == "SERVING"
            assert outputs(c.translate(texts, target="en")) == outputs(before)
    finally:
        restarted.kill()


# ---- faults: broken model files --------------------------------------------------------------------
def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def edit_manifest(change):
    def damage(path):
        manifest = json.loads(path.read_text())
        change(manifest)
        path.write_text(json.dumps(manifest))
    return damage


# (model folder, file, damage, what the message must name)
BROKEN = {
    "graph missing": ("tiny-de-en", "encoder.onnx", lambda p: p.unlink(), "encoder.onnx"),
    "tokenizer missing": ("tiny-de-en", "spm.model", lambda p: p.unlink(), "spm.model"),
    "graph truncated": ("tiny-de-en", "decoder.onnx", truncate, "decoder.onnx"),
    "graph corrupted": ("tiny-de-en", "encoder.int8.onnx", flip_byte, "encoder.int8.onnx"),
    "model.json not JSON": ("tiny-de-en", "model.json", lambda p: p.write_text('{"name": '), "model.json"),
    "model.json not an object": ("tiny-de-en", "model.json", lambda p: p.write_text("[]"), "model.json"),
    "model.json without a task": ("tiny-de-en", "model.json", edit_manifest(lambda m: m.pop("task")), "model.json"),
    "model.json with an unknown task": ("tiny-de-en", "model.json", edit_manifest(lambda m: m.update(task="poem")),
                                        "model.json"),
    "model.json of a newer format": ("tiny-de-en", "model.json",
                                     edit_manifest(lambda m: m.update(format_version=2)), "model.json"),
    "model.json disagreeing with the graphs": (
        "tiny-de-en", "model.json", edit_manifest(lambda m: m["model_config"].update(vocab_size=301)), "model.json"),
    "weights missing": ("tiny-en-de", "model.safetensors", lambda p: p.unlink(), "model.safetensors"),
    "weights truncated": ("tiny-en-de", "model.safetensors", truncate, "model.safetensors"),
    "config.json not JSON": ("tiny-en-de", "config.json", lambda p: p.write_text("{"), "config.json"),
    "checkpoint tokenizer corrupted": ("tiny-en-de", "spm.model", lambda p: p.write_bytes(b"\x00garbage"), "spm.model"),
}


def broken_copy(models, root, name):
    folder, file, damage, _ = BROKEN[name]
    shutil.copytree(models / folder, root / "models" / folder, ignore=shutil.ignore_patterns("state", "snapshots"))
    damage(root / "models" / folder / file)
    return root / "models"


@pytest.mark.parametrize("name", BROKEN)
def test_a_broken_model_folder_stops_the_start_with_a_message_naming_the_file(served_models, tmp_path, caplog, name):
    models = broken_copy(served_models, tmp_path, name)
    code = server_main(["--models-dir", str(models), "--metrics-port", "0", "--build-cache", str(tmp_path / "cache"),
                        "--prepare-only"])
    assert code == 1
    message = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("cannot start"))
    assert BROKEN[name][3] in message


def test_the_server_process_exits_non_zero_naming_the_broken_file(served_models, tmp_path):
    models = broken_copy(served_models, tmp_path, "graph truncated")
    server = ServerProcess("--models-dir", models, "--metrics-port", 0, "--build-cache", tmp_path / "cache")
    assert server.wait(120) == 1
    assert "cannot start" in server.log and "decoder.onnx" in server.log and "Traceback" not in server.log


def test_with_skip_bad_models_a_broken_model_is_skipped_and_named_and_the_rest_serve(served_models, tmp_path):
    models = broken_copy(served_models, tmp_path, "graph truncated")
    models.joinpath("tiny-de-en").rename(models / "broken")
    shutil.copytree(served_models / "tiny-de-en", models / "tiny-de-en")
    server = ServerProcess("--models-dir", models, "--skip-bad-models", "true", "--metrics-port", 0,
                           "--build-cache", tmp_path / "cache", "--prepare-only")
    assert server.wait(120) == 0
    assert "skipping model folder" in server.log and "broken" in server.log and "decoder.onnx" in server.log
    assert "prepared: tiny-de-en" in server.log


# ---- faults: overload --------------------------------------------------------------------------------
def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_the_encoder_caches_of_all_models_together_stay_within_cache_mb(served_models):
    server = RunningServer(config_for(served_models, served_models.parent / "build-cache", cache_mb=1,
                                      models=[VANILLA, "tiny-headlines"]))  # see VANILLA
    try:
        with Client(server.address, timeout=120) as c:
            for offset in range(0, 64, 16):  # far more distinct sources than 1 MiB holds
                c.translate(german(16, offset=offset), target="de", beam_size=1, max_length=2)
                c.summarize(german(16, offset=offset), beam_size=1, max_length=2)
        caches = [p.engine.cache.stats() for p in server.registry]
    finally:
        server.stop()
    assert len(caches) == 2 and all(c["evictions"] for c in caches)
    assert sum(c["max_bytes"] for c in caches) <= 1 << 20
    assert sum(c["bytes"] for c in caches) <= 1 << 20


def test_a_full_queue_answers_resource_exhausted_at_once_and_memory_stays_bounded(served_models, tmp_path):
    metrics_port = free_port()
    server = ServerProcess("--models-dir", served_models, "--models", "tiny-de-en", "--host", "127.0.0.1",
                           "--port", 0, "--metrics-port", metrics_port, "--threads", 1, "--max-queue", 8,
                           "--max-batch-tokens", 2000, "--build-cache", tmp_path,
                           *DECODE_REPEATS)
    flood = request(german(2, offset=300), beam=8, **LONG)  # the queue stays full while the calls below come
    codes, refused, memory, depths = collections.Counter(), [], [], []
    try:
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(server.wait_serving()))
        for _ in range(6):  # waves
            calls = [stub.Translate.future(flood, timeout=120) for _ in range(100)]
            for _ in range(10):  # while the queue is full, a refusal must not wait for it to drain
                try:
                    stub.Translate(flood, timeout=120)
                except grpc.RpcError as e:
                    assert e.code() == CODE.RESOURCE_EXHAUSTED
                    refused.append(not all(call.done() for call in calls))
            depths.append(metric(metrics_port, "gret_serve_queue_depth"))
            codes.update(call.code().name for call in calls)
            memory.append(rss_mb(server.proc.pid))
    finally:
        server.kill()
    print(f"\noverload: {dict(codes)}; server RSS by wave {[round(m) for m in memory]} MB; "
          f"queue depth seen {max(depths):.0f}; refused {len(refused)}")
    assert set(codes) == {"OK", "RESOURCE_EXHAUSTED"} and codes["RESOURCE_EXHAUSTED"] > codes["OK"]
    assert len(refused) >= 30 and all(refused)
    assert max(depths) <= 8
    assert memory[-1] < memory[1] * 1.05  # after the first wave, further floods do not grow the server
