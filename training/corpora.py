"""The corpora under ../shared/data (Multi30K, Gigaword, AESLC): their splits as Examples, read
alike for training, evaluation and the benchmarks."""
from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = Path(os.environ.get("SHARED_DATA", PROJECT_ROOT.parent / "shared" / "data"))

LANGS = ("de", "en", "fr")
SPLITS = {
    "multi30k": ("train", "val", "test_2016_flickr", "test_2017_flickr"),
    "gigaword": ("train", "valid"),
    "aeslc": ("train", "dev"),
}


@dataclass
class Example:
    source: str
    refs: list[str]  # the first is the training target; AESLC dev has four

    @property
    def target(self) -> str:
        return self.refs[0]


def _lines(path: Path) -> list[str]:
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: the data must be at {DATA_DIR} (set SHARED_DATA)")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def load_examples(dataset: str, split: str, src_lang: str = "de", tgt_lang: str = "en") -> list[Example]:
    if dataset not in SPLITS:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {sorted(SPLITS)}")
    if split not in SPLITS[dataset]:
        raise ValueError(f"{dataset} has no split {split!r}; choose from {SPLITS[dataset]}")
    if dataset == "multi30k":
        if src_lang not in LANGS or tgt_lang not in LANGS or src_lang == tgt_lang:
            raise ValueError(f"multi30k directions are two different languages among {LANGS}")
        src = _lines(DATA_DIR / "multi30k" / f"{split}.{src_lang}.gz")
        tgt = _lines(DATA_DIR / "multi30k" / f"{split}.{tgt_lang}.gz")
        return [Example(s, [t]) for s, t in zip(src, tgt, strict=True)]
    if dataset == "gigaword":
        src = _lines(DATA_DIR / "gigaword10k" / f"{split}.article.gz")
        tgt = _lines(DATA_DIR / "gigaword10k" / f"{split}.title.gz")
        return [Example(s, [t]) for s, t in zip(src, tgt, strict=True)]
    rows = [json.loads(line) for line in _lines(DATA_DIR / "aeslc" / f"{split}.jsonl.gz")]
    return [Example(r["email"], [r["subject"]] + [r[k] for k in ("ann0", "ann1", "ann2") if k in r])
            for r in rows]
