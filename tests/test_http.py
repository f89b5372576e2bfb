"""The HTTP/JSON front end, for real on loopback beside gRPC, with the tiny trained models: the same
answers as gRPC, LibreTranslate's shapes, gRPC's status codes and messages as HTTP statuses, events
for the streams, health, and the bearer token over TLS."""
from __future__ import annotations

import json
import ssl
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest

from proto import gret_serve_pb2 as pb
from server.client import Client
from server.web.calls import CallFailed
from tests.served import RunningServer, config_for, free_port

TOKEN = "http-test-token"
GERMAN = ["Ein Hund läuft.", "Zwei Männer spielen Fußball auf einer Wiese.", "Eine Frau liest ein Buch."]


class Http:
    """JSON over urllib: (status, body, headers) whatever the status."""

    def __init__(self, base: str, context: ssl.SSLContext | None = None):
        self.base, self.context = base, context

    def __call__(self, path: str, body=None, headers: dict | None = None, raw: bytes | None = None):
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, headers={
            "Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=60, context=self.context) as r:
                return r.status, self._parse(r), r.headers
        except urllib.error.HTTPError as e:
            return e.code, self._parse(e), e.headers

    @staticmethod
    def _parse(response):
        text = response.read().decode()
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return text
        return json.loads(text) if text else None


def events(stream: str) -> list[tuple[str, dict]]:
    """Server-sent events as (event name, data)."""
    found = []
    for block in stream.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        found.append((fields.get("event", "message"), json.loads(fields["data"])))
    return found


@pytest.fixture(scope="module")
def server(served_models, tmp_path_factory):
    running = RunningServer(config_for(served_models, tmp_path_factory.mktemp("build-cache"), http_port=free_port()))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def http(server):
    return Http(f"http://127.0.0.1:{server.app.http_port}")


@pytest.fixture(scope="module")
def grpc_client(server):
    with Client(server.address, timeout=60) as c:
        yield c


def grpc_status(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


# ---- LibreTranslate -----------------------------------------------------------------------------------
def test_a_libretranslate_request_returns_what_grpc_returns(http, grpc_client):
    status, body, _ = http("/translate", {"q": GERMAN[0], "source": "de", "target": "en"})
    expected = grpc_client.translate(GERMAN[:1], source="de", target="en").results[0].hypotheses[0].text
    assert status == 200 and body == {"translatedText": expected}


def test_a_list_of_texts_is_translated_in_order_with_alternatives(http, grpc_client):
    status, body, _ = http("/translate", {"q": GERMAN, "source": "de", "target": "en", "alternatives": 2})
    results = grpc_client.translate(GERMAN, source="de", target="en", n_best=3, beam_size=4).results
    assert status == 200
    assert body["translatedText"] == [r.hypotheses[0].text for r in results]
    assert body["alternatives"] == [[h.text for h in r.hypotheses[1:]] for r in results]


def test_a_form_request_as_libretranslates_own_clients_send_it(http):
    status, body, _ = http("/translate", raw=b"q=Ein+Hund+l%C3%A4uft.&source=de&target=en",
                           headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 200 and body["translatedText"] == http("/translate", {"q": GERMAN[0], "target": "en",
                                                                            "source": "de"})[1]["translatedText"]


def test_source_auto_detects_the_language_and_says_which(http):
    status, body, _ = http("/translate", {"q": GERMAN[0], "source": "auto", "target": "en"})
    assert status == 200 and body["detectedLanguage"] == {"language": "de", "confidence": None}


def test_languages_lists_each_source_with_its_targets(http):
    status, body, _ = http("/languages")
    assert status == 200
    assert body == [{"code": "de", "name": "German", "targets": ["en"]},
                    {"code": "en", "name": "English", "targets": ["de"]}]


def test_detect_chooses_among_the_served_source_languages(http):
    status, body, _ = http("/detect", {"q": ["Ein Hund läuft über die Wiese.", "A dog runs across the meadow."]})
    assert status == 200 and [d["language"] for d in body] == ["de", "en"]


def test_html_keeps_the_markup_and_translates_the_text_as_grpc_does(http, grpc_client):
    status, body, _ = http("/translate", {"q": "<p>Ein Hund.</p>", "source": "de", "target": "en", "format": "html"})
    expected = grpc_client.stub.Translate(pb.TranslateRequest(texts=["<p>Ein Hund.</p>"], target_language="en",
                                                              format=pb.HTML), timeout=60)
    assert status == 200 and body["translatedText"] == expected.results[0].hypotheses[0].text
    assert body["translatedText"].startswith("<p>") and body["translatedText"].endswith("</p>")


# ---- native routes ------------------------------------------------------------------------------------
def test_v1_translate_is_the_grpc_response_as_proto_json(http, grpc_client):
    status, body, _ = http("/v1/translate", {"texts": GERMAN[:2], "target_language": "en",
                                             "options": {"beam_size": 3, "return_scores": True}})
    expected = grpc_client.translate(GERMAN[:2], target="en", beam_size=3, return_scores=True)
    assert status == 200 and body["model"] == expected.model == "tiny-de-en"
    for got, want in zip(body["results"], expected.results):
        assert got["hypotheses"][0]["text"] == want.hypotheses[0].text
        assert got["hypotheses"][0]["score"] == pytest.approx(want.hypotheses[0].score, abs=1e-5)


def test_v1_translate_takes_a_target_prefix_in_its_options(http, grpc_client):
    status, body, _ = http("/v1/translate", {"texts": GERMAN[:2], "target_language": "en",
                                             "options": {"target_prefix": ["A man", ""]}})
    expected = grpc_client.translate(GERMAN[:2], target="en", target_prefix=["A man", ""])
    assert status == 200 and body["results"][0]["hypotheses"][0]["text"].startswith("A man")
    assert [r["hypotheses"][0]["text"] for r in body["results"]] == [r.hypotheses[0].text for r in expected.results]


def test_v1_summarize_and_models(http, grpc_client):
    article = "japan 's exports rose for a third month in october , the ministry said on monday ."
    status, body, _ = http("/v1/summarize", {"texts": [article]})
    expected = grpc_client.summarize([article]).results[0].hypotheses[0].text
    assert status == 200 and body["results"][0]["hypotheses"][0]["text"] == expected
    status, body, _ = http("/v1/models")
    assert status == 200
    assert sorted(m["name"] for m in body["models"]) == ["tiny-de-en", "tiny-en-de", "tiny-headlines"]


def test_the_stream_sends_each_text_once_as_an_event(http, grpc_client):
    status, stream, headers = http("/v1/translate/stream", {"texts": GERMAN, "target_language": "en"})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    got = {r["index"]: r["hypotheses"][0]["text"] for _, data in events(stream) for r in data["results"]}
    expected = grpc_client.translate(GERMAN, target="en").results
    assert [name for name, _ in events(stream)] == ["message"] * 3
    assert got == {i: r.hypotheses[0].text for i, r in enumerate(expected)}


def test_a_stream_refused_before_its_first_text_keeps_its_status(http):
    status, body, _ = http("/v1/translate/stream", {"texts": ["Ein Hund.", " "], "target_language": "en"})
    assert status == 400 and body["error"] == "text 1 is empty or only whitespace"


# ---- status codes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("request_body, options, status", [
    ({"texts": ["Ein Hund."], "target_language": "en"}, {"beam_size": 99}, 400),
    ({"texts": ["Ein Hund."], "target_language": "en"}, {"n_best": 5, "beam_size": 2}, 400),
    ({"texts": ["Ein Hund."], "target_language": "fr"}, {}, 404),
    ({"texts": ["Ein Hund."], "model": "no-such-model"}, {}, 404),
    ({"texts": ["Ein Hund."], "target_language": "en", "priority": 11}, {}, 400),
])
def test_errors_have_the_grpc_message_under_the_matching_http_status(http, grpc_client, request_body, options,
                                                                      status):
    got, body, _ = http("/v1/translate", {**request_body, "options": options})
    code, message = grpc_status(lambda: grpc_client.translate(
        request_body["texts"], target=request_body.get("target_language", ""), model=request_body.get("model", ""),
        priority=request_body.get("priority", 0), **options))
    assert (got, body) == (status, {"error": message, "code": code.name})


def test_a_body_that_is_not_the_message_is_a_bad_request(http):
    status, body, _ = http("/v1/translate", raw=b"{not json")
    assert status == 400 and body["error"].startswith("the request is not a valid gretserve.v1.TranslateRequest")
    status, body, _ = http("/v1/translate", {"texts": "one string, not a list"})
    assert status == 400 and body["code"] == "INVALID_ARGUMENT"
    status, body, _ = http("/translate", {"q": "Ein Hund.", "source": "de"})
    assert status == 400 and "target" in body["error"]


def test_a_deadline_too_short_to_decode_is_504(http):
    status, body, _ = http("/v1/translate", {"texts": GERMAN * 8, "target_language": "en"},
                           headers={"X-Request-Timeout": "0.001"})
    assert status == 504 and body["code"] == "DEADLINE_EXCEEDED"


def test_a_full_queue_is_429_with_retry_after():
    response = CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full").response()
    assert response.status_code == 429 and response.headers["retry-after"] == "1"


# ---- health and draining ------------------------------------------------------------------------------
def test_liveness_and_readiness_for_the_server_and_each_model(http, grpc_client):
    assert http("/health/live")[:2] == (200, {"status": "live"})
    assert http("/health/ready")[:2] == (200, {"status": "ready"})
    assert http("/health/ready/tiny-en-de")[:2] == (200, {"status": "ready"})
    assert http("/health/ready/nope")[0] == 404
    assert grpc_client.health("tiny-en-de") == "SERVING"


def test_while_draining_readiness_fails_and_calls_are_unavailable(server, http):
    server.app.service.draining = True  # what shutdown sets first
    try:
        assert http("/health/ready")[:2] == (503, {"status": "draining"})
        status, body, _ = http("/translate", {"q": "Ein Hund.", "source": "de", "target": "en"})
        assert status == 503 and body["code"] == "UNAVAILABLE" and "shutting down" in body["error"]
        assert http("/health/live")[0] == 200
    finally:
        server.app.service.draining = False


# ---- the bearer token over TLS ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def guarded(served_models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", folder / "key.pem", "-out", folder / "cert.pem", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    running = RunningServer(config_for(served_models, served_models.parent / "build-cache", models=["tiny-de-en"],
                                       http_port=free_port(), tls_cert=str(folder / "cert.pem"),
                                       tls_key=str(folder / "key.pem"), auth_token=TOKEN))
    yield running, Http(f"https://localhost:{running.app.http_port}",
                        ssl.create_default_context(cafile=str(folder / "cert.pem")))
    running.stop()


def test_over_tls_the_token_is_required_on_the_api_but_not_for_health(guarded):
    _, https = guarded
    request = {"q": "Ein Hund.", "source": "de", "target": "en"}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, body, response_headers = https("/translate", request, headers)
        assert (status, body) == (401, {"error": "missing or wrong bearer token", "code": "UNAUTHENTICATED"})
        assert response_headers["www-authenticate"] == "Bearer"
        assert https("/v1/models", headers=headers)[0] == 401
    assert https("/translate", request, {"Authorization": f"Bearer {TOKEN}"})[0] == 200
    assert https("/health/ready")[0] == 200


def test_every_answer_carries_its_request_id_and_a_clients_own_is_kept(server):
    import urllib.request as web

    def ask(headers: dict) -> str:
        call = web.Request(f"http://127.0.0.1:{server.app.http_port}/translate", method="POST",
                           data=json.dumps({"q": GERMAN[0], "source": "de", "target": "en"}).encode(),
                           headers={"Content-Type": "application/json", **headers})
        with web.urlopen(call, timeout=60) as answer:
            return answer.headers["x-request-id"]

    assert ask({"X-Request-Id": "client-7"}) == "client-7"
    first, second = ask({}), ask({})
    assert first and second and first != second
