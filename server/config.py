"""Server configuration: one YAML file, every field overridable by a flag of the same name.

    python -m server --config server.yaml --port 50052 --batching request

With no flags the server sizes itself to the machine: one engine worker process per usable
core, one intra-op thread each, int8 where its quality was verified.

Precedence: defaults < YAML < flags. Unknown YAML keys are an error (a typo must not be ignored)."""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .backends import BACKENDS
from .engine.options import Limits
from .engine.scheduler import POLICIES

PRECISIONS = ("auto", "fp32", "int8")
REPLICAS = ("process", "thread")


@dataclass
class ServerConfig:
    models_dir: str = "models"  # every model folder here is served ...
    models: list[str] = field(default_factory=list)  # ... or only these
    skip_bad_models: bool = False  # with several models: skip one that fails to load (and log why)
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int = 9090  # 0: no metrics endpoint
    backend: str = "onnx"  # onnx | torch | ct2
    precision: str = field(default="auto", metadata={"help": (
        "fp32 | int8 | auto (the default): int8 where the repository's int8 graphs passed the build's "
        "verification (verified.json), else fp32")})
    threads: int = field(default=1, metadata={"help": "intra-op threads of each engine loop (default 1)"})
    workers: int = field(default=0, metadata={"help": (
        "engine loops per model, each with its own running batch, using workers x threads cores; "
        "0 (the default): one per CPU core this process may use")})
    replicas: str = field(default="process", metadata={"help": (
        "what runs each engine loop: process (the default; a worker process with its own model session, "
        "so loops do not share the GIL) | thread (threads of the server process sharing one session); "
        "the ct2 backend always uses CTranslate2's own replicas")})
    batching: str = "continuous"  # continuous | request | none
    max_batch_tokens: int = 16384  # admission budget: sum of beam x (source + output limit)
    max_queue: int = 1024  # texts waiting per model; beyond it RESOURCE_EXHAUSTED
    cache_mb: int = 256  # encoder caches of all models together, split equally (deploy/k8s sizes the pod with it)
    result_cache: int = 10000  # finished results kept per model, answered again without decoding (0: off)
    build_cache: str = ""  # where checkpoints are exported to ONNX (default ~/.cache/gret-serve)
    verify_build: bool = True  # a fresh export must reproduce the checkpoint's recorded score
    grace_seconds: float = 30.0  # SIGTERM: in-flight calls get this long to finish
    max_message_mb: int = 4  # gRPC receive/send limit
    tls_cert: str = ""  # PEM files; both set = TLS
    tls_key: str = ""
    auth_token: str = ""  # bearer token required on every call but health checks (or $GRET_SERVE_TOKEN)
    log_level: str = "info"  # debug also logs request text
    # limits on requests
    max_beam: int = 16
    max_texts: int = 256
    max_text_chars: int = 4000
    max_output_tokens: int = 256

    def limits(self) -> Limits:
        return Limits(max_beam=self.max_beam, max_n_best=self.max_beam, max_output_tokens=self.max_output_tokens,
                      max_texts=self.max_texts, max_text_chars=self.max_text_chars)

    def loops(self) -> int:
        """Engine loops per model: `workers`, or one per core this process may run on."""
        return self.workers or len(os.sched_getaffinity(0))

    def token(self) -> str:
        return self.auth_token or os.environ.get("GRET_SERVE_TOKEN", "")

    def check(self) -> "ServerConfig":
        problems = []
        if self.backend not in BACKENDS:
            problems.append(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.precision not in PRECISIONS:
            problems.append(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.replicas not in REPLICAS:
            problems.append(f"replicas {self.replicas!r} is not one of {', '.join(REPLICAS)}")
        if self.batching not in POLICIES:
            problems.append(f"batching {self.batching!r} is not one of {', '.join(POLICIES)}")
        if bool(self.tls_cert) != bool(self.tls_key):
            problems.append("TLS needs both tls_cert and tls_key")
        if self.result_cache < 0 or self.cache_mb < 0:
            problems.append("result_cache and cache_mb must not be negative")
        if self.workers < 0:
            problems.append(f"workers must not be negative (0: one per core), got {self.workers}")
        for name in ("port", "threads", "max_batch_tokens", "max_queue", "max_beam", "max_texts", "max_text_chars",
                     "max_output_tokens", "max_message_mb"):
            if getattr(self, name) < (0 if name == "port" else 1):
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if problems:
            raise ValueError("bad server configuration: " + "; ".join(problems))
        return self


def load(argv: list[str] | None = None, prog: str = "python -m server") -> tuple[ServerConfig, bool]:
    """(configuration, --prepare-only)"""
    parser = argparse.ArgumentParser(prog=prog, description="Serve translation/summarisation models over gRPC.")
    parser.add_argument("--config", type=Path, help="YAML file with any of the fields below")
    parser.add_argument("--prepare-only", action="store_true",
                        help="build (and verify) the models' repositories, then exit: for image builds")
    for f in dataclasses.fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = type(f.default) if f.default is not dataclasses.MISSING else list
        described = f.metadata.get("help")
        if kind is bool:
            parser.add_argument(flag, type=_boolean, metavar="true|false", default=None, help=described)
        elif kind is list:
            parser.add_argument(flag, nargs="*", default=None, help=described)
        else:
            parser.add_argument(flag, type=kind, default=None, help=described)
    args = parser.parse_args(argv)
    values = {}
    if args.config:
        loaded = yaml.safe_load(args.config.read_text()) or {}
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


def _boolean(text: str) -> bool:
    if text.lower() in ("true", "1", "yes", "on"):
        return True
    if text.lower() in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
