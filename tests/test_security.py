"""Security of the server: weights come only from formats that cannot run code (safetensors,
ONNX, CTranslate2; no pickle anywhere), messages are bounded, TLS and the bearer token guard every
call but health checks, and neither the metrics port nor the log (below debug level) ever carries
request text."""
from __future__ import annotations

import ast
import gzip
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from proto import gret_serve_pb2 as pb
from proto import gret_serve_pb2_grpc as pb_grpc
from server.client import Client
from tests.served import REPO, RunningServer, ServerProcess, config_for, free_port

CODE = grpc.StatusCode
TOKEN = "s3cret-token-for-tests"
SECRET = "Geheimnisvolle Zauberkatze"  # request text that must not leak


# ---- no pickle -----------------------------------------------------------------------------------
UNPICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "joblib", "cloudpickle", "shelve"}
UNPICKLING_CALLS = {"torch.load", "torch.jit.load"}  # by full name
UNPICKLING_FUNCTIONS = {"read_pickle", "HanoverTagger"}  # by their own name, however imported
# HanTa's POS tagger is a pickle inside the pinned HanTa package; it is loaded by its absolute path
# there (see the test below), never from a model folder or a request.
ALLOWED = {("training/seq2seq/pos_tags.py", "ht.HanoverTagger")}
SKIPPED = {".venv", ".git", "runs", "base-rootfs", "wheelhouse", "__pycache__", ".hypothesis"}


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return ""


def unpickling_sites(source: str) -> list[str]:
    """Imports of pickle-like modules, calls of loaders that unpickle, np.load(..., allow_pickle=True)."""
    sites = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            sites += [a.name for a in node.names if a.name.split(".")[0] in UNPICKLING_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNPICKLING_MODULES:
            sites.append(node.module)
        elif isinstance(node, ast.Call):
            name = dotted(node.func)
            if name in UNPICKLING_CALLS or name.rsplit(".", 1)[-1] in UNPICKLING_FUNCTIONS:
                sites.append(name)
            if name.rsplit(".", 1)[-1] == "load" and any(
                    k.arg == "allow_pickle" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                    for k in node.keywords):
                sites.append(f"{name}(allow_pickle)")
    return sites


def test_the_scan_recognises_pickle_imports_and_unpickling_loaders():
    source = ("import pickle\nfrom joblib import load\nimport torch, numpy as np\ntorch.load('m.pt')\n"
              "np.load('a.npy', allow_pickle=True)\nnp.load('b.npy')\nht.HanoverTagger('x.pgz')\n")
    assert unpickling_sites(source) == ["pickle", "joblib", "torch.load", "np.load(allow_pickle)", "ht.HanoverTagger"]


def test_no_python_source_of_the_repository_unpickles_anything():
    files = [p for p in REPO.rglob("*.py") if not SKIPPED & set(p.relative_to(REPO).parts)]
    assert len(files) > 50  # the scan sees the repository
    found = {(p.relative_to(REPO).as_posix(), site) for p in files for site in unpickling_sites(p.read_text())}
    assert found == ALLOWED


def test_the_pos_tagger_never_unpickles_a_file_from_the_working_directory(tmp_path):
    # A pickle that creates a directory when loaded, under the name of HanTa's German model.
    (tmp_path / "morphmodel_ger.pgz").write_bytes(gzip.compress(b"cos\nmkdir\n(Vpwned\ntR."))
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300, check=False)

    tagged = run("from training.seq2seq.pos_tags import UPOS_ID, Tagger; "
                 "print(Tagger('de').tag_words(['Der', 'Hund']) == [UPOS_ID['DET'], UPOS_ID['NOUN']])")
    assert tagged.stdout.strip() == "True", tagged.stderr
    assert not (tmp_path / "pwned").exists()
    run("from HanTa import HanoverTagger as ht; ht.HanoverTagger('morphmodel_ger.pgz')")
    assert (tmp_path / "pwned").exists()  # the payload is real: HanTa given a bare name runs it


def test_the_shipped_models_hold_weights_only_in_formats_that_cannot_run_code():
    files = [p for p in (REPO / "models").rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    weights, metadata = {".safetensors", ".onnx", ".bin"}, {".json", ".jsonl", ".model", ".md", ".txt"}  # .bin: CT2
    for path in files:
        assert path.suffix in weights | metadata, path
        head = path.read_bytes()[:4]
        assert not head.startswith(b"\x80") and head != b"PK\x03\x04", f"{path} looks like a pickle or torch zip"


# ---- TLS, the bearer token, message size -------------------------------------------------------------
@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for localhost and 127.0.0.1: (cert, key)."""
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", folder / "key.pem", "-out", folder / "cert.pem", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    return folder / "cert.pem", folder / "key.pem"


@pytest.fixture(scope="module")
def guarded(served_models, certificate):
    """TLS, a bearer token and a 1 MB message limit."""
    cert, key = certificate
    running = RunningServer(config_for(served_models, served_models.parent / "build-cache", models=["tiny-de-en"],
                                       tls_cert=str(cert), tls_key=str(key), auth_token=TOKEN, max_message_mb=1))
    yield running
    running.stop()


def tls_channel(server: RunningServer, ca: Path) -> grpc.Channel:
    return grpc.secure_channel(f"localhost:{server.port}", grpc.ssl_channel_credentials(ca.read_bytes()))


def every_method(channel: grpc.Channel, metadata) -> dict[str, grpc.StatusCode]:
    """Each RPC (and reflection) called once: its status code."""
    stub = pb_grpc.InferenceStub(channel)
    translate = pb.TranslateRequest(texts=["Ein Hund läuft."], target_language="en",
                                    options=pb.DecodingOptions(beam_size=1))
    calls = {"Translate": lambda: stub.Translate(translate, timeout=30, metadata=metadata),
             "TranslateStream": lambda: list(stub.TranslateStream(translate, timeout=30, metadata=metadata)),
             "Summarize": lambda: stub.Summarize(pb.SummarizeRequest(texts=["x"]), timeout=30, metadata=metadata),
             "SummarizeStream": lambda: list(stub.SummarizeStream(pb.SummarizeRequest(texts=["x"]), timeout=30,
                                                                  metadata=metadata)),
             "ListModels": lambda: stub.ListModels(pb.ListModelsRequest(), timeout=30, metadata=metadata),
             "reflection": lambda: list(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                 iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30, metadata=metadata))}
    codes = {}
    for name, call in calls.items():
        try:
            call()
            codes[name] = CODE.OK
        except grpc.RpcError as e:
            codes[name] = e.code()
    return codes


def test_with_the_token_over_tls_every_method_answers(guarded, certificate):
    codes = every_method(tls_channel(guarded, certificate[0]), [("authorization", f"Bearer {TOKEN}")])
    # only de-en is loaded: no summariser, so NOT_FOUND (after the token was accepted)
    assert codes == {"Translate": CODE.OK, "TranslateStream": CODE.OK, "Summarize": CODE.NOT_FOUND,
                     "SummarizeStream": CODE.NOT_FOUND, "ListModels": CODE.OK, "reflection": CODE.OK}


@pytest.mark.parametrize("metadata", [None, [("authorization", "Bearer wrong")],
                                      [("authorization", f"Bearer {TOKEN}x")], [("authorization", TOKEN)],
                                      [("authorization", f"Basic {TOKEN}")], [("x-api-key", TOKEN)]],
                         ids=["missing", "wrong", "longer", "no-scheme", "basic", "other-header"])
def test_a_missing_or_wrong_token_is_unauthenticated_on_every_method(guarded, certificate, metadata):
    codes = every_method(tls_channel(guarded, certificate[0]), metadata)
    assert set(codes.values()) == {CODE.UNAUTHENTICATED}


def test_health_checks_need_no_token(guarded, certificate):
    stub = health_pb2_grpc.HealthStub(tls_channel(guarded, certificate[0]))
    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_plaintext_client_cannot_call_the_tls_port(guarded):
    with Client(f"localhost:{guarded.port}", token=TOKEN, timeout=10) as c, pytest.raises(grpc.RpcError) as info:
        c.translate(["Ein Hund."], target="en")
    assert info.value.code() == CODE.UNAVAILABLE


def test_a_client_that_does_not_trust_the_certificate_cannot_connect(guarded, tmp_path):
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", tmp_path / "other.key", "-out", tmp_path / "other.pem", "-days", "1", "-subj",
                    "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"], check=True, capture_output=True)
    other = str(tmp_path / "other.pem")
    with Client(f"localhost:{guarded.port}", token=TOKEN, tls_ca=other, timeout=10) as c, \
            pytest.raises(grpc.RpcError) as info:
        c.translate(["Ein Hund."], target="en")
    assert info.value.code() == CODE.UNAVAILABLE


def test_a_message_over_max_message_mb_is_resource_exhausted_and_one_under_it_reaches_the_service(guarded,
                                                                                                  certificate):
    with Client(f"localhost:{guarded.port}", token=TOKEN, tls_ca=str(certificate[0]), timeout=30) as c:
        for texts, code in ((["x" * 4000] * 300, CODE.RESOURCE_EXHAUSTED),  # 1.2 MB
                            (["x" * 4000] * 199 + [" "], CODE.INVALID_ARGUMENT)):  # 0.8 MB: through, then a blank text
            with pytest.raises(grpc.RpcError) as info:
                c.translate(texts, target="en")
            assert info.value.code() == code
        assert c.translate(["Ein Hund."], target="en", beam_size=1).results[0].hypotheses[0].text


# ---- metrics and logs carry no request text ------------------------------------------------------------
def leak_attempts(address: str) -> None:
    """Calls that carry SECRET in every field a client controls, ending in every kind of outcome."""
    with Client(address, timeout=60) as c:
        c.translate([SECRET], target="en", beam_size=1)
        list(c.translate_stream([SECRET, "Ein Hund."], target="en", beam_size=1))
        for call in (lambda: c.translate([SECRET, " "], target="en"),  # INVALID_ARGUMENT
                     lambda: c.translate([SECRET * 200], target="en"),  # too long
                     lambda: c.translate([SECRET], model=SECRET),  # NOT_FOUND
                     lambda: c.translate([SECRET], source=SECRET, target=SECRET),
                     lambda: c.translate([SECRET], target="en", beam_size=99)):
            with pytest.raises(grpc.RpcError):
                call()


def test_the_metrics_port_never_shows_request_text_or_names_a_client_made_up(served_models):
    port = free_port()
    running = RunningServer(config_for(served_models, served_models.parent / "build-cache", models=["tiny-de-en"],
                                       metrics_port=port))
    try:
        leak_attempts(running.address)
        with Client(running.address, timeout=60) as c:
            for i in range(20):  # made-up model names must not become label values (nor grow the metrics)
                with pytest.raises(grpc.RpcError):
                    c.translate(["Ein Hund."], model=f"made-up-{i}")
        expected = 'gret_serve_requests_total{code="NOT_FOUND",method="Translate",model=""} 22.0'
        deadline = time.monotonic() + 10  # a loaded machine may scrape before the last call is counted
        while True:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            if expected in body or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        running.stop()
    assert expected in body
    for fragment in SECRET.split() + ["made-up"]:
        assert fragment not in body


@pytest.mark.parametrize("level, shown", [("info", False), ("debug", True)])
def test_the_log_shows_request_text_only_at_debug_level(served_models, tmp_path, level, shown):
    server = ServerProcess("--models-dir", served_models, "--models", "tiny-de-en", "--host", "127.0.0.1", "--port", 0,
                           "--metrics-port", 0, "--threads", 1, "--build-cache", tmp_path, "--log-level", level)
    try:
        leak_attempts(server.wait_serving())
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
    finally:
        server.kill()
    assert "serving tiny-de-en" in server.log  # the log was captured
    assert (SECRET in server.log) == shown
    if not shown:
        assert not any(word in server.log for word in SECRET.split())
