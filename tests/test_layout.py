"""What the packages hold, and what the server may import (issue #21).

training/seq2seq/ is the model family: its config, layers, GRET, multi-view decoding, the
Graph-Transformer encoder, positions, Seq2Seq, the beam-search rule and offline search, checkpoints,
and what the model reads (SentencePiece, a dataset's input style, source ids, POS tags). Around it in
training/ are the corpora and the metrics, the training loop, its data preparation and the research
tooling.

The server (server/, and export/, the repository code it loads models with) serves with the model
package. Of the rest of training/ it reads the corpora and the metrics, and only to check an exported
build against the score its checkpoint recorded (server.pipeline.verify_build). It imports nothing of
the training loop, of the training data preparation or of the research tooling: not at start-up and
not later, inside a function.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What the server serves with: the model family, with its tokenizer and input handling.
MODEL_PACKAGE = "training.seq2seq"
# What verify_build checks a build with: the corpora's evaluation splits, scored by the metrics.
EVALUATION = {"training.corpora", "training.metrics"}
# What the server never imports.
TRAINING_LOOP = {"training.train", "training.distributed"}
TRAINING_DATA = {"training.data"}
RESEARCH_TOOLING = {"training.decode", "training.translate", "training.evaluate", "training.ship", "training.study",
                    "training.gret_probe", "training.demo", "training.target_pieces"}
FORBIDDEN = TRAINING_LOOP | TRAINING_DATA | RESEARCH_TOOLING
SERVING_CODE = ("server", "export")  # the packages whose every import the rule covers


def allowed_for_serving(module: str) -> bool:
    return (module in ("training", MODEL_PACKAGE) or module.startswith(MODEL_PACKAGE + ".")
            or module in EVALUATION)


def modules_of(package: str) -> list[str]:
    """Every module of a package, by its dotted name, from the files under its folder."""
    folder = ROOT.joinpath(*package.split("."))
    names = []
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def imported_training_modules(path: Path) -> set[str]:
    """Every training.* module a source file names in an import statement, wherever it stands
    (at the top or inside a function), relative imports resolved."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from training import data` imports the module training.data
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names if base in ("training", MODEL_PACKAGE)]
        else:
            continue
        found |= {t for t in targets if t == "training" or t.startswith("training.")}
    return found


def test_every_module_of_training_is_the_model_package_evaluation_or_named_as_out_of_bounds():
    """A new module in training/ is placed on purpose: in the model package, or named here."""
    outside = {m for m in modules_of("training") if not m.startswith(MODEL_PACKAGE)} - {"training"}
    unplaced = outside - EVALUATION - FORBIDDEN
    assert not unplaced, f"say whether the server may import {sorted(unplaced)} (tests/test_layout.py)"
    assert set(modules_of(MODEL_PACKAGE)) >= {f"{MODEL_PACKAGE}.{m}" for m in (
        "config", "layers", "gret", "multiview", "graph_encoder", "positions", "model", "beam", "search",
        "checkpoint", "inputs", "pos_tags")}


@pytest.mark.parametrize("package", SERVING_CODE)
def test_no_serving_module_names_a_training_module_outside_the_model_package_and_evaluation(package):
    offending = {str(path.relative_to(ROOT)): sorted(m for m in imported_training_modules(path)
                                                     if not allowed_for_serving(m))
                 for path in sorted(ROOT.joinpath(package).rglob("*.py"))}
    assert not {f: ms for f, ms in offending.items() if ms}


def test_the_model_package_imports_nothing_else_of_training():
    offending = {str(path.relative_to(ROOT)): sorted(m for m in imported_training_modules(path)
                                                     if m != "training" and not m.startswith(MODEL_PACKAGE))
                 for path in sorted(ROOT.joinpath(*MODEL_PACKAGE.split(".")).rglob("*.py"))}
    assert not {f: ms for f, ms in offending.items() if ms}


IMPORT_ALL = """
import importlib, json, sys
loaded, brought = set(), {}
for name in sys.argv[1:]:
    importlib.import_module(name)
    new = {m for m in sys.modules if m == "training" or m.startswith("training.")} - loaded
    brought.update({m: name for m in new})
    loaded |= new
print(json.dumps(brought))
"""


def training_modules_loaded_by(modules: list[str]) -> dict[str, str]:
    """{training module: the first of `modules` whose import loaded it}, in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", IMPORT_ALL, *modules], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def test_importing_every_server_module_loads_no_training_loop_data_preparation_or_research_tooling():
    loaded = training_modules_loaded_by(modules_of("server"))
    assert MODEL_PACKAGE + ".model" in loaded  # the server does serve with the model package
    assert {m: by for m, by in loaded.items() if m in FORBIDDEN} == {}
    assert {m: by for m, by in loaded.items() if not allowed_for_serving(m)} == {}


def test_importing_the_model_package_loads_nothing_else_of_training():
    loaded = training_modules_loaded_by(modules_of(MODEL_PACKAGE))
    assert {m: by for m, by in loaded.items() if m != "training" and not m.startswith(MODEL_PACKAGE)} == {}
