"""Ship a trained checkpoint into models/NAME: fp16 weights, the vocabulary, the pieces its training
targets hold (training.target_pieces), metrics measured here by beam search, and a model card that
says how to reproduce it.

python -m training.ship --checkpoint runs/X --out models/NAME [--beam 4]"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import time
from pathlib import Path

import torch

from .corpora import load_examples
from .decode import corpus_translate
from .metrics import bleu, chrf, rouge
from .seq2seq.checkpoint import load_checkpoint, save_checkpoint
from .seq2seq.config import Checkpoint
from .seq2seq.inputs import INPUT_STYLES, input_style
from .target_pieces import write_target_pieces
from .train import parse_args

EVAL_SPLITS = {"multi30k": ("val", "test_2016_flickr", "test_2017_flickr"), "gigaword": ("valid",),
               "aeslc": ("dev",)}


def train_command(args: dict) -> str:
    """The training command line, from the arguments recorded in config.json."""
    defaults = vars(parse_args(["--out", "x"]))
    flags = []
    for key, value in args.items():
        if key == "out" or value == defaults.get(key) or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return " ".join(["python -m training.train --out", str(args["out"])] + flags)


def reproduction(ckpt, log: Path) -> list[str]:
    """The commands that rebuild a checkpoint from nothing: for a warm-started run, its parent's
    first. A run is rebuilt by training to the end of the invocation that wrote the selected
    checkpoint (a run may have been extended since); a wall-clock limit is replaced by the step
    it stopped at, which is reproducible."""
    args = dict(ckpt.training.get("args", {}))
    ends = [json.loads(line)["step"] for line in log.read_text().splitlines() if '"event": "done"' in line] \
        if log.exists() else []
    written = ckpt.training.get("steps", 0)
    if any(end >= written for end in ends):
        args["max_steps"] = min(end for end in ends if end >= written)
        args["max_minutes"] = vars(parse_args(["--out", "x"]))["max_minutes"]
    lines = []
    parent = ckpt.training.get("init_from")
    if parent and (Path(parent["path"]) / "config.json").exists():
        path = Path(parent["path"])
        grand = Checkpoint.load(path)
        lines += reproduction(grand, path / ("train_log.jsonl" if (path / "train_log.jsonl").exists() else "log.jsonl"))
        if (path / "metrics.json").exists():  # a shipped parent: its fp16 weights are what the run started from
            lines.append(f"python -m training.ship --checkpoint {grand.training['args']['out']} --out {path}")
    return lines + [train_command(args)]


def evaluate(model, sp, ckpt, beam: int) -> dict:
    data = ckpt.data
    results = {}
    for split in EVAL_SPLITS[data.dataset]:
        examples = load_examples(data.dataset, split, data.src_lang, data.tgt_lang)
        start = time.time()
        hyps = corpus_translate(model, sp, [e.source for e in examples], beam=beam,
                                max_src_len=data.max_src_len, src_lang=data.src_lang)
        refs = [e.refs for e in examples]
        scores = ({"bleu": bleu(hyps, refs), "chrf": chrf(hyps, refs)} if data.task == "translate"
                  else rouge(hyps, refs))
        results[split] = {k: round(v, 2) for k, v in scores.items()}
        results[split]["sentences"] = len(examples)
        results[split]["decode_seconds"] = round(time.time() - start, 1)
    return results


def serving_section(name: str) -> list[str]:
    return [
        "## Serve",
        "`make serve` loads this checkpoint: on first start the server exports it to an ONNX model repository "
        "(fp32 + int8 graphs) in its build cache and checks that the served model reproduces the validation score "
        "below. The same repository by hand:",
        "```",
        f"python -m export --checkpoint models/{name} --out runs/{name}-onnx --quantize int8",
        "```",
    ]


def model_card(name: str, ckpt, n_params: int, metrics: dict, beam: int, commands: list[str], pieces: dict) -> str:
    data, tr = ckpt.data, ckpt.training
    m = ckpt.model
    arch = ", ".join(k for k in ("capsule", "aggregate", "gate") if getattr(m, k)) or "vanilla"
    if m.multiview:
        arch += f", multi-view {m.multiview.upper()}"
    if m.encoder == "graph":
        arch += f", Graph-Transformer encoder ({m.graph_fusion})"
    if m.pe_k != 1:
        arch += f", mvPE k={m.pe_k}"
    if m.pos_tags:
        arch += ", POS tags"
    lines = [
        f"# {name}",
        "",
        f"{data.task} {data.src_lang}→{data.tgt_lang} on {data.dataset} ({tr.get('train_pairs')} training pairs); "
        f"architecture: {arch}; {n_params / 1e6:.2f}M parameters (d_model {m.d_model}, {m.enc_layers}+{m.dec_layers} "
        f"layers, {m.vocab_size} joint SentencePiece pieces trained on the training split).",
        "",
        f"- Training: {tr.get('steps')} steps, {tr.get('wall_minutes')} minutes of training wall time on "
        f"{tr.get('args', {}).get('threads')} CPU threads (log: `train_log.jsonl`); selected checkpoint: {tr.get('selected')} "
        f"(validation {json.dumps(tr.get('best_valid'))}, greedy).",
        *([f"- Warm-started from `{parent['path']}` ({parent['steps']} steps, {parent['wall_minutes']} minutes; "
           f"weights sha256 {parent.get('weights_sha256', 'not recorded')[:12]}), which the first commands below "
           "rebuild."] if (parent := tr.get("init_from")) else []),
        "- Weights: fp16 safetensors (`model.safetensors`), `config.json`, `spm.model`.",
        f"- Target pieces: `target_pieces.json`, the {pieces['kept']} of {m.vocab_size} pieces that the training "
        "targets hold (filled up to whole blocks of 64): the int8 decoders write only those "
        "(`training.target_pieces`).",
        *([f"- Input: the server and `training.translate` bring plain text into the style of {data.dataset}'s text "
           f"before tokenising it (`training.seq2seq.inputs.{INPUT_STYLES[style].__name__}`); "
           "the outputs are in that style too."]
          if (style := input_style(data.dataset)) else []),
        "",
        "## Reproduce",
        "```",
        *commands,
        f"python -m training.ship --checkpoint {tr.get('args', {}).get('out', 'runs/NAME')} --out models/{name} "
        f"--beam {beam}",
        "```",
        "",
        *serving_section(name),
        "",
        f"## Metrics (beam {beam}, detokenised sacreBLEU / chrF or ROUGE F1; measured by `training.ship`)",
        "",
        "| split | " + " | ".join(k for k in next(iter(metrics.values())) if k != "decode_seconds") + " |",
        "|---|" + "---|" * (len(next(iter(metrics.values()))) - 1),
    ]
    for split, row in metrics.items():
        lines.append(f"| {split} | " + " | ".join(str(v) for k, v in row.items() if k != "decode_seconds") + " |")
    lines += ["", f"Measured on {platform.machine()} with torch {torch.__version__}."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, ckpt, sp = load_checkpoint(args.checkpoint)
    save_checkpoint(args.out, model, ckpt, sp.serialized_model_proto(), dtype=torch.float16)
    pieces = write_target_pieces(args.out)
    shipped, _, _ = load_checkpoint(args.out)  # measure what we ship: the fp16 weights
    metrics = evaluate(shipped, sp, ckpt, args.beam)
    if (args.checkpoint / "log.jsonl").exists():
        shutil.copy(args.checkpoint / "log.jsonl", args.out / "train_log.jsonl")
    (args.out / "metrics.json").write_text(json.dumps({"beam": args.beam, "splits": metrics}, indent=2) + "\n")
    commands = reproduction(ckpt, args.checkpoint / "log.jsonl")
    (args.out / "README.md").write_text(model_card(args.out.name, ckpt, model.num_parameters(), metrics,
                                                   args.beam, commands, pieces))
    print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()
