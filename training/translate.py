"""python -m training.translate --checkpoint DIR [--beam N] [--device cuda] < source.txt > output.txt

One line in, one detokenised line out, in input order."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .decode import corpus_translate
from .seq2seq.checkpoint import load_checkpoint
from .seq2seq.inputs import input_style, normalize_input


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, type=Path)
    p.add_argument("--beam", type=int, default=4, help="1 = greedy")
    p.add_argument("--length-penalty", type=float, default=1.0)
    p.add_argument("--max-len-a", type=float, default=1.5, help="max output length = a * source length + b")
    p.add_argument("--max-len-b", type=int, default=10)
    p.add_argument("--batch-tokens", type=int, default=3000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda; on CUDA the model runs the Triton kernels (kernels/)")
    args = p.parse_args(argv)
    if args.beam < 1:
        p.error("--beam must be >= 1")
    torch.set_num_threads(args.threads)
    model, ckpt, sp = load_checkpoint(args.checkpoint)
    model = model.to(args.device)
    texts = [normalize_input(input_style(ckpt.data.dataset), line.rstrip("\n")) for line in sys.stdin]
    outputs = corpus_translate(model, sp, texts, beam=args.beam, length_penalty=args.length_penalty,
                               max_src_len=ckpt.data.max_src_len, batch_tokens=args.batch_tokens,
                               src_lang=ckpt.data.src_lang, max_len_a=args.max_len_a, max_len_b=args.max_len_b)
    sys.stdout.write("".join(o + "\n" for o in outputs))


if __name__ == "__main__":
    main()
