"""The beam-search rule (training.seq2seq.beam), written once: its vectorised step over sequences with
mixed beam sizes does what the rule says for each sequence alone, each row's best tokens are ONNX
TopK's, and every search path in the project computes the same output-length limit."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from export.ct2_runtime import max_lengths
from server.engine.options import DecodingOptions, Limits
from tests.architectures import tiny_config
from training.seq2seq.beam import NEG_INF, TOP_K_BLOCK, block_maxima, candidates, output_limit, row_top_k, select
from training.seq2seq.config import ModelConfig
from training.seq2seq.search import _max_lengths

EOS = 2


def reference_step(scores, log_probs, beam, last, held):
    """The rule for one sequence, spelt out: (finishing, kept, done), each candidate as (row, token, score).
    Candidates are the 2 x beam best over rows x vocabulary, ties to the lower row, then token."""
    flat = [(s + lp, r, t) for r, (s, row) in enumerate(zip(scores, log_probs)) for t, lp in enumerate(row)]
    ranked = sorted(flat, key=lambda c: (-c[0], c[1], c[2]))[: 2 * beam]
    finishing, kept = [], []
    for j, (s, r, t) in enumerate(ranked):
        if s == NEG_INF:
            break
        if t == EOS or last:
            if j < beam:
                finishing.append((r, t, s))
        elif len(kept) < beam:
            kept.append((r, t, s))
    return finishing, kept, held + len(finishing) >= beam or last or not kept


def vectorised_step(scores, log_probs, counts, beams, last, held):
    k = 2 * max(beams)
    best = log_probs.sort(dim=1, descending=True, stable=True)  # each row's best, ties to the lower token
    cand = candidates(scores.numpy(), best.values[:, :k].numpy(), best.indices[:, :k].numpy(), np.array(counts), k)
    pick = select(cand.scores, cand.tokens == EOS, np.array(last), np.array(beams), np.array(held))
    starts = [sum(counts[:i]) for i in range(len(counts))]  # each sequence's first row, counted plainly

    def listed(mask, i):
        return [(int(cand.rows[i, j] - starts[i]), int(cand.tokens[i, j]), float(cand.scores[i, j]))
                for j in np.flatnonzero(mask[i]).tolist()]

    return [(listed(pick.finishing, i), listed(pick.kept, i), bool(pick.done[i])) for i in range(len(counts))]


@pytest.mark.parametrize("seed", range(20))
def test_one_vectorised_step_equals_the_rule_applied_to_each_sequence_alone(seed):
    """Mixed beam sizes and row counts, dead rows (-inf), forbidden tokens, EOS among the best,
    ties between rows and tokens (coarse log-probabilities), sequences at their last step."""
    g = torch.Generator().manual_seed(seed)
    vocab, n_seqs = 7, 6
    beams = torch.randint(1, 5, (n_seqs,), generator=g).tolist()
    counts = [int(torch.randint(1, b + 1, (1,), generator=g)) for b in beams]
    rows = sum(counts)
    log_probs = torch.randint(-3, 1, (rows, vocab), generator=g).float() / 2  # many ties
    log_probs[torch.rand(rows, vocab, generator=g) < 0.2] = NEG_INF
    log_probs[torch.rand(rows, generator=g) < 0.4, EOS] = 0.0  # EOS often the best token
    scores = torch.randint(-2, 1, (rows,), generator=g).float()
    scores[torch.rand(rows, generator=g) < 0.15] = NEG_INF
    last = (torch.rand(n_seqs, generator=g) < 0.25).tolist()
    held = [int(torch.randint(0, b, (1,), generator=g)) for b in beams]

    got = vectorised_step(scores, log_probs, counts, beams, last, held)
    start = 0
    for i, count in enumerate(counts):
        rows_i = slice(start, start + count)
        expected = reference_step(scores[rows_i].tolist(), log_probs[rows_i].tolist(), beams[i], last[i], held[i])
        assert got[i] == (expected[0], expected[1], expected[2]), f"sequence {i}"
        start += count


def onnx_top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ONNX Runtime's TopK over whole rows: the order row_top_k promises (best first, of equal
    values the lower index first)."""
    graph = helper.make_graph([helper.make_node("TopK", ["x", "k"], ["values", "indices"], axis=1)], "top_k",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", "vocab"]),
                               helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("values", TensorProto.FLOAT, ["rows", "k"]),
                               helper.make_tensor_value_info("indices", TensorProto.INT64, ["rows", "k"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    values, indices = session.run(None, {"x": x.numpy(), "k": np.array([k])})
    return torch.from_numpy(values), torch.from_numpy(indices)


@pytest.mark.parametrize("vocab", [8000, 4000, 50, 7])  # whole blocks, a padded last block, less than one block
def test_each_rows_top_k_is_onnx_topk_over_the_whole_row_ties_included(vocab):
    """row_top_k reads only the blocks whose maxima can hold a row's k best; it must still give
    exactly what TopK over the whole row gives: equal values straddling blocks (the lower index
    first, even in a block whose maximum ranks lower), a row of one value, a row of -inf but one."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(8, vocab, generator=g).log_softmax(-1)
    x[0, [1, vocab // 2, vocab - 1]] = 0.0  # one best value in three blocks
    x[1] = -3.0  # a row of one value
    x[2, : vocab // 2] = -0.5  # a run of equal best values across blocks
    x[3, ::3] = -0.25  # equal best values spread over every block
    x[4, [vocab - 1, 0, vocab // 3]] = torch.tensor([0.0, -0.1, -0.1])  # a tie between the best block and lower ones
    x[5] = NEG_INF  # a constrained row: one token allowed
    x[5, vocab - 1] = 0.0
    for k in sorted({min(k, vocab) for k in (1, 2, 8, 32, vocab)}):
        expected = onnx_top_k(x, k)
        for maxima in (None, block_maxima(x)):  # computed here, or handed over as the decoder graph does
            values, tokens = row_top_k(x, k, maxima)
            assert torch.equal(values, expected[0]) and torch.equal(tokens, expected[1]), (vocab, k)
    assert block_maxima(x).shape == (8, -(-vocab // TOP_K_BLOCK))
    assert row_top_k(x[:0], 2)[0].shape == (0, 2)


def test_a_sequence_without_any_live_candidate_is_done():
    scores = torch.tensor([NEG_INF, 0.0])
    log_probs = torch.zeros(2, 5)
    got = vectorised_step(scores, log_probs, [1, 1], [2, 2], [False, False], [0, 0])
    assert got[0] == ([], [], True) and not got[1][2]


def test_every_search_path_computes_the_same_output_limit_for_ratio_1_3_and_90_pieces():
    """90 * 1.3 + 10 is 127. In float32 (max_length_ratio's wire type; training.seq2seq.search and the
    CTranslate2 path computed in it) 1.3 * 90 truncates to 116, so they allowed 126 tokens while
    the server (float64) allowed 127; now all read the ratio as the decimal 1.3 and agree on 127."""
    cfg = ModelConfig(**{**tiny_config("vanilla").to_dict(), "max_positions": 256})
    cap = cfg.max_positions - 1
    src = torch.full((1, 90), 5)
    options = DecodingOptions(max_len_a=1.3, max_len_b=10)
    assert output_limit(90, 1.3, 10, cap) == 127
    assert options.output_limit(90, cap, Limits(max_output_tokens=1000)) == 127
    assert _max_lengths(src, cfg.pad_id, 1.3, 10, cfg.max_positions).tolist() == [127]
    assert max_lengths(cfg, [90], 1.3, 10) == [127]
    wire = float(torch.tensor(1.3, dtype=torch.float32))  # what a gRPC client's 1.3 arrives as
    assert output_limit(90, wire, 10, cap) == 127


@pytest.mark.parametrize("a, n, b, expected", [(0.29, 100, 0, 29), (1.5, 7, 10, 20), (0.0, 50, 0, 1), (10.0, 90, 0, 200)])
def test_the_output_limit_is_a_times_n_plus_b_rounded_down_at_least_1_at_most_the_cap(a, n, b, expected):
    assert output_limit(n, a, b, 200) == expected
