"""The GRET probe measures how much a model uses its global state s^M: it swaps s^M at inference
and reads the context gate on teacher-forced targets."""
from __future__ import annotations

import torch

from tests.architectures import perturb, random_batch, tiny_config
from training.gret_probe import gate_statistics, global_states, replaced_global_state
from training.seq2seq.inputs import BOS
from training.seq2seq.model import Seq2Seq
from training.study import gret_probe_lines


def gret(name: str = "gret_full", **overrides) -> Seq2Seq:
    torch.manual_seed(0)
    return perturb(Seq2Seq(tiny_config(name, **overrides)))


def sentences(model, lengths):
    src, _ = random_batch(model.cfg, lengths)
    return [row[:n].tolist() for row, n in zip(src, lengths)]


def test_a_replaced_global_state_feeds_the_gate_and_is_gone_after_the_block():
    model = gret()
    src, _ = random_batch(model.cfg, [5, 3])
    own = model.encode(src)
    with replaced_global_state(model, torch.zeros_like):
        zeroed = model.encode(src)
    assert torch.equal(zeroed.global_state, torch.zeros_like(own.global_state))
    # Gs = W_gs s^M + b_g is recomputed from the replacement, so only the bias is left
    assert torch.allclose(zeroed.gate_source, model.context_gate.w_s.bias.expand_as(own.gate_source))
    assert torch.equal(model.encode(src).global_state, own.global_state)


def test_global_states_come_back_in_input_order_whatever_the_batching():
    model = gret()
    src = sentences(model, [7, 3, 5])
    together = global_states(model, src)
    alone = torch.cat([global_states(model, [s]) for s in src])
    assert torch.allclose(together, alone, atol=1e-5)


def test_a_model_that_reads_pos_tags_is_probed_with_its_sentences_tags():
    model = gret("gret_capsule_aggregate", pos_tags=True)
    src, tags = random_batch(model.cfg, [6, 4])
    rows = [row[:n].tolist() for row, n in zip(src, (6, 4))]
    row_tags = [row[:n].tolist() for row, n in zip(tags, (6, 4))]
    states = global_states(model, rows, row_tags)
    assert torch.allclose(states, model.encode(src, tags).global_state, atol=1e-5)
    stats = gate_statistics(model, rows, [[BOS] + r[:-1] for r in rows], row_tags)
    assert stats["tokens"] == 10 and stats["output_term_ratio_mean"] > 0


def test_a_closed_gate_adds_nothing_and_no_gate_adds_all_of_s():
    lengths = [6, 4, 5]
    targets = [[BOS] + s[:-1] for s in sentences(gret(), lengths)]
    closed = gret()
    with torch.no_grad():
        closed.context_gate.w_s.bias.fill_(-60.0)
    stats = gate_statistics(closed, sentences(closed, lengths), targets)
    assert stats["tokens"] == sum(len(t) for t in targets)
    assert stats["gate_mean"] < 1e-6 and stats["output_term_ratio_mean"] < 1e-6

    ungated = gret("gret_capsule_aggregate")
    stats = gate_statistics(ungated, sentences(ungated, lengths), targets)
    assert stats["gate_mean"] == 1.0 and stats["output_term_ratio_mean"] > 0


def test_the_report_shows_each_ablation_as_a_change_from_the_trained_score():
    payload = {"command": "python -m training.gret_probe --systems runs/g", "beam": 4, "threads": 2, "commit": "abc",
               "systems": [{"name": "g", "dataset": "multi30k", "direction": "de-en", "split": "test_2016_flickr",
                            "metric": "bleu", "modules": ["capsule", "aggregate", "gate"], "trained": {"bleu": 40.0},
                            "ablations": {"mean": {"bleu": 39.9, "vs_trained": {"delta": 0.1, "p_value": 0.3}},
                                          "zero": {"bleu": 38.5, "vs_trained": {"delta": 1.5, "p_value": 0.0}}},
                            "global_state_spread": 0.061,
                            "gate": {"tokens": 10, "gate_mean": 0.042, "output_term_ratio_mean": 0.05,
                                     "output_term_ratio_median": 0.044}}]}
    row = [line for line in gret_probe_lines(payload) if line.startswith("| `g`")][0]
    assert "| bleu 40.00 | 39.90 (-0.10, 0.300) | 38.50 (-1.50, 0.000) | 0.042 | 0.050 / 0.044 | 0.061 |" in row
    assert ("by at most 0.10 in any system (smallest p 0.300); setting s^M to zero costs up to 1.50 (`g`)"
            in "\n".join(gret_probe_lines(payload)))


def test_the_report_gives_the_verdict_on_whether_a_model_uses_its_global_state():
    system = {"name": "g", "dataset": "multi30k", "direction": "de-en", "split": "test_2016_flickr",
              "metric": "bleu", "modules": ["capsule", "gate", "global_norm"], "trained": {"bleu": 40.0},
              "uses_global_state": True,
              "ablations": {"mean": {"bleu": 38.0, "vs_trained": {"delta": 2.0, "p_value": 0.0}},
                            "zero": {"bleu": 30.0, "vs_trained": {"delta": 10.0, "p_value": 0.0}}},
              "global_state_spread": 0.9,
              "gate": {"tokens": 10, "gate_mean": 0.4, "output_term_ratio_mean": 0.5, "output_term_ratio_median": 0.5}}
    payload = {"command": "python -m training.gret_probe --systems runs/g", "beam": 4, "threads": 2, "commit": "abc",
               "systems": [system]}
    row = [line for line in gret_probe_lines(payload) if line.startswith("| `g`")][0]
    assert row.endswith("| 0.900 | **yes** |")
