"""Score system outputs against references, optionally with a significance test.

    python -m training.evaluate --hyp out.txt --ref ref.txt [--ref ref2.txt ...]
        [--metrics bleu,chrf,rouge] [--compare baseline.txt] [--json out.json]

Files hold one example per line (``.gz`` is read transparently). Several
``--ref`` files are several references per example. With ``--compare`` each
metric gets a paired bootstrap test of a = the --compare system against
b = the --hyp system (p_value small means --hyp is better).
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from training import metrics


def read_lines(path: str) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        # Strip only the newline: inner whitespace is part of the output.
        return [line.rstrip("\r\n") for line in f]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hyp", required=True, help="system output, one line per example")
    p.add_argument("--ref", required=True, action="append",
                   help="reference file; repeat for multiple references")
    p.add_argument("--metrics", default="bleu,chrf",
                   help="comma-separated: bleu, chrf, rouge (= rouge1,rouge2,rougeL) "
                        "or single rouge variants (default: bleu,chrf)")
    p.add_argument("--compare", help="baseline output (system a) for the paired bootstrap")
    p.add_argument("--samples", type=int, default=1000, help="bootstrap samples")
    p.add_argument("--seed", type=int, default=12345, help="bootstrap seed")
    p.add_argument("--json", help="also write the result to this file")
    return p


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        names = metrics.expand_metrics([m.strip() for m in args.metrics.split(",") if m.strip()])
    except ValueError as e:
        parser.error(str(e))
    if not names:
        parser.error("--metrics is empty")

    hyps = read_lines(args.hyp)
    ref_streams = [read_lines(path) for path in args.ref]
    base = read_lines(args.compare) if args.compare else None
    files = list(zip(args.ref, ref_streams)) + ([(args.compare, base)] if args.compare else [])
    bad = [f"{path} has {len(lines)}" for path, lines in files if len(lines) != len(hyps)]
    if bad:
        parser.error(f"line counts differ: {args.hyp} has {len(hyps)} lines, " + ", ".join(bad))

    refs = [list(r) for r in zip(*ref_streams)]  # refs[i] = references of example i
    result = {"hyp": args.hyp, "refs": args.ref, "n": len(hyps),
              "scores": metrics.score(hyps, refs, names)}
    if args.compare:
        result["compare"] = args.compare
        result["bootstrap"] = {
            m: metrics.paired_bootstrap(base, hyps, refs, m, args.samples, args.seed)
            for m in names}

    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
