"""Tests for training/seq2seq/pos_tags.py (UPOS ids per SentencePiece piece)."""
import gzip
import io
import itertools
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import sentencepiece as spm

from training.corpora import load_examples
from training.seq2seq import pos_tags as pt

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "multi30k"
U = pt.UPOS_ID


def read_lines(split, lang, n):
    with gzip.open(DATA / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in itertools.islice(f, n)]


@pytest.fixture(scope="module")
def sp():
    # A tiny model is enough: we only need realistic multi-piece words.
    lines = read_lines("train", "de", 1000) + read_lines("train", "en", 1000)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=1000,
        num_threads=1, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def word_tags(text, lang, sp):
    """{piece string: tag} for a quick look at single words."""
    pieces = sp.encode(text, out_type=str)
    return list(zip(pieces, pt.subword_tags(text, lang, sp)))


def test_constants():
    assert len(pt.UPOS) == 17 and pt.PAD_TAG == 0
    assert U["ADJ"] == 1 and U["X"] == 17
    for table in (pt.STTS_TO_UPOS, pt.C5_TO_UPOS, pt.JIEBA_TO_UPOS):
        assert set(table.values()) <= set(pt.UPOS)


@pytest.mark.parametrize("lang", ["de", "en"])
def test_tables_cover_every_hanta_tag(lang):
    # Every sentence-level tag the HanTa model can emit has a mapping.
    filename, table = pt._HANTA_MODELS[lang]
    model = pt._hanta(filename)
    emitted = {model.int2tag[-k] for k in model.int2tag if k < 0} - {"UNKNOWN"}
    assert {pt._HANTA_BRACKETS.sub(r"\1", t) for t in emitted} <= set(table)


@pytest.mark.parametrize("lang", ["de", "en"])
def test_length_real_sentences(sp, lang):
    texts = read_lines("val", lang, 200)
    tags = pt.tag_corpus(texts, lang, sp)
    for text, ids in zip(texts, tags):
        assert len(ids) == len(sp.encode(text))
        assert all(1 <= i <= 17 for i in ids)


ODD = ["", " ", "   \t\n", ".", "?!...", "😀", "😀 ok 🐶!", "a\x07b\x00c", "\x1b[0m",
       "…", "ﬁne Ａｂｃ ①②", "x\u200by", "e\u0301té", "2,5 Mio. $ + 3.000 €",
       "can't won't it’s O'Brien's", "___ --- ***", "中文 text", "Straße\r\nweg  "]


@pytest.mark.parametrize("lang", ["de", "en"])
@pytest.mark.parametrize("text", ODD)
def test_length_odd_inputs(sp, lang, text):
    ids = pt.subword_tags(text, lang, sp)
    assert len(ids) == len(sp.encode(text))
    assert all(1 <= i <= 17 for i in ids)


@pytest.mark.parametrize("lang,text,expected", [
    ("de", "Der Hund läuft.", {"Der": "DET", "Hund": "NOUN", "läuft": "VERB", ".": "PUNCT"}),
    ("en", "the dog runs.", {"the": "DET", "dog": "NOUN", "runs": "VERB", ".": "PUNCT"}),
    ("en", "The man isn't running.", {"The": "DET", "man": "NOUN", "is": "AUX",
                                      "n't": "PART", "running": "VERB"}),
    ("de", "Ein Mann und eine Frau sitzen auf 2 Bänken.",
     {"Ein": "DET", "und": "CCONJ", "sitzen": "VERB", "auf": "ADP", "2": "NUM"}),
])
def test_known_words(lang, text, expected):
    tagger = pt.Tagger(lang)
    got = {text[b:e]: pt.UPOS[t - 1] for b, e, t in tagger.tag_text(text)}
    for word, tag in expected.items():
        assert got[word] == tag, (word, got)


def test_known_words_through_pieces(sp):
    tags = dict(word_tags("Ein Hund läuft .", "de", sp))
    assert tags["."] == U["PUNCT"]
    assert tags["▁Hund"] == U["NOUN"]


@pytest.mark.parametrize("lang,text,word,tag", [
    ("de", "Ein Straßenmusikant spielt Gitarre.", "Straßenmusikant", "NOUN"),
    ("en", "A snowboarder is performing tricks.", "snowboarder", "NOUN"),
    ("en", "A man is photographing it.", "photographing", "VERB"),
])
def test_pieces_share_word_tag(sp, lang, text, word, tag):
    start = text.index(word)
    spans = pt.piece_spans(sp, text)
    ids = pt.subword_tags(text, lang, sp)
    inside = [t for (b, e), t in zip(spans, ids) if b < start + len(word) and e > start]
    assert len(inside) > 1, "word should split into several pieces"
    assert set(inside) == {U[tag]}


def test_a_word_outside_the_lexicon_is_analysed_once_and_tagged_the_same_again():
    """HanTa's analysis of an unknown word is memoised: the second sentence with the word reuses it."""
    tagger = pt.Tagger("de")
    analyses = tagger._model.analyze_forward
    before = analyses.cache_info().misses
    first = tagger.tag_text("Ein Straßenmusikantenquartett spielt.")
    misses = analyses.cache_info().misses
    assert misses > before  # the compound is not in the lexicon
    assert tagger.tag_text("Ein Straßenmusikantenquartett spielt.") == first
    assert analyses.cache_info().misses == misses


@pytest.mark.parametrize("lang,other", [("de", "en"), ("en", "de")])
def test_our_search_finds_hantas_own_tags(lang, other):
    """The tagger's search visits only a word's possible tags; on real sentences (and ones with
    words HanTa cannot analyse) it returns exactly what HanTa's tag_sent does, each tag as UPOS
    unless the word's characters decide it."""
    tagger = pt.Tagger(lang)
    texts = [e.source for e in load_examples("multi30k", "test_2016_flickr", lang, other)[:400]]
    texts += ["Xqzvbn wlkjh 123 ?!", "zzz", "A", "Der Hund’s Ball"]
    for text in texts:
        words = [text[b:e] for b, e in tagger.tokenize(text)]
        hanta = tagger._model.tag_sent_viterbi([w.replace("’", "'") for w in words])
        assert tagger.tag_words(words) == [pt._char_class_tag(w) or tagger._hanta_upos[t] for w, t in zip(words, hanta)]


def test_the_lexicon_starts_afresh_past_its_bound_and_tags_the_same(monkeypatch):
    """Past ANALYSES words the lexicon forgets them all, so memory stays bounded whatever the
    requests; a sentence longer than the bound still gets its tags whole."""
    tagger = pt.Tagger("de")
    text = "Ein kleiner Junge spielt mit seinem Hund im Garten hinter dem Haus ."
    words = text.split()
    expected = tagger.tag_words(words)
    monkeypatch.setattr(pt, "ANALYSES", 3)
    tagger = pt.Tagger("de")
    assert tagger.tag_words(words) == expected  # 13 new rows in one sentence
    assert tagger.tag_words(["Der", "Hund"]) == [pt.UPOS_ID["DET"], pt.UPOS_ID["NOUN"]]
    assert tagger._lexicon.rows == 3  # started afresh: the unused row 0 and these two
    assert tagger.tag_words(words) == expected


def test_a_word_of_thousands_of_characters_is_tagged_as_its_first_word_chars():
    """HanTa's analysis is quadratic in a word's length (4000 characters: about a minute); it sees
    WORD_CHARS of them, so a request cannot stall the tagger, and no word of the corpora is cut."""
    tagger = pt.Tagger("de")
    word = "Donaudampfschifffahrtsgesellschaftskapitän" * 100  # uncut, minutes of analysis
    cut = word[: pt.WORD_CHARS]
    assert tagger.tag_words(["Der", word, "lacht", "."]) == tagger.tag_words(["Der", cut, "lacht", "."])
    train = load_examples("multi30k", "train", "de", "en")
    assert max(end - begin for e in train for begin, end in tagger.tokenize(e.source)) <= pt.WORD_CHARS


def test_whitespace_piece_takes_next_word():
    words = [(0, 1, U["NOUN"]), (5, 6, U["VERB"])]
    spans = [(0, 0), (0, 1), (3, 5), (5, 6), (6, 7)]
    assert pt.align(spans, words) == [U["NOUN"], U["NOUN"], U["VERB"], U["VERB"], U["VERB"]]
    assert pt.align([(0, 1)], []) == [pt.X_ID]


def test_a_piece_takes_the_word_it_overlaps_most_the_first_of_equals_else_the_next_word():
    """align's rule, checked against every word for each piece, on random layouts: pieces that
    cross words, lie between them, or past the last."""
    rng = random.Random(0)
    for _ in range(500):
        cuts = sorted(rng.sample(range(1, 60), rng.randint(2, 16)))
        words = [(b, e, rng.randint(1, 17)) for b, e in zip(cuts[::2], cuts[1::2])]
        bounds = sorted(rng.choices(range(0, 64), k=rng.randint(1, 12)))
        spans = list(zip([0] + bounds, bounds))
        expected = []
        for b, e in spans:
            overlaps = [min(e, we) - max(b, wb) for wb, we, _ in words]
            if max(overlaps) > 0:
                expected.append(words[overlaps.index(max(overlaps))][2])
            else:
                after = [w for w in words if w[1] > b]
                expected.append((after[0] if after else words[-1])[2])
        assert pt.align(spans, words) == expected, (spans, words)


def test_offsets_are_characters(sp):
    text = "Größe 😀 läuft"
    ids, spans = pt.encode_with_spans(sp, text)
    assert ids == sp.encode(text) and spans == pt.piece_spans(sp, text)
    for (b, e), piece in zip(spans, sp.encode(text, out_type=str)):
        assert 0 <= b <= e <= len(text)
    assert pt._byte_to_char_offsets("aé😀") == [0, 1, 1, 2, 2, 2, 2, 3]


def test_old_sentencepiece_byte_offsets():
    # sentencepiece < 0.2.1: no offset_mapping; immutable_proto has byte offsets.
    class OldSP:
        def encode(self, text, out_type=int):
            if out_type != "immutable_proto":
                raise ValueError(f"unknown out_type={out_type}")
            return SimpleNamespace(pieces=[SimpleNamespace(id=7, begin=0, end=2),
                                           SimpleNamespace(id=9, begin=2, end=6)])

    assert pt.encode_with_spans(OldSP(), "ä😀") == ([7, 9], [(0, 1), (1, 2)])


@pytest.mark.parametrize("lang", ["fr", "FRX", ""])
def test_unsupported_language(sp, lang):
    with pytest.raises(ValueError, match="supported: de, en, zh"):
        pt.subword_tags("Un chien court.", lang, sp)
    with pytest.raises(ValueError):
        pt.Tagger(lang)


def test_chinese(sp):
    pytest.importorskip("jieba")
    text = "一只狗在公园里跑。"
    got = {text[b:e]: pt.UPOS[t - 1] for b, e, t in pt.Tagger("zh").tag_text(text)}
    assert got["狗"] == "NOUN" and got["跑"] == "VERB" and got["。"] == "PUNCT"
    assert pt.Tagger("zh").tag_words(["狗", "跑", "。"]) == [U["NOUN"], U["VERB"], U["PUNCT"]]
    for t in [text, "两个 年轻人\r\n在街上走, ok 2只😀", ""]:
        assert len(pt.subword_tags(t, "zh", sp)) == len(sp.encode(t))
