"""The gRPC server, for real on loopback, with tiny models trained in the test run: results are
the offline beam search's, every bad request gets its status code and a message that says what
to fix, and the standard services (health, reflection, metrics) answer."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import gret_serve_pb2 as pb
from server.client import Client
from server.reflect import main as reflect_main
from server.service import INLINE_TAGGING_CHARS
from tests.served import RunningServer, config_for, free_port
from training.corpora import load_examples
from training.decode import source_inputs
from training.seq2seq import search
from training.seq2seq.checkpoint import load_checkpoint

torch.set_num_threads(1)
CODE = grpc.StatusCode


@pytest.fixture(scope="module")
def models(served_models):
    return served_models


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    running = RunningServer(config_for(models, tmp_path_factory.mktemp("build-cache"), metrics_port=0))
    yield running
    running.stop()


@pytest.fixture
def client(server):
    with Client(server.address, timeout=60) as c:
        yield c


def german(n: int, offset: int = 0) -> list[str]:
    return [e.source for e in load_examples("multi30k", "val", "de", "en")[offset: offset + n]]


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


# ---- results ------------------------------------------------------------------------------------------
def test_translate_returns_the_offline_beam_search_output_for_each_text(client, models):
    texts = german(6)
    response = client.translate(texts, target="en", source="de", beam_size=4, n_best=2, return_scores=True)
    model, ckpt, sp = load_checkpoint(models.parent / "runs" / "de-en")
    assert response.model == "tiny-de-en" and [r.index for r in response.results] == list(range(6))
    for text, result in zip(texts, response.results):
        ids, tags = source_inputs(model, sp, [text], "de", ckpt.data.max_src_len)
        src, tags = torch.tensor(ids), torch.tensor(tags)
        expected = search.beam_search(model, src, tags, beam=4, n_best=2)[0]
        assert [h.text for h in result.hypotheses] == [sp.decode(h.tokens) for h in expected]
        assert [h.score for h in result.hypotheses] == pytest.approx([h.score for h in expected], abs=1e-3)
        assert result.source_tokens == src.shape[1]


def test_streaming_sends_every_text_once_as_it_finishes(client):
    texts = german(5, offset=10)
    streamed = list(client.translate_stream(texts, target="en"))
    assert all(len(r.results) == 1 for r in streamed)
    assert sorted(r.results[0].index for r in streamed) == list(range(5))
    unary = client.translate(texts, target="en")
    by_index = {r.results[0].index: r.results[0].hypotheses[0].text for r in streamed}
    assert [by_index[i] for i in range(5)] == [r.hypotheses[0].text for r in unary.results]


def test_a_model_that_reads_pos_tags_gets_them_for_short_calls_and_long_ones(client, server):
    """A short call is tagged on the event loop, a long one in the executor: each sentence is tagged
    on its own either way, so ten copies of a sentence translate as ten copies of its translation."""
    assert server.registry.pipelines["tiny-de-en"].entry.cfg.pos_tags
    sentence = "Ein Hund läuft über die Wiese."
    text = " ".join([sentence] * 10)
    assert len(sentence) <= INLINE_TAGGING_CHARS < len(text)
    short = client.translate([sentence], target="en").results[0].hypotheses[0].text
    long = client.translate([text], target="en").results[0]
    assert long.sentences == 10 and long.hypotheses[0].text == " ".join([short] * 10)


def test_a_checkpoint_is_exported_on_first_start_and_serves_the_other_direction(client, server):
    response = client.translate(["A dog runs on the beach."], target="de")
    assert response.model == "tiny-en-de" and response.results[0].hypotheses[0].text
    repo = server.registry.pipelines["tiny-en-de"].entry.repository
    assert (repo / "model.json").exists() and (repo / "encoder.onnx").exists()


def test_summarize_uses_the_summariser_and_reads_a_long_article_from_its_first_sentence(client):
    """Over the window (--max-src-len 64), an article is summarised from its lead sentence (chosen by
    measurement: docs/DOCUMENTS.md), and says that part of it was not read; a first sentence over
    the window on its own (and without clauses to split it at) is cut to it."""
    lead = "the central bank raised interest rates on tuesday , citing inflation ."
    article = f"{lead} " + "prices rose again in march , the ministry said . " * 30
    response = client.summarize([article, lead, "the bank raised rates again " * 20], beam_size=2)
    assert response.model == "tiny-headlines"
    long, alone, cut = response.results
    assert long.truncated and not alone.truncated and cut.truncated
    assert long.source_tokens == alone.source_tokens < 64
    assert [h.text for h in long.hypotheses] == [h.text for h in alone.hypotheses]
    assert cut.source_tokens == 64


def test_plain_text_is_summarised_as_its_gigaword_style_form_would_be(client):
    plain = 'Japan\'s exports rose 5.2% in October (a record), officials said "on Monday".'
    corpus_style = "japan 's exports rose #.#% in october -lrb- a record -rrb- , officials said `` on monday '' ."
    first, second = client.summarize([plain, corpus_style], beam_size=2).results
    assert first.source_tokens == second.source_tokens
    assert [h.text for h in first.hypotheses] == [h.text for h in second.hypotheses]


def test_a_repeated_text_hits_the_encoder_cache(client):
    text = german(1, offset=30)
    first = client.translate(text, target="en").results[0]
    second = client.translate(text, target="en").results[0]
    assert (first.encoder_cache_hit, second.encoder_cache_hit) == (False, True)
    assert first.hypotheses[0].text == second.hypotheses[0].text


def test_a_repeated_request_is_answered_from_the_result_cache_and_counted(models, tmp_path):
    port = free_port()
    running = RunningServer(config_for(models, tmp_path, metrics_port=port, models=["tiny-de-en"], result_cache=64))
    try:
        with Client(running.address, timeout=60) as c:
            text = german(1, offset=40)
            first = c.translate(text, target="en", n_best=2, return_scores=True).results[0]
            again = c.translate(text, target="en", n_best=2, return_scores=True).results[0]
            greedy = c.translate(text, target="en", beam_size=1).results[0]
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        running.stop()
    assert (first.result_cache_hit, again.result_cache_hit, greedy.result_cache_hit) == (False, True, False)
    assert again.encoder_cache_hit
    assert [(h.text, h.score) for h in again.hypotheses] == [(h.text, h.score) for h in first.hypotheses]
    assert 'gret_serve_result_cache_hits_total{model="tiny-de-en"} 1.0' in body
    assert 'gret_serve_result_cache_entries{model="tiny-de-en"} 2.0' in body


def test_list_models_describes_every_loaded_model(client):
    models = {m.name: m for m in client.list_models()}
    assert set(models) == {"tiny-de-en", "tiny-en-de", "tiny-headlines"}
    de_en = models["tiny-de-en"]
    assert (de_en.task, de_en.source_language, de_en.target_language) == ("translate", "de", "en")
    assert de_en.architecture.startswith("GRET(capsule+aggregate+gate)") and de_en.backend == "onnx"
    assert de_en.parameters > 0 and de_en.is_default and len(de_en.version) == 12
    assert models["tiny-headlines"].task == "summarize"


# ---- bad requests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("texts, options, code, message", [
    ([], {}, CODE.INVALID_ARGUMENT, "no texts"),
    (["Ein Hund.", "   "], {}, CODE.INVALID_ARGUMENT, "text 1 is empty"),
    (["x" * 5000], {}, CODE.INVALID_ARGUMENT, "the limit is 4000"),
    (["Ein Hund."] * 300, {}, CODE.INVALID_ARGUMENT, "the limit is 256"),
    (["Ein Hund."], {"beam_size": 0}, CODE.INVALID_ARGUMENT, "beam_size=0"),
    (["Ein Hund."], {"beam_size": 2, "n_best": 5}, CODE.INVALID_ARGUMENT, "n_best=5"),
    (["Ein Hund."], {"max_length": 10**6}, CODE.INVALID_ARGUMENT, "max_length=1000000"),
])
def test_bad_input_is_refused_with_a_message_naming_the_problem(client, texts, options, code, message):
    got, details = status_of(lambda: client.translate(texts, target="en", **options))
    assert got == code and message in details


def test_a_source_sent_as_one_sequence_over_the_model_limit_is_refused_not_truncated(client):
    """(In document mode, the default, it is split or truncated with the flag set: tests/test_documents.py.)"""
    got, details = status_of(lambda: client.translate([" ".join(["Hund"] * 400)], target="en", as_one_sequence=True))
    assert got == CODE.INVALID_ARGUMENT and "accepts at most" in details


@pytest.mark.parametrize("kwargs, message", [
    ({"model": "no-such-model"}, "no model named 'no-such-model'"),
    ({"target": "fr"}, "no translate model *->fr; available: de->en, en->de"),
    ({"model": "tiny-headlines"}, "does not translate"),
])
def test_an_unknown_model_or_language_pair_is_not_found(client, kwargs, message):
    got, details = status_of(lambda: client.translate(["Ein Hund."], **kwargs))
    assert got == CODE.NOT_FOUND and message in details


def test_a_deadline_too_short_to_decode_is_deadline_exceeded(server):
    with Client(server.address, timeout=0.001) as hurried:
        got, _ = status_of(lambda: hurried.translate(german(20), target="en"))
    assert got == CODE.DEADLINE_EXCEEDED


# ---- standard services ------------------------------------------------------------------------------
def test_health_reports_serving_for_the_server_and_the_service(server, client):
    stub = health_pb2_grpc.HealthStub(client.channel)
    for service in ("", "gretserve.v1.Inference"):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lets_a_client_discover_and_call_the_api_without_the_proto(server, capsys):
    """server.reflect does what grpcurl does: types from the server's reflection, JSON in and out."""
    assert reflect_main([server.address, "list"]) == 0
    assert {"gretserve.v1.Inference", "grpc.health.v1.Health"} <= set(capsys.readouterr().out.split())
    assert reflect_main([server.address, "describe", "gretserve.v1.Inference"]) == 0
    assert "rpc TranslateStream(gretserve.v1.TranslateRequest) returns (stream gretserve.v1.GenerateResponse)" \
        in capsys.readouterr().out
    body = json.dumps({"texts": ["Ein Hund.", "Zwei Katzen."], "target_language": "en", "options": {"n_best": 2}})
    assert reflect_main([server.address, "call", "gretserve.v1.Inference/Translate", body]) == 0
    response = json.loads(capsys.readouterr().out)
    assert response["model"] == "tiny-de-en" and [r["index"] for r in response["results"]] == [0, 1]
    assert all(len(r["hypotheses"]) == 2 for r in response["results"])
    assert reflect_main([server.address, "call", "gretserve.v1.Inference/Summarize", '{"texts": [" "]}']) == 1
    assert "INVALID_ARGUMENT: text 0 is empty" in capsys.readouterr().err


def test_metrics_count_calls_and_texts_and_never_expose_request_text(models, tmp_path):
    port = free_port()
    running = RunningServer(config_for(models, tmp_path, metrics_port=port, models=["tiny-de-en"]))
    try:
        secret = "Geheimnisvolle Katze schläft."
        with Client(running.address, timeout=60) as c:
            c.translate([secret], target="en")
            status_of(lambda: c.translate([], target="en"))
            raw = c.channel.unary_unary("/gretserve.v1.Inference/Translate")  # bytes in, bytes out
            status_of(lambda: raw(b"\xff\xff not a message", timeout=10))
        with Client(running.address, timeout=0.5) as hurried:  # arrives, then expires while decoding:
            # 128 texts x 8 beams, each at least 64 tokens long (within every text's output limit of
            # 10 x its pieces + 10), cannot finish in half a second
            status_of(lambda: hurried.translate(german(128), target="en", beam_size=8, max_length_ratio=10,
                                                max_length=128, min_length=64))
        # The server counts it when grpc cancels the handler, just after the client gives up: as
        # DEADLINE_EXCEEDED if its own deadline (the timeout, counted from the call's arrival) is
        # then within DEADLINE_SLACK_S, else as CANCELLED (a call that arrived late under load)
        expired = re.compile(r'gret_serve_requests_total\{code="(DEADLINE_EXCEEDED|CANCELLED)",method="Translate",'
                             r'model="tiny-de-en"\} 1\.0')
        for _ in range(50):
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            if expired.search(body):
                break
            time.sleep(0.1)
    finally:
        running.stop()
    calls = [line for line in body.splitlines() if line.startswith("gret_serve_requests_total")]
    assert 'gret_serve_requests_total{code="OK",method="Translate",model="tiny-de-en"} 1.0' in calls, calls
    assert 'gret_serve_requests_total{code="INVALID_ARGUMENT",method="Translate",model=""} 2.0' in calls, calls
    assert expired.search(body), calls
    ok = re.search(r'gret_serve_texts_total\{model="tiny-de-en",status="ok"\} (\d+)', body)
    assert ok and int(ok.group(1)) >= 1  # the first call's text, and any of the hurried call's that finished in time
    misses = re.search(r'gret_serve_encoder_cache_misses_total\{model="tiny-de-en"\} (\d+)', body)
    assert misses and int(misses.group(1)) >= 1  # the hurried call may have encoded some of its texts
    assert "gret_serve_rows_per_step_bucket" in body and "gret_serve_model_info{" in body
    assert "Geheimnis" not in body and "Katze" not in body


# ---- the CTranslate2 backend ----------------------------------------------------------------------------
def test_the_ct2_backend_serves_a_vanilla_model_with_the_same_outputs(models, client, tmp_path):
    texts = ["A dog runs on the beach.", "Two men are playing soccer in a park.", "A woman reads a book."]
    expected = [r.hypotheses[0].text for r in client.translate(texts, target="de", beam_size=4).results]
    prefixes = ["Ein Hund", "", "Eine"]  # CT2's target_prefix (beam 1: ct2_runtime's docstring)
    prefixed = [r.hypotheses[0].text for r in client.translate(texts, target="de", beam_size=1,
                                                               target_prefix=prefixes).results]
    running = RunningServer(config_for(models, tmp_path, backend="ct2", models=["tiny-en-de"]))
    try:
        with Client(running.address, timeout=60) as ct2:
            assert ct2.list_models()[0].backend == "ct2"
            response = ct2.translate(texts, target="de", beam_size=4)
            with_prefix = ct2.translate(texts, target="de", beam_size=1, target_prefix=prefixes)
    finally:
        running.stop()
    assert [r.hypotheses[0].text for r in response.results] == expected
    assert [r.hypotheses[0].text for r in with_prefix.results] == prefixed
    assert prefixed[0].startswith("Ein Hund") and prefixed[2].startswith("Eine")


def test_the_ct2_backend_refuses_a_gret_model_at_start_and_says_why(models, tmp_path):
    from server.catalog import ModelError
    from server.registry import Registry

    checkpoints = models.parent / "runs"  # de-en: the GRET checkpoint behind tiny-de-en
    with pytest.raises(ModelError, match="GRET"):
        Registry.load(config_for(checkpoints, tmp_path, backend="ct2", models=["de-en"]))


# ---- GRET diagnostics ---------------------------------------------------------------------------------
def test_gret_diagnostics_come_on_request_for_each_output_piece(models, tmp_path):
    running = RunningServer(config_for(models.parent / "runs", tmp_path, models=["de-en"]))
    try:
        with Client(running.address, timeout=60) as c:
            plain = c.translate(german(2), target="en").results
            result = c.translate(german(2), target="en", return_diagnostics=True).results
    finally:
        running.stop()
    assert not plain[0].HasField("diagnostics")
    for r in result:
        assert len(r.diagnostics.gate) == r.hypotheses[0].tokens
        assert all(0.0 < g < 1.0 for g in r.diagnostics.gate)  # a sigmoid per piece
        assert 0.0 < r.diagnostics.routing_agreement <= 1.0


@pytest.mark.parametrize("target, message", [
    ("en", "diagnostics need its checkpoint"),  # tiny-de-en: an exported repository only
    ("de", "not a GRET model"),  # tiny-en-de: vanilla
])
def test_diagnostics_are_refused_where_they_cannot_be_computed(client, target, message):
    got, details = status_of(lambda: client.translate(["Ein Hund."], target=target, return_diagnostics=True))
    assert got == CODE.INVALID_ARGUMENT and message in details


# ---- options and batching ------------------------------------------------------------------------------
def test_options_are_honoured_n_best_count_and_max_length(client):
    result = client.translate(german(1, offset=40), target="en", beam_size=5, n_best=3).results[0]
    assert len(result.hypotheses) == 3
    short = client.translate(german(3, offset=40), target="en", max_length=3).results
    assert all(h.tokens <= 3 for r in short for h in r.hypotheses)


def test_a_server_with_two_engine_loops_per_model_answers_as_one_loop_does(models, client, tmp_path):
    texts = german(10, offset=60)
    one_loop = [r.hypotheses[0].text for r in client.translate(texts, target="en", beam_size=3).results]
    running = RunningServer(config_for(models, tmp_path, models=["tiny-de-en"], workers=2))
    try:
        with Client(running.address, timeout=60) as c:
            two_loops = [r.hypotheses[0].text for r in c.translate(texts, target="en", beam_size=3).results]
        engines = running.registry.pipelines["tiny-de-en"].engine.engines
        assert len(engines) == 2 and all(e.steps > 0 for e in engines)  # the call was spread over both
    finally:
        running.stop()
    assert two_loops == one_loop


def test_concurrent_calls_with_different_options_share_batches_and_match_one_at_a_time(client):
    from concurrent.futures import ThreadPoolExecutor

    texts = german(8, offset=50)
    options = [dict(beam_size=1 + i % 4, length_penalty=0.5 + 0.25 * (i % 3)) for i in range(8)]
    alone = [client.translate([t], target="en", **o).results[0].hypotheses[0].text for t, o in zip(texts, options)]
    with ThreadPoolExecutor(8) as pool:  # all in flight at once: the engine batches them together
        together = list(pool.map(lambda to: client.translate([to[0]], target="en", **to[1]), zip(texts, options)))
    assert [r.results[0].hypotheses[0].text for r in together] == alone
    batched = client.translate(texts[:4], target="en", beam_size=3).results
    singly = [client.translate([t], target="en", beam_size=3).results[0] for t in texts[:4]]
    assert [r.hypotheses[0].text for r in batched] == [r.hypotheses[0].text for r in singly]


def test_a_call_gets_its_request_id_back_and_the_json_log_carries_it(models, tmp_path):
    """--log-format json: one JSON object per line; the lines written for a call carry its request id,
    which the client also gets back (trailing metadata), its own if it sent one."""
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "server", "--models-dir", str(models), "--models", "tiny-de-en",
                                 "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--http-port", "0",
                                 "--workers", "1", "--replicas", "thread", "--build-cache", str(tmp_path / "cache"),
                                 "--log-level", "debug", "--log-format", "json"], stdout=out, stderr=subprocess.STDOUT)
    try:
        port = None
        for _ in range(600):
            found = re.search(r"serving \S+ on [^:\s]+:(\d+)", log.read_text())
            if found:
                port = int(found.group(1))
                break
            time.sleep(0.2)
        assert port, log.read_text()[-2000:]
        with Client(f"127.0.0.1:{port}", timeout=60) as c:
            _, call = c.stub.Translate.with_call(pb.TranslateRequest(texts=["Ein Hund."], target_language="en"),
                                                 metadata=(("x-request-id", "client-42"),), timeout=60)
            assert dict(call.trailing_metadata())["x-request-id"] == "client-42"
            _, call = c.stub.Translate.with_call(pb.TranslateRequest(texts=["Eine Katze."], target_language="en"),
                                                 timeout=60)
            assert dict(call.trailing_metadata())["x-request-id"] not in ("", "client-42")
    finally:
        proc.terminate()
        proc.wait(30)
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert lines and all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    assert any(line.get("request_id") == "client-42" and "Ein Hund" in line["message"] for line in lines)
