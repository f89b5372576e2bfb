"""python -m export --checkpoint DIR --out models/NAME [--format onnx|ct2] [--quantize int8]

Writes a model repository from a checkpoint directory: model.json, spm.model and
  --format onnx (default, every architecture): encoder.onnx, decoder.onnx, decoder2.onnx (and
                global.onnx for capsule models); with --quantize int8 also an int8 twin of each, NAME.int8.onnx
                (ONNX Runtime dynamic quantization)
  --format ct2  (CTranslate2; vanilla and mvPE models only): ct2/ (model.bin, config.json,
                shared_vocabulary.json); with --quantize int8 also ct2.int8/, whose weights
                CTranslate2's converter stored as int8"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .quantize import QUANTIZATIONS
from .repository import FORMATS, write_repository


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, type=Path, help="config.json + model.safetensors + spm.model")
    p.add_argument("--out", required=True, type=Path, help="the model repository to write, e.g. models/NAME")
    p.add_argument("--format", default="onnx", choices=FORMATS)
    p.add_argument("--quantize", choices=QUANTIZATIONS, help="also write int8 graphs (onnx) or an int8 model folder (ct2) beside the fp32 ones")
    p.add_argument("--name", help="model name (default: the name of --out)")
    p.add_argument("--version", help="model version (default: 12 hex digits of the weights' sha256)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        manifest = write_repository(args.checkpoint, args.out, fmt=args.format, quantize=args.quantize,
                                    name=args.name, version=args.version, overwrite=args.overwrite)
    except (ValueError, FileNotFoundError) as e:  # RepositoryError, ExportError, Ct2ExportError, a bad config.json
        p.exit(2, f"{p.prog}: error: {e}\n")
    sizes = {f: entry["bytes"] for f, entry in manifest["files"].items()}
    print(json.dumps({"repository": str(args.out), "version": manifest["version"], "files": sizes}, indent=2))
    return manifest


if __name__ == "__main__":
    main(sys.argv[1:])
