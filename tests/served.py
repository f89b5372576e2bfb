"""Tiny models trained on real data inside the test run, laid out as a models directory the way
models/ is (checkpoints, and one exported repository), and a real server on loopback."""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import uvloop

from export.__main__ import main as export_main
from server.app import App
from server.config import ServerConfig
from server.metrics import Metrics
from server.registry import Registry
from training import train

REPO = Path(__file__).resolve().parent.parent

TINY = ["--preset", "tiny", "--vocab-size", "300", "--batch-tokens", "600", "--lr", "5e-3", "--warmup", "10",
        "--label-smoothing", "0", "--dropout", "0", "--threads", "1", "--log-every", "100"]


def train_models(root: Path) -> Path:
    """root/models: de-en (GRET reading source POS tags, as the shipped de-en does; exported ONNX
    repository; its checkpoint is root/runs/de-en), en-de (vanilla checkpoint: the server exports it
    on first start), gigaword (summariser checkpoint)."""
    runs, models = root / "runs", root / "models"
    train.main(["--out", str(runs / "de-en"), *TINY, "--gret", "full", "--pos-tags", "--train-limit", "60",
                "--valid-limit", "4", "--max-steps", "60", "--eval-every", "60"])
    export_main(["--checkpoint", str(runs / "de-en"), "--out", str(models / "tiny-de-en"), "--quantize", "int8"])
    train.main(["--out", str(models / "tiny-en-de"), *TINY, "--src", "en", "--tgt", "de", "--train-limit", "60",
                "--valid-limit", "4", "--max-steps", "30", "--eval-every", "30"])
    train.main(["--out", str(models / "tiny-headlines"), *TINY, "--dataset", "gigaword", "--train-limit", "60",
                "--valid-limit", "4", "--max-steps", "30", "--eval-every", "30", "--max-src-len", "64"])
    return models


class RunningServer:
    """App on its own event loop thread (uvloop's, as `python -m server` runs it), bound to a free loopback port."""

    def __init__(self, config: ServerConfig):
        self.metrics = Metrics()
        self.registry = Registry.load(config, self.metrics)
        self.app = App(config, self.registry, self.metrics)
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = self.call(self.app.start())
        self.address = f"127.0.0.1:{self.port}"

    def call(self, coroutine, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.call(self.app.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def config_for(models_dir: Path, cache: Path, **overrides) -> ServerConfig:
    """A loopback server's config. The result cache is off unless asked for: the tests send the
    same texts again and again, and each call must exercise the engine. One engine loop on a
    thread unless asked for: tests reach into it (tests/test_workers.py covers worker processes).
    HTTP is off unless asked for (its default port is fixed, and test servers run side by side)."""
    return ServerConfig(**{"models_dir": str(models_dir), "host": "127.0.0.1", "port": 0, "metrics_port": 0,
                           "http_port": 0, "threads": 1, "workers": 1, "replicas": "thread", "build_cache": str(cache),
                           "grace_seconds": 5.0, "result_cache": 0, **overrides}).check()


class ServerProcess:
    """`python -m server ARGS` as a child process, the way an operator runs it; everything it prints
    (the log on stderr, stdout) is collected line by line. HTTP is off unless ARGS name a port."""

    def __init__(self, *args):
        args = ("--http-port", 0, *args)  # argparse keeps the last: a test's own --http-port wins
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "server", *map(str, args)], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_serving(self, timeout: float = 180) -> str:
        """The loopback address, once the server logs that it is serving."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(r"serving .* on \S+:(\d+) \(metrics", self.log)
            if found:
                return f"127.0.0.1:{found.group(1)}"
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.log}")
            time.sleep(0.1)
        raise AssertionError(f"not serving after {timeout} s:\n{self.log}")

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.wait(30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
