"""Documents: a text of any number of sentences and paragraphs, split into the segments a model
decodes one by one and put back together around the original whitespace.

A text is exactly gaps[0] + segments[0] + gaps[1] + ... + segments[-1] + gaps[-1]: the gaps hold
every space, newline and blank line, so reassembly puts the translations where the sentences
were. The rules, in order:
  1. every line break ends a segment (SentencePiece reads a newline as a space, and a list or a
     poem must keep its lines);
  2. each line is split into sentences by sentencex (chosen by measurement: docs/DOCUMENTS.md);
     where sentencex never starts a sentence with a digit (German, for its ordinals: 'am 2. Mai'),
     a digit after a word's full stop starts one all the same wherever sentencex would split
     before a word there ('Landschaft. 2 Mädchen'), unless the word is an abbreviation that
     stands before numbers ('Abb. 2', 'Nr. 5', 'S. 12': NUMBERED);
  3. a sentence longer than the model accepts is split after clause punctuation (, ; : and
     dashes followed by a space), clauses packed greedily into segments that fit;
  4. a clause that still does not fit stays whole: the caller truncates it and says so.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import sentencex

BREAKS = r"\r\n\u2028\u2029\x85\x0b\x0c"  # what str.splitlines() splits on
LINES = re.compile(f"[^{BREAKS}]+")  # line breaks are kept as gaps
CLAUSE_ENDS = re.compile(r"[,;:\u2013\u2014](?=\s)")  # a clause may end after these, before a space
DIGIT_AFTER_STOP = re.compile(r"(?<=[^\W\d_])([.!?]+[\"'\u201c\u201d\u00bb\u00ab)]*\s+)\d")  # 'Landschaft. 2'
NUMBERED = re.compile(r"(?i:\b(?:abb|abs|anm|art|aufl|bd|bsp|fig|fn|hft|jg|jh|kap|nr|no|pp?|rn|sp|tab|tel|vol|"
                      r"ziff|s|\w*str))\.\S*\s+$")  # abbreviations that stand before a number
# A line whose sentence marks (. ! ?) all stand at its end, and whose other characters are letters,
# digits, spaces within the line or punctuation that ends no sentence in any script, is one
# sentence: sentencex, most of the text pipeline's cost for a one-sentence text, is not asked.
# Left out: ';' (a Greek question mark), brackets (sentencex starts a sentence at a list's '2)'),
# a second closing quote. tests/test_documents.py holds the shortcut to sentencex over the corpora.
SPACE = f"[^\\S{BREAKS}]"  # a space that breaks no line (sentencex ends a sentence at a blank line)
WORDS = "\\w,:'\"«»„“”‘’‚/&%+*=@#$€£–—-"  # letters, digits and punctuation that ends no sentence
ONE_SENTENCE = re.compile(f"(?:[{WORDS}]|{SPACE})*[.!?]*[\"'«»“”‘’]?{SPACE}*")


@dataclass
class Layout:
    segments: list[str]
    gaps: list[str]  # len(segments) + 1: the whitespace before, between and after the segments

    def join(self, outputs: list[str]) -> str:
        """The text with each segment replaced by its output, whitespace as it was."""
        parts = [self.gaps[0]]
        for output, gap in zip(outputs, self.gaps[1:]):
            parts += [output, gap]
        return "".join(parts)


def whole(text: str) -> Layout:
    """The text as one segment (summaries, and translation with as_one_sequence)."""
    return Layout([text], ["", ""])


def segment(text: str, language: str, fits: Callable[[str], bool], by_line: bool = True) -> Layout:
    """The segments of `text` (rules 1-4 above; rule 1 only `by_line`: in HTML a line break is a
    space); fits(segment) says whether the model takes it."""
    spans = [clause for sentence in sentence_spans(text, language, by_line) for clause in fit(text, sentence, fits)]
    segments, gaps, end = [], [], 0
    for start, stop in spans:
        gaps.append(text[end:start])
        segments.append(text[start:stop])
        end = stop
    gaps.append(text[end:])
    return Layout(segments, gaps)


def sentence_spans(text: str, language: str, by_line: bool = True) -> list[tuple[int, int]]:
    """(start, end) of each sentence, whitespace excluded (line by line, if `by_line`)."""
    spans = []
    for line in LINES.finditer(text) if by_line else [re.match(r"(?s).*", text)]:
        starts = sentence_starts(line.group(), language)
        for start, end in zip(starts, starts[1:] + [len(line.group())]):
            span = strip(text, line.start() + start, line.start() + end)
            if span:
                spans.append(span)
    return spans


def sentence_starts(line: str, language: str) -> list[int]:
    """Where sentencex starts the line's sentences, and (rule 2) where a sentence that starts with
    a digit begins, in a language whose sentencex rules never start one there."""
    if ONE_SENTENCE.fullmatch(line):
        return [0]
    starts = [b["start_index"] for b in sentencex.get_sentence_boundaries(language, line)]
    if not starts or not _no_digit_starts(language):
        return starts
    digits = [m.end(1) for m in DIGIT_AFTER_STOP.finditer(line) if not NUMBERED.search(line, 0, m.end(1))]
    if not digits:
        return starts
    masked = list(line)
    for at in digits:
        masked[at] = "X"  # a capital: would sentencex split before a word here?
    found = {b["start_index"] for b in sentencex.get_sentence_boundaries(language, "".join(masked))}
    return sorted(set(starts) | (found & set(digits)))


@lru_cache(maxsize=None)
def _no_digit_starts(language: str) -> bool:
    probe = "Sie laufen. 2 Hunde laufen."
    return len(sentencex.get_sentence_boundaries(language, probe)) == 1


def fit(text: str, span: tuple[int, int], fits: Callable[[str], bool]) -> list[tuple[int, int]]:
    """The span as one segment if the model takes it, else as clauses packed greedily into
    segments that fit (a clause too long on its own is a segment all the same)."""
    start, end = span
    if fits(text[start:end]):
        return [span]
    cuts = [m.end() for m in CLAUSE_ENDS.finditer(text, start, end)] + [end]  # finditer gives offsets in text
    segments, begin, last = [], start, None  # `last`: the furthest cut that still fits from `begin`
    for cut in cuts:
        if last is not None and not fits(text[begin:cut]):
            segments.append(strip(text, begin, last))
            begin, last = last, None
        last = cut
    segments.append(strip(text, begin, end))
    return [s for s in segments if s]


def strip(text: str, start: int, end: int) -> tuple[int, int] | None:
    """The span without its leading and trailing whitespace; None if nothing else is left."""
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return (start, end) if start < end else None
