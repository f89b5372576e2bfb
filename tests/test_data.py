"""Real data loaders, SentencePiece and token-based batching."""
from __future__ import annotations

import pytest

from training.corpora import Example, load_examples
from training.data import RARE_WORD, TokenBatcher, encode_target, length_filter, source_batches, train_sentencepiece
from training.seq2seq.inputs import (BOS, EOS, PAD, align_tags, encode_source, input_style, load_sentencepiece,
                                     normalize_gigaword, normalize_input)


def test_multi30k_splits_have_their_documented_sizes_in_every_direction():
    assert len(load_examples("multi30k", "train", "de", "en")) == 29000
    fr_de = load_examples("multi30k", "test_2016_flickr", "fr", "de")
    en_de = load_examples("multi30k", "test_2016_flickr", "en", "de")
    assert len(fr_de) == 1000 and fr_de[0].target == en_de[0].target  # line N is the same sentence


def test_aeslc_dev_has_four_references_and_gigaword_pairs_align():
    dev = load_examples("aeslc", "dev")
    assert len(dev) == 1960 and all(len(e.refs) == 4 for e in dev)
    assert all(len(e.refs) == 1 for e in load_examples("aeslc", "train")[:100])
    giga = load_examples("gigaword", "valid")
    assert len(giga) == 500 and len(giga[0].source.split()) > len(giga[0].target.split())


def test_bad_requests_are_refused_clearly():
    with pytest.raises(ValueError, match="no split"):
        load_examples("multi30k", "test")
    with pytest.raises(ValueError, match="two different languages"):
        load_examples("multi30k", "train", "de", "de")
    with pytest.raises(ValueError, match="unknown dataset"):
        load_examples("wmt", "train")


@pytest.fixture(scope="module")
def sp():
    train = load_examples("multi30k", "train", "de", "en")[:3000]
    return load_sentencepiece(train_sentencepiece([e.source for e in train] + [e.target for e in train], 1000))


def test_joint_sentencepiece_covers_both_languages_and_round_trips(sp):
    assert sp.get_piece_size() == 1000 and sp.pad_id() == PAD and sp.eos_id() == EOS
    for text in ("Ein Hund läuft über die Wiese.", "A dog runs across the meadow."):
        assert sp.decode(sp.encode(text)) == text
    assert encode_source(sp, "Ein Hund.", 64)[-1] == EOS
    tgt = encode_target(sp, "A dog.", 64)
    assert tgt[0] == BOS and tgt[-1] == EOS
    assert len(encode_source(sp, "Hund " * 100, 10)) == 10  # truncated, still ends with EOS


def test_gigawords_rare_word_marker_is_one_piece_that_decodes_to_itself():
    train = load_examples("gigaword", "train")[:2000]
    assert any(RARE_WORD in e.target for e in train)
    giga = load_sentencepiece(train_sentencepiece([e.source for e in train] + [e.target for e in train], 1000))
    headline = f"laura bush {RARE_WORD} rice to attend ## {RARE_WORD}"
    assert giga.decode(giga.encode(headline)) == headline
    assert giga.piece_to_id(RARE_WORD) in giga.encode(headline) and giga.unk_id() not in giga.encode(headline)


def test_plain_english_is_brought_into_gigawords_style_and_the_corpus_is_left_as_it_is():
    assert normalize_gigaword('Japan\'s exports rose 5.2% in October (a record), officials said "on Monday".') == \
        "japan 's exports rose #.#% in october -lrb- a record -rrb- , officials said `` on monday '' ."
    assert normalize_gigaword("S&P can't sell 1,500 shares at 1/2 price!") == \
        "s &amp; p ca n't sell #,### shares at #\\/# price !"
    for e in load_examples("gigaword", "valid"):
        assert normalize_gigaword(e.source) == " ".join(e.source.split())
        assert normalize_gigaword(e.target) == " ".join(e.target.split())
    assert normalize_input(input_style("gigaword"), "Ein Hund.") == "ein hund ."
    assert normalize_input(input_style("multi30k"), "Ein Hund.") == "Ein Hund."  # other models read text as it is


def test_token_batches_respect_the_budget_and_cover_each_example_once_per_epoch(sp):
    train = load_examples("multi30k", "train", "de", "en")[:2000]
    src = [encode_source(sp, e.source, 128) for e in train]
    tgt = [encode_target(sp, e.target, 128) for e in train]
    batcher = TokenBatcher(src, tgt, max_tokens=600, seed=3)
    batches = batcher.batches(epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(len(src)))
    for ids in batches:
        batch = batcher.collate(ids)
        assert max(batch.src.shape[1], batch.tgt.shape[1]) * len(ids) <= 600 or len(ids) == 1
    assert batcher.batches(epoch=0) == batches  # deterministic: exact resume replays it
    assert batcher.batches(epoch=1) != batches


def test_inference_batches_are_length_sorted_and_cover_every_source():
    src = [[5] * n + [EOS] for n in (9, 1, 4, 30, 2)]
    tags = [[1] * len(s) for s in src]
    seen = []
    for ids, batch, tag_batch in source_batches(src, max_tokens=40, tags=tags):
        assert batch.shape == tag_batch.shape
        assert batch.shape[1] * len(ids) <= 40 or len(ids) == 1
        seen += ids
    assert sorted(seen) == list(range(5))


def test_tags_align_with_truncated_sources_and_eos_gets_pad():
    assert align_tags([[4, 5, 6]], [[10, 11, EOS]]) == [[4, 5, 0]]
    assert align_tags([[4]], [[10, 11, EOS]]) == [[4, 0, 0]]


def test_length_filter_drops_long_pairs_but_truncates_long_summarisation_sources(sp):
    short, long_ = "Ein Hund.", "Ein Hund läuft über die große grüne Wiese. " * 20
    pairs = [Example(short, ["A dog."]), Example(long_, ["A dog."]), Example(short, [long_])]
    assert length_filter(pairs, sp, 32, 32, truncate_source=False) == pairs[:1]
    assert length_filter(pairs, sp, 32, 32, truncate_source=True) == pairs[:2]
