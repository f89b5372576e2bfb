"""Where a benchmark's numbers come from: the command that made them, when, from which code, with
which packages, on what machine and under what load. Every benchmark's JSON opens with it in this one
shape, and `bench.report` prints it above each table (report.provenance)."""
from __future__ import annotations

import datetime
import importlib
import os
import platform
import shlex
import subprocess
import sys

from training.corpora import PROJECT_ROOT


class Run:
    """Made when a benchmark starts (the load average then), read when it writes its JSON."""

    def __init__(self, module: str, argv: list[str] | None, *notes: str):
        """module: what follows `python -m` ("bench speed", "bench.soak"); argv: the benchmark's own
        arguments (None: this process's); notes: what the machine was doing, the empty ones left out."""
        self.command = shlex.join(["python", "-m", *module.split(), *(sys.argv[1:] if argv is None else argv)])
        self.note, self.load_start = "; ".join(filter(None, notes)), os.getloadavg()

    def header(self) -> dict:
        return {"command": self.command,
                "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                "commit": git_commit(),
                "versions": versions(),
                "machine": {"cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
                            "cpu": cpu(), "platform": platform.platform(), "load_average_start": list(self.load_start),
                            "load_average_end": list(os.getloadavg()), "note": self.note}}


# The instruction sets that decide which int8 and float kernels ONNX Runtime and CTranslate2 pick
VECTOR_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


def cpu() -> str:
    """The processor, as /proc/cpuinfo names it (a VM may shorten the name: family and model say
    more), and its vector extensions: runs on different processors are not comparable, not even
    in their ratios (int8 kernels differ by extension). Empty where /proc/cpuinfo is missing."""
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
    except OSError:
        return ""
    info = {k.strip(): v.strip() for k, v in info.items()}
    flags = [f for f in VECTOR_FLAGS if f in info.get("flags", "").split()]
    return (f"{info.get('model name', '?')} (family {info.get('cpu family', '?')}, model {info.get('model', '?')}; "
            f"{' '.join(flags) or 'no AVX2'})")


def git_commit() -> str:
    """The short commit, marked when the tree differs from it (results being written, docs/results
    and runs/, are not changes to what is measured)."""
    def git(*a):
        return subprocess.run(["git", *a], check=False, capture_output=True, text=True, cwd=PROJECT_ROOT).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--", ".", ":!docs/results", ":!runs")
        return commit + (" (with uncommitted changes)" if changed else "")
    except OSError:
        return ""


# package -> its module: the runtimes measured and what they stand on
PACKAGES = {"torch": "torch", "onnxruntime": "onnxruntime", "ctranslate2": "ctranslate2", "triton": "triton",
            "grpcio": "grpc", "numpy": "numpy", "protobuf": "google.protobuf"}


def versions() -> dict:
    """The packages' versions, leaving out those not installed (a GPU machine's own image may lack
    some: bench gpu runs there)."""
    found = {"python": platform.python_version()}
    for package, module in PACKAGES.items():
        try:
            found[package] = importlib.import_module(module).__version__
        except ImportError:
            pass
    return found
