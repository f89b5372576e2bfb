"""CTranslate2 export: vanilla and mvPE models, converted through CT2's TransformerSpec, search
exactly as our PyTorch beam search does (fp32: same n-best token for token, scores within 1e-4),
every other architecture is refused with the reason, the repository lists its files with their
sha256, and the int8 model folder runs and stays close to fp32."""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import ctranslate2
import pytest
import torch

from export.__main__ import main as export_main
from export.ct2_export import unsupported_switches
from export.ct2_runtime import Ct2Translator
from export.manifest import MANIFEST, read_manifest, sha256
from tests.architectures import ARCHITECTURES, perturb, random_batch, tiny_config
from training import train
from training.corpora import load_examples
from training.data import train_sentencepiece
from training.seq2seq import search
from training.seq2seq.checkpoint import load_checkpoint, save_checkpoint
from training.seq2seq.config import Checkpoint, DataConfig
from training.seq2seq.inputs import encode_source, pad
from training.seq2seq.model import Seq2Seq

torch.set_num_threads(1)
CONVERTIBLE = ("vanilla", "post_norm", "mvpe")
REFUSED = {name: reason for name, reason in (
    *[(n, "GRET") for n in ARCHITECTURES if n.startswith("gret")],
    *[(n, "multi-view") for n in ARCHITECTURES if n.startswith("multiview")],
    *[(n, "Graph-Transformer") for n in ARCHITECTURES if n.startswith("graph")],
    ("mvpe_pos", "POS-tag"), ("pos_learned_proj", "POS-tag"))}


def test_every_architecture_is_either_converted_or_refused():
    assert set(CONVERTIBLE) | set(REFUSED) == set(ARCHITECTURES)
    assert all(unsupported_switches(tiny_config(n)) == [] for n in CONVERTIBLE)


@pytest.fixture(scope="module")
def spm_bytes():
    examples = load_examples("multi30k", "train", "de", "en")[:200]
    return train_sentencepiece([e.source for e in examples] + [e.target for e in examples], 100)


def hypotheses(pytorch_result) -> list[list[list[int]]]:
    return [[h.tokens for h in hyps] for hyps in pytorch_result]


def ct2_hypotheses(ct2_result) -> list[list[list[int]]]:
    return [[t.tokens for t in hyps] for hyps in ct2_result]


# ---- models trained on real sentences: fp32 parity with training.seq2seq.search ------------------
class Trained(NamedTuple):
    models: dict[str, tuple[Seq2Seq, Path]]  # name -> (PyTorch model, its ct2 repository)
    sources: list[list[int]]
    sp: object


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Trained:
    """Tiny vanilla and mvPE models trained 100 steps on 300 real pairs (enough for outputs that
    depend on the source; the vanilla ones end in EOS), exported with --format ct2 --quantize int8;
    40 real source sentences."""
    out = tmp_path_factory.mktemp("ct2")
    models = {}
    for name, switches in (("vanilla", []), ("mvpe", ["--mvpe"])):
        train.main(["--out", str(out / name), "--preset", "tiny", *switches, "--train-limit", "300",
                    "--valid-limit", "4", "--vocab-size", "300", "--batch-tokens", "800", "--lr", "5e-3",
                    "--warmup", "10", "--label-smoothing", "0", "--dropout", "0", "--threads", "1",
                    "--max-steps", "100", "--eval-every", "100", "--log-every", "50"])
        export_main(["--checkpoint", str(out / name), "--out", str(out / f"{name}-repo"), "--format", "ct2",
                     "--quantize", "int8"])
        model, ckpt, sp = load_checkpoint(out / name)
        models[name] = model, out / f"{name}-repo"
    texts = [e.source for e in load_examples("multi30k", "val", "de", "en")[:40]]
    sources = [encode_source(sp, t, ckpt.data.max_src_len) for t in texts]
    return Trained(models, sources, sp)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vanilla", "mvpe"])
def test_fp32_beam_search_gives_the_pytorch_n_best_and_scores(trained, name):
    (model, repo), sources = trained.models[name], trained.sources
    assert model.cfg.pe_k > 1 if name == "mvpe" else model.cfg.pe_k == 1
    expected = search.beam_search(model, pad(sources), beam=4, n_best=2)
    assert len({tuple(hyps[0].tokens) for hyps in expected}) > 1
    if name == "vanilla":  # most end in EOS (the mvPE model, k=254, mostly runs to its length limit)
        limits = [1.5 * len(s) + 10 for s in sources]
        assert sum(len(hyps[0].tokens) + 1 < limit for hyps, limit in zip(expected, limits)) >= 30
    actual = Ct2Translator(repo).translate(sources, beam=4, n_best=2)
    assert ct2_hypotheses(actual) == hypotheses(expected)
    for hyps, ref in zip(actual, expected):
        assert [t.score for t in hyps] == pytest.approx([h.score for h in ref], abs=1e-4)


@pytest.mark.slow
def test_per_sentence_length_limits_length_penalty_and_greedy_match_pytorch(trained):
    """Limits a * src_len + b that bind (forced finishes at each sentence's own last step), another
    length penalty, and beam 1 against training.seq2seq.search.greedy."""
    (model, repo), sources = trained.models["vanilla"], trained.sources
    ct2_model = Ct2Translator(repo)
    options = {"length_penalty": 0.6, "max_len_a": 0.3, "max_len_b": 2}
    expected = search.beam_search(model, pad(sources), beam=3, n_best=3, **options)
    assert ct2_hypotheses(ct2_model.translate(sources, beam=3, n_best=3, **options)) == hypotheses(expected)
    greedy = search.greedy(model, pad(sources))
    assert [hyps[0].tokens for hyps in ct2_model.translate(sources, beam=1)] == greedy


@pytest.mark.parametrize("name", CONVERTIBLE)
def test_random_weights_and_padded_batches_match_pytorch(name, tmp_path, spm_bytes):
    """Perturbed weights (every parameter off its initialisation), post-norm included."""
    torch.manual_seed(0)
    model = perturb(Seq2Seq(tiny_config(name, vocab_size=100)))
    save_checkpoint(tmp_path / "ck", model, Checkpoint(model.cfg, DataConfig()), spm_bytes)
    export_main(["--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "repo"), "--format", "ct2"])
    src, _ = random_batch(model.cfg, [6, 4, 9, 7, 3], seed=3)
    sources = [row[row != model.cfg.pad_id].tolist() for row in src]
    expected = search.beam_search(model, src, beam=3, n_best=3, max_len_a=0, max_len_b=8)
    actual = Ct2Translator(tmp_path / "repo").translate(sources, beam=3, n_best=3, max_len_a=0, max_len_b=8)
    assert ct2_hypotheses(actual) == hypotheses(expected)


@pytest.mark.parametrize("beam", [1, 3])
def test_a_target_prefix_is_forced_as_in_pytorch(tmp_path, spm_bytes, beam):
    """CT2's target_prefix against training.seq2seq.search with the same prefixes (training.seq2seq.beam.force_prefix):
    the same n-best and scores, a sentence without a prefix beside sentences with one. With beam > 1
    CT2 lets only the best candidate end a sentence at the step after its prefix (ct2_runtime's
    docstring); on these sentences none wants to end there, so the outputs are the same."""
    torch.manual_seed(0)
    model = perturb(Seq2Seq(tiny_config("vanilla", vocab_size=100)))
    save_checkpoint(tmp_path / "ck", model, Checkpoint(model.cfg, DataConfig()), spm_bytes)
    export_main(["--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "repo"), "--format", "ct2"])
    src, _ = random_batch(model.cfg, [6, 4, 9, 7], seed=3)
    sources = [row[row != model.cfg.pad_id].tolist() for row in src]
    prefixes = [[5, 9, 5], [], [17], [30, 31, 32, 33, 34, 35]]
    expected = search.beam_search(model, src, beam=beam, n_best=beam, max_len_a=0, max_len_b=12, prefixes=prefixes)
    actual = Ct2Translator(tmp_path / "repo").translate(sources, beam=beam, n_best=beam, max_len_a=0, max_len_b=12,
                                                        prefixes=prefixes)
    assert ct2_hypotheses(actual) == hypotheses(expected)
    for hyps, ref, prefix in zip(actual, expected, prefixes):
        assert all(t.tokens[:len(prefix)] == prefix for t in hyps)
        assert [t.score for t in hyps] == pytest.approx([h.score for h in ref], abs=1e-4)


# ---- refusals ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_other_architectures_are_refused_with_the_reason(name, tmp_path, spm_bytes, capsys):
    model = Seq2Seq(tiny_config(name, vocab_size=100))
    save_checkpoint(tmp_path / "ck", model, Checkpoint(model.cfg, DataConfig()), spm_bytes)
    with pytest.raises(SystemExit) as exit_info:
        export_main(["--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "repo"), "--format", "ct2"])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "cannot export to CTranslate2" in error and REFUSED[name] in error and "--format onnx" in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no repository, no staging folder


# ---- the repository --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_repository_lists_its_files_with_sha256_and_the_vocabulary_is_our_id_order(trained):
    (model, repo), sp = trained.models["mvpe"], trained.sp
    manifest = json.loads((repo / MANIFEST).read_text())
    assert manifest["backend"] == "ct2" and "mvPE" in manifest["architecture"]["summary"]
    assert manifest["ct2"]["version"] == ctranslate2.__version__
    assert manifest["ct2"]["precisions"] == {"fp32": "ct2", "int8": "ct2.int8"}
    model_files = {"model.bin", "config.json", "shared_vocabulary.json"}
    assert set(manifest["files"]) == {"spm.model"} | {f"{d}/{f}" for d in ("ct2", "ct2.int8") for f in model_files}
    assert all(sha256(repo / f) == entry["sha256"] for f, entry in manifest["files"].items())
    pieces = json.loads((repo / "ct2" / "shared_vocabulary.json").read_text())
    assert pieces == [sp.id_to_piece(i) for i in range(model.cfg.vocab_size)]
    config = json.loads((repo / "ct2" / "config.json").read_text())
    assert (config["decoder_start_token"], config["eos_token"]) == ("<s>", "</s>")
    assert config["add_source_eos"] is False  # our sources already end with EOS


def test_a_changed_file_is_detected_and_a_wrong_precision_is_refused(tmp_path, spm_bytes):
    model = Seq2Seq(tiny_config("vanilla", vocab_size=100))
    save_checkpoint(tmp_path / "ck", model, Checkpoint(model.cfg, DataConfig()), spm_bytes)
    export_main(["--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "repo"), "--format", "ct2"])
    with pytest.raises(ValueError, match="no int8 CT2 model"):
        Ct2Translator(tmp_path / "repo", precision="int8")
    (tmp_path / "repo" / "ct2" / "model.bin").write_bytes(b"changed")
    with pytest.raises(ValueError, match="sha256"):
        read_manifest(tmp_path / "repo")


# ---- runtime options and bad input ------------------------------------------------------------------
@pytest.mark.slow
def test_decoding_options_are_honoured(trained):
    (_, repo), sources = trained.models["vanilla"], trained.sources
    ct2_model = Ct2Translator(repo)
    long = ct2_model.translate(sources, beam=2, min_length=12)
    assert all(len(hyps[0].tokens) >= 12 for hyps in long)
    capped = ct2_model.translate(sources, beam=2, max_length=5)
    assert all(len(hyps[0].tokens) <= 5 for hyps in capped)
    for hyps in ct2_model.translate(sources, beam=2, no_repeat_ngram_size=2):
        bigrams = list(zip(hyps[0].tokens, hyps[0].tokens[1:]))
        assert len(bigrams) == len(set(bigrams))
    n_best = ct2_model.translate(sources[:3], beam=4, n_best=4, return_scores=False)
    assert all(len(hyps) == 4 and {t.score for t in hyps} == {None} for hyps in n_best)


@pytest.mark.slow
@pytest.mark.parametrize("sources, options, message", [
    ([[]], {}, "empty"),
    ([[5, 0, 3]], {}, "padding"),
    ([[5, 100000, 3]], {}, "outside"),
    ([[5, 3]], {"beam": 2, "n_best": 3}, "n_best"),
    ([[5, 3]], {"min_length": 50, "max_length": 10}, "min_length"),
])
def test_bad_input_is_refused_clearly(trained, sources, options, message):
    with pytest.raises(ValueError, match=message):
        Ct2Translator(trained.models["vanilla"][1]).translate(sources, **options)


# ---- int8 --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_int8_weights_run_and_stay_close_to_fp32(trained):
    (model, repo), sources = trained.models["vanilla"], trained.sources
    files = read_manifest(repo)["files"]
    assert files["ct2.int8/model.bin"]["bytes"] < files["ct2/model.bin"]["bytes"] / 2
    int8 = Ct2Translator(repo, precision="int8")
    hyps = int8.translate(sources, beam=4)
    assert all(h and h[0].tokens and all(0 <= t < model.cfg.vocab_size for t in h[0].tokens) for h in hyps)
    # not a different model: the fp32 outputs' log-probabilities move by quantization noise only
    fp32 = Ct2Translator(repo)
    best = [[fp32.pieces[t] for t in h[0].tokens] for h in fp32.translate(sources, beam=4)]
    source_pieces = [[fp32.pieces[t] for t in s] for s in sources]
    per_token = [[sum(r.log_probs) / len(r.log_probs) for r in m.translator.score_batch(source_pieces, best)]
                 for m in (fp32, int8)]
    assert max(abs(a - b) for a, b in zip(*per_token)) < 0.2
