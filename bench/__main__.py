"""python -m bench engine|server|speed|step|replicas|http|memory|startup|gpu|report [options]: see bench/__init__.py."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {"engine": "bench.engine", "server": "bench.server", "speed": "bench.speed",
            "replicas": "bench.replicas", "http": "bench.http", "report": "bench.report",
            "segmenters": "bench.segmenters", "unknowns": "bench.unknowns", "documents": "bench.documents",
            "summaries": "bench.summaries", "memory": "bench.memory", "step": "bench.step",
            "startup": "bench.startup", "gpu": "bench.gpu"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m bench {{{'|'.join(COMMANDS)}}} [options]  (--help after the command)", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
