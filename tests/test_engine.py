"""The continuous-batching engine: whatever joins the batch when, with whatever options, each
text gets exactly what the offline beam search (training.seq2seq.search) gives it alone; cancelled and
expired texts leave the batch at the next step; the encoder cache skips repeated sources."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from server.engine.encoder_cache import EncoderCache
from export.repository import write_repository
from server.backends import OnnxBackend, TorchBackend
from server.engine.batch import banned_tokens, fork_slots
from server.engine.engine import (CAPSULE_ADMISSION_INTERVAL, ENCODE_PIECES, Draining, Engine, Replicas,
                                  admission_interval, encoder_passes)
from server.engine.options import DecodingOptions, Limits, OptionError
from server.engine.scheduler import BUSY_TEXTS, QueueFull, Scheduler, batch_cost
from server.engine.result_cache import ResultCache, result_key
from server.engine.sequence import CANCELLED, DEADLINE, OK, Hypothesis, Sequence
from tests.architectures import perturb, random_batch, tiny_config
from training.corpora import PROJECT_ROOT
from training.seq2seq import search
from training.seq2seq.checkpoint import TARGET_PIECES, save_checkpoint
from training.seq2seq.config import Checkpoint, DataConfig
from training.seq2seq.model import Seq2Seq

torch.set_num_threads(1)
LIMITS = Limits()


def tiny_model(name: str = "gret_full") -> Seq2Seq:
    torch.manual_seed(0)
    return perturb(Seq2Seq(tiny_config(name)))


def sources(model, lengths, seed=0) -> list[list[int]]:
    src, _ = random_batch(model.cfg, lengths, seed)
    return [row[row.ne(model.cfg.pad_id)].tolist() for row in src]


def make_seq(model, src, options=DecodingOptions(), **kw) -> Sequence:
    limit = options.output_limit(len(src), model.cfg.max_positions - 1, LIMITS)
    return Sequence(src, options, limit, on_done=lambda s: None, **kw)


def offline(model, src, options: DecodingOptions) -> list[search.Hypothesis]:
    """training.seq2seq.search.beam_search on this one sentence: the reference answer."""
    return search.beam_search(model, torch.tensor([src]), beam=options.beam, length_penalty=options.length_penalty,
                              max_len_a=options.max_len_a, max_len_b=options.max_len_b, n_best=options.n_best,
                              prefixes=[list(options.prefix)])[0]


def engine_for(model, policy="continuous", **kw) -> Engine:
    return Engine(TorchBackend(model), "v1", Scheduler(policy, **kw), EncoderCache(1 << 24))


def staggered(model, srcs, options, engine: Engine | None = None) -> tuple[Engine, list[Sequence]]:
    """The texts joining one running batch (of `engine`, else a new one) at different steps: two,
    two steps later two more (the first two still running), a step later the rest; run until all
    are done."""
    engine = engine or engine_for(model)
    seqs = [make_seq(model, s, o) for s, o in zip(srcs, options)]
    engine.submit(seqs[:2])
    engine.iterate()
    engine.iterate()
    engine.submit(seqs[2:4])
    engine.iterate()
    engine.submit(seqs[4:])
    engine.run_until_idle()
    return engine, seqs


def assert_offline(model, seqs, srcs, options) -> None:
    """Each text got what the offline beam search gives it alone: the same n-best and scores."""
    for seq, src, opt in zip(seqs, srcs, options):
        assert seq.status == OK
        expected = offline(model, src, opt)
        assert [h.tokens for h in seq.hypotheses] == [h.tokens for h in expected]
        assert [h.score for h in seq.hypotheses] == pytest.approx([h.score for h in expected], abs=1e-4)


@pytest.mark.parametrize("name", ["vanilla", "gret_full", "multiview_gca", "mvpe"])
def test_texts_joining_at_different_steps_get_their_offline_beam_search_results(name):
    model = tiny_model(name)
    srcs = sources(model, [7, 3, 9, 5, 6])
    options = [DecodingOptions(beam=4), DecodingOptions(beam=2), DecodingOptions(beam=1),
               DecodingOptions(beam=3, length_penalty=0.6, n_best=3), DecodingOptions(beam=5, max_len_b=4)]
    _, seqs = staggered(model, srcs, options)
    assert_offline(model, seqs, srcs, options)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (docs/results/gpu-h200)")
@pytest.mark.parametrize("name", ["vanilla", "gret_full", "multiview_gca", "mvpe"])
def test_on_a_gpu_each_text_gets_what_the_engine_gives_it_on_the_cpu(name):
    """The batch's cache and encoder slots on the GPU, the model's steps with the Triton kernels:
    joins at different steps, forks, departures, slot compaction and the constrained options
    (min_length, no_repeat_ngram, a prefix) give the CPU engine's outputs."""
    model = tiny_model(name)
    srcs = sources(model, [7, 3, 9, 5, 6, 12, 4, 8, 10, 2])
    options = [DecodingOptions(beam=4), DecodingOptions(beam=2), DecodingOptions(beam=1),
               DecodingOptions(beam=3, length_penalty=0.6, n_best=3), DecodingOptions(beam=5, max_len_b=4),
               DecodingOptions(beam=4, min_length=5), DecodingOptions(beam=3, no_repeat_ngram=2),
               DecodingOptions(beam=4, prefix=(5, 6)), DecodingOptions(beam=2, n_best=2), DecodingOptions(beam=4)]
    _, on_cpu = staggered(model, srcs, options)
    engine, on_gpu = staggered(tiny_model(name).cuda(), srcs, options)
    assert engine.batch.sources.device.type == "cuda"
    for cpu, gpu in zip(on_cpu, on_gpu):
        assert gpu.status == cpu.status == OK
        assert [h.tokens for h in gpu.hypotheses] == [h.tokens for h in cpu.hypotheses]
        assert [h.score for h in gpu.hypotheses] == pytest.approx([h.score for h in cpu.hypotheses], abs=1e-3)


@pytest.mark.parametrize("name", ["vanilla", "gret_full"])
def test_the_gpus_ways_of_writing_slots_and_copying_forks_give_the_same_outputs_on_the_cpu(name):
    """What a GPU's batch does differently, run here on CPU tensors: encoder slots written, freed and
    moved through torch's indexing instead of NumPy views, forked beams' cache columns copied with
    torch instead of Numba."""
    model = tiny_model(name)
    srcs = sources(model, [7, 3, 9, 5, 6, 12, 4, 8, 10, 2])
    options = [DecodingOptions(beam=b, n_best=min(b, 2)) for b in (4, 2, 1, 3, 5, 4, 3, 4, 2, 4)]
    _, native = staggered(model, srcs, options)
    engine = engine_for(model)
    engine.batch.compiled_copies = engine.batch.sources.numpy_views = False
    _, seqs = staggered(model, srcs, options, engine)
    for a, b in zip(native, seqs):
        assert b.status == OK and [h.tokens for h in b.hypotheses] == [h.tokens for h in a.hypotheses]


def test_texts_joining_and_leaving_move_no_running_row_out_of_its_cache_slot():
    """Slot storage: a join takes free slots, a departure frees its own; the rows that keep
    running (each beam's first child) keep their slots and their cached keys."""
    model = tiny_model("vanilla")
    engine = engine_for(model)
    long = make_seq(model, sources(model, [9])[0], DecodingOptions(beam=1, max_len_b=40))
    engine.submit([long])
    for _ in range(3):
        engine.iterate()
    batch = engine.batch
    slot = int(batch.slot[0])
    cached = batch.kv[:, slot, :, :3].clone()
    short = [make_seq(model, s, DecodingOptions(beam=2, max_len_a=0, max_len_b=2)) for s in sources(model, [4, 6], seed=2)]
    engine.submit(short)
    engine.iterate()  # the short texts join (and take one step)
    assert len(batch) == 3 and int(batch.slot[0]) == slot
    while any(s.status is None for s in short):
        engine.iterate()
    assert len(batch) == 1 and int(batch.slot[0]) == slot  # they left; the long text stayed put
    torch.testing.assert_close(batch.kv[:, slot, :, :3], cached)
    engine.run_until_idle()
    assert [h.tokens for h in long.hypotheses] == [h.tokens for h in offline(model, long.src, long.options)]


def test_a_departure_below_running_rows_moves_the_top_row_down_so_that_no_step_computes_an_empty_slot():
    """A step runs over every slot up to the highest in use, so an empty slot below it would be
    computed, and ignored, at every step: the top row moves down into it at once, its cached
    columns with it, and its text's output does not change."""
    model = tiny_model("vanilla")
    engine = engine_for(model)
    srcs = sources(model, [5, 9, 7], seed=3)
    quick = make_seq(model, srcs[0], DecodingOptions(beam=1, max_len_a=0, max_len_b=2))
    slow = [make_seq(model, s, DecodingOptions(beam=1, min_length=8, max_len_b=40)) for s in srcs[1:]]
    engine.submit([quick, *slow])
    engine.iterate()
    batch = engine.batch
    assert batch.slot.tolist() == [0, 1, 2]  # one row each, in order of joining
    while quick.status is None:
        engine.iterate()
    assert batch.seqs == slow and batch.slot.tolist() == [1, 0]  # the last text moved into the first slot
    engine.run_until_idle()
    for seq in slow:
        assert [h.tokens for h in seq.hypotheses] == [h.tokens for h in offline(model, seq.src, seq.options)]


def test_a_beams_first_child_keeps_its_slot_and_later_children_take_ending_siblings_slots_then_the_lowest_free():
    """Two sequences: rows 0-2 (slots 4, 0, 2) and rows 3-4 (slots 1, 3), children of rows
    0, 0, 0, 3, 3, 3. First children keep 4 and 1. Row 0's later children take the slots of its
    childless siblings, the longest shared prefix first: row 1 (two tokens: columns BOS, 5, 6 are
    the same, 3 shared) then row 2 (one token: 2 shared); row 3's second child takes row 4's
    (2 shared), and its third, with no sibling left, the lowest free slot: past the storage."""
    history = np.array([[5, 6, 7], [5, 6, 9], [5, 8, 1], [2, 2, 0], [2, 3, 0]])
    slot, forks, shared = fork_slots(np.array([0, 0, 0, 3, 3, 3]), np.array([4, 0, 2, 1, 3]),
                                     np.array([0, 0, 0, 1, 1]), np.array([3, 3, 3, 2, 2]), history, 5)
    assert slot.tolist() == [4, 0, 2, 1, 3, 5] and forks.tolist() == [1, 2, 4, 5] and shared.tolist() == [3, 2, 2, 0]
    slot, forks, shared = fork_slots(np.array([0, 0]), np.array([2]), np.array([0]), np.array([1]),
                                     np.array([[7]]), 4)
    assert slot.tolist() == [2, 0] and forks.tolist() == [1] and shared.tolist() == [0]  # slot 0 is free


def test_rows_of_a_sequence_hold_the_same_bytes_in_the_columns_of_their_shared_prefix():
    """What a fork's copy skips (fork_slots): two beams of one text whose tokens agree up to some
    point hold identical keys and values for BOS and those tokens, bit for bit, at every step."""
    model = tiny_model("vanilla")
    engine = engine_for(model)
    seq = make_seq(model, sources(model, [9], seed=7)[0], DecodingOptions(beam=5, min_length=8, max_len_b=12))
    engine.submit([seq])
    batch, compared = engine.batch, 0
    while seq.status is None:
        engine.iterate()
        for a in range(batch.rows):
            for b in range(a + 1, batch.rows):
                n = int(batch.positions[a])
                common = next((k for k in range(n - 1) if batch.history[a, k] != batch.history[b, k]), n - 1)
                kv = batch.kv
                assert torch.equal(kv[:, batch.slot[a], :, :common + 1], kv[:, batch.slot[b], :, :common + 1])
                compared += common > 0
    assert compared > 0 and seq.status == OK
    assert [h.tokens for h in seq.hypotheses] == [h.tokens for h in offline(model, seq.src, seq.options)]


def test_steps_that_keep_the_row_layout_hand_the_backend_the_same_row_sentence():
    """The ONNX backend groups the rows by sentence once per layout (OnnxModel._layout): the batch
    hands it the very row_sentence tensor again while no row joins, leaves or changes sentence,
    and a new one once a text joins."""
    model = tiny_model("vanilla")
    engine = engine_for(model)
    seen, step_top = [], engine.backend.step_top
    engine.backend.step_top = lambda *args: seen.append(args[2]) or step_top(*args)
    engine.submit([make_seq(model, sources(model, [9])[0], DecodingOptions(beam=1, min_length=8, max_len_b=40))])
    for _ in range(4):
        engine.iterate()
    assert len(seen) == 4 and all(t is seen[0] for t in seen)  # beam 1: one row, in one slot
    engine.submit([make_seq(model, sources(model, [5], seed=1)[0], DecodingOptions(beam=1))])
    engine.iterate()
    assert seen[-1] is not seen[0] and seen[-1].tolist() == [0, 1]


def test_encoder_slots_free_on_leaving_close_their_holes_and_change_no_output():
    """Each sequence's encoder state sits in a slot of its own, in the length class of its source:
    up to the median length (in whole steps of 8 columns), or longer. A departure frees its slot
    (nothing else moves), a class's source axis shrinks once its longest source has left, and once
    holes are an eighth of a class's slots read its top slots move down; every text still gets its
    offline result."""
    model = tiny_model("gret_full")
    engine = engine_for(model)
    quick = DecodingOptions(beam=2, max_len_a=0, max_len_b=2)
    slow = DecodingOptions(beam=2, max_len_b=30)
    srcs = sources(model, [23, 4, 5, 6, 4, 5, 6, 7, 12], seed=4)
    seqs = [make_seq(model, srcs[0], quick)] + [make_seq(model, s, quick) for s in srcs[1:6]] + \
        [make_seq(model, s, slow) for s in srcs[6:]]
    engine.submit(seqs)
    engine.iterate()
    short, long = engine.batch.sources.classes
    assert (short.width, short.in_use()) == (8, 7)  # the median (6) is the bound: the sources up to 8 ...
    assert (long.width, long.in_use()) == (24, 2)  # ... and the two longer ones, as wide as the longest
    while any(s.status is None for s in seqs[:6]):
        engine.iterate()
    assert len(engine.batch) == 3
    assert long.width == 16  # its longest source left
    assert short.in_use() == 2  # the class's two running texts were moved down into the freed slots
    engine.run_until_idle()
    for seq, src in zip(seqs, srcs):
        assert seq.status == OK
        assert [h.tokens for h in seq.hypotheses] == [h.tokens for h in offline(model, src, seq.options)]


def test_a_second_run_reuses_the_cache_storage_and_its_stale_columns_change_no_output():
    """Resizes lay the cache out in the batch's spare storage: once it has seen the largest cache,
    nothing is allocated, and what earlier rows left in unwritten columns stays masked."""
    model = tiny_model("vanilla")
    engine = engine_for(model)
    srcs = sources(model, [9, 4, 7], seed=3)
    options = DecodingOptions(beam=3, max_len_b=40)

    def run() -> list[list[int]]:
        seqs = [make_seq(model, src, options) for src in srcs]
        engine.submit(seqs)
        engine.run_until_idle()
        return [h.tokens for s in seqs for h in s.hypotheses]

    first = run()
    kept = engine.batch.storages
    storages = {kept.live.data_ptr(), kept.spare.data_ptr()}
    assert kept.live.abs().sum() > 0  # stale keys and values, not zeros
    assert run() == first == [h.tokens for src in srcs for h in offline(model, src, options)]
    assert {kept.live.data_ptr(), kept.spare.data_ptr()} == storages


def test_source_layouts_alternate_between_two_storages_and_their_stale_columns_change_no_output():
    """A length class's source axis grows with a long source and shrinks once it leaves; each new
    layout is written into the spare of two kept storages: once they have seen the largest layout,
    nothing is allocated, and what earlier sources left in unwritten columns stays masked."""
    model = tiny_model("vanilla")
    engine = engine_for(model)
    srcs = sources(model, [23, 12, 4, 5], seed=5)
    quick, slow = DecodingOptions(beam=2, max_len_a=0, max_len_b=2), DecodingOptions(beam=2, max_len_b=12)
    long = engine.batch.sources.classes[1]  # over the median: the 23 and the 12

    def run() -> list[list[int]]:
        seqs = [make_seq(model, srcs[0], quick)] + [make_seq(model, s, slow) for s in srcs[1:]]
        engine.submit(seqs)
        engine.run_until_idle()
        assert long.width == 16  # laid out again once the 23 left
        return [h.tokens for s in seqs for h in s.hypotheses]

    first = run()
    kept = long.storages
    storages = {kept.live.data_ptr(), kept.spare.data_ptr()}
    assert kept.spare.abs().sum() > 0  # the former layout's keys and values, not zeros
    assert run() == first == [h.tokens for src, o in zip(srcs, (quick, slow, slow, slow))
                              for h in offline(model, src, o)]
    assert {kept.live.data_ptr(), kept.spare.data_ptr()} == storages


def test_batching_policies_give_identical_outputs():
    model = tiny_model()
    srcs = sources(model, [7, 3, 9, 5], seed=1)
    outputs = {}
    for policy in ("continuous", "request", "none"):
        engine = engine_for(model, policy)
        seqs = [make_seq(model, s) for s in srcs]
        engine.submit(seqs)
        engine.run_until_idle()
        outputs[policy] = [[h.tokens for h in s.hypotheses] for s in seqs]
    assert outputs["continuous"] == outputs["request"] == outputs["none"]


def test_min_length_and_no_repeat_ngram_constrain_the_output():
    model = tiny_model()
    src = sources(model, [6], seed=2)[0]
    engine = engine_for(model)
    short = make_seq(model, src, DecodingOptions(beam=2, min_length=12, max_len_b=20))
    no_repeat = make_seq(model, src, DecodingOptions(beam=2, no_repeat_ngram=2, max_len_b=30))
    engine.submit([short, no_repeat])
    engine.run_until_idle()
    assert len(short.hypotheses[0].tokens) >= 12
    tokens = no_repeat.hypotheses[0].tokens
    bigrams = list(zip(tokens, tokens[1:]))
    assert len(bigrams) == len(set(bigrams))


@pytest.mark.parametrize("name", ["vanilla", "gret_full"])
def test_a_target_prefix_is_forced_in_the_running_batch_as_in_offline_search(name):
    """Texts with and without prefixes (of 1 to 6 pieces, one a piece short of its output limit)
    join a running batch at different steps; each gets offline search with the same prefix: its
    hypotheses begin with the prefix and are scored on what follows it."""
    model = tiny_model(name)
    srcs = sources(model, [7, 3, 9, 5, 6, 4], seed=4)
    options = [DecodingOptions(beam=4, n_best=2, prefix=(5, 9, 5)), DecodingOptions(beam=2),
               DecodingOptions(beam=1, prefix=(17,)), DecodingOptions(beam=3, length_penalty=0.6, prefix=(8, 8)),
               DecodingOptions(beam=5, n_best=5, prefix=(30, 31, 32, 33, 34, 35)),
               DecodingOptions(beam=2, n_best=2, max_len_a=0, max_len_b=4, prefix=(6, 7, 8))]
    engine, seqs = staggered(model, srcs, options)  # the third and fourth join while the first is in its prefix
    assert_offline(model, seqs, srcs, options)
    for seq, opt in zip(seqs, options):
        assert all(h.tokens[:len(opt.prefix)] == list(opt.prefix) for h in seq.hypotheses)
    assert [h.tokens[:3] for h in seqs[5].hypotheses] == [[6, 7, 8]] * 2  # one step of its own: n-best all the same
    assert all(len(h.tokens) <= 4 for h in seqs[5].hypotheses)
    assert engine.batch.constrained == 0


def test_where_the_int8_decoder_writes_only_the_target_pieces_texts_get_only_those_and_constraints_still_hold(
        tmp_path):
    """An int8 repository whose decoders write only the checkpoint's target pieces (export.quantize.
    trim_output): the texts of one running batch, with and without constraints, write only those
    pieces after their prefix, a prefix is forced even where it holds other pieces, min_length and
    no_repeat_ngram hold."""
    model = perturb(Seq2Seq(tiny_config("vanilla", vocab_size=192)))
    pieces = sorted({model.cfg.eos_id} | set(range(4, 4 + 2 * 63, 2)))  # even ids: the odd ones are not written
    save_checkpoint(tmp_path / "ckpt", model, Checkpoint(model.cfg, DataConfig()),
                    (PROJECT_ROOT / "models" / "multi30k-de-en-vanilla" / "spm.model").read_bytes())
    (tmp_path / "ckpt" / TARGET_PIECES).write_text(json.dumps({"pieces": pieces}))
    write_repository(tmp_path / "ckpt", tmp_path / "repo", quantize="int8")
    engine = Engine(OnnxBackend(tmp_path / "repo", "int8"), "v1", Scheduler(), EncoderCache(1 << 24))
    options = [DecodingOptions(beam=4, n_best=2), DecodingOptions(beam=2, prefix=(5, 9)),
               DecodingOptions(beam=2, min_length=10, max_len_b=20), DecodingOptions(beam=3, no_repeat_ngram=2)]
    seqs = [make_seq(model, src, o) for src, o in zip(sources(model, [6, 4, 7, 5], seed=3), options)]
    engine.submit(seqs)
    engine.run_until_idle()
    assert all(s.status == OK and s.hypotheses for s in seqs)
    for seq, opt in zip(seqs, options):
        for h in seq.hypotheses:
            assert h.tokens[:len(opt.prefix)] == list(opt.prefix)
            assert set(h.tokens[len(opt.prefix):]) <= set(pieces)
    assert len(seqs[2].hypotheses[0].tokens) >= 10
    tokens = seqs[3].hypotheses[0].tokens
    assert len(set(zip(tokens, tokens[1:]))) == len(tokens) - 1


def test_a_prefix_wins_over_no_repeat_ngram_and_min_length_counts_it():
    """The prefix is forced even where it repeats an n-gram; after it, no n-gram repeats (the
    prefix's own count); min_length counts the prefix's pieces, as CTranslate2 does."""
    model = tiny_model()
    src = sources(model, [6], seed=2)[0]
    engine = engine_for(model)
    repeated = make_seq(model, src, DecodingOptions(beam=2, no_repeat_ngram=2, max_len_b=30, prefix=(5, 6, 5, 6)))
    longer = make_seq(model, src, DecodingOptions(beam=2, min_length=12, max_len_b=20, prefix=(5, 6)))
    engine.submit([repeated, longer])
    engine.run_until_idle()
    tokens = repeated.hypotheses[0].tokens
    assert tokens[:4] == [5, 6, 5, 6]
    bigrams = list(zip(tokens[3:], tokens[4:]))  # those that end after the prefix
    assert (5, 6) not in bigrams[1:] and len(bigrams) == len(set(bigrams))
    assert longer.hypotheses[0].tokens[:2] == [5, 6] and len(longer.hypotheses[0].tokens) >= 12


def test_banned_tokens_complete_an_earlier_ngram():
    assert sorted(banned_tokens([5, 6, 7, 5, 6], 3)) == [7]
    assert banned_tokens([5, 6, 7], 3) == []
    assert sorted(banned_tokens([5, 6, 5], 1)) == [5, 5, 6]


def test_a_cancelled_text_leaves_the_batch_at_the_next_step_and_others_are_unaffected():
    model = tiny_model()
    srcs = sources(model, [8, 8, 8], seed=3)
    engine = engine_for(model)
    seqs = [make_seq(model, s, DecodingOptions(beam=4, max_len_b=40)) for s in srcs]
    engine.submit(seqs)
    engine.iterate()
    engine.iterate()
    rows_before = engine.batch.rows
    seqs[1].cancelled = True
    engine.iterate()
    assert seqs[1].status == CANCELLED
    assert seqs[1] not in engine.batch.seqs
    assert engine.batch.rows <= rows_before - 1  # its rows are gone (others may shrink too)
    engine.run_until_idle()
    for i in (0, 2):
        assert [h.tokens for h in seqs[i].hypotheses] == [h.tokens for h in offline(model, srcs[i], seqs[i].options)]


def test_an_expired_deadline_fails_the_text_waiting_or_running():
    model = tiny_model()
    srcs = sources(model, [5, 5], seed=4)
    engine = engine_for(model)
    running = make_seq(model, srcs[0], deadline=time.monotonic() + 3600)
    engine.submit([running])
    engine.iterate()
    running.deadline = time.monotonic() - 1
    waiting = make_seq(model, srcs[1], deadline=time.monotonic() - 1)
    engine.submit([waiting])
    engine.iterate()
    assert running.status == waiting.status == DEADLINE
    assert engine.idle()


def test_waiting_texts_are_looked_at_after_a_cancel_or_once_the_earliest_deadline_passes(monkeypatch):
    """Hundreds of texts may wait: the engine reads them only when one may be doomed, after a client's
    cancel (which wakes it) or once the earliest of their deadlines has passed, not at every step."""
    model = tiny_model()
    engine = engine_for(model, "none")  # one text at a time: the others wait
    first, cancelled, expiring = (make_seq(model, s) for s in sources(model, [6, 6, 6], seed=6))
    expiring.deadline = time.monotonic() + 3600
    engine.submit([first, cancelled, expiring])
    engine.iterate()
    cancelled.cancelled = True
    engine.iterate()
    assert cancelled.status is None  # nobody woke the engine: it has not looked
    engine.wake()
    engine.iterate()
    assert cancelled.status == CANCELLED and expiring.status is None
    later = time.monotonic() + 7200
    monkeypatch.setattr(time, "monotonic", lambda: later)
    engine.iterate()
    assert expiring.status == DEADLINE


def test_a_repeated_source_skips_the_encoder():
    model = tiny_model()
    src = sources(model, [9], seed=5)[0]
    engine = engine_for(model)
    first, second = make_seq(model, src), make_seq(model, src)
    engine.submit([first])
    engine.run_until_idle()
    engine.submit([second])
    engine.run_until_idle()
    assert (first.cache_hit, second.cache_hit) == (False, True)
    assert engine.cache.stats()["misses"] == 1 and engine.cache.stats()["hits"] == 1
    assert [h.tokens for h in second.hypotheses] == [h.tokens for h in first.hypotheses]


def test_a_repeated_request_is_answered_from_the_result_cache_without_decoding():
    model = tiny_model()
    src = sources(model, [9], seed=5)[0]
    engine = Engine(TorchBackend(model), "v1", Scheduler("continuous"), EncoderCache(0), results=ResultCache(8))
    first = make_seq(model, src, DecodingOptions(beam=3, n_best=2))
    engine.submit([first])
    engine.run_until_idle()
    steps = engine.steps
    again, other_options = make_seq(model, src, DecodingOptions(beam=3, n_best=2)), make_seq(model, src)
    engine.submit([again, other_options])
    assert again.status == OK and other_options.status is None  # answered inside submit; the other waits
    assert [h.tokens for h in again.hypotheses] == [h.tokens for h in first.hypotheses]
    assert again.result_cache_hit and not first.result_cache_hit
    engine.run_until_idle()
    assert engine.steps > steps and not other_options.result_cache_hit  # other options: decoded
    assert engine.results.stats() == {"hits": 1, "misses": 2, "evictions": 0, "entries": 2}


def test_a_request_refused_whole_is_not_answered_in_part_from_the_result_cache():
    model = tiny_model()
    srcs = sources(model, [5, 6], seed=7)
    engine = Engine(TorchBackend(model), "v1", Scheduler("continuous", max_waiting=0), EncoderCache(0),
                    results=ResultCache(8))
    cached = make_seq(model, srcs[0])
    engine.results.put(result_key("v1", cached), [Hypothesis([5, 6], -1.0, -2.0)])
    new = make_seq(model, srcs[1])
    with pytest.raises(QueueFull):
        engine.submit([cached, new])
    assert cached.status is None and new.status is None


def test_admission_is_budgeted_in_beam_times_tokens_and_the_queue_is_bounded():
    model = tiny_model()
    srcs = sources(model, [5, 5, 5], seed=6)
    seqs = [make_seq(model, s, DecodingOptions(beam=4, max_len_b=10)) for s in srcs]
    budget = seqs[0].rows_budget * 2  # room for two at a time
    engine = engine_for(model, max_batch_tokens=budget, max_waiting=3)
    engine.submit(seqs)
    engine.iterate()
    assert len(engine.batch) == 2 and len(engine.scheduler) == 1
    with pytest.raises(QueueFull, match="at most 3"):
        engine.submit([make_seq(model, srcs[0]) for _ in range(3)])
    engine.run_until_idle()
    assert all(s.status == OK for s in seqs)


def test_encoder_passes_bound_the_padded_pieces_and_keep_the_texts_in_order():
    """An encoder pass pads its texts to the longest: passes hold at most ENCODE_PIECES padded
    pieces, so many short texts share one and long ones go a few at a time."""
    def seq(n):
        return Sequence([1] * n, DecodingOptions(beam=1), 5, on_done=lambda s: None)

    lengths = [16] * 70 + [127] * 20 + [8, 2 * ENCODE_PIECES, 8]
    seqs = [seq(n) for n in lengths]
    passes = encoder_passes(seqs)
    assert [s for p in passes for s in p] == seqs
    for p in passes:
        assert len(p) * max(len(s.src) for s in p) <= ENCODE_PIECES or len(p) == 1
    assert len(passes[0]) == ENCODE_PIECES // 16  # short texts: many per pass
    assert max(len(p) for p in passes if max(len(s.src) for s in p) == 127) == ENCODE_PIECES // 127
    assert [seqs[-2]] in passes  # longer than a pass allows: alone


# ---- who is admitted next (server.engine.scheduler) --------------------------------------------------
def texts(n: int, priority: int = 0, budget: int = 10) -> list[Sequence]:
    """n waiting texts of one call, each charging `budget` (beam 1: source + output limit)."""
    return [Sequence([1] * (budget - 5), DecodingOptions(beam=1), 5, on_done=lambda s: None, priority=priority)
            for _ in range(n)]


def test_a_batch_is_charged_every_row_at_the_width_of_its_longest_output_limit():
    """Each row's self-attention cache is as wide as the batch's longest output limit: ten short
    texts (budget 10 each alone) fit a budget of 100 by themselves, but beside a text that may
    write 50 tokens each is charged 5 + 50."""
    long = Sequence([1] * 5, DecodingOptions(beam=1), 50, on_done=lambda s: None)
    assert batch_cost(texts(10)) == 100 and batch_cost([long, *texts(1)]) == 110
    scheduler = Scheduler(max_batch_tokens=200)
    scheduler.add([long])
    scheduler.add(short := texts(10))
    assert scheduler.admit([]) == [long, *short[:2]]  # 55 + 2 x 55 = 165; a third would make 220


def test_higher_priority_texts_are_admitted_first_and_calls_of_one_priority_take_turns():
    scheduler = Scheduler(max_batch_tokens=1000)
    low, a, b, high = texts(3, priority=-1), texts(3), texts(3), texts(1, priority=5)
    for call in (low, a, b, high):
        scheduler.add(call)
    assert scheduler.admit([]) == [*high, a[0], b[0], a[1], b[1], a[2], b[2], *low]


def test_a_lower_priority_text_never_overtakes_a_higher_one_that_does_not_fit_yet():
    scheduler = Scheduler(max_batch_tokens=100)
    scheduler.add(running := texts(9))
    assert scheduler.admit([]) == running
    scheduler.add(low := texts(1, priority=-1, budget=5))  # would fit the 10 left ...
    scheduler.add(high := texts(1, priority=1, budget=20))  # ... but this more urgent one waits for room
    assert scheduler.admit(running) == []
    assert scheduler.admit(running[:7]) == [*high, *low]


def test_while_others_wait_a_call_holding_its_share_of_the_batch_is_passed_over_and_keeps_its_turn():
    """call_share 0.5 of a budget of 100: call A holds 60 when B arrives. B's texts take the room
    until A is below its share; then the turn is A's again."""
    capped, uncapped = Scheduler(max_batch_tokens=100, call_share=0.5), Scheduler(max_batch_tokens=100)
    for scheduler in (capped, uncapped):
        scheduler.add(a := texts(12))
        admitted = scheduler.admit([])
        assert admitted == a[:10]
        running = admitted[:6]  # four of A's texts have finished: A holds 60
        scheduler.add(b := texts(5))
        if scheduler is capped:
            assert scheduler.admit(running) == b[:4]
            assert scheduler.admit(running[:4] + b[:4]) == [a[10], b[4]]  # A holds 40 < 50: its turn
        else:  # taking turns alone: A's turn first, although it holds more than half the batch
            assert scheduler.admit(running) == [a[10], b[0], a[11], b[1]]


def test_the_cap_never_keeps_a_call_waiting_while_nobody_else_does():
    scheduler = Scheduler(max_batch_tokens=100, call_share=0.25)
    scheduler.add(a := texts(12))
    running = scheduler.admit([])
    assert running == a[:10]
    assert scheduler.admit(running[:8]) == a[10:]  # holds 80, far over its share: alone, it still goes


def test_a_loaded_batch_paced_every_third_step_admits_what_arrived_meanwhile_together():
    """Pacing: with BUSY_TEXTS texts running, admission happens at steps 0, 3, 6... only, and what
    waited is admitted at once; a lighter batch admits at every step, and so does every = 1."""
    running = texts(BUSY_TEXTS)
    scheduler = Scheduler(max_batch_tokens=1000)
    scheduler.add(first := texts(1))
    assert [scheduler.admit(running, clock, every=3) for clock in (1, 2)] == [[], []]
    scheduler.add(second := texts(1))
    assert scheduler.admit(running, 3, every=3) == [*first, *second]
    scheduler.add(light := texts(1))
    assert scheduler.admit(running[1:], 4, every=3) == light
    scheduler.add(unpaced := texts(1))
    assert scheduler.admit(running, 4) == unpaced


def test_capsule_models_pace_their_admission_and_other_models_admit_at_every_step():
    """The capsule models' encoder pass (routing on the host, then the global-state graph) is
    shared by the texts that waited for it; each text still gets its offline result."""
    assert [admission_interval(tiny_config(name)) for name in ("vanilla", "gret_full")] == \
        [1, CAPSULE_ADMISSION_INTERVAL]
    model = tiny_model("gret_full")
    engine, options = engine_for(model), DecodingOptions(beam=2)
    srcs = sources(model, [5, 7, 4, 6, 8, 5, 6, 7, 4, 6, 5])
    seqs = [make_seq(model, s, options) for s in srcs]
    engine.submit(seqs[:BUSY_TEXTS])
    engine.iterate()
    engine.submit(seqs[BUSY_TEXTS:])
    engine.iterate()
    engine.iterate()
    assert len(engine.batch) == BUSY_TEXTS  # steps 1 and 2: the late texts wait
    engine.iterate()
    assert len(engine.batch) == len(seqs)  # step 3: all three join
    engine.run_until_idle()
    for seq, src in zip(seqs, srcs):
        assert [h.tokens for h in seq.hypotheses] == [h.tokens for h in offline(model, src, options)]


def test_calls_of_several_texts_fill_their_share_of_the_budget_and_one_text_calls_the_rest():
    """bulk_share 0.5 of a budget of 100: a call of ten texts is admitted up to 50, and one-text
    calls that arrive behind it take the other half at once; past the whole budget nobody joins.
    The calls of several texts hold their half among themselves, whatever the one-text calls hold."""
    scheduler = Scheduler(max_batch_tokens=100, bulk_share=0.5)
    scheduler.add(bulk := texts(10))
    running = scheduler.admit([])
    assert running == bulk[:5]
    assert scheduler.admit(running) == []  # the bulk call waits although half the budget is free
    singles = [texts(1) for _ in range(6)]
    for one in singles:
        scheduler.add(one)
    admitted = scheduler.admit(running)
    assert admitted == [one[0] for one in singles[:5]]
    assert scheduler.admit(running + admitted) == []  # the whole budget held: nobody joins
    assert scheduler.admit(running[1:] + admitted) == bulk[5:6]  # the room a bulk text left is bulk's again
    assert scheduler.admit(running + admitted[1:]) == singles[5]  # a one-text call's room is not


def test_a_bulk_text_wider_than_its_share_still_runs_alone():
    scheduler = Scheduler(max_batch_tokens=100, bulk_share=0.5)
    scheduler.add(bulk := texts(2, budget=60))
    assert scheduler.admit([]) == bulk[:1]
    assert scheduler.admit(bulk[:1]) == []
    assert scheduler.admit([]) == bulk[1:]


def wide(beam: int, source: int, limit: int, priority: int = 0) -> Sequence:
    return Sequence([1] * source, DecodingOptions(beam=beam), limit, on_done=lambda s: None, priority=priority)


def test_while_a_text_waits_for_room_other_calls_backfill_what_it_cannot_use_yet():
    """Budget 200. A running text may write 50 tokens and has taken 10 steps: it leaves within
    40. A's text (beam 3) needs the room it holds, so A waits, with the promise of room 40 steps
    from now. B's short texts fit beside the running one and end within 5 steps: two are admitted
    (a third would not fit). C's text fits now as well, but may write 45 tokens: still running at
    the promised step, it would leave A no room, so it waits. Once the running text has left, A
    goes first."""
    running = wide(1, 5, 50)
    scheduler = Scheduler(max_batch_tokens=200)
    scheduler.add([a := wide(3, 10, 50)])
    scheduler.add(b := [wide(1, 5, 5) for _ in range(3)])
    scheduler.add([c := wide(1, 5, 45)])
    assert scheduler.admit([running], clock=10) == b[:2]
    assert scheduler.admit([], clock=50) == [a]
    a.joined = 50
    assert scheduler.admit([a], clock=50) == []  # C, then B's last: neither fits beside A's 180


def test_a_call_of_short_texts_is_answered_while_a_call_of_long_wide_ones_waits_for_room():
    """A real engine: two texts of beam 4 forced to 20 tokens fill the budget and a third of their
    call waits for room; a later call's four texts of at most two tokens are answered meanwhile,
    before any long one has ended, each as the offline search gives it."""
    model = tiny_model("vanilla")
    engine = engine_for(model, max_batch_tokens=300)
    long_options = DecodingOptions(beam=4, max_length=20, min_length=20)
    short_options = DecodingOptions(beam=1, max_len_a=0.0, max_len_b=2)
    ended = {}
    long = [make_seq(model, src, long_options) for src in sources(model, [8, 8, 8])]
    short = [make_seq(model, src, short_options) for src in sources(model, [5, 6, 7, 8], seed=1)]
    for seq in long + short:
        seq.on_done = lambda s: ended.setdefault(s, engine.steps)
    engine.submit(long)
    engine.iterate()
    engine.submit(short)
    engine.run_until_idle()
    assert max(ended[s] for s in short) < min(ended[s] for s in long)
    assert all(s.status == OK for s in long + short)
    for s in short:
        assert [h.tokens for h in s.hypotheses] == [h.tokens for h in offline(model, s.src, short_options)]


def test_a_backfilled_text_never_makes_the_waiting_one_start_after_its_promised_step():
    """Random calls through a budget, texts ending at random steps within their output limits: a
    text that found no room is admitted by the step it was first promised, whatever was
    backfilled meanwhile."""
    import random

    rng = random.Random(0)
    for _ in range(40):
        scheduler = Scheduler(max_batch_tokens=rng.choice([150, 300, 600]))
        for _ in range(rng.randint(2, 6)):
            scheduler.add([wide(rng.choice([1, 2, 4]), rng.randint(1, 20), rng.randint(1, 40))
                           for _ in range(rng.randint(1, 6))])
        ends, promised, clock = {}, {}, 0
        while scheduler or ends:
            ends = {s: end for s, end in ends.items() if end > clock}
            for seq in scheduler.admit(list(ends), clock):
                seq.joined = clock
                ends[seq] = clock + rng.randint(1, seq.max_len)
                assert clock <= promised.get(seq, clock)
            if scheduler.promise is not None:
                head, step = scheduler.promise
                promised.setdefault(head, step)
            clock += 1


def test_a_draining_engine_finishes_its_work_and_refuses_more():
    model = tiny_model()
    engine = engine_for(model).start()
    done = []
    seq = Sequence(sources(model, [6])[0], DecodingOptions(), 20, on_done=done.append)
    engine.submit([seq])
    engine.drain()
    with pytest.raises(Draining):
        engine.submit([make_seq(model, sources(model, [4])[0])])
    deadline = time.monotonic() + 30
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.stop(timeout=10)
    assert done == [seq] and seq.status == OK


@pytest.mark.parametrize("options, message", [
    (DecodingOptions(beam=0), "beam_size=0"),
    (DecodingOptions(beam=2, n_best=3), "n_best=3"),
    (DecodingOptions(max_length=100000), "max_length=100000"),
    (DecodingOptions(no_repeat_ngram=-1), "no_repeat_ngram_size=-1"),
    (DecodingOptions(length_penalty=float("nan")), "length_penalty=nan"),
])
def test_out_of_range_options_are_refused_by_name(options, message):
    with pytest.raises(OptionError, match=message):
        options.check(LIMITS)


def test_a_min_length_above_a_texts_output_limit_is_refused_naming_both_numbers():
    # 16 source tokens: 1.5 x 16 + 10 = 34 output tokens at most
    with pytest.raises(OptionError, match="min_length=35 is above the output limit of 34 tokens"):
        DecodingOptions(min_length=35).output_limit(16, 255, LIMITS)
    assert DecodingOptions(min_length=34).output_limit(16, 255, LIMITS) == 34
    with pytest.raises(OptionError, match="min_length=10 is above the output limit of 5 tokens"):
        DecodingOptions(min_length=10, max_length=5).output_limit(16, 255, LIMITS)


def test_a_prefix_as_long_as_a_texts_output_limit_is_refused_naming_both_numbers():
    with pytest.raises(OptionError, match="target_prefix is 34 pieces, not shorter than the output limit of 34 tokens"):
        DecodingOptions(prefix=tuple(range(5, 39))).output_limit(16, 255, LIMITS)
    assert DecodingOptions(prefix=tuple(range(5, 38))).output_limit(16, 255, LIMITS) == 34


@pytest.mark.parametrize("name", ["gret_full", "multiview_gca"])
def test_the_torch_backend_runs_the_kernels_dispatch_path_with_unchanged_outputs(name):
    """The server's PyTorch backend calls the Triton kernels (here in the interpreter, forced)
    for the beam-grouped cross-attention and the fused LayerNorm + context gate; the engine's
    outputs are those of the reference math."""
    from kernels.dispatch import force_triton

    model = tiny_model(name)
    srcs = sources(model, [6, 4, 7], seed=7)
    outputs = []
    for forced in (False, True):
        engine = engine_for(model)
        seqs = [make_seq(model, s, DecodingOptions(beam=b)) for s, b in zip(srcs, (3, 1, 2))]
        engine.submit(seqs)
        if forced:
            with force_triton():
                engine.run_until_idle()
        else:
            engine.run_until_idle()
        outputs.append([[h.tokens for h in s.hypotheses] for s in seqs])
    assert outputs[0] == outputs[1]


# ---- replicas ---------------------------------------------------------------------------------------
def test_replicas_spread_one_request_over_their_loops_and_each_text_gets_its_offline_result():
    model = tiny_model()
    backend = TorchBackend(model)  # one backend, one cache: shared by the loops
    cache = EncoderCache(1 << 24)
    replicas = Replicas([Engine(backend, "v1", Scheduler(), cache) for _ in range(2)])
    srcs = sources(model, [7, 3, 9, 5, 6, 4], seed=3)
    options = DecodingOptions(beam=3, n_best=2)
    seqs = [make_seq(model, s, options) for s in srcs]
    replicas.submit(seqs)
    assert [len(e.scheduler) for e in replicas.engines] == [3, 3] and replicas.queued() == 6
    replicas.run_until_idle()
    assert all(e.steps > 0 for e in replicas.engines) and replicas.idle()
    for seq, src in zip(seqs, srcs):
        assert seq.status == OK
        assert [h.tokens for h in seq.hypotheses] == [h.tokens for h in offline(model, src, options)]


def test_replicas_queue_a_request_whole_or_refuse_it_whole():
    model = tiny_model()
    replicas = Replicas([engine_for(model, max_waiting=2) for _ in range(2)])
    srcs = sources(model, [5, 5, 5, 5, 5], seed=4)
    with pytest.raises(QueueFull, match="at most 4; this request has 5"):
        replicas.submit([make_seq(model, s) for s in srcs])
    assert replicas.queued() == 0  # nothing of the refused request stayed
    replicas.submit([make_seq(model, s) for s in srcs[:4]])
    assert replicas.queued() == 4
    replicas.drain()
    with pytest.raises(Draining):
        replicas.submit([make_seq(model, srcs[0])])
    replicas.run_until_idle()


def test_one_lru_bounds_both_caches_by_the_sum_of_entry_sizes():
    from server.engine.lru import LRU

    by_entries = LRU(2)
    for key in "abc":
        by_entries.put(key, key)
    assert "a" not in by_entries and by_entries.get("b") == "b" and by_entries.evictions == 1
    by_size = LRU(10, size=len)
    by_size.put("short", "xxxx")
    by_size.put("too long", "x" * 11)  # larger than everything: not stored, nothing evicted
    by_size.put("fits", "x" * 6)
    assert (by_size.rejected, by_size.evictions, by_size.used) == (1, 0, 10)
    by_size.get("short")  # touched: the next eviction takes "fits"
    by_size.put("new", "x")
    assert "fits" not in by_size and "short" in by_size and by_size.used == 5
