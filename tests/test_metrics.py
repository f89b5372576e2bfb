"""Specification of training.metrics and the training.evaluate CLI."""
from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest
import sacrebleu

from training import evaluate, metrics

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _lines(path: Path, n: int) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [next(f).rstrip("\n") for _ in range(n)]


def _perturb(lines: list[str], edits: int, seed: int) -> list[str]:
    """Deterministic damage: drop, swap or replace `edits` words per line."""
    rnd = random.Random(seed)
    out = []
    for line in lines:
        w = line.split()
        for _ in range(edits):
            if len(w) < 3:
                break
            i = rnd.randrange(len(w) - 1)
            op = rnd.choice(("drop", "swap", "replace"))
            if op == "drop":
                del w[i]
            elif op == "swap":
                w[i], w[i + 1] = w[i + 1], w[i]
            else:
                w[i] = "thing"
        out.append(" ".join(w))
    return out


@pytest.fixture(scope="module")
def refs_en() -> list[str]:
    return _lines(DATA / "multi30k" / "val.en.gz", 50)


def single(refs: list[str]) -> list[list[str]]:
    return [[r] for r in refs]


# ------------------------------------------------------------- BLEU / chrF

def test_identical_text_scores_100(refs_en):
    assert metrics.bleu(refs_en, single(refs_en)) == pytest.approx(100.0)
    assert metrics.chrf(refs_en, single(refs_en)) == pytest.approx(100.0)


def test_agrees_with_sacrebleu_single_and_multi_reference(refs_en):
    hyps = _perturb(refs_en, 2, seed=1)
    assert metrics.bleu(hyps, single(refs_en)) == pytest.approx(
        sacrebleu.corpus_bleu(hyps, [refs_en]).score, abs=1e-9)
    assert metrics.chrf(hyps, single(refs_en)) == pytest.approx(
        sacrebleu.corpus_chrf(hyps, [refs_en]).score, abs=1e-9)

    # refs[i] = list per hypothesis  <->  sacreBLEU's one stream per reference
    other = _perturb(refs_en, 1, seed=2)
    per_example = [[r, o] for r, o in zip(refs_en, other)]
    assert metrics.bleu(hyps, per_example) == pytest.approx(
        sacrebleu.corpus_bleu(hyps, [refs_en, other]).score, abs=1e-9)
    assert metrics.chrf(hyps, per_example) == pytest.approx(
        sacrebleu.corpus_chrf(hyps, [refs_en, other]).score, abs=1e-9)


def test_bad_reference_layouts_are_rejected(refs_en):
    hyps = refs_en[:3]
    with pytest.raises(ValueError, match="same number of references"):
        metrics.bleu(hyps, [["a"], ["b", "c"], ["d"]])
    with pytest.raises(ValueError, match="reference lists"):
        metrics.chrf(hyps, single(refs_en[:2]))
    with pytest.raises(TypeError):
        metrics.bleu(hyps, refs_en[:3])  # flat strings, not lists
    with pytest.raises(ValueError, match="unknown metric"):
        metrics.score(hyps, single(hyps), ["meteor"])


# ------------------------------------------------------------------- ROUGE

def test_rouge_stems_and_takes_max_over_references():
    # Porter stemming: cats -> cat, running/runs -> run.
    assert metrics.rouge(["cats running"], [["cat runs"]])["rouge1"] == pytest.approx(100.0)

    hyp = "the cat sat on the mat"
    one_bad = metrics.rouge([hyp], [["a dog barked loudly"]])
    both = metrics.rouge([hyp], [["a dog barked loudly", "the cat sat on the mat"]])
    assert one_bad["rouge1"] == 0.0
    assert both == pytest.approx({"rouge1": 100.0, "rouge2": 100.0, "rougeL": 100.0})


def test_rouge_multi_reference_on_aeslc():
    rows = [json.loads(line) for line in _lines(DATA / "aeslc" / "dev.jsonl.gz", 30)]
    hyps = [" ".join(r["email"].split()[:6]) for r in rows]  # lead-6 baseline
    refs = [[r["subject"], r["ann0"], r["ann1"], r["ann2"]] for r in rows]

    per_ref = [metrics.rouge_per_example(hyps, [[rs[k]] for rs in refs]) for k in range(4)]
    best = per_ref[0]
    for p in per_ref[1:]:
        best = best.clip(min=p)  # elementwise max, each metric on its own
    assert metrics.rouge_per_example(hyps, refs) == pytest.approx(best)

    means = metrics.rouge(hyps, refs)
    assert list(means) == ["rouge1", "rouge2", "rougeL"]
    assert [means[k] for k in means] == pytest.approx(best.mean(axis=0).tolist())
    # more references can only help
    single_means = metrics.rouge(hyps, [[rs[0]] for rs in refs])
    assert all(means[k] >= single_means[k] for k in means)


# --------------------------------------------------------------- bootstrap

@pytest.mark.parametrize("metric", ["bleu", "chrf", "rouge1"])
def test_bootstrap_system_against_itself_is_not_significant(refs_en, metric):
    hyps = _perturb(refs_en, 2, seed=3)
    r = metrics.paired_bootstrap(hyps, hyps, single(refs_en), metric, samples=200)
    assert r["delta"] == 0.0
    assert r["p_value"] == 1.0  # b never beats an identical a
    assert r["ci95"] == [0.0, 0.0]


@pytest.mark.parametrize("metric", ["bleu", "chrf", "rouge2"])
def test_bootstrap_detects_a_clearly_better_system(refs_en, metric):
    worse, better = _perturb(refs_en, 4, seed=4), _perturb(refs_en, 1, seed=5)
    r = metrics.paired_bootstrap(worse, better, single(refs_en), metric, samples=300)
    assert r["delta"] > 0 and r["p_value"] < 0.05
    assert r["ci95"][0] > 0
    # swapped roles: b is now the worse one
    r = metrics.paired_bootstrap(better, worse, single(refs_en), metric, samples=300)
    assert r["delta"] < 0 and r["p_value"] > 0.95


def test_bootstrap_full_sample_equals_corpus_score(refs_en):
    a, b = _perturb(refs_en, 3, seed=6), _perturb(refs_en, 1, seed=7)
    r = metrics.paired_bootstrap(a, b, single(refs_en), "bleu", samples=10)
    assert r["a"] == pytest.approx(sacrebleu.corpus_bleu(a, [refs_en]).score, abs=1e-9)
    assert r["b"] == pytest.approx(sacrebleu.corpus_bleu(b, [refs_en]).score, abs=1e-9)
    assert r["delta"] == pytest.approx(r["b"] - r["a"])
    r = metrics.paired_bootstrap(a, b, single(refs_en), "rougeL", samples=10)
    assert r["b"] == pytest.approx(metrics.rouge(b, single(refs_en))["rougeL"])


def test_bootstrap_is_reproducible_with_a_seed(refs_en):
    a, b = _perturb(refs_en, 2, seed=8), _perturb(refs_en, 2, seed=9)
    run = lambda seed: metrics.paired_bootstrap(a, b, single(refs_en), "chrf", 100, seed)
    assert run(1) == run(1)
    assert run(1)["ci95"] != run(2)["ci95"]


# --------------------------------------------------------------------- CLI

def _write(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_cli_end_to_end(tmp_path, refs_en, capsys):
    ref1 = _write(tmp_path / "ref1.txt", refs_en)
    ref2 = _write(tmp_path / "ref2.txt", _perturb(refs_en, 1, seed=10))
    hyp = _write(tmp_path / "hyp.txt", _perturb(refs_en, 1, seed=11))
    base = _write(tmp_path / "base.txt", _perturb(refs_en, 4, seed=12))
    out = tmp_path / "out.json"

    result = evaluate.main(["--hyp", hyp, "--ref", ref1, "--ref", ref2,
                            "--metrics", "bleu,chrf,rouge", "--compare", base,
                            "--samples", "100", "--json", str(out)])
    printed = json.loads(capsys.readouterr().out)
    assert printed == result == json.loads(out.read_text())

    assert result["n"] == 50
    assert set(result["scores"]) == {"bleu", "chrf", "rouge1", "rouge2", "rougeL"}
    refs = [[x, y] for x, y in zip(Path(ref1).read_text().splitlines(),
                                   Path(ref2).read_text().splitlines())]
    hyps = Path(hyp).read_text().splitlines()
    assert result["scores"]["bleu"] == pytest.approx(metrics.bleu(hyps, refs))

    assert set(result["bootstrap"]) == set(result["scores"])
    for m, r in result["bootstrap"].items():
        assert set(r) >= {"metric", "a", "b", "delta", "p_value", "ci95"}
        assert r["b"] == pytest.approx(result["scores"][m])  # b is --hyp


def test_cli_rejects_mismatched_line_counts(tmp_path, refs_en, capsys):
    ref = _write(tmp_path / "ref.txt", refs_en)
    hyp = _write(tmp_path / "hyp.txt", refs_en[:-1])
    with pytest.raises(SystemExit):
        evaluate.main(["--hyp", hyp, "--ref", ref])
    err = capsys.readouterr().err
    assert "line counts differ" in err and "49" in err and "50" in err
