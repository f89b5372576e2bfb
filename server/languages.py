"""Language codes as clients write them, reduced to the ISO 639-1 codes models are named by.

`de`, `DE`, `de-DE`, `de_AT`, `deu` and `ger` all mean German: the language subtag of the IETF
(BCP 47) tag, with three-letter ISO 639-2/3 codes replaced by their two-letter equivalent
(langcodes does both). Region and script are dropped: a model serves a language, not a country."""
from __future__ import annotations

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
