"""Characters a model cannot write: two ways to keep them, measured on a shipped model.

    python -m bench unknowns [--model models/multi30k-de-en] [--sample 200] [--publish]

Placeholders: a run of foreign characters is replaced by a word the model should copy. Each
candidate is put, as a word of its own, in the middle of `sample` Multi30K test sentences; a copy
is an output holding it exactly once. Removal (server.unknowns, what the server does): the model
reads the sentence without the run, which goes back in at the same relative position.
For both: BLEU of the test sentences plain, and with a foreign run put in each (taken out of the
outputs again before scoring), and the share of outputs that hold their run. Then the SPECIAL
sentences (€, emoji, CJK, accents, rare symbols): as the model reads them raw, and as served.
All decoding is the served engine's (beam 4), on the PyTorch backend."""
from __future__ import annotations

import argparse
import json
import random

from server.engine.options import DecodingOptions, Limits
from server.engine.sequence import Sequence
from server.unknowns import protect
from bench import add_publish, results_dir, torch_pipeline
from training.corpora import load_examples
from training.metrics import bleu
from training.seq2seq.inputs import EOS

CANDIDATES = ["X", "#", "@", "1"]
SPECIAL = ["Der Preis ist 5€ 😀 日本.", "Ein Mann trinkt Kaffee im Café „Zur Krone“ in Łódź.",
           "Zwei Kinder spielen mit einem Ball 🏀 am Strand.", "Eine Frau hält ein Schild mit der Aufschrift 東京.",
           "Ein Hund läuft über den Rasen ™ und bellt.", "Drei Männer zahlen £20 für ein Taxi nach Zürich.",
           "Ein Junge zeigt auf das Symbol ♥ an der Wand.", "Eine Frau namens Ångström liest ein Buch ½ Stunde lang.",
           "Ein Mädchen trägt ein T-Shirt mit → Pfeilen.", "Ein Mann sitzt vor dem Restaurant ¥ 100 🍜.",
           "Die Straße heißt Œuvre-Allee № 5.", "Ein Koch lächelt 😊 und hält einen Teller mit Sushi 寿司."]
FOREIGN = ["€", "😀", "日本", "™", "Łódź", "♥", "№", "寿司 🍜"]


def engine_outputs(pipeline, sources: list[str]) -> list[str]:
    """Best outputs for `sources` as the model reads them raw (no copy-through), beam 4."""
    options, sp = DecodingOptions(), pipeline.entry.sp
    seqs = []
    for text in sources:
        src = sp.encode(text)[: pipeline.entry.max_src_len - 1] + [EOS]
        seqs.append(Sequence(src, options, options.output_limit(len(src), 255, pipeline.limits), lambda s: None))
    pipeline.engine.submit(seqs)
    pipeline.engine.run_until_idle()
    return [sp.decode(s.hypotheses[0].tokens) for s in seqs]


def with_word(sentence: str, word: str) -> str:
    words = sentence.split()
    return " ".join(words[: len(words) // 2] + [word] + words[len(words) // 2:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench unknowns", description=__doc__)
    p.add_argument("--model", default="models/multi30k-de-en")
    p.add_argument("--sample", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    add_publish(p)
    args = p.parse_args(argv)
    pipeline = torch_pipeline(args.model, args.threads, limits=Limits(max_texts=10_000))
    examples = load_examples("multi30k", "test_2016_flickr", "de", "en")[: args.sample]
    sources, refs = [e.source for e in examples], [e.refs for e in examples]

    copied = {}
    for candidate in CANDIDATES:
        outputs = engine_outputs(pipeline, [with_word(s, candidate) for s in sources])
        copied[candidate] = round(100 * sum(o.split().count(candidate) == 1 for o in outputs) / len(outputs), 1)
        print(f"placeholder {candidate!r}: copied in {copied[candidate]}% of {len(outputs)}", flush=True)
    best = max(copied, key=copied.get)
    rng = random.Random(0)
    inserted = [rng.choice(FOREIGN) for _ in sources]
    plain = pipeline.decode(sources)
    approaches = {f"placeholder {best!r}": [o.replace(best, run, 1) for o, run in zip(
                      engine_outputs(pipeline, [with_word(s, best) for s in sources]), inserted)],
                  "removal (served)": pipeline.decode([with_word(s, run) for s, run in zip(sources, inserted)])}
    scores = {"plain": {"bleu": round(bleu(plain, refs), 2)}}
    for name, outputs in approaches.items():
        cleaned = [" ".join(o.replace(run, " ").split()) for run, o in zip(inserted, outputs)]
        kept = sum(run in o for run, o in zip(inserted, outputs))
        scores[name] = {"bleu": round(bleu(cleaned, refs), 2), "runs_kept_percent": round(100 * kept / len(sources), 1)}
        print(name, scores[name], flush=True)

    special = [{"source": s, "read_as": pipeline.entry.sp.decode(pipeline.entry.sp.encode(s)), "output": o,
                "runs": [run.text for run in protect(s, pipeline.alphabet).runs]}
               for s, o in zip(SPECIAL, pipeline.decode(SPECIAL))]
    for row in special:
        row["kept"] = all(run in row["output"] for run in row["runs"])
        print(f"{row['source']}\n  read as: {row['read_as']}\n  output:  {row['output']}  (kept: {row['kept']})")

    result = {"model": args.model, "split": "test_2016_flickr", "sample": len(sources), "placeholder_copied": copied,
              "scores": scores, "special": special,
              "test_sentences_with_foreign_characters": sum(bool(protect(s, pipeline.alphabet).runs) for s in sources)}
    out = results_dir(args.publish)
    out.mkdir(parents=True, exist_ok=True)
    (out / "unknowns.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "special"}, indent=2, ensure_ascii=False))
    return 0
