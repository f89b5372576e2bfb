"""The ablation study: evaluate systems against a control in one run, then render docs/RESULTS.md.

python -m training.study evaluate --name translation --control runs/A --systems runs/B runs/C
python -m training.study report            # every docs/results/*.json -> docs/RESULTS.md

All systems are decoded in the same process with the same settings (beam, threads), and
significance is a paired bootstrap against the control on the same sentences. The speed column
is measured apart, in rounds in which the systems take turns on the same sentences (a change of
machine load during one system's long decode would otherwise show as a speed difference)."""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from .corpora import PROJECT_ROOT, load_examples
from .decode import corpus_translate
from .metrics import bleu, chrf, paired_bootstrap, rouge
from .seq2seq.checkpoint import load_checkpoint

RESULTS_DIR = PROJECT_ROOT / "docs" / "results"
TARGET_DELTA = 1.0  # the seed papers' claim to check: at least +1 BLEU/ROUGE over the control
PROBE_PREFIX = "gret-probe"  # training.gret_probe writes docs/results/gret-probe*.json
TEST_SPLITS = {"multi30k": ("test_2016_flickr", "test_2017_flickr"), "gigaword": ("valid",), "aeslc": ("dev",)}


def dataset_of(path: Path) -> str:
    return json.loads((path / "config.json").read_text())["data"]["dataset"]


def describe(cfg) -> dict:
    return {"capsule": cfg.capsule, "aggregate": cfg.aggregate, "gate": cfg.gate, "global_norm": cfg.global_norm,
            "routing_scale": cfg.routing_scale, "global_dropout": cfg.global_dropout, "multiview": cfg.multiview,
            "pe_k": cfg.pe_k, "pos_tags": cfg.pos_tags, "encoder": cfg.encoder,
            "graph": f"{cfg.graph_fusion}{'+half' if cfg.graph_half_dim else ''}" if cfg.encoder == "graph" else None}


def bag_of_words_weight(ckpt) -> float:
    """The training's --global-bow weight (0: the model was trained without the bag-of-words loss)."""
    return ckpt.training.get("args", {}).get("global_bow") or 0.0


def decode_system(path: Path, splits: tuple[str, ...], beam: int) -> dict:
    model, ckpt, sp = load_checkpoint(path)
    data = ckpt.data
    out = {"name": path.name, "checkpoint": str(path), "parameters": model.num_parameters(),
           "arch": describe(ckpt.model) | {"global_bow": bag_of_words_weight(ckpt)},
           "steps": ckpt.training.get("steps"),
           "init_from": ckpt.training.get("init_from"), "splits": {}, "hyps": {}}
    for split in splits:
        examples = load_examples(data.dataset, split, data.src_lang, data.tgt_lang)
        start = time.perf_counter()
        hyps = corpus_translate(model, sp, [e.source for e in examples], beam=beam,
                                max_src_len=data.max_src_len, src_lang=data.src_lang)
        seconds = time.perf_counter() - start
        out["hyps"][split] = hyps
        out["splits"][split] = {"decode_seconds": round(seconds, 2),
                                "sentences_per_s": round(len(examples) / seconds, 2)}
    return out, data


SPEED_SENTENCES, SPEED_ROUNDS = 200, 3


def speed_rounds(paths: list[Path], split: str, beam: int) -> list[dict]:
    """sentences/s of each system on the first SPEED_SENTENCES of `split`, per round; the systems
    take turns (the order rotates every round), so all of them see the same machine load."""
    loaded = [load_checkpoint(p) for p in paths]
    data = loaded[0][1].data
    sources = [e.source for e in load_examples(data.dataset, split, data.src_lang, data.tgt_lang)[:SPEED_SENTENCES]]
    speeds = [[] for _ in paths]
    for r in range(SPEED_ROUNDS):
        order = list(range(len(paths)))
        order = order[r % len(order):] + order[: r % len(order)]
        for i in order:
            model, ckpt, sp = loaded[i]
            start = time.perf_counter()
            corpus_translate(model, sp, sources, beam=beam, max_src_len=ckpt.data.max_src_len, src_lang=ckpt.data.src_lang)
            speeds[i].append(round(len(sources) / (time.perf_counter() - start), 2))
    return [{"split": split, "sentences": len(sources), "sentences_per_s_by_round": s} for s in speeds]


def evaluate(name: str, control: Path, systems: list[Path], beam: int, threads: int, samples: int,
             command: str) -> Path:
    torch.set_num_threads(threads)
    results, data = [], None
    for path in [control] + systems:
        result, data = decode_system(path, TEST_SPLITS[dataset_of(path)], beam)
        results.append(result)
    speeds = speed_rounds([control] + systems, TEST_SPLITS[data.dataset][0], beam)
    for r, speed in zip(results, speeds):  # the median round-by-round ratio to the control
        ratios = [mine / theirs for mine, theirs in zip(speed["sentences_per_s_by_round"],
                                                         speeds[0]["sentences_per_s_by_round"])]
        r["speed"] = speed | {"vs_control": round(statistics.median(ratios), 3)}
    translate = data.task == "translate"
    metric_names = ("bleu", "chrf") if translate else ("rouge1", "rouge2", "rougeL")
    base = results[0]
    for split in TEST_SPLITS[data.dataset]:
        examples = load_examples(data.dataset, split, data.src_lang, data.tgt_lang)
        refs = [e.refs for e in examples]
        for r in results:
            row = r["splits"][split]
            hyps = r["hyps"][split]
            row.update({"bleu": bleu(hyps, refs), "chrf": chrf(hyps, refs)} if translate else rouge(hyps, refs))
            if r is not base:
                row["significance"] = {m: paired_bootstrap(base["hyps"][split], hyps, refs, m, samples=samples)
                                       for m in metric_names}
    for r in results:
        r.pop("hyps")
    payload = {"name": name, "command": command, "task": data.task, "dataset": data.dataset, "direction": f"{data.src_lang}-{data.tgt_lang}",
               "settings": {"beam": beam, "threads": threads, "bootstrap_samples": samples, "commit": git_commit(),
                            "torch": torch.__version__, "machine": platform.machine()},
               "control": results[0]["name"], "systems": results}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def git_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=PROJECT_ROOT).stdout.strip()


def steps_text(system: dict) -> str:
    """'parent steps + own steps' for warm-started systems."""
    parent = (system.get("init_from") or {}).get("steps")
    return f"{parent}+{system['steps']}" if parent else str(system["steps"])


def _mark(flag) -> str:
    return "✓" if flag else ""


def render(payload: dict) -> list[str]:
    translate = payload["task"] == "translate"
    splits = list(payload["systems"][0]["splits"])
    metrics = ("bleu", "chrf") if translate else ("rouge1", "rouge2", "rougeL")
    head = ["system", "capsule", "aggregate", "gate", "other", "params", "steps"]
    for split in splits:
        head += [f"{m} {split}" for m in metrics] + [f"Δ{metrics[0]} (p)"]
    head += ["speed ×"]
    probe = payload["systems"][0].get("speed")
    speed_text = (f"Speed: sentences/s relative to the control, the median over {len(probe['sentences_per_s_by_round'])} "
                  f"rounds in which the systems take turns on the first {probe['sentences']} sentences of "
                  f"`{probe['split']}`." if probe else
                  f"Speed: sentences/s relative to the control, decoded in the same run on `{splits[0]}`.")
    lines = [f"## {payload['name']} — {payload['dataset']} {payload['direction']}", "",
             f"Control: `{payload['control']}`. Beam {payload['settings']['beam']}, "
             f"{payload['settings']['threads']} threads, commit {payload['settings']['commit']}; Δ and p from a "
             f"paired bootstrap ({payload['settings']['bootstrap_samples']} samples, one-sided: p = share of samples "
             f"where the system does not beat the control). {speed_text} Command: `{payload['command']}`", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in payload["systems"]:
        a = s["arch"]
        other = ", ".join(x for x in (
            f"multi-view {a['multiview']}" if a["multiview"] else "", f"mvPE k={a['pe_k']}" if a["pe_k"] != 1 else "",
            "POS" if a["pos_tags"] else "", f"graph {a['graph']}" if a["graph"] else "",
            "s^M LayerNorm" if a.get("global_norm") else "", "routing ÷√D" if a.get("routing_scale") else "",
            f"bag-of-words {a['global_bow']}" if a.get("global_bow") else "",
            f"s^M dropout {a['global_dropout']}" if a.get("global_dropout") else "") if x)
        row = [f"`{s['name']}`", _mark(a["capsule"]), _mark(a["aggregate"]), _mark(a["gate"]), other,
               f"{s['parameters'] / 1e6:.2f}M", steps_text(s)]
        for split in splits:
            r = s["splits"][split]
            row += [f"{r[m]:.2f}" for m in metrics]
            sig = r.get("significance", {}).get(metrics[0])
            row.append(f"{sig['delta']:+.2f} ({sig['p_value']:.3f})" if sig else "—")
        speed = s["speed"]["vs_control"] if "speed" in s else s["splits"][splits[0]]["speed_vs_control"]
        row.append(f"{speed:.2f}")
        lines.append("| " + " | ".join(row) + " |")
    return lines + [x for line in (target_line(payload, metrics[0]), *seed_lines(payload, metrics[0])) for x in ("", line)] + [""]


def judged(payload: dict, metric: str) -> list[tuple[bool, float, float, str, str]]:
    """(meets the target, Δ, p, system, split) on the first split for every system that changes the
    control's recipe. The target: Δ ≥ TARGET_DELTA with p < 0.05 on the first split (test_2016_flickr
    for Multi30K) and no loss on the others. A re-run of the control's recipe with another seed is
    not a system: seed_lines shows it as the yardstick."""
    out, reference = [], control(payload)
    for s in payload["systems"]:
        sig = {split: r["significance"][metric] for split, r in s["splits"].items() if "significance" in r}
        if not sig or same_recipe(s, reference):
            continue
        first, *others = sig
        meets = (sig[first]["delta"] >= TARGET_DELTA and sig[first]["p_value"] < 0.05
                 and all(sig[o]["delta"] >= 0 for o in others))
        out.append((meets, sig[first]["delta"], sig[first]["p_value"], s["name"], first))
    return out


def target_line(payload: dict, metric: str) -> str:
    """The study's target, checked from the same JSON (judged)."""
    results = judged(payload, metric)
    if not results:
        return ""
    meets, delta, p, name, split = max(results)
    verdict = "met" if meets else "**not met** by any system"
    return (f"Target (Δ{metric} ≥ +{TARGET_DELTA:.1f} with p < 0.05 against the control on {split}, and no loss on "
            f"the other splits): {verdict}; largest Δ on {split} {delta:+.2f} (`{name}`, p {p:.3f}).")


def control(payload: dict) -> dict | None:
    return next((s for s in payload["systems"] if s["name"] == payload["control"]), None)


def same_recipe(system: dict, control: dict | None) -> bool:
    """The control's architecture and steps: a re-run of it (another seed), not a variant."""
    return control is not None and system["arch"] == control["arch"] and system["steps"] == control["steps"]


def seed_lines(payload: dict, metric: str) -> list[str]:
    """What a second seed of the control's own recipe gives: the spread that training noise alone
    makes, which the bootstrap's p (test sentences resampled, the models fixed) does not count."""
    lines, reference = [], control(payload)
    for s in payload["systems"]:
        if s["name"] == payload["control"] or not same_recipe(s, reference):
            continue
        cells = [f"{split} {r['significance'][metric]['delta']:+.2f} (p {r['significance'][metric]['p_value']:.3f})"
                 for split, r in s["splits"].items() if "significance" in r]
        lines.append(f"Seed: `{s['name']}` is the control's own recipe with another seed: Δ{metric} "
                     f"{'; '.join(cells)}. A difference of that size is training noise, which the bootstrap's p "
                     f"(test sentences resampled, the models fixed) does not count.")
    return lines


GRET_MODULES = ("capsule", "aggregate", "gate")


def gret_modules(system: dict) -> list[str]:
    return [m for m in GRET_MODULES if system["arch"][m]]


def gret_account(payloads: list[dict], probes: dict[str, dict] | None = None) -> list[str]:
    """Every GRET system of every study against its target, in one table: what was tried. The target has
    two parts: +1.0 over the control (judged) from a system that reads its sentence's global state, by
    the probe's verdict (`probes`: training.gret_probe's entry per system name). A gain that the mean
    s^M gives as well is a learned output bias at work, not the sentence's global state."""
    probes = probes or {}
    rows, best = [], []
    for payload in payloads:
        metric = "bleu" if payload["task"] == "translate" else "rouge1"
        gret = {s["name"] for s in payload["systems"] if gret_modules(s)}
        best += [b for b in judged(payload, metric) if b[3] in gret]
        for s in payload["systems"]:
            modules = gret_modules(s)
            if not modules or s["name"] == payload["control"]:
                continue
            how = (f"continued from the {s['init_from']['steps']}-step baseline" if s.get("init_from")
                   else "from scratch") + f"; the checkpoint of step {s['steps']}"
            cells = []
            for split, r in s["splits"].items():
                sig = r["significance"][metric]
                cells.append(f"{split} {sig['delta']:+.2f} (p {sig['p_value']:.3f})")
            rows.append(f"| {payload['dataset']} {payload['direction']} | `{s['name']}` | {' + '.join(modules)} | "
                        f"{how} | `{payload['control']}` | Δ{metric}: {'; '.join(cells)} | "
                        f"{reads_text(probes.get(s['name']))} |")
    if not rows:
        return []
    return ["## GRET against its target", "",
            f"The target: GRET at least +{TARGET_DELTA:.1f} over the control with p < 0.05 on the first test split "
            "(test_2016_flickr for Multi30K), and no loss on the others, from a system that reads its sentence's "
            "global state (the probe below: the mean s^M in place of the sentence's own costs score with p < 0.05). "
            "Every GRET system of the sections above, in one table:", "",
            "| task | system | modules | trained | control | Δ against the control (one-sided p) | reads s^M "
            "(probe: the mean s^M costs, p) |",
            "|---|---|---|---|---|---|---|", *rows, "",
            gret_verdict(best, probes), "",
            "What was varied, and what was not: each module alone and together (the ablations); continued learning, "
            "where the modules start untrained on a converged baseline and the control gets the same extra steps, "
            "and training from scratch, where GRET learns with the model from the first step (the paper's setting) "
            "for the control's total steps; translation and both summarisation sets, where the paper reports its "
            "largest gains. Not varied: the data and model scale. The paper trained Transformer base and big models "
            "on WMT news with millions of sentence pairs; here the `small` preset trains on Multi30K's short image "
            "captions and on ten thousand Gigaword pairs, on two CPU cores.", ""]


def gret_verdict(best: list[tuple], probes: dict[str, dict]) -> str:
    """Met only by a system that gains enough and reads s^M; else why not, naming the best gain."""
    gains = sorted((b for b in best if b[0]), key=lambda b: -b[1])
    reading = [b for b in gains if (probes.get(b[3]) or {}).get("uses_global_state")]
    if reading:
        _, delta, p, name, split = reading[0]
        return f"Met: `{name}` gains {delta:+.2f} on {split} (p {p:.3f}) and reads s^M ({reads_text(probes[name])})."
    if gains:
        _, delta, p, name, split = gains[0]
        return (f"**Not met**: `{name}` gains {delta:+.2f} on {split} (p {p:.3f}), but "
                + (f"the probe finds it does not read its sentence's s^M (the mean s^M costs {mean_cost(probes[name])})"
                   if name in probes else "the probe has not judged it") + "; no system that reads s^M gains enough.")
    _, delta, p, name, split = max(best)
    return f"**Not met**: the largest Δ on {split} is {delta:+.2f} (`{name}`, p {p:.3f})."


def reads_text(probe: dict | None) -> str:
    """A system's probe verdict with the mean replacement's cost, or that it was not probed."""
    return "not probed" if probe is None else f"{uses_text(probe)}: {mean_cost(probe)}"


def mean_cost(probe: dict) -> str:
    """What the mean s^M in place of each sentence's own costs, with its p."""
    mean = probe["ablations"]["mean"]["vs_trained"]
    return f"{mean['delta']:+.2f}, p {mean['p_value']:.3f}"


def gret_probe_lines(payload: dict) -> list[str]:
    """training.gret_probe's JSON: does each GRET model use its sentence's global state?"""
    lines = ["### Does GRET use its global state?", "",
             "Each GRET model decoded again with each sentence's s^M replaced by the split's mean s^M (the "
             "sentence-specific part removed) and by zero (GRET's output term removed); Gs is recomputed from the "
             "replaced s^M. p: the share of bootstrap resamples in which the model with its own s^M does not beat "
             "the ablation. Gate and output term: teacher-forced on the references, per target token; the output "
             "term is ||g·s^M|| / ||r||, its size relative to the decoder state r it is added to. Spread: the mean "
             "distance of a sentence's s^M from the mean s^M, relative to the mean's norm. "
             f"Beam {payload['beam']}, {payload['threads']} threads, commit {payload['commit']}. "
             f"Command: `{payload['command']}`", "",
             "| system | task | as trained | s^M = mean: score (Δ, p) | s^M = 0: score (Δ, p) | mean gate | "
             "output term, mean / median | spread of s^M | uses s^M |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in payload["systems"]:
        m, gate = s["metric"], s["gate"]
        ablated = [f"{a[m]:.2f} ({-a['vs_trained']['delta']:+.2f}, {a['vs_trained']['p_value']:.3f})"
                   for a in (s["ablations"]["mean"], s["ablations"]["zero"])]
        lines.append(f"| `{s['name']}` ({' + '.join(s['modules'])}) | {s['dataset']} {s['direction']}, {s['split']} "
                     f"| {m} {s['trained'][m]:.2f} | {ablated[0]} | {ablated[1]} | {gate['gate_mean']:.3f} | "
                     f"{gate['output_term_ratio_mean']:.3f} / {gate['output_term_ratio_median']:.3f} | "
                     f"{s['global_state_spread']:.3f} | {uses_text(s)} |")
    mean = [(abs(s["ablations"]["mean"]["vs_trained"]["delta"]), s["ablations"]["mean"]["vs_trained"]["p_value"])
            for s in payload["systems"]]
    zero = max(payload["systems"], key=lambda s: s["ablations"]["zero"]["vs_trained"]["delta"])
    return lines + ["", f"Replacing each sentence's s^M by the mean s^M changes the score by at most "
                        f"{max(d for d, _ in mean):.2f} in any system (smallest p {min(p for _, p in mean):.3f}); "
                        f"setting s^M to zero costs up to {zero['ablations']['zero']['vs_trained']['delta']:.2f} "
                        f"(`{zero['name']}`).", ""]


def uses_text(system: dict) -> str:
    """The probe's verdict; files written before the verdict existed have none."""
    uses = system.get("uses_global_state")
    return "—" if uses is None else ("**yes**" if uses else "no")


def report() -> Path:
    lines = ["# Results", "",
             "Generated by `python -m training.study report` from `docs/results/*.json`; each JSON was written by "
             "`python -m training.study evaluate`, the GRET probe's by `python -m training.gret_probe` (each section "
             "names its command). No number here is typed by hand.",
             "",
             "How the systems were trained: `training/runs.sh` (one baseline per task; every variant continues it for "
             "the same extra steps as a control that continues the unchanged baseline, so a gain cannot come from "
             "more training). Variants that change the embeddings or the encoder (mvPE, POS tags, Graph-Transformer), "
             "and GRET as its paper trains it, train from scratch for the control's total steps instead, against a "
             "vanilla model trained from scratch the same way (`translation-scratch-2650`). The speed column is "
             "PyTorch decoding on a shared machine, a rough guide; serving speed is measured by the engine benchmark "
             "(`docs/BENCHMARKS.md`).",
             ""]
    payloads = [json.loads(path.read_text()) for path in sorted(RESULTS_DIR.glob("*.json"))]
    payloads = [p for p in payloads if "control" in p]  # other tools keep their results here too (export.quality)
    for payload in payloads:
        lines += render(payload)
    probes = [json.loads(path.read_text()) for path in sorted(RESULTS_DIR.glob(f"{PROBE_PREFIX}*.json"))]
    lines += gret_account(payloads, {s["name"]: s for probe in probes for s in probe["systems"]})
    for probe in probes:
        lines += gret_probe_lines(probe)
    out = PROJECT_ROOT / "docs" / "RESULTS.md"
    out.write_text("\n".join(lines))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    ev = sub.add_parser("evaluate")
    ev.add_argument("--name", required=True)
    ev.add_argument("--control", required=True, type=Path)
    ev.add_argument("--systems", nargs="+", type=Path, required=True)
    ev.add_argument("--beam", type=int, default=4)
    ev.add_argument("--threads", type=int, default=2)
    ev.add_argument("--samples", type=int, default=1000)
    sub.add_parser("report")
    args = p.parse_args(argv)
    if args.command == "evaluate":
        command = "python -m training.study " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
        print(evaluate(args.name, args.control, args.systems, args.beam, args.threads, args.samples, command))
    print(report())


if __name__ == "__main__":
    main()
