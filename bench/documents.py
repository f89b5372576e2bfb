"""Document mode measured: BLEU of whole documents against their sentences translated one by one,
and the special characters and HTML markup that come back.

    python -m bench documents [--model models/multi30k-de-en] [--sample 150] [--publish]

The first `sample` Multi30K test_2016 captions are joined into paragraphs of 1 to 6 sentences and
those into documents of 4 paragraphs (bench.segmenters.documents). Four sets: plain; punctuated
(a full stop added to the captions that lack one, so that every boundary can be seen); with a run
of special characters (€, emoji, CJK, accents, symbols) in every sentence; plain wrapped in HTML
(paragraphs in <p>, a word of each sentence in <b> or <a href>, &amp; and a comment between
sentences). Each document is translated whole (served document mode, beam 4) and, as the
baseline, each caption alone (the segments that are not one caption are listed: the segmenter's
misses); BLEU is per document (the captions' references joined), the same
for both (the special runs taken out of the outputs first). Preserved: the share of special runs
found in the output, and of documents whose markup (tags with attributes, entities, comments, in
order) is identical."""
from __future__ import annotations

import argparse
import json
import random
from collections import Counter

from bench.segmenters import documents
from bench.unknowns import FOREIGN, with_word
from server.engine.options import Limits
from server.documents import segment
from server.markup import markup_of
from bench import add_publish, results_dir, torch_pipeline
from training.corpora import load_examples
from training.metrics import bleu


def as_html(paragraphs: list[list[str]], rng: random.Random) -> str:
    def marked(sentence: str) -> str:
        words = sentence.split()
        k = rng.randrange(len(words))
        words[k] = rng.choice(["<b>{}</b>", '<a href="/s?q=1&amp;r=2">{}</a>']).format(words[k])
        return " ".join(words)

    between = [" ", " &amp; ", " <!-- n --> "]
    return "<html><body>\n" + "\n".join(
        "<p>" + "".join(marked(s) + (rng.choice(between) if i < len(p) - 1 else "") for i, s in enumerate(p)) + "</p>"
        for p in paragraphs) + "\n</body></html>\n"


def _without(output: str, runs: list[str]) -> str:
    """The output with the special runs taken out again: BLEU then scores the translation itself."""
    for run in runs:
        output = output.replace(run, " ", 1)
    return output


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench documents", description=__doc__)
    p.add_argument("--model", default="models/multi30k-de-en")
    p.add_argument("--sample", type=int, default=150)
    p.add_argument("--threads", type=int, default=2)
    add_publish(p)
    args = p.parse_args(argv)
    pipeline = torch_pipeline(args.model, args.threads, limits=Limits(max_texts=10_000, max_text_chars=1 << 20))
    examples = load_examples("multi30k", "test_2016_flickr", "de", "en")[: args.sample]
    rng = random.Random(0)
    plain = [e.source.strip() for e in examples]
    runs = [rng.choice(FOREIGN) for _ in plain]
    special = [with_word(s, run) for s, run in zip(plain, runs)]
    punctuated = [s if s[-1] in ".!?" else s + "." for s in plain]
    docs = {name: [text for text, _ in documents(sentences)]
            for name, sentences in (("plain", plain), ("punctuated", punctuated), ("special", special))}
    sizes = [len(starts) for _, starts in documents(plain)]  # the grouping depends on the seed only
    groups = [list(range(sum(sizes[:d]), sum(sizes[: d + 1]))) for d in range(len(sizes))]
    refs = [[" ".join(examples[i].refs[0] for i in g)] for g in groups]
    result = {"model": args.model, "split": "test_2016_flickr", "sentences": len(plain), "documents": len(sizes),
              "captions_without_full_stop": sum(s[-1] not in ".!?" for s in plain)}
    for name in ("plain", "punctuated"):  # where the segmenter did not find a caption's boundaries
        captions = set(plain if name == "plain" else punctuated)
        found = [s for text in docs[name] for s in segment(text, "de", pipeline._fits).segments]
        result[f"segments_{name}"] = len(found)
        result[f"segments_not_one_caption_{name}"] = [s for s in found if s not in captions]
    for name, sentences in (("plain", plain), ("punctuated", punctuated)):
        one_by_one = pipeline.decode(sentences)
        result[f"bleu_one_by_one_{name}"] = round(bleu([" ".join(one_by_one[i] for i in g) for g in groups], refs), 2)
    for name, texts in docs.items():
        outputs = pipeline.decode(texts, split=True)
        scored = [_without(o, [runs[i] for i in g]) if name == "special" else o for o, g in zip(outputs, groups)]
        result[f"bleu_document_{name}"] = round(bleu([" ".join(o.split()) for o in scored], refs), 2)
        print(name, result[f"bleu_document_{name}"], flush=True)
    kept = total = 0
    for g, output in zip(groups, outputs):  # the special set's
        for run, n in Counter(runs[i] for i in g).items():
            kept, total = kept + min(n, output.count(run)), total + n
    result["special_runs_kept_percent"] = round(100 * kept / total, 1)
    pages = [as_html([[plain[i] for i in g[k: k + 3]] for k in range(0, len(g), 3)], rng) for g in groups]
    html_out = pipeline.decode(pages, split=True, markup=True)
    result["html_markup_identical_percent"] = round(
        100 * sum(markup_of(o) == markup_of(page) for o, page in zip(html_out, pages)) / len(pages), 1)
    result["html_example"] = {"source": pages[0], "output": html_out[0]}
    out = results_dir(args.publish)
    out.mkdir(parents=True, exist_ok=True)
    (out / "documents.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0
