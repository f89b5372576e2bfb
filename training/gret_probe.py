"""Does a trained GRET model use its global state? Ablate s^M at inference and measure the gate.

python -m training.gret_probe --systems runs/deen-gret-full runs/deen-gret-scratch [--name NAME] [--threads 2]

For each system, on its study split (the first of training.study.TEST_SPLITS):
- the metric as trained, then with each sentence's s^M replaced by the split's mean s^M (the
  sentence-specific part removed, its average kept) and by zero (GRET's output term removed);
  Gs = W_gs s^M + b_g is recomputed from the replaced s^M;
- teacher-forced on the references: the mean gate value g and the size of GRET's output term
  relative to the decoder state it is added to, ||g * s^M|| / ||r||, per target token;
- how sentence-specific s^M is: the spread of s^M across sentences relative to its mean's norm.
The verdict: a model uses its sentence's global state when the mean replacement costs at least
USES_MARGIN with p < 0.05. The JSON goes to docs/results/NAME.json (NAME starts with gret-probe);
`python -m training.study report` renders every such file."""
from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from pathlib import Path

import torch

from kernels.context_gate import gate_values

from .corpora import load_examples
from .data import source_batches
from .decode import corpus_translate, source_tags
from .metrics import bleu, paired_bootstrap, rouge
from .seq2seq.checkpoint import load_checkpoint
from .seq2seq.inputs import BOS, PAD, align_tags, encode_source, pad
from .study import PROBE_PREFIX, RESULTS_DIR, TEST_SPLITS, bag_of_words_weight, git_commit

USES_MARGIN = 0.5  # BLEU / ROUGE-1 points the mean replacement must cost (issue 18's bar)


@contextlib.contextmanager
def replaced_global_state(model, replace):
    """Every encode() in the block uses replace(s^M) instead of the model's s^M."""
    handle = model.global_state.register_forward_hook(lambda module, inputs, s: replace(s))
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def global_states(model, src: list[list[int]], tags: list[list[int]] | None = None) -> torch.Tensor:
    """s^M of every sentence, (N, D), in input order (tags: aligned POS tags, for models that read them)."""
    out = torch.empty(len(src), model.cfg.d_model)
    for ids, src_batch, tag_batch in source_batches(src, 3000, tags):
        out[ids] = model.encode(src_batch, tag_batch).global_state
    return out


@torch.no_grad()
def gate_statistics(model, sources: list[list[int]], targets: list[list[int]],
                    tags: list[list[int]] | None = None) -> dict:
    """Teacher-forced (targets are the decoder's inputs, BOS + pieces): the mean gate value and
    ||g * s^M|| / ||r|| over the real target tokens."""
    captured = {}
    hook = model.decoder[-1].register_forward_hook(lambda m, inputs, out: captured.__setitem__("x", out))
    gates, ratios = [], []
    try:
        for start in range(0, len(sources), 64):
            tgt_in = pad(targets[start: start + 64])
            enc = model.encode(pad(sources[start: start + 64]), None if tags is None else pad(tags[start: start + 64]))
            model.decode(tgt_in, enc)
            r = model.dec_norm(captured["x"])  # the state GRET's output term is added to
            s = enc.global_state[:, None]
            if model.context_gate is not None:
                g = gate_values(r, model.context_gate.w_r.weight, enc.gate_source[:, None])
            else:  # aggregate without the gate: s^M is added as it is
                g = torch.ones_like(r)
            real = tgt_in.ne(PAD)
            gates.append(g.mean(-1)[real])
            ratios.append(((g * s).norm(dim=-1) / r.norm(dim=-1))[real])
    finally:
        hook.remove()
    gates, ratios = torch.cat(gates), torch.cat(ratios)
    return {"tokens": gates.numel(), "gate_mean": round(gates.mean().item(), 4),
            "output_term_ratio_mean": round(ratios.mean().item(), 4),
            "output_term_ratio_median": round(ratios.median().item(), 4)}


def probe(path: Path, beam: int, samples: int) -> dict:
    model, ckpt, sp = load_checkpoint(path)
    if model.global_state is None:
        raise SystemExit(f"{path} is not a GRET model with a global state (capsule or aggregate)")
    data = ckpt.data
    split = TEST_SPLITS[data.dataset][0]
    examples = load_examples(data.dataset, split, data.src_lang, data.tgt_lang)
    sources, refs = [e.source for e in examples], [e.refs for e in examples]
    metric = "bleu" if data.task == "translate" else "rouge1"
    score = (lambda hyps: bleu(hyps, refs)) if metric == "bleu" else (lambda hyps: rouge(hyps, refs)[metric])

    src = [encode_source(sp, t, data.max_src_len) for t in sources]
    tags = source_tags(model, sp, sources, data.src_lang)  # tagged once, read by every pass
    aligned = None if tags is None else align_tags(tags, src)
    states = global_states(model, src, aligned)
    mean = states.mean(0)
    spread = (states - mean).norm(dim=-1).mean().item() / mean.norm().item()

    def translate():
        return corpus_translate(model, sp, sources, beam=beam, max_src_len=data.max_src_len, tags=tags,
                                src_lang=data.src_lang)

    trained = translate()
    ablations = {}
    for name, replace in (("mean", lambda s: mean.expand_as(s)), ("zero", torch.zeros_like)):
        with replaced_global_state(model, replace):
            hyps = translate()
        # p: the share of resamples in which the model with its own s^M does not beat the ablation
        ablations[name] = {metric: score(hyps), "vs_trained": paired_bootstrap(hyps, trained, refs, metric,
                                                                                 samples=samples)}
    mean_cost = ablations["mean"]["vs_trained"]
    uses = mean_cost["delta"] >= USES_MARGIN and mean_cost["p_value"] < 0.05
    return {"name": path.name, "dataset": data.dataset, "uses_global_state": uses, "direction": f"{data.src_lang}-{data.tgt_lang}",
            "split": split, "metric": metric,
            "modules": [m for m in ("capsule", "aggregate", "gate", "global_norm", "routing_scale")
                        if getattr(ckpt.model, m)] + (["bow"] if bag_of_words_weight(ckpt) else [])
                       + (["global_dropout"] if ckpt.model.global_dropout else []),
            "trained": {metric: score(trained)}, "ablations": ablations,
            "global_state_spread": round(spread, 4),
            "gate": gate_statistics(model, src, [[BOS] + sp.encode(e.target)[: data.max_tgt_len - 2]
                                                 for e in examples], aligned)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", nargs="+", type=Path, required=True)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--name", default=PROBE_PREFIX, help=f"the JSON's name in docs/results (starts with {PROBE_PREFIX})")
    args = p.parse_args(argv)
    if not args.name.startswith(PROBE_PREFIX):
        p.error(f"--name must start with {PROBE_PREFIX}")
    torch.set_num_threads(args.threads)
    payload = {"command": "python -m training.gret_probe " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
               "beam": args.beam, "threads": args.threads, "commit": git_commit(),
               "systems": [probe(path, args.beam, args.samples) for path in args.systems]}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{args.name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(path)


if __name__ == "__main__":
    main()
