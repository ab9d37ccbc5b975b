"""Fold text to what a reader (or a model) sees before injection detection looks at it.

Attackers hide an instruction from pattern matchers while a language model still reads it:
fullwidth or other compatibility letters (``ｉｇｎｏｒｅ``), invisible format characters between
letters (``ig\u200bnore``), Unicode tag characters that spell ASCII invisibly ("ASCII smuggling"),
Cyrillic or Greek look-alikes inside Latin words (``іgnоre``), and Turkish dotted and dotless i
(``İGNORE ALL PREVİOUS İNSTRUCTİONS``). ``fold`` undoes each, so the injection heuristics see
``ignore``. The classifier reads the raw text it was trained on: it should read folded text only
once training folds too (issue 14).

Only the injection heuristics read folded text; PII redaction works on the original, whose spans
it rewrites. Linear in the text: no regular expression, one pass per step.
"""

from __future__ import annotations

import unicodedata

# Invisible format characters that can sit inside a word without changing how it reads.
_INVISIBLE = [0x00AD, 0x034F, 0x061C, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x180E, 0x3164, 0xFEFF, 0xFFA0]
_INVISIBLE += [*range(0x180B, 0x1810), *range(0x200B, 0x2010), *range(0x202A, 0x202F), *range(0x2060, 0x2070)]
_INVISIBLE += [*range(0xFE00, 0xFE10), *range(0xE0100, 0xE01F0)]  # variation selectors
_TABLE: dict[int, int | str | None] = dict.fromkeys(_INVISIBLE)
# Tag characters U+E0020-U+E007E mirror printable ASCII and render as nothing: decode them,
# so a hidden instruction is read as the text it spells.
_TABLE |= {0xE0000 + c: chr(c) for c in range(0x20, 0x7F)}
_TABLE |= {0xE0001: None, 0xE007F: None}
# Turkish dotted capital I and dotless small i: English attack words written with them.
_TABLE |= {0x0130: "I", 0x0131: "i"}

# Cyrillic and Greek letters that look like Latin ones; replaced only inside a word that also
# has Latin letters (a Russian or Greek word stays as it is).
_LOOKALIKE_FROM = "аеорсхуіјѕԁһӏԛԝАВЕКМНОРСТХУІЈЅαεικνορτυχΑΒΕΗΙΚΜΝΟΡΤΥΧ"
_LOOKALIKE_TO = "aeopcxyijsdhlqwABEKMHOPCTXYIJSaeikvoptuxABEHIKMNOPTYX"
_LOOKALIKE = str.maketrans(_LOOKALIKE_FROM, _LOOKALIKE_TO)
_LOOKALIKE_SET = frozenset(_LOOKALIKE_FROM)


def fold(text: str) -> str:
    """``text`` with compatibility forms, invisible characters, tag characters, Turkish i and
    look-alike letters inside Latin words folded to what they look like."""
    folded = unicodedata.normalize("NFKC", text).translate(_TABLE)
    if _LOOKALIKE_SET.isdisjoint(folded):
        return folded
    words = folded.split(" ")
    for i, word in enumerate(words):
        if not _LOOKALIKE_SET.isdisjoint(word) and any("a" <= c.lower() <= "z" for c in word):
            words[i] = word.translate(_LOOKALIKE)
    return " ".join(words)
