"""The training loop on real data: it learns, resumes exactly, warm-starts, and every
architecture trains with the tiny preset and translates through the CLIs."""
from __future__ import annotations

import hashlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch

from training import train, translate
from training.corpora import load_examples
from training.decode import corpus_translate
from training.seq2seq.checkpoint import WEIGHTS, load_checkpoint, save_checkpoint
from training.ship import reproduction

pytestmark = pytest.mark.slow  # it trains models

# A small real subset: the first 60 Multi30K pairs, a 300-piece vocabulary.
COMMON = ["--preset", "tiny", "--train-limit", "60", "--valid-limit", "8", "--vocab-size", "300",
          "--batch-tokens", "600", "--lr", "3e-3", "--warmup", "50", "--threads", "2", "--log-every", "10"]


def run_train(out: Path, *extra: str):
    train.main(["--out", str(out), *COMMON, *extra])
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def losses(log):
    return {r["step"]: r["loss"] for r in log if r["event"] == "train"}


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A tiny vanilla model trained 400 steps on 60 real pairs: it must fit them."""
    out = tmp_path_factory.mktemp("fitted")
    log = run_train(out, "--max-steps", "400", "--eval-every", "200", "--label-smoothing", "0",
                    "--dropout", "0", "--average-last", "2")
    return out, log


def test_loss_falls_and_the_model_reproduces_its_training_targets(fitted):
    out, log = fitted
    curve = losses(log)
    assert curve[400] < curve[10] / 8, curve  # from ~5.7 (uniform over 300) to well under 1
    model, ckpt, sp = load_checkpoint(out)
    pairs = load_examples("multi30k", "train", "de", "en")[:20]
    hyps = corpus_translate(model, sp, [p.source for p in pairs], beam=4)
    exact = sum(h == p.target for h, p in zip(hyps, pairs))
    assert exact >= 15, list(zip(hyps, [p.target for p in pairs]))


def test_checkpoint_directory_holds_config_weights_and_vocabulary(fitted):
    out, _ = fitted
    config = json.loads((out / "config.json").read_text())
    assert {"model", "data", "training"} <= set(config)
    assert config["training"]["steps"] == 400 and config["data"]["src_lang"] == "de"
    assert not list(out.rglob("*.pt")) and not list(out.rglob("*.pkl"))  # never pickle


def test_save_then_load_gives_identical_outputs(fitted, tmp_path):
    model, ckpt, sp = load_checkpoint(fitted[0])
    save_checkpoint(tmp_path, model, ckpt, sp.serialized_model_proto())
    again, _, _ = load_checkpoint(tmp_path)
    src = torch.tensor([sp.encode("Ein Mann fährt Fahrrad.") + [3]])
    tgt = torch.tensor([[2] + sp.encode("A man rides a bike.")])
    torch.testing.assert_close(model(src, tgt), again(src, tgt), rtol=0, atol=0)


def test_resume_continues_with_the_same_losses(tmp_path):
    straight = losses(run_train(tmp_path / "straight", "--max-steps", "40", "--eval-every", "20"))
    run_train(tmp_path / "resumed", "--max-steps", "20", "--eval-every", "20")
    resumed = losses(run_train(tmp_path / "resumed", "--max-steps", "40", "--eval-every", "20"))
    assert resumed == straight


def test_a_killed_run_resumes_from_its_last_periodic_save_with_the_same_losses(tmp_path, monkeypatch):
    straight = losses(run_train(tmp_path / "straight", "--max-steps", "40", "--eval-every", "40"))
    real_step = train.Trainer.train_step

    def killed_at_step_27(self, ids):
        if self.step == 27:
            raise KeyboardInterrupt
        return real_step(self, ids)

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(train.Trainer, "train_step", killed_at_step_27)
        run_train(tmp_path / "killed", "--max-steps", "40", "--eval-every", "40", "--save-every", "10")
    log = run_train(tmp_path / "killed", "--max-steps", "40", "--eval-every", "40")
    assert [r["step"] for r in log if r["event"] == "train"] == [10, 20, 30, 40]  # it went on from step 20
    assert losses(log) == straight  # steps 21 to 27 were lost and are trained again, identically


def test_intervals_must_be_positive(tmp_path):
    with pytest.raises(SystemExit):
        train.parse_args(["--out", str(tmp_path), "--save-every", "0"])


def test_translate_cli_keeps_order_and_one_line_per_input(fitted, monkeypatch, capsys):
    pairs = load_examples("multi30k", "train", "de", "en")[:5]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(p.source + "\n" for p in reversed(pairs))))
    translate.main(["--checkpoint", str(fitted[0]), "--beam", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5
    assert sum(line == p.target for line, p in zip(lines, reversed(pairs))) >= 3


def test_warm_start_adds_gret_modules_and_keeps_the_parent_weights(fitted, tmp_path):
    parent, _, _ = load_checkpoint(fitted[0])
    log = run_train(tmp_path / "gret", "--init-from", str(fitted[0]), "--gret", "full", "--max-steps", "1",
                    "--eval-every", "1", "--lr", "1e-12")
    child, ckpt, _ = load_checkpoint(tmp_path / "gret")
    added = ckpt.training["added_parameters"]
    assert any(n.startswith("global_state.capsule_w") for n in added)
    assert any(n.startswith("context_gate.") for n in added)
    assert not any(n.startswith(("encoder.", "decoder.", "embed")) for n in added)
    torch.testing.assert_close(child.embed.weight, parent.embed.weight)
    assert ckpt.model.capsule and ckpt.model.gate and log[0]["event"] == "start"


def test_the_scale_switches_and_the_bag_of_words_loss_train_a_warm_started_gret_model(fitted, tmp_path):
    log = run_train(tmp_path / "scaled", "--init-from", str(fitted[0]), "--gret", "capsule,gate", "--global-norm",
                    "--global-zero-bias", "--routing-scale", "--gate-bias-init", "0", "--global-bow", "0.5",
                    "--max-steps", "20", "--eval-every", "20")
    _, ckpt, _ = load_checkpoint(tmp_path / "scaled")
    assert ckpt.model.global_norm and ckpt.model.global_zero_bias and ckpt.model.routing_scale
    assert ckpt.model.gate_bias_init == 0.0 and ckpt.training["args"]["global_bow"] == 0.5
    assert all(r["loss"] == r["loss"] for r in log if r["event"] == "train")  # finite, not NaN
    with pytest.raises(SystemExit, match="global state"):
        run_train(tmp_path / "vanilla-bow", "--global-bow", "0.5", "--max-steps", "1")


def test_the_bag_of_words_loss_is_each_target_words_negative_log_probability_under_s():
    word_logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]))
    target = torch.tensor([[1, 2, 0], [2, 2, 2]])  # 0 is PAD
    expected = -(2 * torch.log(torch.tensor(0.25)) + 3 * torch.log(torch.tensor(0.8)))
    torch.testing.assert_close(train.bag_of_words_loss(word_logits, target), expected)


def test_a_model_card_rebuilds_a_warm_started_model_from_its_parent_and_records_the_parent_weights(tmp_path):
    parent, child = tmp_path / "parent", tmp_path / "child"
    run_train(parent, "--max-steps", "3", "--eval-every", "3")
    run_train(child, "--init-from", str(parent), "--max-steps", "2", "--eval-every", "2", "--max-minutes", "30")
    ckpt = load_checkpoint(child)[1]
    assert ckpt.training["init_from"]["weights_sha256"] == hashlib.sha256((parent / WEIGHTS).read_bytes()).hexdigest()
    parent_command, child_command = reproduction(ckpt, child / "log.jsonl")
    assert parent_command.startswith(f"python -m training.train --out {parent} ") and " --max-steps 3 " in parent_command
    assert child_command.startswith(f"python -m training.train --out {child} ") and " --max-steps 2 " in child_command
    assert f"--init-from {parent}" in child_command and "--max-minutes" not in child_command  # steps, not time


ARCHITECTURE_FLAGS = {
    "gret_full": ["--gret", "full"],
    "multiview_gca": ["--multiview", "gca"],
    "multiview_ama": ["--multiview", "ama"],
    "mvpe_pos": ["--mvpe", "--pos-tags"],
    "graph_weight_gate_half": ["--encoder", "graph", "--graph-fusion", "weight_gate", "--graph-half-dim"],
    "post_norm": ["--post-norm"],
}


@pytest.mark.parametrize("name", sorted(ARCHITECTURE_FLAGS))
def test_every_architecture_trains_translates_and_serves_from_onnx(name, tmp_path, monkeypatch, capsys):
    """Trained here, the checkpoint translates; exported to ONNX, the server's engine gives the
    same translations."""
    from export.__main__ import main as export_main
    from server.catalog import from_repository
    from server.engine.options import DecodingOptions
    from server.pipeline import build_pipeline

    log = run_train(tmp_path, *ARCHITECTURE_FLAGS[name], "--max-steps", "60", "--eval-every", "60")
    curve = losses(log)
    assert curve[60] < curve[10]
    texts = ["Ein Hund rennt.", "Zwei Frauen sitzen auf einer Bank."]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(t + "\n" for t in texts)))
    translate.main(["--checkpoint", str(tmp_path), "--beam", "2"])
    expected = capsys.readouterr().out.splitlines()
    assert len(expected) == 2
    export_main(["--checkpoint", str(tmp_path), "--out", str(tmp_path / "repo")])
    pipeline = build_pipeline(from_repository(tmp_path / "repo", "onnx", tmp_path))
    assert pipeline.decode(texts, DecodingOptions(beam=2)) == expected
