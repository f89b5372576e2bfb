"""Benchmarks that compare systems side by side in one run and report ratios.

    python -m bench engine [--quick]   offline decoding: our engine vs CTranslate2 vs PyTorch
    python -m bench server [--quick]   gRPC load: latency vs offered load per batching policy
    python -m bench server --scenario backlog   one-text calls while a 640-text backlog decodes
    python -m bench speed [--quick]    the server with its defaults vs CTranslate2 int8, GRET vs vanilla
    python -m bench step [--quick]     one step's fixed overhead and cost per row, per architecture and phase
    python -m bench replicas --repository REPO   engine loops as threads vs worker processes
    python -m bench http [--quick]     the HTTP/JSON front end against gRPC on one server, same load
    python -m bench segmenters|unknowns|documents|summaries   issue 19's measurements (docs/DOCUMENTS.md)
    python -m bench memory [--quick]   peak memory of the server with every shipped model under load
    python -m bench startup            a new server's seconds to SERVING and its first calls' latency
    python -m bench gpu                the engine on a CUDA device against the CPU: same outputs, texts/s
    python -m bench report             BENCHMARKS.md from bench-*.json
    python -m bench.soak               the 10-minute soak at ~70% of saturation

Each writes into runs/bench (gitignored); with --publish, into docs/results and docs/, the
tracked record (`python -m bench report --publish` renders docs/BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from training.corpora import PROJECT_ROOT


def add_publish(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--publish", action="store_true",
                        help="write into docs/results and docs/, the tracked record (default: runs/bench)")


def results_dir(publish: bool) -> Path:
    """A run that is not published stays out of the tracked tree."""
    return PROJECT_ROOT / "docs" / "results" if publish else PROJECT_ROOT / "runs" / "bench"


def torch_pipeline(model: str, threads: int, **kwargs):
    """A served model's pipeline on the PyTorch backend, driven in this process (the text benches:
    what they measure is the pipeline's handling of texts, not a backend's speed)."""
    from server.catalog import load_entry  # the server's import chain, only for the benches that drive it
    from server.pipeline import build_pipeline

    return build_pipeline(load_entry(Path(model), "torch"), "torch", threads=threads, **kwargs)


def pages_dir(publish: bool) -> Path:
    """Where the pages rendered from the results go: docs/ beside docs/results, or beside runs/bench's JSON."""
    return PROJECT_ROOT / "docs" if publish else results_dir(False)
