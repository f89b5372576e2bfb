"""python -m training.target_pieces CHECKPOINT...: the pieces a model was trained to write.

A translation model's SentencePiece vocabulary is shared by both languages, yet it only ever learnt
to write the pieces of its targets: of a German-English model's 8000 pieces, 3968 (EOS and the
block's fill included; this command prints the count) are those of the English side of Multi30K
train. Training pushed the others' probabilities down at every step,
so they never win a beam. The int8 decoder computes its output layer, log-softmax and block maxima
over these pieces only (export.quantize.trim_output; docs/MODEL.md says what that saves). A model
whose checkpoint has no target_pieces.json keeps its whole vocabulary in every graph.

The file holds the sorted ids of every piece of every training target, plus EOS, filled up with
the next ids to a whole number of the block maxima's blocks (TOP_K_BLOCK columns), so the graph's
blocks stay whole.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from training.corpora import load_examples
from training.seq2seq.beam import TOP_K_BLOCK
from training.seq2seq.checkpoint import TARGET_PIECES, load_checkpoint
from training.seq2seq.inputs import EOS


def target_pieces(sp, targets, vocab_size: int) -> list[int]:
    """The sorted ids of the pieces of `targets` and EOS, filled up to whole blocks with the lowest
    ids not among them."""
    seen = {EOS}
    for text in targets:
        seen.update(sp.encode(text))
    whole = min(vocab_size, -(-len(seen) // TOP_K_BLOCK) * TOP_K_BLOCK)
    fill = (i for i in range(vocab_size) if i not in seen)
    while len(seen) < whole:
        seen.add(next(fill))
    return sorted(seen)


def write_target_pieces(checkpoint: Path) -> dict:
    """The checkpoint's target pieces, from its training data, written beside its weights."""
    model, ckpt, sp = load_checkpoint(checkpoint)
    data = ckpt.data
    targets = [e.target for e in load_examples(data.dataset, "train", data.src_lang, data.tgt_lang)]
    pieces = target_pieces(sp, targets, model.cfg.vocab_size)
    record = {"source": f"{data.dataset} train ({data.tgt_lang}): {len(targets)} targets",
              "vocab_size": model.cfg.vocab_size, "kept": len(pieces), "pieces": pieces}
    (Path(checkpoint) / TARGET_PIECES).write_text(json.dumps(record) + "\n")
    return record


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", type=Path, nargs="+")
    for checkpoint in p.parse_args(argv).checkpoints:
        record = write_target_pieces(checkpoint)
        print(f"{checkpoint}: {record['kept']} of {record['vocab_size']} pieces ({record['source']})")


if __name__ == "__main__":
    main()
