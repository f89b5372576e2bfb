"""Source-side POS tags as Universal POS ids, one per SentencePiece piece.

Taggers (all offline): HanTa for German (STTS) and English (BNC C5),
jieba.posseg for Chinese (ICTCLAS-style flags). Every tag set is mapped to
the 17 UPOS tags so one embedding table serves all languages.
Ids: 0 = PAD, 1..17 = UPOS in the order below. Subword pieces inherit the
tag of the word they belong to.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import unicodedata
from typing import Iterable

import numba
import numpy as np

UPOS: tuple[str, ...] = (
    "ADJ", "ADP", "ADV", "AUX", "CCONJ", "DET", "INTJ", "NOUN", "NUM",
    "PART", "PRON", "PROPN", "PUNCT", "SCONJ", "SYM", "VERB", "X",
)
PAD_TAG = 0
UPOS_ID: dict[str, int] = {t: i + 1 for i, t in enumerate(UPOS)}
X_ID = UPOS_ID["X"]
SUPPORTED_LANGS: tuple[str, ...] = ("de", "en", "zh")

# STTS (HanTa writes e.g. "VV(FIN)"; see _HANTA_BRACKETS) -> UPOS.
# NNA/NNI are HanTa's nominalised adjectives/infinitives.
STTS_TO_UPOS: dict[str, str] = {
    "$(": "PUNCT", "$,": "PUNCT", "$.": "PUNCT",
    "ADJA": "ADJ", "ADJD": "ADJ", "ADV": "ADV",
    "APPO": "ADP", "APPR": "ADP", "APPRART": "ADP", "APZR": "ADP",
    "ART": "DET", "CARD": "NUM", "FM": "X", "ITJ": "INTJ",
    "KOKOM": "CCONJ", "KON": "CCONJ", "KOUI": "SCONJ", "KOUS": "SCONJ",
    "NE": "PROPN", "NN": "NOUN", "NNA": "NOUN", "NNI": "NOUN",
    "PDAT": "DET", "PDS": "PRON", "PIAT": "DET", "PIDAT": "DET", "PIS": "PRON",
    "PPER": "PRON", "PPOSAT": "DET", "PPOSS": "PRON",
    "PRELAT": "DET", "PRELS": "PRON", "PRF": "PRON",
    "PROAV": "ADV", "PAV": "ADV",
    "PTKA": "PART", "PTKANT": "PART", "PTKNEG": "PART", "PTKZU": "PART",
    "PTKVZ": "ADP",  # separable verb prefix: UD German tags it ADP
    "PWAT": "DET", "PWAV": "ADV", "PWS": "PRON", "TRUNC": "X",
    "VAFIN": "AUX", "VAIMP": "AUX", "VAINF": "AUX", "VAPP": "AUX",
    "VMFIN": "AUX", "VMINF": "AUX", "VMPP": "AUX",
    "VVFIN": "VERB", "VVIMP": "VERB", "VVINF": "VERB", "VVIZU": "VERB",
    "VVPP": "VERB", "XY": "X",
}

# BNC C5, as HanTa's English model emits it (taglevel=1, third field), -> UPOS.
# Its extras: "NN" (untyped noun), "IN" (preposition-like), "!!!" (leftovers).
C5_TO_UPOS: dict[str, str] = {
    "AJ0": "ADJ", "AJC": "ADJ", "AJS": "ADJ", "ORD": "ADJ",
    "AT0": "DET", "DT0": "DET", "DTQ": "DET",
    "AV0": "ADV", "AVQ": "ADV",
    "AVP": "ADP",  # verb particle ("pick up"): UD English tags it ADP
    "CJC": "CCONJ", "CJS": "SCONJ", "CJT": "SCONJ",
    "CRD": "NUM",
    "DPS": "PRON", "EX0": "PRON",  # UD: possessives and existential "there"
    "PNI": "PRON", "PNP": "PRON", "PNQ": "PRON", "PNX": "PRON",
    "ITJ": "INTJ",
    "NN": "NOUN", "NN0": "NOUN", "NN1": "NOUN", "NN2": "NOUN", "NP0": "PROPN",
    "POS": "PART", "TO0": "PART", "XX0": "PART",
    "PRF": "ADP", "PRP": "ADP", "IN": "ADP",
    "PUL": "PUNCT", "PUN": "PUNCT", "PUQ": "PUNCT", "PUR": "PUNCT",
    # be/have/modals are AUX (as STTS VA*/VM*); "do" is mostly a main verb
    # in descriptive text, so VD* stays VERB.
    "VBB": "AUX", "VBD": "AUX", "VBG": "AUX", "VBI": "AUX", "VBN": "AUX",
    "VBZ": "AUX", "VHB": "AUX", "VHD": "AUX", "VHG": "AUX", "VHI": "AUX",
    "VHN": "AUX", "VHZ": "AUX", "VM0": "AUX",
    "VDB": "VERB", "VDD": "VERB", "VDG": "VERB", "VDI": "VERB", "VDN": "VERB",
    "VDZ": "VERB", "VVB": "VERB", "VVD": "VERB", "VVG": "VERB", "VVI": "VERB",
    "VVN": "VERB", "VVZ": "VERB",
    "UNC": "X", "ZZ0": "X", "!!!": "X",
}

# jieba.posseg flags (ICTCLAS-style) -> UPOS. Punctuation and spaces come
# out as "x"; the character-class override below fixes those.
JIEBA_TO_UPOS: dict[str, str] = {
    "a": "ADJ", "ag": "ADJ", "b": "ADJ", "z": "ADJ", "zg": "ADJ",
    "ad": "ADV", "d": "ADV", "df": "ADV", "dg": "ADV",
    "an": "NOUN", "n": "NOUN", "ng": "NOUN", "j": "NOUN", "s": "NOUN",
    "t": "NOUN", "tg": "NOUN", "vn": "NOUN",
    "q": "NOUN",  # classifiers: UD Chinese tags them NOUN
    "f": "ADP",  # localisers (里, 上): UD Chinese treats them as postpositions
    "nr": "PROPN", "nrfg": "PROPN", "nrt": "PROPN", "ns": "PROPN",
    "nt": "PROPN", "nz": "PROPN",
    "c": "CCONJ", "p": "ADP", "e": "INTJ", "o": "INTJ",
    "m": "NUM", "mg": "NUM", "mq": "NUM",
    "r": "PRON", "rg": "PRON", "rr": "PRON", "rz": "PRON",
    "u": "PART", "ud": "PART", "ug": "PART", "uj": "PART", "ul": "PART",
    "uv": "PART", "uz": "PART", "y": "PART", "k": "PART", "h": "PART",
    "v": "VERB", "vd": "VERB", "vg": "VERB", "vi": "VERB", "vq": "VERB",
    "eng": "X", "g": "X", "i": "X", "l": "X", "x": "X",
}

_HANTA_MODELS = {"de": ("morphmodel_ger.pgz", STTS_TO_UPOS),
                 "en": ("morphmodel_en.pgz", C5_TO_UPOS)}

# Words for the tagger: numbers with separators ("2,5"), words with inner
# hyphens/apostrophes ("black-and-white", "man's"), single other chars.
_TOKEN_RE = re.compile(r"\d+(?:[.,]\d+)+|\w+(?:[-'’]\w+)*|[^\w\s]")
# HanTa's English model was trained on Penn-style clitics: "is n't", "man 's".
_EN_CLITIC_RE = re.compile(r"^(.+?)(n['’]t|['’](?:s|re|ve|ll|d|m))$", re.I)
_NUMBER_RE = re.compile(r"\d+(?:[.,]\d+)*")
# HanTa writes "VV(FIN)" for STTS "VVFIN"; "$(" must stay as it is.
_HANTA_BRACKETS = re.compile(r"\((\w+)\)$")


def _check_lang(lang: str) -> str:
    code = lang.lower() if isinstance(lang, str) else lang
    if code not in SUPPORTED_LANGS:
        raise ValueError(
            f"no POS tagger for language {lang!r}; supported: {', '.join(SUPPORTED_LANGS)}")
    return code


ANALYSES = 1 << 15  # words memoised per language: HanTa's analyses, the Lexicon's rows (a few KB each at most)
# HanTa analyses a word in time quadratic in its length (200 characters: 0.13 s, 400: 0.54 s,
# so 4000: about a minute), so it sees a word's first WORD_CHARS characters only. The corpora's
# longest word has 36 (Multi30K de; 23 in Gigaword): no training tag changes, and no request can
# stall the tagger.
WORD_CHARS = 40


@functools.lru_cache(maxsize=None)
def _hanta(filename: str):
    # Loading unpickles a large model: do it once per process and language. Always the file inside
    # the installed package: given a bare name, HanTa tries the working directory first and would
    # unpickle (run) whatever file of that name it found there.
    from HanTa import HanoverTagger as ht
    model = ht.HanoverTagger(os.path.join(os.path.dirname(ht.__file__), filename))
    # A word outside HanTa's precomputed lexicon is analysed afresh at every occurrence, and that is
    # most of its tagging time. The analysis depends on the word alone: memoise it, bounded.
    model.analyze_forward = functools.lru_cache(maxsize=ANALYSES)(model.analyze_forward)
    return model


class Lexicon:
    """The words one HanTa model has tagged, each analysed once, as rows of flat arrays: a word's
    possible tags (indices into _hmm's) and their emission scores, and its tag where the
    characters alone decide it (_char_class_tag; 0 where they do not). A sentence then costs one
    dict lookup per word and one compiled search (_tag_sentence) over a few contiguous arrays.
    Why so lean: the server tags in its front end, on the cores its engine workers decode on, and
    every cache line the tagger touches is one they fetch again (ad hoc, 64 callers on the GRET
    model: this lexicon in place of memoised arrays per word made the front end 0.07 core-ms a
    text cheaper and the workers as much). A sentence's first word is analysed case-insensitively
    (as HanTa's tag_sent does), so it has rows of its own. Bounded: past ANALYSES rows it starts
    afresh."""

    def __init__(self, model, upos_of: dict[int, int]):
        self.model = model
        tag_ids, self.index, self.transitions = _hmm(model)
        self.upos = np.array([upos_of.get(t, X_ID) for t in tag_ids], np.int64)  # by tag index
        self.order = [t for t in next(iter(model.LP_trans_word.values())) if t != _END]  # HanTa's order of tags
        n = len(tag_ids)
        self.where = np.full(n * n, -1)  # _tag_sentence's
        self.search = (self.index[_EMPTY] * n + self.index[_START], self.index[_END], n)
        self.clear()

    def clear(self) -> None:
        self.first: dict[str, int] = {}  # a sentence's first word -> its row
        self.rest: dict[str, int] = {}
        self.rows, self.used = 1, 0  # row 0 is never a word's, so a row number is true
        self.starts, self.counts, self.overrides = (np.zeros(1024, np.int64) for _ in range(3))
        self.tags, self.scores = np.zeros(4096, np.int64), np.zeros(4096)

    def tag(self, words: list[str]) -> list[int]:
        """UPOS ids for a tokenised sentence of at least one word."""
        if self.rows > ANALYSES:
            self.clear()
        first, rest = self.first, self.rest
        rows = [first.get(words[0]) or self._add(words[0], False)]
        rows += [rest.get(w) or self._add(w, True) for w in words[1:]]
        return _tag_sentence(np.array(rows), self.starts, self.counts, self.overrides, self.tags, self.scores,
                             self.transitions, self.upos, self.where, *self.search).tolist()

    def _add(self, word: str, case_sensitive: bool) -> int:
        """The word's row: its tags in the order HanTa tries them (every state lists its successors
        in one order). A word HanTa cannot analyse (no tag, or only its UNKNOWN, which is no
        state's successor) may take any tag, free; so may one whose tags no state can reach, where
        HanTa's own search would fail."""
        clean = word[:WORD_CHARS].replace("’", "'")  # HanTa knows ASCII apostrophes only
        emissions = dict(self.model._tag_word(clean, cutoff=5, casesensitive=case_sensitive, conditional=True))
        pairs = [(t, emissions[t]) for t in self.order if t in emissions] or [(t, 0.0) for t in self.order]
        row, used = self.rows, self.used + len(pairs)
        if row == len(self.starts):
            self.starts, self.counts, self.overrides = (_grown(a, 2 * row)
                                                        for a in (self.starts, self.counts, self.overrides))
        if used > len(self.tags):
            size = max(2 * len(self.tags), used)
            self.tags, self.scores = _grown(self.tags, size), _grown(self.scores, size)
        self.starts[row], self.counts[row], self.overrides[row] = self.used, len(pairs), _char_class_tag(word) or 0
        self.tags[self.used: used] = [self.index[t] for t, _ in pairs]
        self.scores[self.used: used] = [e for _, e in pairs]
        self.rows, self.used = row + 1, used
        (self.rest if case_sensitive else self.first)[word] = row
        return row


_EMPTY, _START, _END = 0, 1, 2  # HanTa's reserved tag ids


@functools.lru_cache(maxsize=None)
def _hmm(model) -> tuple[np.ndarray, dict[int, int], np.ndarray]:
    """HanTa's transitions as arrays: (its tag ids, sorted; each id's index i in them; the
    log-probability of tag j after state (tag a, tag b), at [a * T + b, j], -inf where HanTa has none)."""
    transitions = model.LP_trans_word
    tag_ids = sorted({t for state in transitions for t in state} | {t for nxt in transitions.values() for t in nxt})
    index = {t: i for i, t in enumerate(tag_ids)}
    n = len(tag_ids)
    table = np.full((n * n, n), -np.inf)
    for (previous, tag), successors in transitions.items():
        for successor, lp in successors.items():
            table[index[previous] * n + index[tag], index[successor]] = lp
    return np.array(tag_ids), index, table


@numba.njit(cache=True)  # holding the GIL: the callers' `where` is one buffer for all threads
def _tag_sentence(rows, starts, counts, overrides, tags, scores, transitions, upos, where, start, end, n):
    """The UPOS ids of HanTa's tag sequence for a sentence of Lexicon rows (a row's override
    first): the sequence HanTa's tag_sent finds, visiting far fewer candidates.

    The model is a second-order HMM: a state is the pair (previous tag, tag), previous * n + tag,
    and a word may take only its row's tags. HanTa's own search tries every one of the ~56
    successor tags of each live state and then discards all but the word's few; this one visits
    only the word's, in the same order, with HanTa's pruning (states within 1 of the sixth best),
    sums and tie-breaking, so the tags are the same. The lattice holds word w's states at
    bounds[w + 1]:bounds[w + 2] (the start's at 0) in the order they were first reached, which
    decides ties as HanTa's dictionaries do, each with its best predecessor's place. `where`
    (n * n, all -1) gives a state's place while its word's states are built, and is left as it came."""
    floor = -1e6
    words = len(rows)
    size = 64
    states, lps, parents = np.empty(size, np.int64), np.empty(size), np.empty(size, np.int64)
    bounds = np.empty(words + 2, np.int64)
    states[0], lps[0], parents[0], bounds[0], bounds[1] = start, 0.0, -1, 0, 1
    for w in range(words):
        lo, hi = bounds[w], bounds[w + 1]
        c0 = starts[rows[w]]
        c1 = c0 + counts[rows[w]]
        if hi + (hi - lo) * (c1 - c0) > size:  # room for every successor
            size = 2 * (hi + (hi - lo) * (c1 - c0))
            states, lps, parents = _grown(states, size), _grown(lps, size), _grown(parents, size)
        bound = _sixth_largest(lps[lo:hi]) - 1 if hi - lo > 5 else floor
        k = hi
        for a in range(lo, hi):
            if lps[a] < bound:
                continue
            previous = states[a] % n
            for c in range(c0, c1):
                lp = lps[a] + transitions[states[a], tags[c]] + scores[c]
                if not lp > floor:  # no such transition (-inf), or too unlikely
                    continue
                nxt = previous * n + tags[c]
                at = where[nxt]
                if at < 0:
                    where[nxt], states[k], lps[k], parents[k] = k, nxt, lp, a
                    k += 1
                elif lp > lps[at]:
                    lps[at], parents[at] = lp, a
        for i in range(hi, k):
            where[states[i]] = -1
        bounds[w + 2] = k
    lo, hi = bounds[words], bounds[words + 1]
    if hi == lo:
        raise ValueError("no tag sequence reaches the end of the sentence")
    best = lo  # the first of equals, as HanTa
    for a in range(lo + 1, hi):
        if lps[a] + transitions[states[a], end] > lps[best] + transitions[states[best], end]:
            best = a
    out = np.empty(words, np.int64)
    for w in range(words - 1, -1, -1):
        override = overrides[rows[w]]
        out[w] = override if override else upos[states[best] % n]
        best = parents[best]
    return out


@numba.njit(cache=True, nogil=True)
def _sixth_largest(values):
    """np.sort(values)[-6] without sorting: the six largest so far, largest first."""
    top = np.full(6, -np.inf)
    for v in values:
        if v > top[5]:
            i = 5
            while i > 0 and v > top[i - 1]:
                top[i] = top[i - 1]
                i -= 1
            top[i] = v
    return top[5]


@numba.njit(cache=True, nogil=True)
def _grown(a, size):
    """a's values in a longer array (the rest unset): the search's lattice and the Lexicon's rows."""
    out = np.empty(size, a.dtype)
    out[: len(a)] = a
    return out


@functools.lru_cache(maxsize=None)
def _jieba_posseg():
    import jieba
    import jieba.posseg
    jieba.setLogLevel(logging.WARNING)  # silence the dictionary-loading chatter
    return jieba.posseg


@functools.lru_cache(maxsize=ANALYSES)  # a word's class is the word's alone; real text repeats its words
def _char_class_tag(token: str) -> int | None:
    """Tag decided by the characters alone, or None for real words.

    Taggers guess wildly on symbols and digits (HanTa tags "?" UNC, "2" IN
    and jieba tags all punctuation "x"), so these win over the tagger.
    """
    if _NUMBER_RE.fullmatch(token):
        return UPOS_ID["NUM"]
    if any(c.isalnum() for c in token):
        return None
    kinds = {unicodedata.category(c)[0] for c in token}
    if kinds == {"P"}:
        return UPOS_ID["PUNCT"]
    if "S" in kinds:
        return UPOS_ID["SYM"]
    return X_ID


@functools.lru_cache(maxsize=ANALYSES)
def _is_invisible(token: str) -> bool:
    # Control/format chars: SentencePiece drops them or turns them into spaces.
    return all(unicodedata.category(c)[0] in "CZ" for c in token)


class Tagger:
    """POS tagger for one language, giving UPOS ids (1..17)."""

    def __init__(self, lang: str):
        self.lang = _check_lang(lang)
        if self.lang == "zh":
            self._posseg = _jieba_posseg()
        else:
            filename, table = _HANTA_MODELS[self.lang]
            self._model = _hanta(filename)
            self._hanta_upos = {i: self._to_id(_HANTA_BRACKETS.sub(r"\1", tag), table)
                                for i, tag in self._model.int2tag.items()}
            self._lexicon = Lexicon(self._model, self._hanta_upos)

    def tag_words(self, words: list[str]) -> list[int]:
        """UPOS ids for an already tokenised sentence (same length)."""
        if not words:
            return []
        if self.lang == "zh":
            # The segmentation is given, so look each word up on its own.
            flags = [max(self._posseg.cut(w), key=lambda p: len(p.word), default=None)
                     for w in words]
            raw = [self._to_id(p.flag if p else "x", JIEBA_TO_UPOS) for p in flags]
            return [_char_class_tag(w) or t for w, t in zip(words, raw)]
        return self._lexicon.tag(words)

    def tag_text(self, text: str) -> list[tuple[int, int, int]]:
        """(begin, end, upos_id) for each word of raw text; char offsets."""
        if self.lang == "zh":
            return self._tag_text_zh(text)
        words, spans = self._split(text)
        return [(b, e, t) for (b, e), t in zip(spans, self.tag_words(words))]

    def tokenize(self, text: str) -> list[tuple[int, int]]:
        """Word spans (char offsets) for HanTa: words, numbers, punctuation."""
        return self._split(text)[1]

    def _split(self, text: str) -> tuple[list[str], list[tuple[int, int]]]:
        """tokenize's words and their spans."""
        words, spans = [], []
        english = self.lang == "en"
        for m in _TOKEN_RE.finditer(text):
            word = m.group()
            if len(word) == 1 and _is_invisible(word):  # a longer match holds \w, which is never invisible
                continue
            b, e = m.span()
            clitic = _EN_CLITIC_RE.match(word) if english else None
            if clitic:
                cut = b + clitic.end(1)
                words += [text[b:cut], text[cut:e]]
                spans += [(b, cut), (cut, e)]
            else:
                words.append(word)
                spans.append((b, e))
        return words, spans

    def _tag_text_zh(self, text: str) -> list[tuple[int, int, int]]:
        # jieba segments and tags in one go; find each word's offsets.
        out, pos = [], 0
        for pair in self._posseg.cut(text):
            b = text.find(pair.word, pos)
            if b < 0 or not pair.word:
                continue  # jieba altered the text: skip rather than misalign
            pos = b + len(pair.word)
            if pair.word.isspace() or _is_invisible(pair.word):
                continue
            tag = _char_class_tag(pair.word) or self._to_id(pair.flag, JIEBA_TO_UPOS)
            out.append((b, pos, tag))
        return out

    @staticmethod
    def _to_id(tag: str, table: dict[str, str]) -> int:
        return UPOS_ID[table.get(tag, "X")]


@functools.lru_cache(maxsize=None)
def get_tagger(lang: str) -> Tagger:
    """Shared Tagger per language."""
    return Tagger(lang)


def _byte_to_char_offsets(text: str) -> list[int]:
    """Map each UTF-8 byte offset of text (0..len(bytes)) to a char offset."""
    table = []
    for i, ch in enumerate(text):
        table += [i] * len(ch.encode("utf-8"))
    table.append(len(text))
    return table


def encode_with_spans(sp, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """sp.encode(text) and, for each piece, its (begin, end) char offsets into
    the *original* text, from one encoding (a POS model's server reads every
    request's pieces and their spans).

    sentencepiece >= 0.2.1 has out_type='offset_mapping' (char offsets for
    str input). Older versions only have 'immutable_proto', whose
    .begin/.end are UTF-8 byte offsets into the original text.
    Pieces made purely by normalisation (e.g. "…" -> "...") may be empty.
    """
    try:
        encoded = sp.encode(text, out_type="offset_mapping")
        return encoded["ids"], [tuple(o) for o in encoded["offsets"]]
    except ValueError:
        proto = sp.encode(text, out_type="immutable_proto")
        to_char = _byte_to_char_offsets(text)
        return [p.id for p in proto.pieces], [(to_char[p.begin], to_char[p.end]) for p in proto.pieces]


def piece_spans(sp, text: str) -> list[tuple[int, int]]:
    """The spans of encode_with_spans."""
    return encode_with_spans(sp, text)[1]


def align(spans: list[tuple[int, int]], words: list[tuple[int, int, int]]) -> list[int]:
    """Tag id per piece span, given sorted (begin, end, tag) word spans.

    A piece takes the tag of the word it overlaps most; a piece that covers
    no word (whitespace, a lone '▁', a dropped control char) takes the next
    word's tag, or the last word's at the end of the text. Pieces and words
    both run left to right, so one pass over each suffices (the GRET server
    tags every request: this is on its hot path).
    """
    if not words:
        return [X_ID] * len(spans)
    out, i, last = [], 0, len(words) - 1
    for b, e in spans:
        while i < last and words[i][1] <= b:  # words that end before the piece begins are behind it
            i += 1
        best, best_overlap, j = i, 0, i  # i: the next word (or the last), where the piece overlaps none
        while j <= last and words[j][0] < e:
            begin, end, _ = words[j]
            overlap = (e if e < end else end) - (b if b > begin else begin)  # min/max calls cost more
            if overlap > best_overlap:
                best, best_overlap = j, overlap
            j += 1
        out.append(words[best][2])
    return out


def subword_tags(text: str, lang: str, sp, tagger: Tagger | None = None,
                 spans: list[tuple[int, int]] | None = None) -> list[int]:
    """One UPOS id per piece of sp.encode(text), same order and length; `spans`: the pieces'
    (encode_with_spans), where the caller has them."""
    tagger = tagger or get_tagger(_check_lang(lang))
    spans = piece_spans(sp, text) if spans is None else spans
    if not spans:
        return []
    return align(spans, tagger.tag_text(text))


def tag_corpus(texts: Iterable[str], lang: str, sp) -> list[list[int]]:
    """subword_tags for many sentences with one shared tagger."""
    tagger = get_tagger(_check_lang(lang))
    return [subword_tags(t, lang, sp, tagger) for t in texts]
