"""Documents in, documents out: segmentation keeps every character of the layout, the real server
translates texts of many sentences and paragraphs in one call (as the sentences one by one, put
back in place), says when it cut a source or stopped at the length limit, and normalises language
codes; the CLI translates stdin as one document; a target prefix begins a text's output."""
from __future__ import annotations

import io

import grpc
import pytest
import sentencex
from hypothesis import given, settings
from hypothesis import strategies as st

from proto import gret_serve_pb2 as pb
from server import client as client_cli
from server.client import Client
from server.documents import CLAUSE_ENDS, ONE_SENTENCE, segment, whole
from server.languages import normalize
from server.markup import markup_of, segment_html
from server.unknowns import Alphabet, protect, restore
from tests.served import REPO, RunningServer, config_for
from training.corpora import load_examples
from training.seq2seq.inputs import load_sentencepiece

CODE = grpc.StatusCode
LAYOUTS = ["Ein Hund läuft. Eine Katze schläft.", "  Zwei Männer.\n\nDrei Frauen!\n", "A.\r\nB?\tC.\n\n\n",
           "eins\u2028zwei\u2029drei", "Dr. Müller kommt um 5 Uhr.  Er lacht.", "\u00a0Ja.\u3000Nein."]


def german(n: int, offset: int = 0) -> list[str]:
    """Validation captions that end a sentence (a few have no full stop: joined, they read as one)."""
    captions = [e.source.strip() for e in load_examples("multi30k", "val", "de", "en")]
    return [c for c in captions if c[-1] in ".!?"][offset: offset + n]


# ---- segmentation (no server) ---------------------------------------------------------------------------
@pytest.mark.parametrize("text", LAYOUTS)
def test_a_layout_puts_every_character_back(text):
    layout = segment(text, "de", lambda s: True)
    assert layout.join(layout.segments) == text
    assert all(s == s.strip() and s for s in layout.segments)
    assert all(not gap.strip() for gap in layout.gaps)


def test_sentences_and_lines_are_segments():
    assert segment("Ein Hund läuft. Dr. Müller kommt.\nZeile zwei", "de", lambda s: True).segments == [
        "Ein Hund läuft.", "Dr. Müller kommt.", "Zeile zwei"]


@pytest.mark.parametrize("text, segments", [
    ("Leute fahren durch eine Landschaft. 2 Mädchen sitzen. Ein Tisch, der bemalt ist. 3 Jungen stehen.",
     ["Leute fahren durch eine Landschaft.", "2 Mädchen sitzen.", "Ein Tisch, der bemalt ist.", "3 Jungen stehen."]),
    ("Sie rief „Komm!“ 3 Leute kamen.", ["Sie rief „Komm!“", "3 Leute kamen."]),
    ("Am 2. Mai kam er. Es kostet ca. 2 Euro. Siehe Abb. 4 und Nr. 5 in der Hauptstr. 7, z. B. 8 Leute.",
     ["Am 2. Mai kam er.", "Es kostet ca. 2 Euro.", "Siehe Abb. 4 und Nr. 5 in der Hauptstr. 7, z. B. 8 Leute."]),
])
def test_a_german_sentence_may_start_with_a_digit_but_not_after_an_ordinal_or_abbreviation(text, segments):
    assert segment(text, "de", lambda s: True).segments == segments


def test_a_sentence_too_long_is_split_at_clauses_that_fit():
    text = "eins, zwei, drei; vier: fünf sechs sieben, acht."
    layout = segment(text, "de", lambda s: len(s) <= 12)
    assert layout.segments == ["eins, zwei,", "drei; vier:", "fünf sechs sieben,", "acht."]
    assert layout.join(layout.segments) == text


def test_a_long_sentence_after_others_is_split_at_its_own_clauses():
    text = "Ja. Nein.\n\neins, zwei, drei; vier: fünf sechs sieben, acht."
    layout = segment(text, "de", lambda s: len(s) <= 12)
    assert layout.segments == ["Ja.", "Nein.", "eins, zwei,", "drei; vier:", "fünf sechs sieben,", "acht."]
    assert layout.join(layout.segments) == text


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.sampled_from(["Hund", "Männer", "2", "laufen", ",", ";", ":", " –", ".", "!", " ", " ", " ", "\n",
                                 "\n\n", "Dr.", "z. B."]), max_size=60).map("".join))
def test_any_text_is_cut_where_the_rules_say_and_put_back_whole(text):
    """Rules 1-4 of server.documents on any text: the layout gives the text back, and a segment too
    long for the model is a single clause (it holds no clause end before its last character)."""
    fits = lambda s: len(s) <= 12  # noqa: E731
    layout = segment(text, "de", fits)
    assert layout.join(layout.segments) == text
    assert all(s == s.strip() and s and "\n" not in s for s in layout.segments)
    for s in layout.segments:
        assert fits(s) or not any(m.end() < len(s) for m in CLAUSE_ENDS.finditer(s)), s


def corpus_lines() -> list[tuple[str, str]]:
    """(line, language) for every source line of the corpora's held-out splits."""
    pairs = [("de", "en"), ("en", "fr"), ("fr", "de")]
    lines = [(e.source, src) for src, tgt in pairs for split in ("val", "test_2016_flickr", "test_2017_flickr")
             for e in load_examples("multi30k", split, src, tgt)]
    for dataset, split in (("gigaword", "valid"), ("aeslc", "dev")):
        lines += [(line, "en") for e in load_examples(dataset, split) for line in e.source.splitlines()]
    return lines


def test_a_line_the_one_sentence_shortcut_takes_is_one_sentence_to_sentencex():
    """The shortcut (ONE_SENTENCE) only skips sentencex where sentencex would find one sentence: over
    every held-out line of the corpora, and on marks that end a sentence in other scripts."""
    taken = 0
    for line, language in corpus_lines():
        if ONE_SENTENCE.fullmatch(line):
            taken += 1
            assert len(sentencex.get_sentence_boundaries(language, line)) == 1, (language, line)
    assert taken > 5000  # it pays: most captions are one sentence with its mark at the end
    for line in ["Τι κάνεις; Καλά", "नमस्ते। आप कैसे हैं", "你好。我很好", "Warte… dann geh", "Eins\n\nZwei", "Dr. Müller kommt"]:
        assert not ONE_SENTENCE.fullmatch(line), line  # sentencex decides


def test_a_clause_that_cannot_fit_stays_whole():
    text = "ein sehr langer Satz ohne jedes Komma"
    assert segment(text, "de", lambda s: len(s) < 10).segments == [text]
    assert whole(" x. y. ").segments == [" x. y. "]


SPECIAL = {"Der Preis ist 5€ 😀 日本.": ["€ 😀 日本"], "Ein Koch mit Sushi 寿司.": ["寿司"], "東京": ["東京"],
           "Eine Frau namens Ångström in Łódź ½ Stunde lang ™.": ["Å", "Łódź ½", "™"]}


@pytest.fixture(scope="module")
def alphabet():
    """The shipped de-en model's: Multi30K's alphabet."""
    return Alphabet(load_sentencepiece(REPO / "models" / "multi30k-de-en" / "spm.model"))


@pytest.mark.parametrize("text, runs", SPECIAL.items())
def test_characters_the_model_cannot_write_are_taken_out_and_put_back(alphabet, text, runs):
    protected = protect(text, alphabet)
    assert [run.text for run in protected.runs] == runs
    assert all(c in alphabet for c in protected.text)
    assert restore(protected.text, protected).replace(" ", "") == text.replace(" ", "")  # in place, spacing aside
    for output in ("", "A dog.", "Ein Koch mit Sushi."):
        assert all(run in restore(output, protected) for run in runs)


def test_a_sentence_with_nothing_foreign_is_read_as_it_is(alphabet):
    sentences = german(200)
    assert [protect(s, alphabet).text for s in sentences] == sentences


PAGE = """<!DOCTYPE html>
<html><head><title>Hunde</title><style>p > b { color: red; }</style></head>
<body>
  <h1>Ein Tag im Park</h1>
  <p class="intro">Ein <b>großer</b> Hund läuft über die Wiese. Eine <a href="/k?a=1&amp;b=2">kleine Katze</a> schläft
     &amp; träumt.</p>
  <ul><li>Zwei Männer spielen Fußball.</li><li><i>Ein Kind lacht.</i> <!-- zweiter Satz --> Es regnet.</li></ul>
  <p>Ein Mann&nbsp;sitzt<br>auf einer Bank.</p>
  <script>if (a < b) { go(); }</script>
</body></html>
"""


def test_html_sentences_span_inline_tags_and_leave_the_rest_alone():
    layout = segment_html(PAGE, "de", lambda s: True)
    assert [" ".join(s.split()) for s in layout.segments] == [
        "Hunde", "Ein Tag im Park", "Ein großer Hund läuft über die Wiese.", "Eine kleine Katze schläft träumt.",
        "Zwei Männer spielen Fußball.", "Ein Kind lacht.", "Es regnet.", "Ein Mann sitzt", "auf einer Bank."]
    assert markup_of(layout.join(layout.segments)) == markup_of(PAGE)


def test_inline_tags_go_to_the_same_relative_word_position():
    layout = segment_html('<p>Ein <b>großer</b> Hund &amp; eine <a href="x">Katze</a>.</p>', "de", lambda s: True)
    # &amp; stood after 3 of 5 words: before word round(3 / 5 * 6) = 4 of the 6
    assert layout.join(["A big dog and a cat."]) == '<p>A <b>big</b> dog and &amp; a <a href="x">cat</a>.</p>'


@pytest.mark.parametrize("code", ["de", "DE", "de-DE", "de_AT", "deu", "ger", " de "])
def test_language_codes_mean_their_language(code):
    assert normalize(code) == "de"


# ---- the real server --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(served_models, tmp_path_factory):
    running = RunningServer(config_for(served_models, tmp_path_factory.mktemp("build-cache")))
    yield running
    running.stop()


@pytest.fixture
def client(server):
    with Client(server.address, timeout=120) as c:
        yield c


def document(sentences: list[str]) -> str:
    """Paragraphs of two sentences with blank lines, an indented line and a trailing newline."""
    paragraphs = [" ".join(sentences[i: i + 2]) for i in range(0, len(sentences), 2)]
    return "\n\n".join(paragraphs[:-1]) + "\n\n   " + paragraphs[-1] + "\n"


@pytest.mark.slow  # a real server
def test_a_document_is_its_sentences_translated_one_by_one_in_place(client):
    sentences = german(5)
    text = document(sentences)
    result = client.translate([text], target="en", beam_size=2, n_best=2, return_scores=True).results[0]
    one_by_one = client.translate(sentences, target="en", beam_size=2, as_one_sequence=True).results
    layout = segment(text, "de", lambda s: True)
    assert layout.segments == sentences
    assert result.sentences == 5 and not result.truncated
    assert result.hypotheses[0].text == layout.join([r.hypotheses[0].text for r in one_by_one])
    assert result.source_tokens == sum(r.source_tokens for r in one_by_one)
    assert result.hypotheses[0].text.count("\n\n") == 2 and result.hypotheses[0].text.endswith("\n")
    assert len(result.hypotheses) == 2 and result.hypotheses[0].score >= result.hypotheses[1].score


@pytest.mark.slow  # a real server
def test_a_long_text_is_no_longer_refused_unless_sent_as_one_sequence(client, server):
    text = " ".join(german(30, offset=20))
    pieces = len(server.registry.pipelines["tiny-de-en"].entry.sp.encode(text))
    assert pieces > 127
    result = client.translate([text], target="en", beam_size=1).results[0]
    assert result.sentences >= 25 and not result.truncated
    with pytest.raises(grpc.RpcError) as info:
        client.translate(["Ein Hund.", text], target="en", as_one_sequence=True)
    assert info.value.code() == CODE.INVALID_ARGUMENT
    assert f"text 1 is {pieces} pieces long" in info.value.details() and "at most 127" in info.value.details()


@pytest.mark.slow  # a real server
def test_a_sentence_that_cannot_be_split_is_truncated_and_says_so(client):
    result = client.translate(["Hund " * 300, "Ein Hund."], target="en", beam_size=1).results
    assert result[0].truncated and result[0].sentences == 1 and result[0].source_tokens == 128
    assert not result[1].truncated


@pytest.mark.slow  # a real server
def test_finish_reasons_tell_the_length_limit_from_an_end_of_sentence(client):
    cut = client.translate(german(3), target="en", max_length=3, min_length=3, n_best=2).results
    assert all(h.finish_reason == pb.LENGTH and h.tokens == 3 for r in cut for h in r.hypotheses)
    results = client.translate(german(8, offset=40), target="en", as_one_sequence=True).results
    for r in results:
        limit = min(int(1.5 * r.source_tokens + 10), 255)
        h = r.hypotheses[0]
        assert h.finish_reason == (pb.END_OF_SENTENCE if h.tokens < limit else pb.LENGTH)


@pytest.mark.slow  # a real server
def test_streaming_sends_each_document_once(client):
    texts = [document(german(4, offset=60)), german(1, offset=70)[0], document(german(3, offset=80))]
    streamed = {r.results[0].index: r.results[0] for r in client.translate_stream(texts, target="en")}
    unary = client.translate(texts, target="en").results
    assert sorted(streamed) == [0, 1, 2]
    assert [streamed[i].hypotheses[0].text for i in range(3)] == [r.hypotheses[0].text for r in unary]
    assert [streamed[i].sentences for i in range(3)] == [4, 1, 3]


@pytest.mark.slow  # a real server
@pytest.mark.parametrize("html", [False, True])
def test_streaming_sentences_sends_each_as_partial_before_its_text(client, html):
    """"Ja." ends many decoding steps before the long sentence after it, so it is sent apart,
    marked partial, as it is translated alone; each text still comes once, whole, after its
    sentences; a one-sentence text only whole."""
    long = " ".join(german(3, offset=150)).replace(".", ",")[:-1] + "."
    text = f"<p>Ja. <b>{long}</b></p>" if html else f"Ja.\n\nNein. {long}"
    sentences = ["Ja.", long] if html else ["Ja.", "Nein.", long]
    events = [r.results[0] for r in client.translate_stream([text, "Ein Hund."], target="en", beam_size=2, html=html,
                                                            stream_sentences=True)]
    final = {r.index: r for r in events if not r.partial}
    assert sorted(final) == [0, 1] and len(events) - sum(r.partial for r in events) == 2
    unary = client.translate([text, "Ein Hund."], target="en", beam_size=2, html=html).results
    assert [final[i].hypotheses[0].text for i in (0, 1)] == [r.hypotheses[0].text for r in unary]
    alone = client.translate(sentences, target="en", beam_size=2, as_one_sequence=True).results
    partial = [r for r in events if r.partial]
    assert partial and partial[0].sentence == 0  # a scheduling fact: "Ja." ends ~20 decoder steps earlier
    for r in partial:
        assert (r.index, r.sentences) == (0, len(sentences)) and r.sentence < len(sentences) - 1
        assert r.hypotheses[0].text == alone[r.sentence].hypotheses[0].text
        assert events.index(r) < events.index(final[0])
    assert len({r.sentence for r in partial}) == len(partial)


@pytest.mark.slow  # a real server
def test_metrics_count_texts_and_sentences(client, server):
    def count(name: str) -> float:
        return server.metrics.registry.get_sample_value(name, {"model": "tiny-de-en", "status": "ok"}) or 0.0

    before = count("gret_serve_texts_total"), count("gret_serve_sentences_total")
    client.translate([document(german(4, offset=90)), "Ein Hund."], target="en", beam_size=1)
    assert (count("gret_serve_texts_total") - before[0], count("gret_serve_sentences_total") - before[1]) == (2, 5)


@pytest.mark.slow  # a real server
def test_list_models_gives_input_and_option_limits(client):
    info = {m.name: m for m in client.list_models()}
    assert info["tiny-de-en"].max_input_pieces == 127 and info["tiny-headlines"].max_input_pieces == 63
    limits = info["tiny-de-en"].limits
    assert (limits.max_beam_size, limits.max_n_best, limits.max_texts, limits.max_text_chars) == (16, 16, 256, 4000)
    assert 0 < limits.max_output_tokens <= 256


@pytest.mark.slow  # a real server
@pytest.mark.parametrize("source, target", [("deu", "EN"), ("de-DE", "en_US"), ("DE", "eng")])
def test_language_codes_are_normalised(client, source, target):
    assert client.translate(["Ein Hund."], source=source, target=target).model == "tiny-de-en"


@pytest.mark.slow  # a real server
def test_the_cli_translates_stdin_as_one_document(server, monkeypatch, capsys):
    text = document(german(3, offset=100))
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    assert client_cli.main(["--address", server.address, "translate", "--to", "en", "--beam", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n\n") == text.count("\n\n") and out.endswith("\n") and not out.endswith("\n\n")


@pytest.mark.slow  # a real server
def test_special_characters_survive_the_round_trip(client):
    texts = list(SPECIAL)
    results = client.translate([" ".join(texts[:2]) + "\n\n" + texts[2], texts[3]], target="en").results
    outputs = [h.text for r in results for h in r.hypotheses]
    assert all(run in outputs[0] for runs in list(SPECIAL.values())[:3] for run in runs)
    assert all(run in outputs[1] for run in SPECIAL[texts[3]])
    assert "⁇" not in "".join(outputs) and "\n\n" in outputs[0]


@pytest.mark.slow  # a real server
def test_html_comes_back_with_identical_markup(client):
    response = client.translate([PAGE, "<p>Ein <b>Hund</b> 😀.</p>"], target="en", html=True, beam_size=2).results
    out = response[0].hypotheses[0].text
    assert markup_of(out) == markup_of(PAGE)
    assert response[0].sentences == 9 and "<script>if (a < b) { go(); }</script>" in out
    assert markup_of(response[1].hypotheses[0].text) == markup_of("<p><b></b></p>")
    assert "😀" in response[1].hypotheses[0].text


@pytest.mark.slow  # a real server
def test_auto_reads_an_html_documents_text_not_its_markup(client):
    page = ('<p title="Ein Hund läuft über die Wiese und ein Mann schaut zu, während die Kinder im Garten spielen">'
            'A dog runs across the meadow and a man watches.</p>')
    response = client.translate([page], source="auto", html=True, beam_size=1)
    assert (response.source_language, response.model) == ("en", "tiny-en-de")


@pytest.mark.slow  # a real server
@pytest.mark.parametrize("text, detected, model", [
    ("Ein Hund läuft über die Wiese und ein Mann schaut zu.", "de", "tiny-de-en"),
    ("A dog runs across the meadow and a man watches.", "en", "tiny-en-de")])
def test_auto_detects_the_source_language(client, text, detected, model):
    response = client.translate([text], source="auto")
    assert (response.source_language, response.model) == (detected, model)


# ---- target prefix ----------------------------------------------------------------------------------------
@pytest.mark.slow  # a real server
def test_a_target_prefix_begins_each_text_and_only_a_documents_first_sentence(client):
    sentences = german(4, offset=110)
    text = "  " + document(sentences)
    results = client.translate([text, sentences[0]], target="en", beam_size=2, target_prefix="A dog").results
    first = client.translate(sentences[:1], target="en", beam_size=2, as_one_sequence=True,
                             target_prefix="A dog").results[0].hypotheses[0].text
    rest = client.translate(sentences[1:], target="en", beam_size=2, as_one_sequence=True).results
    assert first.startswith("A dog") and results[1].hypotheses[0].text == first
    layout = segment(text, "de", lambda s: True)
    assert results[0].hypotheses[0].text == layout.join([first] + [r.hypotheses[0].text for r in rest])
    assert results[0].hypotheses[0].text.startswith("  A dog")  # after the text's own leading whitespace
    n_best = client.translate(sentences[1:3], target="en", beam_size=3, n_best=3, target_prefix="Two").results
    assert all(h.text.startswith("Two") for r in n_best for h in r.hypotheses)


@pytest.mark.slow  # a real server
def test_a_prefix_per_text_comes_back_as_sent(client):
    texts = german(3, offset=120)
    plain = client.translate(texts, target="en", beam_size=2).results
    prefixes = ["The  man ", "", "Ein 😀 & <b>"]  # spaces as sent, none, characters the model cannot write
    results = client.translate(texts, target="en", beam_size=2, target_prefix=prefixes).results
    first = results[0].hypotheses[0].text
    assert first.startswith("The  man ") and not first[9:].startswith(" ")  # no second space after the prefix
    assert results[1].hypotheses[0].text == plain[1].hypotheses[0].text
    assert results[2].hypotheses[0].text.startswith("Ein 😀 & <b>")
    headline = client.summarize(["japan 's exports rose for a third month in october , the ministry said ."],
                                beam_size=2, target_prefix="Japan's").results[0].hypotheses[0].text
    assert headline.startswith("Japan's")  # the model reads it in its style ('japan 's'); it comes back as sent


@pytest.mark.slow  # a real server
def test_a_prefix_longer_than_the_output_limit_or_one_too_many_is_refused(client, server):
    prefix = "Ein Mann und eine Frau laufen mit zwei Hunden"
    pieces = len(server.registry.pipelines["tiny-de-en"].entry.sp.encode(prefix))
    with pytest.raises(grpc.RpcError) as info:
        client.translate(["Ein Hund.", "Eine Katze."], target="en", max_length=5, target_prefix=["", prefix])
    assert info.value.code() == CODE.INVALID_ARGUMENT
    assert (f"text 1: option target_prefix is {pieces} pieces, not shorter than the output limit of 5 tokens"
            in info.value.details())
    with pytest.raises(grpc.RpcError) as info:
        client.translate(["Ein Hund.", "Eine Katze.", "Ein Pferd."], target="en", target_prefix=["A", "B"])
    assert info.value.code() == CODE.INVALID_ARGUMENT
    assert "option target_prefix has 2 entries for 3 texts" in info.value.details()
