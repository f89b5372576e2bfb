"""HTML documents: the text is translated, the markup comes back byte for byte.

The stdlib parser (html.parser) cuts the document into text and markup, each kept as its exact
source slice. Markup is inline (the tags in INLINE, entities and character references, comments)
or a block boundary (every other tag). The text between two block boundaries, read without its
inline markup, is one plain text, segmented into sentences like any text (server.documents; a
line break, though, is only a space), so a sentence that spans <b> or <a> is translated as one
sentence. The output is the document again: block markup and the whitespace between sentences
exactly as they were, each sentence's translation escaped as HTML text, and the sentence's inline
markup put back by these rules:
  - markup between sentences (or at a sentence's very edge) stays there, in its whitespace;
  - markup inside a sentence goes to the same relative word position (the share of the
    sentence's words before it): an opening tag before the word there, a closing tag after the
    word before it, other markup (read as a space) before the word there, as a word of its own;
  - markup keeps its source order, so the tags nest as before (a pair may end up around no word).
Script and style contents are markup. Entities and comments are kept as written and read as a
space ('Mann&nbsp;sitzt' is two words): one inside a word splits the word for the model (write
such characters as UTF-8)."""
from __future__ import annotations

import html
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from typing import Callable

from .documents import Layout, segment

INLINE = {"a", "abbr", "b", "bdi", "bdo", "cite", "code", "data", "dfn", "em", "font", "i", "kbd", "mark", "q", "s",
          "samp", "small", "span", "strong", "sub", "sup", "time", "u", "var"}
RAW_TEXT = {"script", "style"}  # their contents are code, not text
WORDS = re.compile(r"\w(?:\S*\w)?")  # a word from its first to its last letter or digit: 'dog.' -> 'dog'
OPEN, CLOSE, OTHER, BLOCK, TEXT = "open", "close", "other", "block", "text"


@dataclass
class Piece:
    kind: str  # OPEN, CLOSE, OTHER (inline markup), BLOCK (markup that ends a block) or TEXT
    raw: str  # its exact source slice


class _Pieces(HTMLParser):
    """The document as Pieces, each cut at the source position where the parser saw it begin."""

    def __init__(self, source: str):
        super().__init__(convert_charrefs=False)
        self.source, self.starts, self.kinds = source, [], []
        self.lines = [0] + [m.end() for m in re.finditer("\n", source)]
        self.raw_text = None  # inside <script> or <style>: the tag name
        self.feed(source)
        self.close()

    def _add(self, kind: str) -> None:
        line, column = self.getpos()
        self.starts.append(self.lines[line - 1] + column)
        self.kinds.append(kind)

    def handle_starttag(self, tag, attrs):
        self._add(OPEN if tag in INLINE else BLOCK)
        self.raw_text = tag if tag in RAW_TEXT else None

    def handle_startendtag(self, tag, attrs):
        self._add(OTHER if tag in INLINE else BLOCK)

    def handle_endtag(self, tag):
        self._add(CLOSE if tag in INLINE else BLOCK)
        self.raw_text = None

    def handle_data(self, data):
        self._add(BLOCK if self.raw_text else TEXT)

    def handle_entityref(self, name):
        self._add(OTHER)

    handle_charref = handle_entityref

    def handle_comment(self, data):
        self._add(OTHER)

    def handle_decl(self, decl):
        self._add(BLOCK)

    handle_pi = unknown_decl = handle_decl

    def pieces(self) -> list[Piece]:
        ends = self.starts[1:] + [len(self.source)]
        pieces = [Piece(kind, self.source[start:end]) for kind, start, end in zip(self.kinds, self.starts, ends)]
        head = self.source[: self.starts[0]] if self.starts else self.source
        return ([Piece(TEXT, head)] if head else []) + pieces


@dataclass
class Block:
    """The text between two block boundaries, read without its inline markup (`plain`), its
    sentences, and its inline markup with the plain-text offset each piece stands at."""
    plain: str
    layout: Layout
    markup: list[tuple[int, Piece]]

    def join(self, outputs: list[str]) -> str:
        out, cursor, markup = [], 0, list(self.markup)
        for (start, end), output in zip(self._spans(), outputs):
            out.append(_with_markup(self.plain[cursor:start], cursor, [m for m in markup if m[0] <= start]))
            markup = [m for m in markup if m[0] > start]
            inside = [m for m in markup if m[0] < end]
            out.append(_placed(html.escape(output, quote=False), self.plain[start:end], start, inside))
            markup, cursor = markup[len(inside):], end
        out.append(_with_markup(self.plain[cursor:], cursor, markup))
        return "".join(out)

    def _spans(self) -> list[tuple[int, int]]:
        spans, position = [], 0
        for gap, sentence in zip(self.layout.gaps, self.layout.segments):
            position += len(gap)
            spans.append((position, position + len(sentence)))
            position += len(sentence)
        return spans


class HtmlLayout:
    """A Layout for an HTML document: its segments are the sentences of all its blocks; join()
    gives the document back with the translations in their place."""

    def __init__(self, parts: list[Piece | Block]):
        self.parts = parts
        self.segments = [s for p in parts if isinstance(p, Block) for s in p.layout.segments]

    def join(self, outputs: list[str]) -> str:
        out, i = [], 0
        for part in self.parts:
            if isinstance(part, Piece):
                out.append(part.raw)
            else:
                n = len(part.layout.segments)
                out.append(part.join(outputs[i: i + n]))
                i += n
        return "".join(out)


def segment_html(source: str, language: str, fits: Callable[[str], bool]) -> HtmlLayout:
    """The document cut into blocks and their sentences (server.documents.segment)."""
    parts, pending = [], []  # pending: the pieces of the block being read

    def end_block():
        plain = "".join(stand_in(p) for p in pending)
        if plain.strip():
            markup, offset = [], 0
            for p in pending:
                if p.kind != TEXT:
                    markup.append((offset, p))
                offset += len(stand_in(p))
            parts.append(Block(plain, segment(plain, language, fits, by_line=False), markup))
        else:  # whitespace and markup only: nothing to translate
            parts.extend(pending)
        pending.clear()

    for piece in _Pieces(source).pieces():
        if piece.kind == BLOCK:
            end_block()
            parts.append(piece)
        else:
            pending.append(piece)
    end_block()
    return HtmlLayout(parts)


def text_of(source: str) -> str:
    """A document's text without its markup (what language detection reads)."""
    return "".join(stand_in(p) for p in _Pieces(source).pieces() if p.kind in (TEXT, OTHER))


def stand_in(piece: Piece) -> str:
    """What a piece is in a block's plain text."""
    return piece.raw if piece.kind == TEXT else " " if piece.kind == OTHER else ""


def _with_markup(text: str, offset: int, markup: list[tuple[int, Piece]]) -> str:
    """Whitespace between sentences with its markup exactly where it was (offsets from `offset`)."""
    out, cursor = [], 0
    for at, piece in markup:
        out += [text[cursor: at - offset], piece.raw]
        cursor = at - offset + len(stand_in(piece))
    return "".join(out) + text[cursor:]


def _placed(output: str, sentence: str, offset: int, markup: list[tuple[int, Piece]]) -> str:
    """A sentence's translation with its inline markup at the same relative word positions."""
    if not markup:
        return output
    total = max(1, len(WORDS.findall(sentence)))
    words = list(WORDS.finditer(output))
    inserts, last = [], 0
    for at, piece in markup:
        k = round(len(WORDS.findall(sentence[: at - offset])) / total * len(words))
        raw = piece.raw
        if piece.kind == CLOSE:
            position = words[k - 1].end() if k > 0 else 0
        else:
            position = words[k].start() if k < len(words) else len(output)
            if piece.kind == OTHER:  # it read as a space: a word of its own
                raw = f"{raw} " if k < len(words) else f" {raw}"
        last = max(last, position)  # source order: tags nest as they did
        inserts.append((last, raw))
    out, cursor = [], 0
    for position, raw in inserts:
        out += [output[cursor:position], raw]
        cursor = position
    return "".join(out) + output[cursor:]


class _Markup(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=False)
        self.seen: list[tuple] = []

    def handle_starttag(self, tag, attrs):
        self.seen.append(("start", tag, attrs))

    def handle_startendtag(self, tag, attrs):
        self.seen.append(("startend", tag, attrs))

    def handle_endtag(self, tag):
        self.seen.append(("end", tag))

    def handle_entityref(self, name):
        self.seen.append(("entity", name))

    def handle_comment(self, data):
        self.seen.append(("comment", data))

    def handle_decl(self, decl):
        self.seen.append(("decl", decl))


def markup_of(document: str) -> list[tuple]:
    """A document's markup in order (tags with their attributes, entities, comments, declarations),
    text left out: what a translation must give back unchanged (the tests and bench/documents.py
    compare it)."""
    parser = _Markup()
    parser.feed(document)
    parser.close()
    return parser.seen
