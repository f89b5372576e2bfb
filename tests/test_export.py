"""ONNX export: every architecture's graphs give the PyTorch log-probabilities, beam search on the
ONNX Runtime backend gives the PyTorch outputs on real sentences, int8 graphs run, and bad input
is refused clearly.

Parity tolerance: log-probabilities within atol 1e-4 + rtol 1e-4 (fp32; observed differences are
about 1e-5, from ONNX Runtime's fused kernels and a different summation order)."""
from __future__ import annotations

import dataclasses
import inspect
import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from export.__main__ import main as export_main
from export.manifest import MANIFEST, read_manifest, sha256
from export.onnx_export import ExportError, export_onnx, signature_errors
from export.repository import write_repository
from export import onnx_runtime
from export.onnx_runtime import OnnxModel, beam_search, greedy
from export.spec import decoder_spec, encoder_spec, export_sources, model_specs
from tests.architectures import ARCHITECTURES, length_classes, perturb, random_batch, step_case, tiny_config
from training.corpora import load_examples
from training.data import train_sentencepiece
from training.seq2seq import search
from training.seq2seq.beam import block_maxima, row_top_k
from training.seq2seq.checkpoint import TARGET_PIECES, load_checkpoint, save_checkpoint
from training.seq2seq.config import Checkpoint, DataConfig
from training.decode import source_inputs
from training.seq2seq.inputs import EOS, load_sentencepiece, pad
from training.target_pieces import target_pieces
from training.seq2seq.model import Seq2Seq

torch.set_num_threads(1)
ALL = sorted(ARCHITECTURES)
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(scope="module")
def spm_bytes():
    examples = load_examples("multi30k", "train", "de", "en")[:200]
    return train_sentencepiece([e.source for e in examples] + [e.target for e in examples], 100)


def export_tiny(name: str, directory, spm: bytes, *export_args: str) -> tuple[Seq2Seq, OnnxModel]:
    torch.manual_seed(0)
    model = perturb(Seq2Seq(tiny_config(name)))  # moves zero-initialised weights, as test_model does
    save_checkpoint(directory / "checkpoint", model, Checkpoint(model.cfg, DataConfig()), spm)
    export_main(["--checkpoint", str(directory / "checkpoint"), "--out", str(directory / "repo"), *export_args])
    return model, OnnxModel(directory / "repo")


def within_sentence_shuffle(n_sent: int, beam: int, g: torch.Generator) -> torch.Tensor:
    """A beam-search-like reorder: each row takes the cache of some row of its own sentence."""
    return (torch.arange(n_sent)[:, None] * beam + torch.randint(0, beam, (n_sent, beam), generator=g)).flatten()


# ---- log-probability parity, every architecture ------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_onnx_log_probs_match_pytorch_over_steps_with_beams_and_padding(name, tmp_path, spm_bytes):
    model, onnx_model = export_tiny(name, tmp_path, spm_bytes)
    src, tags = random_batch(model.cfg, [6, 4, 9])  # padded sentences
    beam, steps = 3, 4
    ref_enc, enc = model.encode(src, tags), onnx_model.encode(src, tags)
    torch.testing.assert_close(enc.src_pad, ref_enc.src_pad, rtol=0, atol=0)
    for (k, v), (ref_k, ref_v) in zip(enc.memory, ref_enc.memory):
        torch.testing.assert_close(k, ref_k, **TOLERANCE)
        torch.testing.assert_close(v, ref_v, **TOLERANCE)
    if model.cfg.gret:
        torch.testing.assert_close(enc.global_state, ref_enc.global_state, **TOLERANCE)
    g = torch.Generator().manual_seed(1)
    ref_cache = cache = None
    for step in range(steps):
        tokens = torch.randint(4, model.cfg.vocab_size, (3 * beam,), generator=g)
        ref_log_probs, ref_cache = model.decode_step(tokens, step, ref_enc, ref_cache, beam)
        log_probs, cache = onnx_model.decode_step(tokens, step, enc, cache, beam)
        torch.testing.assert_close(log_probs, ref_log_probs, **TOLERANCE)
        rows = within_sentence_shuffle(3, beam, g)
        ref_cache = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in ref_cache]
        cache = onnx_model.reorder(cache, rows)


@pytest.mark.parametrize("name", ALL)
def test_the_onnx_step_reads_two_length_classes_as_the_model_reads_one_padded_batch(name, tmp_path, spm_bytes):
    """The graph's two length classes of sentences (the serving engine's layout), each padded to
    its own longest source: every row gets what the PyTorch step gives it over one padded batch."""
    model, onnx_model = export_tiny(name, tmp_path, spm_bytes)
    src, tags = random_batch(model.cfg, [9, 3, 4, 8])
    enc = onnx_model.encode(src, tags)
    row_sentence = [3, 0, 0, 1, 2, 1, 2, 3]
    tokens, positions, cache = step_case(model.cfg, row_sentence)
    classed = {1: 0, 2: 1, 0: 2, 3: 3}  # short: sentences 1 and 2, long: 0 and 3
    with torch.no_grad():
        want = model.step(tokens, positions, torch.tensor(row_sentence), model.encode(src, tags),
                          [(k.clone(), v.clone()) for k, v in cache])
    got = onnx_model.step(tokens, positions, torch.tensor([classed[b] for b in row_sentence]),
                          length_classes(enc, [[1, 2], [0, 3]]), [(k.contiguous(), v.contiguous()) for k, v in cache])
    torch.testing.assert_close(got, want, **TOLERANCE)


def test_rows_may_mix_beam_sizes_without_tiling_the_encoder_output(tmp_path, spm_bytes):
    """row_sentence lets sentences with beams 1, 3 and 2 share one decoder step."""
    model, onnx_model = export_tiny("gret_full", tmp_path, spm_bytes)
    src, _ = random_batch(model.cfg, [6, 4, 9])
    beams = [1, 3, 2]
    row_sentence = torch.repeat_interleave(torch.arange(3), torch.tensor(beams))
    enc = onnx_model.encode(src)
    assert enc.memory[0][0].shape[0] == 3  # one K/V entry per sentence
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(4, model.cfg.vocab_size, (2, len(row_sentence)), generator=g)
    cache = None
    ref = {i: (model.encode(src[i: i + 1]), None) for i in range(3)}
    for step in range(2):
        log_probs, cache = onnx_model.decode_step(tokens[step], step, enc, cache, row_sentence=row_sentence)
        for i, beam in enumerate(beams):
            mine = row_sentence.eq(i)
            ref_enc, ref_cache = ref[i]
            ref_log_probs, ref_cache = model.decode_step(tokens[step][mine], step, ref_enc, ref_cache, beam)
            ref[i] = ref_enc, ref_cache
            torch.testing.assert_close(log_probs[mine], ref_log_probs, **TOLERANCE)


def test_a_sentence_may_join_the_batch_later_and_each_row_reads_only_its_own_columns(tmp_path, spm_bytes):
    """Continuous batching: sentence 1 joins at step 2 next to sentence 0, in a cache as wide as
    sentence 0 needs and filled with junk. Each row carries its own position, the step writes its
    K/V in place at that column, and each sentence's log-probabilities are those of decoding it
    alone: a row reads its own columns and never the junk past them."""
    model, onnx_model = export_tiny("gret_full", tmp_path, spm_bytes)
    src, _ = random_batch(model.cfg, [6, 4])
    enc = onnx_model.encode(src)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(4, model.cfg.vocab_size, (4,), generator=g)
    alone = [model.encode(src[i: i + 1]) for i in range(2)]
    ref_cache = [None, None]
    shape = (2, model.cfg.n_heads, 6, model.cfg.d_model // model.cfg.n_heads)  # columns to spare
    cache = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(model.cfg.dec_layers)]
    for step in range(4):  # sentence 0 is at position `step`, sentence 1 at `step - 2` from step 2 on
        rows = torch.tensor([0, 1]) if step >= 2 else torch.tensor([0])
        positions = torch.tensor([step, step - 2])[: len(rows)]
        log_probs, _ = onnx_model.step_top(tokens[rows], positions, rows, enc,
                                           [(k[: len(rows)], v[: len(rows)]) for k, v in cache], 1)
        for row, sentence in enumerate(rows.tolist()):
            ref, ref_cache[sentence] = model.decode_step(tokens[sentence: sentence + 1], int(positions[row]),
                                                         alone[sentence], ref_cache[sentence])
            torch.testing.assert_close(log_probs[row: row + 1], ref, **TOLERANCE)
            for (k, v), (ref_k, ref_v) in zip(cache, ref_cache[sentence]):  # its columns, written in place
                torch.testing.assert_close(k[row, :, : positions[row] + 1], ref_k[0], **TOLERANCE)
                torch.testing.assert_close(v[row, :, : positions[row] + 1], ref_v[0], **TOLERANCE)


@dataclasses.dataclass
class Twins:
    """A tiny exported model twice: `onnx_model`, the backend under test, and `fresh`, a second
    backend over the same repository that every step is compared with; each holds its own copy of
    one random 3-row cache."""
    model: Seq2Seq
    onnx_model: OnnxModel
    fresh: OnnxModel
    enc: object
    fresh_enc: object
    cache: list
    fresh_cache: list
    g: torch.Generator

    def step(self, tokens, positions, row_sentence, cache) -> None:
        """onnx_model's step on `cache` (views of this cache's first rows) equals fresh's on the same
        rows of its copy, given as new objects, so that it derives everything afresh."""
        rows = len(row_sentence)
        log_probs, top = self.onnx_model.step_top(tokens, positions, row_sentence, self.enc, cache, 4)
        fresh_cache = [(k[:rows], v[:rows]) for k, v in self.fresh_cache]
        expected, expected_top = self.fresh.step_top(tokens, positions, row_sentence.clone(), self.fresh_enc,
                                                     fresh_cache, 4)
        assert torch.equal(log_probs, expected) and all(np.array_equal(a, b) for a, b in zip(top, expected_top))

    def caches_equal(self) -> bool:
        pairs = zip(self.cache, self.fresh_cache)
        return all(torch.equal(a, b) for kv, fresh_kv in pairs for a, b in zip(kv, fresh_kv))


def twins(tmp_path, spm_bytes, seed: int) -> Twins:
    model, onnx_model = export_tiny("vanilla", tmp_path, spm_bytes)
    fresh = OnnxModel(tmp_path / "repo")
    src, _ = random_batch(model.cfg, [5, 3])
    g = torch.Generator().manual_seed(seed)
    shape = (3, model.cfg.n_heads, 4, model.cfg.d_model // model.cfg.n_heads)
    cache = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(model.cfg.dec_layers)]
    return Twins(model, onnx_model, fresh, onnx_model.encode(src), fresh.encode(src), cache,
                 [(k.clone(), v.clone()) for k, v in cache], g)


def test_a_step_whose_row_layout_stays_reads_its_new_tokens_and_regroups_nothing(tmp_path, spm_bytes, monkeypatch):
    """The engine hands the step the very row_sentence, encoder state and cache objects while no
    row joins or leaves: the backend then reuses the row groups it derived (OnnxModel._layout) and
    gives ONNX Runtime only the new tokens and positions, copied into the tensors the last step bound
    (OnnxGraph.rerun: no other input or output is looked at). The log-probabilities and the cache are
    those of a model that derives everything afresh at every step; new row_sentence values (a new
    object) are grouped again."""
    t = twins(tmp_path, spm_bytes, seed=5)
    grouped, bound = [], []
    monkeypatch.setattr("export.onnx_runtime.layout_inputs",
                        lambda *args, real=onnx_runtime.layout_inputs: grouped.append(1) or real(*args))
    monkeypatch.setattr(t.onnx_model.decoder, "run",
                        lambda *args, real=t.onnx_model.decoder.run, **kw: bound.append(1) or real(*args, **kw))
    row_sentence = torch.tensor([0, 0, 1])
    for step in range(3):
        tokens = torch.randint(4, t.model.cfg.vocab_size, (3,), generator=t.g)
        t.step(tokens, torch.tensor([step, step, step]), row_sentence, t.cache)
    assert t.caches_equal()
    assert len(grouped) == 1 + 3  # this model's first step, and each of the fresh model's
    assert len(bound) == 1  # its later steps only rerun the binding
    t.onnx_model.step_top(tokens, torch.tensor([3, 3, 3]), torch.tensor([0, 1, 1]), t.enc, t.cache, 4)
    assert len(grouped) == 5 and len(bound) == 2


def test_a_row_count_that_comes_back_finds_its_own_input_tensors_and_the_steps_stay_exact(tmp_path, spm_bytes,
                                                                                           monkeypatch):
    """The step's small inputs are copied into the backend's own tensors, views of kept storage
    that OnnxGraph._owned keeps by shape: under load the row count moves at almost every step, and
    one it had before finds its view again. Steps of 3, 2 and again 3 rows give the
    log-probabilities of a model that binds afresh, and a further step of the last layout only
    reruns the binding."""
    t = twins(tmp_path, spm_bytes, seed=7)
    bound, bound_tokens = [], []
    monkeypatch.setattr(t.onnx_model.decoder, "run",
                        lambda *args, real=t.onnx_model.decoder.run, **kw: bound.append(1) or real(*args, **kw))
    layouts = [torch.tensor([0, 0, 1]), torch.tensor([0, 1]), torch.tensor([0, 1, 1])]
    views = [[(k[:len(r)], v[:len(r)]) for k, v in t.cache] for r in layouts]  # the cache's first rows
    for step, (row_sentence, rows_cache) in enumerate(zip(layouts + layouts[-1:], views + views[-1:])):
        rows = len(row_sentence)
        t.step(torch.randint(4, t.model.cfg.vocab_size, (rows,), generator=t.g), torch.full((rows,), step),
               row_sentence, rows_cache)
        bound_tokens.append(t.onnx_model.decoder.local.bound["tokens"])
    assert t.caches_equal()
    assert bound_tokens[2] is bound_tokens[0] and bound_tokens[1] is not bound_tokens[0]
    assert len(bound) == 3  # the last step reran the binding of the one before


def test_the_step_refuses_a_cache_it_could_not_write_in_place(tmp_path, spm_bytes):
    """The step writes its K/V into the memory it was given: a strided view would be copied on the
    way in and the step's column lost with the copy, so it is refused, naming the reason."""
    model, onnx_model = export_tiny("vanilla", tmp_path, spm_bytes)
    src, _ = random_batch(model.cfg, [5])
    wide = torch.zeros(2, model.cfg.n_heads, 8, model.cfg.d_model // model.cfg.n_heads)
    cache = [(wide[:, :, :4], wide[:, :, :4])] * model.cfg.dec_layers  # narrowed: not contiguous
    with pytest.raises(ValueError, match="contiguous float32"):
        zeros = torch.zeros(2, dtype=torch.long)
        onnx_model.step(torch.full((2,), model.cfg.bos_id), zeros, zeros, onnx_model.encode(src), cache)


def test_a_graph_runs_with_denormals_flushed_and_its_caller_keeps_its_own_float_mode(tmp_path):
    """Inside a run, on whichever thread runs it, a denormal reads as zero (MLAS's exponential is
    slow on them: export.onnx_runtime.flushed); after it the caller's thread computes with
    denormals as before (a later Hypothesis or NumPy in the same thread sees IEEE floats)."""
    import threading

    import numpy as np
    from onnx import TensorProto, helper

    from export.spec import GraphSpec, TensorSpec

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    graph = helper.make_graph([helper.make_node("Mul", ["x", "one"], ["y"])], "times_one", [x], [y], [one])
    path = tmp_path / "times_one.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    times_one = onnx_runtime.OnnxGraph(path, GraphSpec("times_one", (TensorSpec("x", "float32", ("n",)),),
                                                       (TensorSpec("y", "float32", ("n",)),), ()))
    denormal = torch.tensor([1e-39, 1.0])
    float_mode = lambda: ((torch.tensor([1e-39]) * 1.0).item(), float(np.float32(1e-39) * 2))  # noqa: E731
    seen = []

    def run_twice():  # the fresh-output run, then a bound one (the decoder step's kind)
        before = float_mode()
        fresh = times_one.run({"x": denormal}, {"y": (2,)})["y"]
        bound = times_one.run({"x": denormal}, {"y": (2,)}, reuse=True)["y"]
        seen.append((fresh.tolist(), bound.tolist(), before, float_mode()))

    thread = threading.Thread(target=run_twice)
    thread.start()
    thread.join()
    run_twice()
    for fresh, bound, before, after in seen:
        assert fresh == bound == [0.0, 1.0]
        assert before[0] > 0.0 and before[1] > 0.0 and after == before


def test_the_servers_backend_stays_on_the_cpu_where_onnx_runtime_could_take_a_gpu(tmp_path, spm_bytes, monkeypatch):
    """The engine's cache lives in host memory: on a GPU machine (onnxruntime-gpu and a CUDA torch,
    as deploy's cuda image has them) OnnxModel would default to CUDA and refuse that cache at every
    step. This machine has no GPU, so the probe is made to say there is one."""
    import export.onnx_runtime as onnx_runtime
    from server.backends import OnnxBackend

    export_tiny("vanilla", tmp_path, spm_bytes)
    monkeypatch.setattr(onnx_runtime, "default_device", lambda: "cuda")
    backend = OnnxBackend(tmp_path / "repo")
    assert backend.device.type == "cpu" and backend.decoder.session.get_providers() == ["CPUExecutionProvider"]


def test_the_servers_backend_checks_every_graph_against_model_json_the_global_one_too(tmp_path, spm_bytes):
    """A capsule model's model.json that swaps K and d_c keeps the votes' width K*d_c, so the encoder
    and decoder graphs still fit it: only the global graph, whose input is (groups, K, d_c), shows the
    disagreement, and the start must stop there rather than fail every request."""
    from server.backends import OnnxBackend

    model, _ = export_tiny("gret_full", tmp_path, spm_bytes)
    path = tmp_path / "repo" / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["model_config"] |= {"capsules": model.cfg.capsule_dim, "capsule_dim": model.cfg.capsules}
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="global graph: capsules"):
        OnnxBackend(tmp_path / "repo")


def test_the_step_picks_each_rows_top_k_as_topk_over_its_own_log_probs(tmp_path, spm_bytes):
    """The beam search's candidates come from the decoder graph's block maxima: each row's top_k
    best log-probabilities and tokens, best first, exactly what row_top_k over the step's log_probs
    alone gives (the PyTorch backend's choice), for any top_k up to the vocabulary."""
    model, onnx_model = export_tiny("gret_full", tmp_path, spm_bytes)
    src, _ = random_batch(model.cfg, [5, 3])
    enc = onnx_model.encode(src)
    rows = torch.tensor([0, 0, 1])
    column = torch.zeros(3, model.cfg.n_heads, 1, model.cfg.d_model // model.cfg.n_heads)
    for top_k in (1, 8, model.cfg.vocab_size):
        log_probs, (values, tokens) = onnx_model.step_top(
            torch.tensor([model.cfg.bos_id, 7, model.cfg.bos_id]), torch.tensor([0, 0, 0]), rows, enc,
            [(column.clone(), column.clone()) for _ in range(model.cfg.dec_layers)], top_k)
        assert values.shape == tokens.shape == (3, top_k)
        expected = row_top_k(log_probs, top_k)
        assert np.array_equal(values, expected[0].numpy()) and np.array_equal(tokens, expected[1].numpy())
        assert np.array_equal(log_probs.gather(1, torch.from_numpy(tokens)).numpy(), values)


def test_the_graphs_block_maxima_are_torchs_for_whole_and_padded_blocks(tmp_path):
    """The decoder graph's block_max output is block_maxima traced: exported, it gives exactly the
    maxima torch computes (so row_top_k chooses the same tokens from either), for a vocabulary cut
    into whole blocks, one whose last block is padded with -inf, and one smaller than a block."""
    class Maxima(torch.nn.Module):
        def forward(self, x):
            return block_maxima(x)

    g = torch.Generator().manual_seed(0)
    for vocab in (8000, 4000, 50):
        path = tmp_path / f"maxima{vocab}.onnx"
        torch.onnx.export(Maxima(), (torch.randn(3, vocab),), str(path), dynamo=False,
                          input_names=["x"], output_names=["maxima"], dynamic_axes={"x": {0: "rows"}})
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        x = torch.randn(6, vocab, generator=g).log_softmax(-1)
        x[1] = -3.0
        x[2, -1] = 0.0  # the best value in the last block (padded with -inf where the vocabulary needs it)
        (maxima,) = session.run(None, {"x": x.numpy()})
        assert torch.equal(torch.from_numpy(maxima), block_maxima(x))


def test_int8_quantizes_every_weight_matmul_and_the_gret_graphs_run(tmp_path, spm_bytes):
    """A capsule model's repository has four graphs: the encoder, ending at the routing's votes,
    which it projects by the stacked capsule weights as one 2-D matrix; the global state after the
    host's routing; the decoder step over one and over two length classes. int8 leaves no MatMul on an fp32 weight in any of them, and
    the int8 GRET graphs give an s^M and log-probabilities close to fp32's (within 10% of their
    norm: int8's error)."""
    model, fp32 = export_tiny("gret_full", tmp_path, spm_bytes, "--quantize", "int8")
    int8 = OnnxModel(tmp_path / "repo", precision="int8")
    assert read_manifest(tmp_path / "repo")["onnx"]["precisions"]["int8"] == {
        name: f"{name}.int8.onnx" for name in ("encoder", "global", "decoder", "decoder2")}
    graphs = {name: onnx.load(str(tmp_path / "repo" / f"{name}.int8.onnx")).graph
              for name in ("encoder", "global", "decoder", "decoder2")}
    for name, graph in graphs.items():
        weights = {t.name for t in graph.initializer}
        assert not [n.name for n in graph.node if n.op_type == "MatMul" and weights & set(n.input)], name
    capsule = model.cfg.d_model, model.cfg.capsules * model.cfg.capsule_dim
    encoder = graphs["encoder"]
    assert any(t.data_type == onnx.TensorProto.INT8 and tuple(t.dims) == capsule for t in encoder.initializer)
    src, tags = random_batch(model.cfg, [6, 4])
    enc, enc8 = fp32.encode(src, tags), int8.encode(src, tags)
    tokens = torch.full((2,), model.cfg.bos_id)
    log_probs, _ = fp32.decode_step(tokens, 0, enc, None)
    log_probs8, _ = int8.decode_step(tokens, 0, enc8, None)
    for got, expected in ((enc8.global_state, enc.global_state), (log_probs8, log_probs)):
        assert (got - expected).norm() < 0.1 * expected.norm()


@pytest.mark.parametrize("name", ["vanilla", "gret_full", "multiview_gca"])
def test_int8_decoders_over_the_target_pieces_rank_them_as_the_whole_vocabulary_does(name, tmp_path, spm_bytes):
    """A checkpoint that names its target pieces (training.target_pieces) gets int8 decoders whose
    output layer has only their columns: per row, the same log-probabilities as the whole int8
    vocabulary's over those pieces, renormalised (one shift per row), so the same best pieces in
    the same order; the tokens step_top gives are piece ids, and vocabulary() puts -inf on every
    other piece. The fp32 graphs keep the whole vocabulary (they are the reference)."""
    torch.manual_seed(0)
    model = perturb(Seq2Seq(tiny_config(name, vocab_size=192)))
    pieces = sorted({model.cfg.eos_id} | set(range(4, 4 + 2 * 63, 2)))  # 64: one whole block
    for folder, named in (("whole", None), ("trimmed", pieces)):
        save_checkpoint(tmp_path / folder, model, Checkpoint(model.cfg, DataConfig()), spm_bytes)
        if named:
            (tmp_path / folder / TARGET_PIECES).write_text(json.dumps({"pieces": named}))
        write_repository(tmp_path / folder, tmp_path / f"{folder}-repo", quantize="int8")
    whole, trimmed = (OnnxModel(tmp_path / f"{f}-repo", precision="int8") for f in ("whole", "trimmed"))
    assert OnnxModel(tmp_path / "trimmed-repo").pieces is None  # fp32
    src, tags = random_batch(model.cfg, [6, 4])
    tokens, positions, cache = step_case(model.cfg, [0, 0, 1, 1])
    steps = [m.step_top(tokens, positions, torch.tensor([0, 0, 1, 1]), m.encode(src, tags),
                        [(k.clone(), v.clone()) for k, v in cache], 4) for m in (whole, trimmed)]
    (full, _), (kept, (values, top)) = steps
    assert kept.shape == (4, 64)
    shift = kept - full[:, pieces]
    torch.testing.assert_close(shift, shift[:, :1].expand_as(shift), atol=1e-5, rtol=0)
    assert (shift[:, 0] > 0).all()  # the other pieces' share is gone
    best = full[:, pieces].topk(4)
    assert (top == np.array(pieces)[best.indices.numpy()]).all()
    np.testing.assert_allclose(values, kept.topk(4).values.numpy(), rtol=0, atol=0)
    widened = trimmed.vocabulary(kept)
    assert torch.equal(widened[:, pieces], kept)
    assert torch.isinf(widened).sum() == 4 * (model.cfg.vocab_size - 64)


def test_target_pieces_are_every_piece_of_the_training_targets_and_eos_in_whole_blocks(spm_bytes):
    sp = load_sentencepiece(spm_bytes)
    targets = [e.target for e in load_examples("multi30k", "train", "de", "en")[:50]]
    pieces = target_pieces(sp, targets, 1000)
    written = {p for t in targets for p in sp.encode(t)} | {EOS}
    assert written <= set(pieces) and pieces == sorted(set(pieces)) and len(pieces) % 64 == 0
    assert len(pieces) - len(written) < 64  # filled up to the block, no further
    assert target_pieces(sp, targets, 100) == list(range(100))  # a vocabulary below the block keeps every piece


@pytest.mark.parametrize("name", ALL)
def test_the_build_key_covers_the_code_of_every_module_the_graphs_are_traced_from(name):
    """Servers cache exports under export_digest, which hashes export_sources(): a change to any
    module of any architecture (or to the kernels' references they call) must change the key,
    or the server would go on serving the export of the old code."""
    covered = {path.resolve() for path in export_sources()}
    model = Seq2Seq(tiny_config(name))
    for module in model.modules():
        if type(module).__module__.split(".")[0] in ("training", "kernels", "export"):  # ours, not torch's
            source = Path(inspect.getsourcefile(type(module))).resolve()
            assert source in covered, f"{type(module).__name__} ({source}) is not in the build key"
    for function in (model.encode, model.step_rows):
        assert Path(inspect.getsourcefile(function)).resolve() in covered


def test_the_step_attends_with_group_query_attention_and_copies_no_logits(tmp_path, spm_bytes):
    """Each decoder layer's self-attention is one GroupQueryAttention node over the cache (in place,
    each row's own columns), fed its query, key and value packed from one projection (one int8
    quantization of the layer's input, not three), and no If is left from a squeeze of unknown
    shape: it would copy the (R, V) logits every step."""
    model, _ = export_tiny("gret_full", tmp_path, spm_bytes, "--quantize", "int8")
    for name in ("decoder.onnx", "decoder.int8.onnx"):
        nodes = onnx.load(str(tmp_path / "repo" / name)).graph.node
        ops = Counter(n.op_type for n in nodes)
        assert ops["GroupQueryAttention"] == model.cfg.dec_layers and ops["If"] == 0, name
        assert all(n.input[1] == n.input[2] == "" for n in nodes if n.op_type == "GroupQueryAttention"), name
        projections = [n for n in nodes if "/res_self" in n.name and n.op_type in ("Gemm", "MatMul", "MatMulInteger")]
        assert len(projections) == 2 * model.cfg.dec_layers, name  # per layer: q, k, v at once; the output


def test_the_steps_cross_attention_computes_no_shapes_at_run_time(tmp_path, spm_bytes):
    """Its reshapes are to fixed shapes and its grouping is one gather per length class: no Shape or
    ConstantOfShape node, each of which costs a one-text step about what a small kernel does. The
    step over one class has no Concat either; the one over two joins the classes' outputs once per
    layer."""
    import onnxruntime as ort

    model, _ = export_tiny("gret_full", tmp_path, spm_bytes)
    for classes, name in enumerate(("decoder.onnx", "decoder2.onnx"), 1):
        options = ort.SessionOptions()  # the graph as ONNX Runtime runs it: constants folded
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = str(tmp_path / "run.onnx")
        ort.InferenceSession(str(tmp_path / "repo" / name), options, providers=["CPUExecutionProvider"])
        nodes = [n for n in onnx.load(str(tmp_path / "run.onnx")).graph.node if "/res_cross" in n.name]
        ops = Counter(n.op_type for n in nodes)
        assert ops["MatMul"] >= classes * model.cfg.dec_layers, name  # the attention of every class is there ...
        assert ops["Shape"] == ops["ConstantOfShape"] == 0, name  # ... with no shape arithmetic ...
        assert ops["Concat"] == (classes - 1) * model.cfg.dec_layers, name  # ... and the classes joined once a layer


def test_the_encoders_heads_split_and_merge_without_shape_chains(tmp_path, spm_bytes):
    """Each head split reshapes by the tensor's own dims, which ONNX Runtime folds into the Reshape
    (0 = keep that dim), and the merge flattens: no Shape -> Slice -> Concat chain per projection.
    Those chains were a third of the vanilla encoder's nodes, each costing a short sentence about
    what a small kernel does."""
    import onnxruntime as ort

    model, _ = export_tiny("vanilla", tmp_path, spm_bytes)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "run.onnx")
    ort.InferenceSession(str(tmp_path / "repo" / "encoder.onnx"), options, providers=["CPUExecutionProvider"])
    ops = Counter(n.op_type for n in onnx.load(str(tmp_path / "run.onnx")).graph.node if "/res_attn/" in n.name)
    assert ops["Reshape"] == 3 * model.cfg.enc_layers  # q, k, v split in every layer ...
    assert ops["Flatten"] == model.cfg.enc_layers  # ... and the output merged ...
    assert ops["Concat"] == 0 and ops["Slice"] <= model.cfg.enc_layers  # ... by shapes computed nowhere


def test_first_step_has_an_empty_past_and_the_past_axis_is_dynamic(tmp_path, spm_bytes):
    model, onnx_model = export_tiny("vanilla", tmp_path, spm_bytes)
    graph = onnx.load(str(tmp_path / "repo" / "decoder.onnx")).graph
    past = next(v for v in graph.input if v.name == "past_key.0")
    assert [d.dim_param or d.dim_value for d in past.type.tensor_type.shape.dim] == ["rows", 4, "past_len", 16]
    src, _ = random_batch(model.cfg, [5, 3])
    enc = onnx_model.encode(src)
    tokens = torch.full((4,), model.cfg.bos_id)
    log_probs, cache = onnx_model.decode_step(tokens, 0, enc, None, beam=2)  # past length 0
    assert [tuple(k.shape) for k, _ in cache] == [(4, 4, 1, 16)] * model.cfg.dec_layers
    torch.testing.assert_close(log_probs, model.decode_step(tokens, 0, model.encode(src), None, 2)[0], **TOLERANCE)


# ---- the repository ------------------------------------------------------------------------------
def test_repository_lists_its_files_signatures_and_recorded_metrics(tmp_path, spm_bytes):
    model, _ = export_tiny("mvpe_pos", tmp_path, spm_bytes)
    repo = tmp_path / "repo"
    manifest = json.loads((repo / MANIFEST).read_text())
    assert manifest["backend"] == "onnx" and manifest["task"] == "translate"
    assert (manifest["source_language"], manifest["target_language"]) == ("de", "en")
    assert manifest["onnx"]["opset"] == 17 and manifest["onnx"]["precisions"] == {
        "fp32": {"encoder": "encoder.onnx", "decoder": "decoder.onnx", "decoder2": "decoder2.onnx"}}
    assert set(manifest["files"]) == {"encoder.onnx", "decoder.onnx", "decoder2.onnx", "spm.model"}
    assert all(sha256(repo / f) == entry["sha256"] for f, entry in manifest["files"].items())
    assert "POS tags" in manifest["architecture"]["summary"] and "metrics" in manifest
    assert manifest["version"] == sha256(tmp_path / "checkpoint" / "model.safetensors")[:12]
    for spec in (encoder_spec(model.cfg), decoder_spec(model.cfg), decoder_spec(model.cfg, 2)):
        assert signature_errors(onnx.load(str(repo / f"{spec.name}.onnx")).graph, spec) == []
    assert [t["name"] for t in manifest["onnx"]["graphs"]["encoder"]["inputs"]] == ["src_ids", "src_tags"]
    (repo / "spm.model").write_bytes(b"changed")
    with pytest.raises(ValueError, match="sha256"):
        read_manifest(repo)


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "spm.model"])
def test_an_incomplete_checkpoint_is_refused_by_name(missing, tmp_path, spm_bytes, capsys):
    model = Seq2Seq(tiny_config("vanilla"))
    save_checkpoint(tmp_path / "ck", model, Checkpoint(model.cfg, DataConfig()), spm_bytes)
    (tmp_path / "ck" / missing).unlink()
    with pytest.raises(SystemExit) as exit_info:
        export_main(["--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "repo")])
    assert exit_info.value.code == 2 and missing in capsys.readouterr().err
    assert not (tmp_path / "repo").exists()


def test_unknown_format_or_quantization_and_an_occupied_output_are_refused(tmp_path, spm_bytes, capsys):
    model = Seq2Seq(tiny_config("vanilla"))
    save_checkpoint(tmp_path / "ck", model, Checkpoint(model.cfg, DataConfig()), spm_bytes)
    for bad in (["--format", "tflite"], ["--quantize", "int4"]):
        with pytest.raises(SystemExit):
            export_main(["--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "repo"), *bad])
        assert "invalid choice" in capsys.readouterr().err
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "keep.txt").write_text("x")
    with pytest.raises(SystemExit):
        export_main(["--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "repo")])
    assert "--overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        export_main(["--checkpoint", str(tmp_path / "nowhere"), "--out", str(tmp_path / "repo2")])
    assert "not a directory" in capsys.readouterr().err


def test_a_parameter_no_graph_carries_is_an_error(tmp_path):
    model = Seq2Seq(tiny_config("vanilla")).eval()
    model.extra_head = torch.nn.Linear(4, 4)  # a module the exporter does not know
    with pytest.raises(ExportError, match="extra_head.weight"):
        export_onnx(model, tmp_path)


# ---- a model trained on real data: beam search parity and int8 -----------------------------------
@pytest.fixture(scope="module")
def trained(served_models):
    """The session's tiny GRET de-en model (tests/served.py: 60 steps on 60 real pairs, enough for
    word-like output, e.g. "A man in a ... on a ..."), exported with int8 graphs."""
    model, ckpt, sp = load_checkpoint(served_models.parent / "runs" / "de-en")
    texts = [e.source for e in load_examples("multi30k", "val", "de", "en")[:20]]
    ids, tags = source_inputs(model, sp, texts, "de", ckpt.data.max_src_len)  # it reads POS tags (tests/served.py)
    return model, served_models / "tiny-de-en", pad(ids), pad(tags)


def test_beam_search_on_onnx_gives_the_pytorch_outputs_on_real_sentences(trained):
    model, repo, src, tags = trained
    onnx_model = OnnxModel(repo)
    expected = search.beam_search(model, src, tags, beam=4, n_best=2)
    assert sum(len(hyps[0].tokens) >= 5 for hyps in expected) >= 15  # real output, not EOS at once
    actual = beam_search(onnx_model, src, tags, beam=4, n_best=2)
    assert [[h.tokens for h in hyps] for hyps in actual] == [[h.tokens for h in hyps] for hyps in expected]
    for hyps, ref_hyps in zip(actual, expected):
        assert [h.score for h in hyps] == pytest.approx([h.score for h in ref_hyps], abs=1e-4)
    assert greedy(onnx_model, src, tags) == search.greedy(model, src, tags)


def test_int8_graphs_run_and_give_valid_output(trained):
    model, repo, src, tags = trained
    manifest = read_manifest(repo)
    assert manifest["onnx"]["precisions"]["int8"] == {s.name: f"{s.name}.int8.onnx" for s in model_specs(model.cfg)}
    files = manifest["files"]
    assert files["decoder.int8.onnx"]["bytes"] < files["decoder.onnx"]["bytes"]
    int8, fp32 = OnnxModel(repo, precision="int8"), OnnxModel(repo)
    tokens = torch.full((src.shape[0],), model.cfg.bos_id)
    log_probs, _ = int8.decode_step(tokens, 0, int8.encode(src, tags), None)
    assert log_probs.shape == (src.shape[0], model.cfg.vocab_size) and torch.isfinite(log_probs).all()
    torch.testing.assert_close(log_probs.logsumexp(-1), torch.zeros(src.shape[0]), atol=1e-4, rtol=0)
    reference, _ = fp32.decode_step(tokens, 0, fp32.encode(src, tags), None)
    assert (log_probs - reference).abs().max() < 0.25  # quantization noise (observed 0.04), not a different model
    hyps = beam_search(int8, src, tags, beam=4)
    assert all(h and all(0 <= t < model.cfg.vocab_size for t in h[0].tokens) for h in hyps)
