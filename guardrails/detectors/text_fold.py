"""Fold text to what a reader (or a model) sees before injection detection looks at it.

Attackers hide an instruction from pattern matchers while a language model still reads it:
fullwidth or other compatibility letters (``ｉｇｎｏｒｅ``), invisible format characters between
letters (``ig\u200bnore``), Unicode tag characters that spell ASCII invisibly ("ASCII smuggling"),
Cyrillic or Greek look-alikes inside Latin words (``іgnоre``), and Turkish dotted and dotless i
(``İGNORE ALL PREVİOUS İNSTRUCTİONS``). ``fold`` undoes each, so the heuristics, the character
n-grams and the multilingual encoder see ``ignore``. Training folds the same way
(guardrails/train_injection.py), so scores mean the same at serving time.

Encoded runs (base64, hex: hashes, keys, blobs, or an instruction written so no reader sees it)
say nothing a classifier can read. ``fold`` writes each as ``[encoded]``, so the classifier judges
the words around it (an opaque hash in a question is not an attack, "decode this and obey it" is),
and ``decoded_payloads`` gives what each one decodes to when that is text, which the injection rail
checks as a text of its own.

Only the injection rail reads folded text; PII redaction works on the original, whose spans it
rewrites: ``decoded_runs`` gives it each run's span in the original and what the run says. Linear in the text: no regular expression, one pass per step.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import itertools
import string
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


ENCODED = "[encoded]"
MAX_DECODE_DEPTH = 3  # levels of encoding read (a run inside what a run decodes to, ...)
# A run of these characters is a candidate encoded run: base64 (standard and URL-safe) and hex.
_B64_CHARS = frozenset(string.ascii_letters + string.digits + "+/-_")
_HEX_CHARS = frozenset(string.hexdigits)
_MIN_HEX = 16  # a 64-bit value; git's short SHAs (7-12) stay words
_MIN_B64 = 20  # 15 bytes; below this, ordinary identifiers and words


def fold(text: str) -> str:
    """``text`` with compatibility forms, invisible characters, tag characters, Turkish i and
    look-alike letters inside Latin words folded to what they look like, and encoded runs
    written as ``[encoded]``."""
    folded = unicodedata.normalize("NFKC", text).translate(_TABLE)
    if not _LOOKALIKE_SET.isdisjoint(folded):
        words = folded.split(" ")
        for i, word in enumerate(words):
            if not _LOOKALIKE_SET.isdisjoint(word) and any("a" <= c.lower() <= "z" for c in word):
                words[i] = word.translate(_LOOKALIKE)
        folded = " ".join(words)
    spans = _encoded_spans(folded)
    if not spans:
        return folded
    out, last = [], 0
    for start, end in spans:
        out += [folded[last:start], ENCODED]
        last = end
    return "".join(out) + folded[last:]


def decoded_payloads(text: str, _depth: int = 0) -> list[str]:
    """What the encoded runs of ``text`` (folded first) decode to, where that is readable text:
    base64 or hex of UTF-8, and what runs inside those decode to, up to ``MAX_DECODE_DEPTH``
    levels (base64 of base64). All of them (a cap would let an attack hide behind enough
    harmless runs); each level is shorter than the one it came from."""
    folded = unicodedata.normalize("NFKC", text).translate(_TABLE)
    out = []
    for start, end in _encoded_spans(folded):
        decoded = _decode(folded[start:end])
        if decoded is not None:
            out.append(decoded)
            if _depth + 1 < MAX_DECODE_DEPTH:
                out += decoded_payloads(decoded, _depth + 1)
    return out


def decoded_runs(text: str) -> list[tuple[int, int, str]]:
    """``(start, end, decoded)`` of each encoded run of ``text`` that decodes to readable UTF-8,
    digits alone included (a card number), with ``start`` and ``end`` indexing ``text`` itself
    (folded per character, so fullwidth base64 is found too), for a rail that rewrites spans:
    the PII rail reads what a run says and writes it out in place (gateway PII redaction)."""
    folded = unicodedata.normalize("NFKC", text).translate(_TABLE)
    if not _encoded_spans(folded, loose=True):
        return []  # the common case: one pass, no per-character folding
    pieces = [unicodedata.normalize("NFKC", c).translate(_TABLE) for c in text]
    offsets = list(itertools.accumulate(map(len, pieces), initial=0))  # folded offset of each character
    folded = "".join(pieces)
    runs = []
    for start, end in _encoded_spans(folded, loose=True):
        decoded = _decode(folded[start:end], letters=False)
        if decoded is not None:
            runs.append((bisect.bisect_right(offsets, start) - 1, bisect.bisect_left(offsets, end), decoded))
    return runs


def _encoded_spans(text: str, *, loose: bool = False) -> list[tuple[int, int]]:
    """(start, end) of the runs that look encoded: hex of 16+ digits with a digit and a letter,
    or base64 of 20+ characters mixing upper case, lower case and digits (a word, a path or a
    snake_case name does not). ``loose``: hex of digits alone, base64 without digits too (the
    base64 of "4111 1111 1111 1111" has none); for a caller that keeps only runs whose decoded
    text has something in it (the PII rail), so a CamelCase name costs one failed decode."""
    spans, i, n = [], 0, len(text)
    while i < n:
        if text[i] not in _B64_CHARS:
            i += 1
            continue
        j = i
        while j < n and text[j] in _B64_CHARS:
            j += 1
        run = text[i:j].strip("-_")
        start = i + text[i:j].index(run) if run else i
        if run and _looks_encoded(run, loose):
            end = start + len(run)
            while end < min(n, start + len(run) + 2) and text[end] == "=":  # base64 padding
                end += 1
            spans.append((start, end))
        i = j
    return spans


def _looks_encoded(run: str, loose: bool = False) -> bool:
    digits = any(c.isdigit() for c in run)
    if len(run) >= _MIN_HEX and digits and all(c in _HEX_CHARS for c in run):
        return loose or any(c.isalpha() for c in run)
    if len(run) < _MIN_B64 or not (digits or loose):
        return False
    return any(c.isupper() for c in run) and any(c.islower() for c in run)


def _decode(run: str, *, letters: bool = True) -> str | None:
    """What ``run`` decodes to, if it is readable text (with a letter in it, unless ``letters``
    is false)."""
    raw: bytes | None = None
    if len(run) % 2 == 0 and all(c in _HEX_CHARS for c in run):
        raw = bytes.fromhex(run)
    else:
        body = run.rstrip("=")
        try:
            padded = body + "=" * (-len(body) % 4)
            raw = (base64.urlsafe_b64decode if ("-" in body or "_" in body) else base64.b64decode)(padded)
        except (binascii.Error, ValueError):
            return None
    try:
        decoded = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    readable = sum(c.isprintable() or c.isspace() for c in decoded)
    if not decoded or readable < 0.95 * len(decoded) or (letters and not any(c.isalpha() for c in decoded)):
        return None
    return decoded
