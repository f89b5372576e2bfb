"""python -m server [--config server.yaml] [--port 50051] [--models-dir models] ... (--help lists all)

Serves every model under models/ (shipped checkpoints are exported to ONNX on first start)."""
from __future__ import annotations

import logging
import sys

import torch
import uvloop

from . import config as server_config
from . import logs
from .catalog import ModelError


def main(argv=None) -> int:
    config, prepare_only = server_config.load(argv)
    logs.configure(config.log_level, config.log_format)
    from .app import App  # after logging is set up: loading models logs
    from .engine.engine import freeze_loaded
    from .metrics import Metrics
    from .registry import Registry

    # torch holds the engine's cache and encoder slots (allocations and views; the copies between steps
    # go through NumPy); with the ONNX Runtime or CTranslate2 backend the heavy work has its own
    # threads, and torch's pool would compete.
    torch.set_num_threads(config.threads if config.backend == "torch" else 1)
    metrics = Metrics()
    try:
        registry = Registry.load(config, metrics)
    except ModelError as e:
        logging.getLogger("server").error("cannot start: %s", e)
        return 1
    if prepare_only:
        print("prepared: " + ", ".join(f"{p.entry.name} ({p.entry.version})" for p in registry))
        return 0
    freeze_loaded()  # what loading made lives as long as the server
    # uvloop: gRPC's and HTTP's callbacks run on libuv's loop, which spends less of the parent
    # process's CPU per call than asyncio's own; that CPU is what the engine's workers share the cores with
    uvloop.run(App(config, registry, metrics).serve_forever())
    return 0


if __name__ == "__main__":
    sys.exit(main())
