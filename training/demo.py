"""The README's main job until the server exists: translate a few Multi30K test sentences with
the shipped de->en model (training one first, briefly, if models/ does not hold it)."""
from __future__ import annotations

import sys

import torch

from . import train
from .corpora import PROJECT_ROOT, load_examples
from .decode import corpus_translate
from .seq2seq.checkpoint import load_checkpoint

SHIPPED = PROJECT_ROOT / "models" / "multi30k-de-en"
FALLBACK = PROJECT_ROOT / "runs" / "demo-de-en"


def main():
    torch.set_num_threads(2)
    directory = SHIPPED
    if not (directory / "model.safetensors").exists():
        print(f"{SHIPPED} not found: training a small de->en model for 15 minutes into {FALLBACK}",
              file=sys.stderr)
        train.main(["--out", str(FALLBACK), "--preset", "small", "--max-minutes", "15", "--max-steps", "100000",
                    "--batch-tokens", "3000", "--eval-every", "500"])
        directory = FALLBACK
    model, ckpt, sp = load_checkpoint(directory)
    examples = load_examples("multi30k", "test_2016_flickr", "de", "en")[:8]
    outputs = corpus_translate(model, sp, [e.source for e in examples], beam=4, src_lang="de")
    for e, out in zip(examples, outputs):
        print(f"de:  {e.source}\nout: {out}\nref: {e.target}\n")


if __name__ == "__main__":
    main()
