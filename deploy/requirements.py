"""Print the image's requirements, one per line: pyproject.toml's [project] dependencies.

Both wheelhouse.sh (on the host) and the Dockerfile (offline, in the builder stage) call this, so the
wheelhouse and the image ask for the same thing; pyproject.toml stays the only list. Standard library
only (tomllib, Python 3.11): it runs in the bare base image before anything is installed.
"""
from __future__ import annotations

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def requirements(root: Path = ROOT) -> list[str]:
    dependencies = tomllib.loads((root / "pyproject.toml").read_text())["project"].get("dependencies", [])
    # An unpinned dependency would make the image depend on the day the wheelhouse was filled.
    unpinned = [r for r in dependencies if "==" not in r]
    if unpinned:
        sys.exit(f"requirements.py: every dependency in pyproject.toml must be pinned with ==, not: {unpinned}")
    return [r.strip() for r in dependencies]


if __name__ == "__main__":
    print("\n".join(requirements()))
