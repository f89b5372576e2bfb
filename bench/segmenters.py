"""Which sentence segmenter serves documents best: split accuracy and speed on real text.

    python -m bench segmenters [--split test_2016_flickr] [--publish]

Multi30K captions are joined into paragraphs of 1 to 6 sentences (one space between them) and
paragraphs into documents (a blank line between them), so the true sentence boundaries are known.
Each segmenter's boundaries (the character offsets where a sentence starts) are scored against
them: precision, recall, F1, and the share of documents split exactly right; speed is characters
per second on one core. About 5% of the captions end without a full stop, a boundary no segmenter
can see; the `punctuated` rows add one, to compare the segmenters on the boundaries they can see."""
from __future__ import annotations

import argparse
import json
import random
import time

from bench import add_publish, results_dir
from training.corpora import load_examples

LANGUAGES = ("de", "en", "fr")


def pysbd_starts(lang: str):
    import pysbd

    segmenter = pysbd.Segmenter(language=lang, clean=False, char_span=True)
    return lambda text: [span.start for span in segmenter.segment(text)]


def sentencex_starts(lang: str):
    import sentencex

    return lambda text: [b["start_index"] for b in sentencex.get_sentence_boundaries(lang, text)]


def syntok_starts(lang: str):
    from syntok import segmenter

    return lambda text: [sentence[0].offset for paragraph in segmenter.analyze(text) for sentence in paragraph]


def blingfire_starts(lang: str):
    import blingfire

    return lambda text: [start for start, _ in blingfire.text_to_sentences_and_offsets(text)[1]]


def served_starts(lang: str):
    """What the server splits on: sentencex, line by line, with digit starts (server.documents)."""
    from server.documents import sentence_spans

    return lambda text: [start for start, _ in sentence_spans(text, lang)]


SEGMENTERS = {"pysbd": pysbd_starts, "sentencex": sentencex_starts, "syntok": syntok_starts,
              "blingfire": blingfire_starts, "served": served_starts}


def documents(sentences: list[str], seed: int = 0) -> list[tuple[str, set[int]]]:
    """Paragraphs of 1..6 captions, four paragraphs a document; each with its true sentence starts."""
    rng, docs, i = random.Random(seed), [], 0
    while i < len(sentences):
        text, starts = "", set()
        for p in range(4):
            if p:
                text += "\n\n"
            n = rng.randint(1, 6)
            for k, sentence in enumerate(sentences[i: i + n]):
                text += " " if k else ""
                starts.add(len(text))
                text += sentence
            i += n
        docs.append((text, starts))
    return docs


def first_letter(text: str, start: int) -> int:
    while start < len(text) and text[start].isspace():
        start += 1
    return start


def score(starts_of, docs) -> dict:
    hits = predicted = true = exact = 0
    begin = time.perf_counter()
    found = [set(starts_of(text)) for text, _ in docs]
    seconds = time.perf_counter() - begin
    for (text, truth), got in zip(docs, found):
        got = {first_letter(text, s) for s in got} - {len(text)}  # a segment may start with the space before it
        hits, predicted, true = hits + len(got & truth), predicted + len(got), true + len(truth)
        exact += got == truth
    precision, recall = hits / predicted, hits / true
    return {"precision": round(100 * precision, 1), "recall": round(100 * recall, 1),
            "f1": round(200 * precision * recall / (precision + recall), 1),
            "documents_exact": round(100 * exact / len(docs), 1),
            "chars_per_second": round(sum(len(t) for t, _ in docs) / seconds)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench segmenters", description=__doc__)
    p.add_argument("--split", default="test_2016_flickr")
    add_publish(p)
    args = p.parse_args(argv)
    results = {}
    for lang in LANGUAGES:
        other = "en" if lang != "en" else "de"
        raw = [e.source.strip() for e in load_examples("multi30k", args.split, lang, other)]
        punctuated = [s if s[-1] in ".!?" else s + "." for s in raw]
        for variant, sentences in (("raw", raw), ("punctuated", punctuated)):
            docs = documents(sentences)
            for name, make in SEGMENTERS.items():
                results.setdefault(f"{name} ({variant})", {})[lang] = score(make(lang), docs)
    out = results_dir(args.publish)
    out.mkdir(parents=True, exist_ok=True)
    (out / "segmenters.json").write_text(json.dumps({"split": args.split, "results": results}, indent=2) + "\n")
    print("| segmenter | " + " | ".join(f"{lang} F1 | {lang} exact" for lang in LANGUAGES) + " | chars/s (de) |")
    print("|---" * (2 * len(LANGUAGES) + 2) + "|")
    for name, by_lang in results.items():
        cells = " | ".join(f"{by_lang[lang]['f1']} | {by_lang[lang]['documents_exact']}%" for lang in LANGUAGES)
        print(f"| {name} | {cells} | {by_lang['de']['chars_per_second']:,} |")
    return 0
