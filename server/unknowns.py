"""Characters a model cannot write survive the round trip: they are taken out of the source and put
back into the translation.

A character is foreign to a model when its SentencePiece cannot give it back: encoded then decoded
it comes out as ' ⁇ ' (outside the alphabet: €, emoji, CJK, most symbols) or changed (NFKC turns
½ into 1⁄2 and ™ into TM). The foreign part of each word (from its first to its last foreign
character, so that 'Łódź' stays whole while '5€' leaves '5' to the model) is a run; runs with only
spaces between them are one. The model reads the sentence without its runs; each run goes back
into the output before the word at the same relative position (the share of the sentence's words
before it), at the end before the final full stop if it stood last. No character is lost; a run
may land a word or two away from where a human would put it.

Why not placeholders the model copies, or CTranslate2's replace_unknowns: the shipped models never
saw a placeholder nor an unknown piece in training, and copy neither (docs/DOCUMENTS.md measures
this: `python -m bench unknowns`); a model leaves a missing word out more gracefully than it
reads one it does not know."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

WORDS = re.compile(r"\S+")
COUNTED = re.compile(r"\S*\w\S*")  # the words positions count: a lone full stop is none
FINAL_STOP = re.compile(r"[.!?]+\s*$")


@dataclass
class Alphabet:
    """The characters a model's SentencePiece gives back unchanged (each one tried once)."""
    sp: object  # SentencePieceProcessor
    _good: set[str] = field(default_factory=set)
    _bad: set[str] = field(default_factory=set)

    def __contains__(self, char: str) -> bool:
        if char in self._good:
            return True
        if char not in self._bad:
            good = char.isspace() or self.sp.decode(self.sp.encode(char)) == char
            (self._good if good else self._bad).add(char)
            return good
        return False

    def covers(self, text: str) -> bool:
        """Whether the model writes every character of `text`: one set comparison for a text of
        known characters (almost every text), instead of a lookup per character."""
        chars = set(text)
        return chars <= self._good or all(c in self for c in chars)


@dataclass
class Run:
    text: str
    at: float  # share of the sentence's (remaining) words before it


@dataclass
class Protected:
    text: str  # the sentence without its runs: what the model reads
    runs: list[Run]


def protect(text: str, alphabet: Alphabet) -> Protected:
    spans = []
    for start, end in foreign_spans(text, alphabet):
        if spans and not text[spans[-1][1]:start].strip():  # only spaces since the last span: one run
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    if not spans:
        return Protected(text, [])
    parts, before, last = [], [], 0
    for start, end in spans:
        parts.append(text[last:start] + " ")  # 'Hund😀Katze' stays two words
        if end < len(text) and not text[end].isspace() and not text[end].isalnum():
            parts[-1] = parts[-1].rstrip()  # '寿司.': the full stop joins the word before
        before.append(len(COUNTED.findall("".join(parts))))
        last = end
    parts.append(text[last:])
    kept = " ".join("".join(parts).split())
    words = len(COUNTED.findall(kept))
    return Protected(kept, [Run(text[s:e], n / words if words else 1.0) for (s, e), n in zip(spans, before)])


def foreign_spans(text: str, alphabet: Alphabet) -> list[tuple[int, int]]:
    """In each word, the span from its first to its last foreign character."""
    if alphabet.covers(text):
        return []
    spans = []
    for word in WORDS.finditer(text):
        foreign = [i for i, c in enumerate(word.group()) if c not in alphabet]
        if foreign:
            spans.append((word.start() + foreign[0], word.start() + foreign[-1] + 1))
    return spans


def restore(output: str, protected: Protected, keep: int = 0, given: str = "") -> str:
    """The output with the runs put back (module docstring); a sentence that was all runs comes
    back as it was, since the model had nothing to translate. With a target prefix, the output's
    first `keep` characters (the prefix) stay as they are, runs go after them, and a run the prefix
    as sent (`given`) already holds is not put back a second time."""
    runs = []
    for run in protected.runs:
        if run.text in given:
            given = given.replace(run.text, "", 1)
        else:
            runs.append(run)
    if protected.runs and not protected.text:
        return " ".join(run.text for run in runs)
    if not runs:
        return output
    starts = [m.start() for m in COUNTED.finditer(output)]
    first = next((k for k, start in enumerate(starts) if start >= keep), len(starts))  # the first word it may go before
    stop = FINAL_STOP.search(output, keep)
    end = stop.start() if stop else len(output)
    for run in reversed(runs):  # from the back, so that earlier positions stay valid
        k = max(first, round(run.at * len(starts)))
        if k < len(starts):
            output = f"{output[:starts[k]]}{run.text} {output[starts[k]:]}"
        else:
            output = f"{output[:end].rstrip()} {run.text}{output[end:]}"
    return output.strip()
