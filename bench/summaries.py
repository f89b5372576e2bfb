"""Summarising inputs longer than the model's window: which way reads them best, measured.

    python -m bench summaries [--model models/gigaword-headlines] [--sample 0] [--publish]

The served summariser reads at most max_src_len - 1 pieces. Real long inputs are AESLC's e-mails
(dev split: bodies of up to thousands of words, a subject line and three annotators' subjects as
references); Gigaword's validation articles are single lead sentences, and the script counts how
many of them are over the window (none: it is what the model was trained on). Every dev e-mail
over the window (in the model's input style: training.data.normalize_input) is summarised five
ways, beam 4:
  window         the first max_src_len - 1 pieces (what Summarize did before: cut, `truncated` set;
                 Pipeline.documents with truncate=True)
  sentences      the leading whole sentences that fit (server.documents: lines, then sentences)
  first          the first sentence alone (what a Gigaword model was trained to read; what Summarize
                 does since, Pipeline.documents by default)
  chunks-best    all of it, in window-sized chunks of whole sentences, each summarised; the summary
                 with the best score (log P / length) is the answer
  chunks-resummarised   the chunks' summaries joined and summarised again
ROUGE-1/2/L F1 (training.metrics.rouge, the best of the four references per e-mail; the references
put in the model's style first, as its outputs are), each strategy's ROUGE-1 against `window` by
paired bootstrap (1000 samples: p = share in which it does not beat `window`), and decoder
sequences per e-mail (the cost).
"""
from __future__ import annotations

import argparse
import json

from bench import add_publish, results_dir, torch_pipeline
from server.documents import segment
from server.engine.options import DecodingOptions, Limits
from server.engine.sequence import OK
from training.corpora import load_examples
from training.seq2seq.inputs import normalize_input
from training.metrics import paired_bootstrap, rouge


def summarise(pipeline, texts: list[str]) -> list[tuple[str, float]]:
    """(best summary, its score) per text, each read whole (cut to the window where longer)."""
    docs = pipeline.documents(texts, DecodingOptions(beam=4), lambda s: None, None, split=False, truncate=True)
    seqs = [s for d in docs for s in d.sequences]
    pipeline.engine.submit(seqs)
    pipeline.engine.run_until_idle()
    assert all(s.status == OK for s in seqs)
    return [(o.text, o.score) for o in (pipeline.outputs(d)[0] for d in docs)]


def chunks(text: str, fits) -> list[str]:
    """The text's sentences (server.documents) packed greedily, in order, into chunks that fit."""
    layout = segment(text, "en", fits)
    out, current = [], ""
    for gap, sentence in zip(layout.gaps, layout.segments):
        joined = f"{current}{gap}{sentence}" if current else sentence
        if current and not fits(joined):
            out.append(current)
            joined = sentence
        current = joined
    return out + [current] if current else out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench summaries", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/gigaword-headlines")
    p.add_argument("--sample", type=int, default=0, help="the first N long e-mails only (0: all)")
    p.add_argument("--threads", type=int, default=2)
    add_publish(p)
    args = p.parse_args(argv)
    pipeline = torch_pipeline(args.model, args.threads, max_queue=1 << 20,
                              limits=Limits(max_texts=100_000, max_text_chars=1 << 24))
    entry = pipeline.entry
    fits = pipeline._fits
    window = entry.max_src_len - 1
    gigaword = load_examples("gigaword", "valid")
    dev = load_examples("aeslc", "dev")
    over = [e for e in dev if not fits(e.source)]
    long = over[: args.sample] if args.sample else over
    texts = [e.source for e in long]
    refs = [[normalize_input(entry.input_style, r) for r in e.refs] for e in long]
    result = {"model": args.model, "window_pieces": window, "split": "aeslc dev", "emails": len(dev),
              "emails_over_window": len(over), "measured": len(long),
              "gigaword_valid_articles_over_window": sum(not fits(e.source) for e in gigaword),
              "strategies": {}}
    print(f"{len(over)} of {len(dev)} AESLC dev e-mails are over the {window}-piece window (measured: the first "
          f"{len(long)}); {result['gigaword_valid_articles_over_window']} of {len(gigaword)} Gigaword validation "
          f"articles", flush=True)

    split = [chunks(t, fits) for t in texts]
    firsts = [segment(t, "en", fits).segments[0] for t in texts]
    per_chunk = summarise(pipeline, [c for cs in split for c in cs])
    best, joined, at = [], [], 0
    for cs in split:
        mine = per_chunk[at: at + len(cs)]
        at += len(cs)
        best.append(max(mine, key=lambda m: m[1])[0])
        joined.append(" . ".join(text for text, _ in mine))
    outputs = {
        "window": ([o for o, _ in summarise(pipeline, texts)], 1.0),
        "sentences": ([o for o, _ in summarise(pipeline, [cs[0] for cs in split])], 1.0),
        "first": ([o for o, _ in summarise(pipeline, firsts)], 1.0),
        "chunks-best": (best, sum(map(len, split)) / len(split)),
        "chunks-resummarised": ([o for o, _ in summarise(pipeline, joined)], sum(map(len, split)) / len(split) + 1),
    }
    for name, (hyps, cost) in outputs.items():
        scores = {k: round(v, 2) for k, v in rouge(hyps, refs).items()}
        against = paired_bootstrap(outputs["window"][0], hyps, refs, "rouge1") if name != "window" else None
        result["strategies"][name] = {**scores, "sequences_per_email": round(cost, 2),
                                      "rouge1_vs_window": against and {"delta": round(against["delta"], 2),
                                                                       "p": round(against["p_value"], 3)}}
        print(name, result["strategies"][name], flush=True)
    result["examples"] = [{"email": t[:400], "subject": e.refs[0], **{n: o[0][i] for n, o in outputs.items()}}
                          for i, (t, e) in enumerate(zip(texts[:3], long[:3]))]
    out = results_dir(args.publish)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summaries.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "examples"}, indent=2))
    return 0
