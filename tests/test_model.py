"""Invariants of the model family (docs/GRET.md and docs/MODEL.md)."""
from __future__ import annotations

import pytest
import torch

from tests.architectures import ARCHITECTURES, length_classes, perturb, random_batch, step_case, tiny_config
from kernels.routing import capsule_routing, capsule_routing_votes, masked_mean, squash
from training.seq2seq.layers import EncoderLayer, Packing
from training.seq2seq.model import Seq2Seq, row_groups
from training.seq2seq.multiview import view_index
from training.seq2seq.positions import choose_mvpe_k, mvpe_objective, sinusoid_table
from training.seq2seq.search import beam_search, greedy

torch.set_num_threads(1)
ALL = sorted(ARCHITECTURES)


def build(name: str, **overrides) -> Seq2Seq:
    torch.manual_seed(0)
    return perturb(Seq2Seq(tiny_config(name, **overrides)))


def teacher_forced_log_probs(model, src, tags, tgt_in):
    return torch.log_softmax(model(src, tgt_in, tags), -1)


@pytest.mark.parametrize("name", ALL)
def test_padding_and_batch_invariance(name):
    model = build(name)
    src, tags = random_batch(model.cfg, [7, 3, 5])
    tgt = torch.randint(4, model.cfg.vocab_size, (3, 4))
    together = teacher_forced_log_probs(model, src, tags, tgt)
    for i, n in enumerate([7, 3, 5]):
        alone = teacher_forced_log_probs(model, src[i: i + 1, :n], None if tags is None else tags[i: i + 1, :n],
                                         tgt[i: i + 1])
        torch.testing.assert_close(together[i: i + 1], alone, atol=1e-5, rtol=1e-4)


def test_the_encoder_computes_real_tokens_only_and_gives_what_the_padded_layers_give():
    encoder = build("vanilla").encoder.eval()
    x = torch.randn(3, 7, encoder.norm.normalized_shape[0])
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 4:], pad[2, 1:] = True, True
    padded = x
    with torch.no_grad():
        views = encoder(x, pad)
        for i, layer in enumerate(encoder.layers):  # the same layers on every slot, padding included
            padded = layer.res_attn(padded, lambda h: layer.self_attn(h, key_pad=pad))
            padded = layer.res_ffn(padded, layer.ffn)
            want = encoder.norm(padded) if i == len(encoder.layers) - 1 else padded
            torch.testing.assert_close(views[i][~pad], want[~pad], atol=1e-6, rtol=1e-5)
            assert views[i][pad].eq(views[i][0, 0]).all()  # padding is never computed: it reads token 0


def test_packing_round_trips_the_real_tokens_in_order():
    pad = torch.tensor([[False, False, True], [False, True, True], [False, False, False]])
    x = torch.arange(9.0).view(3, 3, 1)
    packing = Packing(pad)
    assert packing.pack(x).flatten().tolist() == [0, 1, 3, 6, 7, 8]
    torch.testing.assert_close(packing.unpack(packing.pack(x)), torch.where(pad[..., None], x[0, 0], x))


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("beam", [1, 3])
def test_cached_incremental_decoding_equals_teacher_forcing(name, beam):
    model = build(name)
    src, tags = random_batch(model.cfg, [6, 4])
    steps = 5
    g = torch.Generator().manual_seed(1)
    tgt = torch.randint(4, model.cfg.vocab_size, (2 * beam, steps), generator=g)
    tgt[:, 0] = model.cfg.bos_id
    # Reference: every row teacher-forced against its own (tiled) source.
    tiled_src = src.repeat_interleave(beam, 0)
    tiled_tags = None if tags is None else tags.repeat_interleave(beam, 0)
    reference = teacher_forced_log_probs(model, tiled_src, tiled_tags, tgt)
    # Incremental: the encoder state is per sentence, rows read it by row // beam.
    enc, cache = model.encode(src, tags), None
    for t in range(steps):
        log_probs, cache = model.decode_step(tgt[:, t], t, enc, cache, beam)
        torch.testing.assert_close(log_probs, reference[:, t], atol=1e-5, rtol=1e-4)


def test_rows_join_their_sentences_groups_in_row_order():
    """Rows in any order: each sentence's rows fill its group in row order, and a group narrower than
    the widest is padded with R (no row); a row of sentence -1 joins no group and reads sentence 0.
    A sentence past the last is refused: the grouping is compiled code, which checks no index."""
    sentence, row_slot, group_rows = row_groups(torch.tensor([1, 0, -1, 1, 2, 1]), 3)
    assert sentence.tolist() == [1, 0, 0, 1, 2, 1]
    assert group_rows.tolist() == [[1, 6, 6], [0, 3, 5], [4, 6, 6]]
    assert row_slot.tolist() == [3, 0, 0, 4, 6, 5]  # sentence * 3 + its place in the group
    with pytest.raises(IndexError):
        row_groups(torch.tensor([0, 3]), 2)


@pytest.mark.parametrize("name", ALL)
def test_a_step_over_length_classes_gives_what_one_padded_batch_gives(name):
    """Sentences kept in length classes, each padded to its own longest source (the serving
    engine's layout), numbered one class after another: each row reads its sentence's K/V in its
    class and gets the log-probabilities it gets from one batch padded to the longest source."""
    model = build(name).eval()
    src, tags = random_batch(model.cfg, [9, 3, 4, 8])
    enc = model.encode(src, tags)
    row_sentence = [0, 0, 1, 2, 1, 2, 3, -1, 3]  # -1: an empty row
    tokens, positions, cache = step_case(model.cfg, row_sentence)
    classed = {1: 0, 2: 1, 0: 2, 3: 3, -1: -1}  # short: sentences 1 and 2, long: 0 and 3
    with torch.no_grad():
        one = model.step(tokens, positions, torch.tensor(row_sentence), enc, [(k.clone(), v.clone()) for k, v in cache])
        two = model.step(tokens, positions, torch.tensor([classed[b] for b in row_sentence]),
                         length_classes(enc, [[1, 2], [0, 3]]), cache)
    real = torch.tensor(row_sentence) >= 0
    torch.testing.assert_close(two[real], one[real], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["vanilla", "gret_full", "multiview_gca", "graph_weight_gate_half", "mvpe_pos"])
def test_beam_one_equals_greedy(name):
    model = build(name)
    src, tags = random_batch(model.cfg, [6, 4, 9])
    greedy_out = greedy(model, src, tags)
    beam_out = [h[0].tokens for h in beam_search(model, src, tags, beam=1)]
    assert beam_out == greedy_out


def test_beam_search_returns_sorted_n_best_with_their_model_log_probs():
    model = build("gret_full")
    src, _ = random_batch(model.cfg, [6, 4, 9])
    results = beam_search(model, src, beam=4, n_best=3, length_penalty=0.0, max_len_a=1.0, max_len_b=3)
    for i, hyps in enumerate(results):
        max_len = int(src[i].ne(0).sum()) + 3
        assert len(hyps) == 3
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        best = hyps[0]
        tgt = torch.tensor([[model.cfg.bos_id] + best.tokens[: max_len - 1]])
        ended_by_eos = len(best.tokens) < max_len  # else it was cut at the length limit
        gold = torch.tensor(best.tokens + [model.cfg.eos_id] * ended_by_eos)
        log_probs = teacher_forced_log_probs(model, src[i: i + 1], None, tgt)[0]
        assert log_probs.gather(-1, gold[:, None]).sum().item() == pytest.approx(best.log_prob, abs=1e-4)


# ---- GRET ------------------------------------------------------------------------------
def routing_inputs(g=3, s=7, d=12, k=5, dc=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(g, s, d, generator=gen)
    pad = torch.zeros(g, s, dtype=torch.bool)
    pad[1, 4:] = True
    pad[2, 1:] = True  # a one-token sentence
    w = torch.randn(k, d, dc, generator=gen) * 0.3
    return h, pad, w


@pytest.mark.parametrize("scale", [1.0, 0.125])
@pytest.mark.parametrize("iters", [1, 2, 3, 5])
def test_factorised_routing_equals_algorithm_1_over_its_votes(iters, scale):
    """The form training runs (u_hat never built) and the form the ONNX backend runs (u_hat by one
    GEMM, the iterations compiled by Numba) agree, padding read nowhere: not after a sentence, not
    before one, not in a group that is all padding."""
    h, pad, w = routing_inputs()
    pad = torch.cat([pad, torch.tensor([[True, True, False, False, False, True, True], [True] * 7])])
    h = torch.cat([h, torch.randn(2, *h.shape[1:])])
    h[pad] = 1e3
    votes = capsule_routing_votes(h, pad, w, iters, scale=scale)
    expected = capsule_routing(h[:-1], pad[:-1], w, iters, scale=scale)
    torch.testing.assert_close(votes[:-1], expected, atol=1e-5, rtol=1e-4)
    assert (votes[-1] == 0).all()  # the squashed mean of nothing (the reference's softmax has no answer there)


def test_one_iteration_is_squashed_transform_of_masked_mean():
    h, pad, w = routing_inputs()
    expected = squash(torch.einsum("gd,kdc->gkc", masked_mean(h, pad), w))
    torch.testing.assert_close(capsule_routing(h, pad, w, 1), expected)


def test_shared_transform_makes_capsules_identical_and_norms_below_one():
    h, pad, w = routing_inputs()
    u = capsule_routing(h, pad, w[:1].expand_as(w).contiguous(), 3)
    torch.testing.assert_close(u, u[:, :1].expand_as(u))
    assert (capsule_routing(h, pad, w, 3).norm(dim=-1) < 1).all()


def test_routing_ignores_padding_values():
    h, pad, w = routing_inputs()
    noisy = h.clone()
    noisy[pad] = 1e3
    torch.testing.assert_close(capsule_routing(noisy, pad, w, 3), capsule_routing(h, pad, w, 3))


def test_closed_gate_reproduces_the_baseline_logits():
    """W_g = 0 and b_g -> -inf: g = 0, so r_bar = r and GRET's output equals the vanilla head."""
    model = build("gret_full")
    with torch.no_grad():
        model.context_gate.w_r.weight.zero_()
        model.context_gate.w_s.weight.zero_()
        model.context_gate.w_s.bias.fill_(-1e4)
    src, _ = random_batch(model.cfg, [6, 4])
    tgt = torch.randint(4, model.cfg.vocab_size, (2, 5))
    enc = model.encode(src)
    x = model.embed_tokens(tgt)
    for layer, memory in zip(model.decoder, enc.memory):
        x = layer(x, memory, enc.src_pad)
    baseline = torch.nn.functional.linear(model.dec_norm(x), model.embed.weight)
    torch.testing.assert_close(model.decode(tgt, enc), baseline)


# ---- multi-view ------------------------------------------------------------------------
def test_gca_mapping_reverses_layers_and_handles_unequal_depths():
    assert [view_index("gca", i, 6, 6) for i in range(1, 7)] == [6, 5, 4, 3, 2, 1]
    assert [view_index("gpa", i, 6, 6) for i in range(1, 7)] == [1, 2, 3, 4, 5, 6]
    assert [view_index("fga", i, 6, 6) for i in range(1, 7)] == [1] * 6
    assert [view_index("gca", i, 6, 3) for i in range(1, 4)] == [6, 3, 1]  # 6 - round(2.5) = 3 (half up)
    assert [view_index("gca", i, 2, 3) for i in range(1, 4)] == [2, 1, 1]


def test_zero_initialised_fma_and_ama_start_from_the_top_layer():
    """At the start of continued learning FMA gives LN_i(S_N) and AMA the mean of the views."""
    for strategy in ("fma", "ama"):
        torch.manual_seed(0)
        model = Seq2Seq(tiny_config(f"multiview_{strategy}")).eval()
        src, _ = random_batch(model.cfg, [6, 4])
        views = model.encoder(model.embed_source(src, None), src.eq(0))
        memories = model.multiview(views)
        expected = views[-1] if strategy == "fma" else torch.stack(views).mean(0)
        for norm, memory in zip(model.multiview.norms, memories):
            torch.testing.assert_close(memory, norm(expected + views[-1]))


# ---- mvPE --------------------------------------------------------------------------------
def test_mvpe_k_is_the_smallest_k_within_one_percent_of_the_plateau():
    k = choose_mvpe_k(512, 100)
    objective = mvpe_objective(torch.arange(1, 3001), 512, 100)
    assert objective[k - 1] >= 0.99 * objective.max() > objective[k - 2]
    assert 250 <= k <= 350  # docs/MODEL.md: about 300 for D=512, L=100


def test_mvpe_objective_matches_the_pairwise_definition():
    table = sinusoid_table(20, 16, k=3)[1:]
    direct = torch.pdist(table.double()).sum()
    torch.testing.assert_close(mvpe_objective(torch.tensor([3]), 16, 20)[0], direct, rtol=1e-5, atol=1e-3)


def test_k_one_is_the_standard_table():
    table = sinusoid_table(10, 8)
    assert table[0, 1] == 1.0 and table[0, 0] == 0.0
    torch.testing.assert_close(sinusoid_table(10, 8, k=4)[1], table[4])


def test_pos_source_words_read_the_tied_table_at_its_scale():
    """[sqrt(d_emb) E[w] + PE ; tag]: E is the first D - 64 columns of the one shared table."""
    pos = Seq2Seq(tiny_config("mvpe_pos", pos_dim=16)).eval()
    assert pos.num_parameters() == Seq2Seq(tiny_config("mvpe")).num_parameters()  # no second vocabulary
    src, tags = random_batch(pos.cfg, [6])
    d_word = pos.cfg.d_model - 16
    words = pos.embed.weight[src, :d_word] * d_word ** 0.5 + pos.src_positions[:6]
    torch.testing.assert_close(pos.embed_source(src, tags), torch.cat([words, pos.tag_table[tags]], -1))


# ---- Graph-Transformer ------------------------------------------------------------------
def test_graph_layer_one_with_sum_fusion_is_a_standard_encoder_layer():
    graph = build("graph_sum")
    layer1 = graph.encoder.layers[0]
    standard = EncoderLayer(graph.cfg).eval()
    with torch.no_grad():
        for part in ("q", "k", "v", "o"):
            getattr(standard.self_attn, part).load_state_dict(getattr(layer1.high, part).state_dict())
        standard.ffn.load_state_dict(layer1.ffn.state_dict())
        standard.res_attn.norm.load_state_dict(layer1.norm_n.state_dict())
        standard.res_ffn.norm.load_state_dict(layer1.norm_f.state_dict())
    x = torch.randn(2, 5, graph.cfg.d_model)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    a, n = layer1(torch.zeros_like(x), x, pad)
    packing = Packing(pad)
    torch.testing.assert_close(packing.pack(a + n), standard(packing.pack(x), packing))


def test_shared_qkv_uses_six_input_projections_per_layer():
    def projections(model):
        layer = model.encoder.layers[1]
        return sum(isinstance(m, torch.nn.Linear) for name, m in layer.named_modules()
                   if name.split(".")[-1] in ("q", "k", "v"))

    assert projections(build("graph_sum")) == 9
    assert projections(build("graph_self_gate_shared")) == 6


def test_half_dim_halves_the_attention_width():
    assert build("graph_weight_gate_half").encoder.layers[1].high.q.out_features == tiny_config("vanilla").d_model // 2


def test_scaled_global_state_sits_on_the_decoder_states_scale():
    """global_norm: s^M is LayerNormed, so its norm is about sqrt(D) like the decoder state r it is
    added to; in the paper's form it is a small vector (issue: the output term changed nothing)."""
    torch.manual_seed(0)
    src, _ = random_batch(tiny_config("gret_full"), [6, 4, 5])
    d = tiny_config("gret_full").d_model
    scaled = Seq2Seq(tiny_config("gret_full_scaled")).eval()
    norms = scaled.encode(src).global_state.norm(dim=-1)
    assert torch.allclose(norms, torch.full_like(norms, d ** 0.5), rtol=0.05)
    pool = scaled.global_state.pool_out
    assert not pool.w1.bias.any() and not pool.w2.bias.any()  # global_zero_bias
    assert not scaled.context_gate.w_s.bias.detach().any()


def test_routing_scale_softens_the_coupling():
    """Routing logits are dot products of LayerNormed states (norm ~ sqrt(D)): unscaled, a capsule
    couples to a few positions; divided by sqrt(D), the coupling spreads over the sentence."""
    from kernels.routing import capsule_routing_reference

    cfg = tiny_config("gret_capsule", routing_scale=True)
    model = Seq2Seq(cfg)
    assert cfg.routing_logit_scale == pytest.approx(cfg.d_model ** -0.5)
    assert tiny_config("gret_capsule").routing_logit_scale == 1.0
    g = torch.Generator().manual_seed(0)
    h = torch.nn.functional.layer_norm(torch.randn(4, 12, cfg.d_model, generator=g), (cfg.d_model,))
    pad = torch.zeros(4, 12, dtype=torch.bool)
    peak = {scale: capsule_routing_reference(h, pad, model.global_state.capsule_w.detach(), 3, coupling=True,
                                             scale=scale)[1].max(-1).values.mean()
            for scale in (1.0, cfg.routing_logit_scale)}
    assert peak[cfg.routing_logit_scale] < peak[1.0]
