"""Language codes as clients write them, reduced to the ISO 639-1 codes models are named by.

`de`, `DE`, `de-DE`, `de_AT`, `deu` and `ger` all mean German: the language subtag of the IETF
(BCP 47) tag, with three-letter ISO 639-2/3 codes replaced by their two-letter equivalent
(langcodes does both). Region and script are dropped: a model serves a language, not a country.
"auto" asks for the source language to be detected (py3langid)."""
from __future__ import annotations

import threading

import langcodes


def normalize(code: str) -> str:
    """The language subtag of `code`; '' stays ''; a code that is no language tag is only lower-cased
    (the model lookup then names what it has)."""
    code = code.strip()
    if not code:
        return ""
    try:
        return langcodes.Language.get(code).language or code.lower()
    except (langcodes.LanguageTagError, ValueError):
        return code.lower()


AUTO = "auto"
_identifier = None  # py3langid's model: loaded on the first request that asks for detection
_lock = threading.Lock()  # set_languages then classify: one caller at a time


def detect(text: str, candidates: set[str]) -> str:
    """The most likely of `candidates` for `text` by py3langid (naive Bayes over byte n-grams,
    97 languages), or '' if it knows none of them. Choosing among the languages the server can
    translate, not all 97, is what makes a short text's guess reliable."""
    global _identifier
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    with _lock:
        if _identifier is None:
            _identifier = LanguageIdentifier.from_model_file(MODEL_FILE)
        known = sorted(set(candidates) & set(_identifier.nb_classes))
        if not known:
            return ""
        if len(known) == 1:
            return known[0]
        _identifier.set_languages(known)
        return _identifier.classify(text)[0]
