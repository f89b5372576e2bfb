"""What an operator meets: every flag explains itself and lists its choices, a bad value is one line
and exit status 2, the process's own resources are in the metrics, and `gret-serve` is installed."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from server.config import CHOICES, ServerConfig, field_help, load
from server.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent


def serve(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "server", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_every_field_has_help_text_from_its_comment():
    helps = field_help()
    assert set(helps) == {f.name for f in dataclasses.fields(ServerConfig)}
    assert all(text.strip() for text in helps.values())
    assert helps["http_port"] == "HTTP/JSON API and web page (0: off)"


def test_help_shows_each_description_default_and_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        load(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert exit_.value.code == 0
    assert "--http-port HTTP_PORT HTTP/JSON API and web page (0: off) [default: 8080]" in out
    assert "--log-level {debug,info,warning,error}" in out and "--backend {onnx,torch,ct2}" in out


@pytest.mark.parametrize("args, names", [
    (["--log-level", "verbose"], ["--log-level", "verbose", "choose from", "debug", "warning"]),
    (["--tls-cert", "/no/cert.pem", "--tls-key", "/no/key.pem"], ["tls_cert /no/cert.pem: no such file"]),
    (["--config", "/no/server.yaml"], ["/no/server.yaml"]),
    (["--port", "many"], ["--port", "many"]),
    (["--device", "cuda"], ["device cuda needs backend torch", "the onnx backend decodes on the CPU"]),
    *([(["--backend", "torch", "--device", "cuda"], ["device cuda: torch sees no CUDA device"])]
      if not torch.cuda.is_available() else []),
])
def test_a_bad_value_exits_2_with_one_line_naming_it(args, names):
    done = serve(*args)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m server: error: ")
    assert all(name in lines[0] for name in names)


def test_a_bad_choice_in_the_yaml_file_is_refused_like_the_flag(tmp_path, capsys):
    config = tmp_path / "server.yaml"
    config.write_text("batching: sometimes\n")
    with pytest.raises(SystemExit) as exit_:
        load(["--config", str(config)])
    assert exit_.value.code == 2
    assert f"batching 'sometimes' is not one of {', '.join(CHOICES['batching'])}" in capsys.readouterr().err


def test_process_metrics_and_the_new_gauges_are_exported():
    metrics = Metrics()
    metrics.input_pieces.labels("m").observe(12)
    text = generate_latest(metrics.registry).decode()
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "gret_serve_input_pieces_bucket",
                 "gret_serve_running_sequences"):
        assert name in text


def test_gret_serve_is_an_installed_command():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"gret-serve": "server.__main__:main"}
