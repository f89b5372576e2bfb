"""Triton kernels vs their PyTorch references (kernels/), the model on the Triton path, and the
encoder cache. On a machine without a GPU the kernels run in the Triton interpreter
(TRITON_INTERPRET=1, set in conftest.py before triton is imported); set TRITON_INTERPRET=0 on a
CUDA machine to run the same parity tests on the compiled kernels."""
from __future__ import annotations

import os
import threading

import pytest
import torch

import kernels
from kernels import context_gate, cross_attention, routing
from server.engine.encoder_cache import CachedEncoder, EncoderCache, encode_cached
from tests.architectures import perturb, random_batch, tiny_config
from training.seq2seq.model import Seq2Seq
from training.seq2seq.search import beam_search, greedy

torch.set_num_threads(1)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
# Tolerances: fp32 kernels accumulate in fp32 like the reference; fp16 compares the kernel with the
# reference run in fp16 (both round intermediates to fp16, at different points).
FP32 = dict(atol=1e-5, rtol=1e-4)
FP16 = dict(atol=1e-2, rtol=1e-2)
# bf16 keeps 8 significant bits to fp16's 11: one rounding step at magnitude 2 is already 2^-6 (0.016),
# which the compiled kernels showed on CUDA (docs/results/gpu-h200/).
BF16 = dict(atol=2e-2, rtol=2e-2)
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif(
              INTERPRET, reason="triton 3.9's interpreter computes tl.dot on bf16 bit patterns as integers"))]


def tol(dtype):
    return {torch.float32: FP32, torch.float16: FP16, torch.bfloat16: BF16}[dtype]


def randn(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE)


def right_pad(lengths, width):
    return torch.arange(width)[None, :] >= torch.tensor(lengths)[:, None]


# ---- routing ---------------------------------------------------------------------------------
ROUTING_SHAPES = {  # G sentences, their lengths, D, K capsules, d_c, iterations
    "one sentence, one token": ([1], 16, 1, 16, 1),
    "odd sizes, heavy padding": ([13, 1, 2, 13, 7], 24, 7, 10, 3),
    "K > BLOCK_K, S and D over several tiles": ([40, 3, 33], 70, 33, 12, 4),
    "G > BLOCK_R": ([5, 2, 4] * 24, 16, 3, 16, 2),
    "wide D (smaller R1 tiles)": ([20, 6], 264, 17, 16, 2),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(ROUTING_SHAPES))
def test_routing_matches_reference(case, dtype):
    lengths, d, k, c, iters = ROUTING_SHAPES[case]
    gen = torch.Generator().manual_seed(0)
    pad = right_pad(lengths, max(lengths)).to(DEVICE)
    h = randn(len(lengths), max(lengths), d, gen=gen)
    h[pad] = 1e3  # pad values must not leak in
    w = randn(k, d, c, gen=gen, scale=d ** -0.5)
    h, w = h.to(dtype), w.to(dtype)
    got = routing.capsule_routing_triton(h, pad, w, iters)
    want = routing.capsule_routing_reference(h, pad, w, iters)
    torch.testing.assert_close(got, want, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_routing_temperature_matches_reference(dtype):
    """The routing-logit scale (routing_scale: 1/sqrt(D)) is applied inside the kernel's softmax."""
    lengths, d, k, c, iters = ROUTING_SHAPES["odd sizes, heavy padding"]
    gen = torch.Generator().manual_seed(1)
    pad = right_pad(lengths, max(lengths)).to(DEVICE)
    h = randn(len(lengths), max(lengths), d, gen=gen, scale=4.0).to(dtype)
    w = randn(k, d, c, gen=gen, scale=d ** -0.5).to(dtype)
    got = routing.capsule_routing_triton(h, pad, w, iters, scale=d ** -0.5)
    want = routing.capsule_routing_reference(h, pad, w, iters, scale=d ** -0.5)
    torch.testing.assert_close(got, want, **tol(dtype))
    assert not torch.allclose(want.float(), routing.capsule_routing_reference(h, pad, w, iters).float(), atol=1e-3)


# ---- context gate ----------------------------------------------------------------------------
GATE_SHAPES = {  # sentences, beam, T, D
    "one row": (1, 1, 1, 16),
    "beam 4, odd D": (3, 4, 1, 24),
    "teacher forcing T=5, D over two tiles": (2, 3, 5, 70),
    "rows > BLOCK_R": (33, 1, 1, 32),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [True, False], ids=["pre_norm", "post_norm"])
@pytest.mark.parametrize("case", list(GATE_SHAPES))
def test_context_gate_matches_reference(case, with_norm, dtype):
    b, beam, t, d = GATE_SHAPES[case]
    gen = torch.Generator().manual_seed(1)
    h = randn(b * beam, t, d, gen=gen, scale=2.0) + 0.5
    w_r = randn(d, d, gen=gen, scale=d ** -0.5)
    s, gs = randn(b, d, gen=gen), randn(b, d, gen=gen)
    norm = (randn(d, gen=gen).to(dtype), randn(d, gen=gen).to(dtype), 1e-5) if with_norm else None
    args = [x.to(dtype) for x in (h, w_r, s, gs)]
    got = context_gate.gated_output_triton(*args, beam, norm)
    want = context_gate.gated_output_reference(*args, beam, norm)
    torch.testing.assert_close(got, want, **tol(dtype))


# ---- multi-view memory build -----------------------------------------------------------------
MEMORY_SHAPES = {  # views, lengths, D, heads, decoder layers, soft integration
    "GCA soft, 3 layers": (3, [5, 2], 32, 4, 3, True),
    "replacement, one sentence, one token": (1, [1], 16, 1, 2, False),
    "d_h = 8, rows and columns over several tiles": (2, [30, 11, 30], 40, 5, 2, True),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(MEMORY_SHAPES))
def test_memory_build_matches_reference(case, dtype):
    n_views, lengths, d, heads, n_dec, soft = MEMORY_SHAPES[case]
    gen = torch.Generator().manual_seed(2)
    b, s = len(lengths), max(lengths)
    sources = randn(n_views, b, s, d, gen=gen).to(dtype)
    last = sources[-1] if soft else None
    index = [n_views - 1 - i % n_views for i in range(n_dec)]
    norms = [(randn(d, gen=gen).to(dtype), randn(d, gen=gen).to(dtype), 1e-5) for _ in range(n_dec)] if soft else None
    projections = [tuple(randn(*shape, gen=gen, scale=0.2).to(dtype) for shape in ((d, d), (d,), (d, d), (d,)))
                   for _ in range(n_dec)]
    got = cross_attention.memory_kv_triton(sources, index, last, norms, projections, heads)
    want = cross_attention.memory_kv_reference(sources, index, last, norms, projections, heads)
    for (k1, v1), (k2, v2) in zip(got, want):
        torch.testing.assert_close(k1, k2, **tol(dtype))
        torch.testing.assert_close(v1, v2, **tol(dtype))


# ---- beam-grouped attention ------------------------------------------------------------------
ATTENTION_SHAPES = {  # lengths (None = no key padding), beam, T, heads, d_h
    "one sentence, one key, beam 1": ([1], 1, 1, 1, 16),
    "beam 4, heavy padding, a one-token source": ([13, 1, 6], 4, 1, 2, 16),
    "S over two tiles, T = 2, d_h = 8": ([70, 64, 3], 3, 2, 4, 8),
    "no key padding (decoder self-attention), beam 1": (None, 1, 1, 2, 24),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(ATTENTION_SHAPES))
def test_grouped_attention_matches_reference(case, dtype):
    lengths, beam, t, heads, dh = ATTENTION_SHAPES[case]
    gen = torch.Generator().manual_seed(3)
    b, s = (len(lengths), max(lengths)) if lengths else (5, 9)
    key_pad = right_pad(lengths, s).to(DEVICE) if lengths else None
    q = randn(b * beam, heads, t, dh, gen=gen).to(dtype)
    k, v = randn(b, heads, s, dh, gen=gen), randn(b, heads, s, dh, gen=gen)
    if key_pad is not None:  # padded keys must not leak in
        k.masked_fill_(key_pad[:, None, :, None], 1e3)
        v.masked_fill_(key_pad[:, None, :, None], 1e3)
    k, v = k.to(dtype), v.to(dtype)
    got = cross_attention.grouped_attention_triton(q, k, v, key_pad, beam)
    want = cross_attention.grouped_attention_reference(q, k, v, key_pad, beam)
    torch.testing.assert_close(got, want, **tol(dtype))


# ---- dispatch --------------------------------------------------------------------------------
def test_dispatch_rule():
    x, w = torch.zeros(2), torch.zeros(2, requires_grad=True)
    assert kernels.use_triton(x) == x.is_cuda
    with kernels.force_triton():
        assert kernels.use_triton(x)
        assert not kernels.use_triton(x, w)  # recording gradients: the kernels have no backward
        with torch.no_grad():
            assert kernels.use_triton(x, w)
        with kernels.use_reference():
            assert not kernels.use_triton(x)
    assert kernels.use_triton(x) == x.is_cuda


# ---- the whole model on the Triton path --------------------------------------------------------
WHOLE_MODELS = {  # GRET + multi-view (every kernel), and a post-norm GRET (no LN_out, no multi-view)
    "gret_full+gca": dict(name="gret_full", multiview="gca", dec_layers=3),
    "gret_aggregate_gate_post_norm": dict(name="gret_aggregate_gate_post_norm"),
}


def count_triton_calls(monkeypatch) -> dict[str, int]:
    calls = {}

    def counting(name, kernel):
        def counted(*args, **kw):
            calls[name] = calls.get(name, 0) + 1
            return kernel(*args, **kw)
        return counted

    for module, name in [(routing, "capsule_routing_triton"), (context_gate, "gated_output_triton"),
                         (cross_attention, "memory_kv_triton"), (cross_attention, "grouped_attention_triton")]:
        monkeypatch.setattr(module, name, counting(name, getattr(module, name)))
    return calls


@pytest.mark.parametrize("arch", list(WHOLE_MODELS))
def test_model_decodes_the_same_on_the_triton_path(arch, monkeypatch):
    torch.manual_seed(0)
    overrides = dict(WHOLE_MODELS[arch])
    model = perturb(Seq2Seq(tiny_config(overrides.pop("name"), **overrides))).to(DEVICE)
    src, _ = random_batch(model.cfg, [7, 3])
    src = src.to(DEVICE)
    steps = dict(max_len_a=0.5, max_len_b=2)  # a few steps: the interpreter runs every program in Python
    with kernels.use_reference():
        ref_enc = model.encode(src)
        ref_greedy = greedy(model, src, **steps)
        ref_beam = beam_search(model, src, beam=3, n_best=2, **steps)
    calls = count_triton_calls(monkeypatch)
    with kernels.force_triton(), torch.no_grad():
        enc = model.encode(src)
        got_greedy = greedy(model, src, **steps)
        got_beam = beam_search(model, src, beam=3, n_best=2, **steps)
    expected = {"gated_output_triton", "memory_kv_triton", "grouped_attention_triton"}
    assert set(calls) == expected | ({"capsule_routing_triton"} if model.cfg.capsule else set())
    torch.testing.assert_close(enc.global_state, ref_enc.global_state, **FP32)
    torch.testing.assert_close(enc.gate_source, ref_enc.gate_source, **FP32)
    for (k1, v1), (k2, v2) in zip(enc.memory, ref_enc.memory):
        torch.testing.assert_close(k1, k2, **FP32)
        torch.testing.assert_close(v1, v2, **FP32)
    assert got_greedy == ref_greedy
    for got, want in zip(got_beam, ref_beam):
        assert [h.tokens for h in got] == [h.tokens for h in want]
        assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-4)


# ---- encoder cache -----------------------------------------------------------------------------
def counting_encoder(model):
    batches = []
    encode = model.encode

    def counted(src, tags=None):
        batches.append(src.shape[0])
        return encode(src, tags)
    model.encode = counted  # instance attribute: shadows the method for this model only
    return batches


@pytest.fixture
def gret_model():
    torch.manual_seed(0)
    return perturb(Seq2Seq(tiny_config("gret_full", multiview="gca")))


def test_repeated_source_skips_the_encoder_and_decodes_identically(gret_model):
    src, _ = random_batch(gret_model.cfg, [7, 3, 5])
    expected = beam_search(gret_model, src, beam=3, max_len_b=4)
    batches = counting_encoder(gret_model)
    cache = EncoderCache(max_bytes=1 << 20)
    cached = CachedEncoder(gret_model, cache, version="v1")
    first = beam_search(cached, src, beam=3, max_len_b=4)
    second = beam_search(cached, src, beam=3, max_len_b=4)
    assert batches == [3]  # one encoder pass, for the first request only
    assert cache.stats()["hits"] == 3 and cache.stats()["misses"] == 3
    assert [[(h.tokens, h.score) for h in hyps] for hyps in second] == \
           [[(h.tokens, h.score) for h in hyps] for hyps in first]
    assert [hyps[0].tokens for hyps in first] == [hyps[0].tokens for hyps in expected]


def test_partial_hits_encode_only_the_misses_and_match_a_joint_encode(gret_model):
    cfg = gret_model.cfg
    src, _ = random_batch(cfg, [7, 3, 5, 6], seed=4)
    ids = [row[row.ne(cfg.pad_id)].tolist() for row in src]
    batches = counting_encoder(gret_model)
    cache = EncoderCache(max_bytes=1 << 20)
    encode_cached(gret_model, cache, "v1", [ids[1]])
    enc = encode_cached(gret_model, cache, "v1", ids + [ids[0]])  # a duplicate in the batch too
    assert batches == [1, 3]  # misses only, each distinct source once
    encode_cached(gret_model, cache, "v2", [ids[1]])  # another model version never shares entries
    assert batches == [1, 3, 1]
    joint = gret_model.__class__.encode(gret_model, torch.cat([src, src[:1]]))
    assert torch.equal(enc.src_pad, joint.src_pad)
    keep = ~joint.src_pad[:, None, :, None]
    for (k1, v1), (k2, v2) in zip(enc.memory, joint.memory):
        torch.testing.assert_close(k1 * keep, k2 * keep, **FP32)
        torch.testing.assert_close(v1 * keep, v2 * keep, **FP32)
    torch.testing.assert_close(enc.global_state, joint.global_state, **FP32)
    tokens = torch.full((5,), cfg.bos_id)
    with torch.no_grad():
        torch.testing.assert_close(gret_model.decode_step(tokens, 0, enc, None)[0],
                                   gret_model.decode_step(tokens, 0, joint, None)[0], **FP32)


def test_eviction_keeps_the_cache_within_its_byte_budget(gret_model):
    cfg = gret_model.cfg
    sources = [[5 + i, 6, 7, cfg.eos_id] for i in range(5)]  # equal lengths: equal entry sizes
    probe = EncoderCache(max_bytes=1 << 20)
    encode_cached(gret_model, probe, "v", sources[:1])
    entry = probe.stats()["bytes"]
    cache = EncoderCache(max_bytes=int(2.5 * entry))  # room for two entries
    for i in range(3):
        encode_cached(gret_model, cache, "v", [sources[i]])
    assert cache.stats()["bytes"] <= cache.max_bytes and len(cache) == 2 and cache.evictions == 1
    encode_cached(gret_model, cache, "v", [sources[1]])  # touch: 1 becomes most recently used
    encode_cached(gret_model, cache, "v", [sources[3]])  # evicts 2, the least recently used
    keys = {key[1] for key in cache._entries}
    assert keys == {tuple(sources[1]), tuple(sources[3])} and cache.evictions == 2
    tiny = EncoderCache(max_bytes=entry - 1)
    encode_cached(gret_model, tiny, "v", [sources[0]])
    assert len(tiny) == 0 and tiny.rejected == 1 and tiny.bytes == 0


def test_cache_counters_and_bytes_stay_consistent_under_threads(gret_model):
    enc = encode_cached(gret_model, EncoderCache(1 << 20), "v", [[5, 6, gret_model.cfg.eos_id]])
    size = enc.nbytes
    cache = EncoderCache(max_bytes=10 * size)

    def worker(seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(200):
            key = ("v", (int(torch.randint(0, 30, (1,), generator=g)),), None)
            if cache.get(key) is None:
                cache.put(key, enc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = cache.stats()
    assert stats["hits"] + stats["misses"] == 800
    assert stats["bytes"] == size * stats["entries"] <= cache.max_bytes
