"""Server configuration: one YAML file, every field overridable by a flag of the same name.

    python -m server --config server.yaml --port 50052 --batching request

With no flags the server sizes itself to the machine: one engine worker process per usable
core, one intra-op thread each, int8 where its quality was verified.

Precedence: defaults < YAML < flags. Unknown YAML keys are an error (a typo must not be ignored)."""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from .backends import BACKENDS
from .engine.options import Limits
from .engine.scheduler import POLICIES

# The enumerated fields and their values: the flags list them, check() refuses anything else.
CHOICES = {"backend": tuple(BACKENDS), "device": ("cpu", "cuda"), "precision": ("auto", "fp32", "int8"),
           "replicas": ("process", "thread"),
           "batching": tuple(POLICIES), "log_level": ("debug", "info", "warning", "error"), "log_format": ("text", "json")}


@dataclass
class ServerConfig:
    """Each field's trailing comment is also its flag's --help text (field_help): one description."""

    models_dir: str = "models"  # every model folder here is served ...
    models: list[str] = field(default_factory=list)  # ... or only these (folder names)
    skip_bad_models: bool = False  # with several models: skip one that fails to load (and log why)
    host: str = "0.0.0.0"  # address every port listens on
    port: int = 50051  # gRPC (0: any free port)
    http_port: int = 8080  # HTTP/JSON API and web page (0: off)
    metrics_port: int = 9090  # Prometheus metrics (0: off)
    backend: str = "onnx"  # inference runtime
    device: str = "cpu"  # where the engine decodes; cuda: the torch backend on the GPU (its Triton kernels), one engine loop per model unless `workers` says more, as threads of this process (one CUDA context), whatever `replicas` says
    precision: str = "auto"  # weights of the exported graphs; auto: int8 where the build verified the int8 graphs against fp32 (verified.json), else fp32
    threads: int = 1  # intra-op threads per engine loop
    workers: int = 0  # engine loops per model, each with its own running batch (uses workers x threads cores); 0: one per CPU core this process may use
    replicas: str = "process"  # what runs each engine loop: process (a worker process with its own model session: loops do not share the GIL) or thread (threads sharing one session); ct2 uses CTranslate2's own replicas
    batching: str = "continuous"  # continuous: admit at every decoder step; request: only into an empty batch; none: one text at a time
    max_batch_tokens: int = 16384  # admission budget of each engine loop, what its batch's caches hold: the sum over its texts of beam x (source + the batch's longest output limit); a larger batch decodes more texts per second up to a point (python -m bench speed), and each of them more slowly (python -m bench server --scenario backlog)
    max_queue: int = 1024  # texts waiting per model; beyond it RESOURCE_EXHAUSTED
    max_bulk_share: float = 0.5  # calls of several texts (batch and stream calls) fill at most this share of an engine loop's admission budget; one-text calls may fill the rest, so that a one-text call behind a backlog joins a batch that steps fast; 1: no limit
    max_call_share: float = 0.05  # per-call cap: while other calls of its priority wait, a call holding this share of an engine loop's admission budget gets no more texts admitted (the room its finished texts free goes to the others); 1: no cap
    cache_mb: int = 256  # encoder caches of all models together, split equally (deploy/k8s sizes the pod with it)
    result_cache: int = 10000  # finished results kept per model, answered again without decoding (0: off)
    build_cache: str = ""  # where checkpoints are exported to ONNX (default ~/.cache/gret-serve)
    verify_build: bool = True  # a fresh export must reproduce the checkpoint's recorded score
    grace_seconds: float = 30.0  # SIGTERM: in-flight calls get this long to finish
    max_message_mb: int = 4  # gRPC receive/send limit
    tls_cert: str = ""  # PEM certificate; with tls_key, gRPC and HTTP use TLS
    tls_key: str = ""  # PEM private key of tls_cert
    auth_token: str = ""  # bearer token required on every call but health checks (or $GRET_SERVE_TOKEN)
    log_level: str = "info"  # debug also logs request text
    log_format: str = "text"  # json: one JSON object per line, with the request id of the call it concerns
    # limits on requests
    max_beam: int = 16  # beam size and n-best list at most
    max_texts: int = 256  # texts in one call at most
    max_text_chars: int = 4000  # characters of one text at most
    max_output_tokens: int = 256  # output pieces of one text at most

    def limits(self) -> Limits:
        return Limits(max_beam=self.max_beam, max_n_best=self.max_beam, max_output_tokens=self.max_output_tokens,
                      max_texts=self.max_texts, max_text_chars=self.max_text_chars)

    def loops(self) -> int:
        """Engine loops per model: `workers`, or one per core this process may run on (one on a GPU)."""
        return self.workers or (1 if self.device == "cuda" else len(os.sched_getaffinity(0)))

    def replica_kind(self) -> str:
        """What runs each engine loop: `replicas`, but threads on a GPU (worker processes would each
        open a CUDA context and a copy of the model)."""
        return "thread" if self.device == "cuda" else self.replicas

    def token(self) -> str:
        return self.auth_token or os.environ.get("GRET_SERVE_TOKEN", "")

    def check(self) -> "ServerConfig":
        problems = [f"{name} {getattr(self, name)!r} is not one of {', '.join(allowed)}"
                    for name, allowed in CHOICES.items() if getattr(self, name) not in allowed]
        if bool(self.tls_cert) != bool(self.tls_key):
            problems.append("TLS needs both tls_cert and tls_key")
        problems += [f"{name} {getattr(self, name)}: no such file" for name in ("tls_cert", "tls_key")
                     if getattr(self, name) and not os.path.isfile(getattr(self, name))]
        if self.result_cache < 0 or self.cache_mb < 0:
            problems.append("result_cache and cache_mb must not be negative")
        if not 0 < self.max_call_share <= 1:
            problems.append(f"max_call_share must be above 0 and at most 1 (1: no cap), got {self.max_call_share}")
        if not 0 < self.max_bulk_share <= 1:
            problems.append(f"max_bulk_share must be above 0 and at most 1 (1: no limit), got {self.max_bulk_share}")
        if self.device == "cuda" and self.backend != "torch":
            problems.append(f"device cuda needs backend torch (the {self.backend} backend decodes on the CPU here)")
        elif self.device == "cuda" and not torch.cuda.is_available():
            problems.append("device cuda: torch sees no CUDA device (a CUDA build of torch and a GPU are needed)")
        if self.workers < 0:
            problems.append(f"workers must not be negative (0: one per core), got {self.workers}")
        for name in ("port", "http_port", "metrics_port", "threads", "max_batch_tokens", "max_queue", "max_beam",
                     "max_texts", "max_text_chars",
                     "max_output_tokens", "max_message_mb"):
            if getattr(self, name) < (0 if name.endswith("port") else 1):
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if problems:
            raise ValueError("bad server configuration: " + "; ".join(problems))
        return self


def load(argv: list[str] | None = None, prog: str = "python -m server") -> tuple[ServerConfig, bool]:
    """(configuration, --prepare-only); a bad flag, field or file exits 2 with one line saying which."""
    parser = OneLineErrors(prog=prog, description="Serve translation/summarisation models over gRPC and HTTP.")
    parser.add_argument("--config", type=Path, help="YAML file with any of the fields below")
    parser.add_argument("--prepare-only", action="store_true",
                        help="build (and verify) the models' repositories, then exit: for image builds")
    helps = field_help()
    for f in dataclasses.fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = str(default).lower() if isinstance(default, bool) else repr(default) if isinstance(default, str) \
            else " ".join(default) or "all" if isinstance(default, list) else default
        text = f"{helps.get(f.name, '')} [default: {shown}]".replace("%", "%%")
        if isinstance(default, bool):
            parser.add_argument(flag, type=_boolean, metavar="true|false", default=None, help=text)
        elif isinstance(default, list):
            parser.add_argument(flag, nargs="*", default=None, help=text)
        else:
            parser.add_argument(flag, type=type(default), choices=CHOICES.get(f.name), default=None, help=text)
    args = parser.parse_args(argv)
    values = {}
    if args.config:
        try:
            loaded = yaml.safe_load(args.config.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            parser.error(f"--config {args.config}: {e}")
        known = {f.name for f in dataclasses.fields(ServerConfig)}
        unknown = sorted(set(loaded) - known)
        if unknown:
            parser.error(f"{args.config}: unknown fields {', '.join(unknown)}")
        values.update(loaded)
    values.update({k: v for k, v in vars(args).items() if v is not None and k not in ("config", "prepare_only")})
    try:
        config = ServerConfig(**values).check()
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    return config, args.prepare_only


class OneLineErrors(argparse.ArgumentParser):
    """An operator's mistake gets one line naming it (exit 2), not the whole usage; --help has the rest."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def field_help() -> dict[str, str]:
    """ServerConfig's field comments by field name (the source is the documentation)."""
    lines = inspect.getsource(ServerConfig).splitlines()
    return {m[1]: m[2] for m in (re.match(r"\s+(\w+): [^#]*?  # (.*)$", line) for line in lines) if m}


def _boolean(text: str) -> bool:
    if text.lower() in ("true", "1", "yes", "on"):
        return True
    if text.lower() in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
