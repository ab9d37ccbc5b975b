"""Linear-time regular expressions (RE2) for text that a client or a model controls.

Python's `re` backtracks: a crafted 8 KB message can cost it seconds, holding the GIL on the event
loop. RE2 (`google-re2`, module `re2`) guarantees time linear in the text, at the price of syntax:
no lookaround, no backreferences, and `\\w \\d \\s \\b` are ASCII-only. The patterns in this package
are written for RE2 with the helpers below so that they keep the behaviour of the `re` str patterns
they replace:

* `WORD`, `DIGIT`, `SPACE` are character-class bodies equal to Python's Unicode `\\w`, `\\d`, `\\s`
  (checked code point by code point in tests/guardrails/test_regex_linear_time.py; the only
  differences are characters that Python 3.11's Unicode 14 database does not assign yet).
* `ci(literal)` is a case-insensitive literal with Python's folding: RE2 folds `i` only with `I`,
  Python also with dotless `ı` and dotted `İ`. RE2 also folds U+0345 into letter classes under
  `(?i)`, which Python does not, so case-insensitivity is scoped to literals, never to classes.
* A lookbehind `(?<!X)` becomes one consumed character `[^X]`, and a lookahead `(?!Y)` a consumed
  group `(?:\\z|[^Y]...)`; `finditer_spans` runs such a pattern so that the consumed characters
  never hide an adjacent match, and reports the spans of the capturing groups.

Text is matched as UTF-8 bytes encoded once (`to_utf8`; lone surrogates, which `str.encode`
rejects, become U+FFFD so a JSON "\\ud800" cannot make a rail raise), and byte offsets are
converted back to `str` offsets.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterator

import re2

# RE2 compiled pattern type (the module does not export it under a public name).
Pattern = type(re2.compile(""))

# Bodies of character classes: use as f"[{WORD}]" or f"[^{WORD}-]".
WORD = r"\p{L}\p{N}_"  # Python's \w on str: str.isalnum() or "_"
DIGIT = r"\p{Nd}"  # Python's \d on str: str.isdecimal()
SPACE = r"\t-\r\x1c-\x1f\x85\p{Z}"  # Python's \s on str: str.isspace()

# Characters Python's IGNORECASE matches for "i" (RE2 simple case folding has only i and I).
_FOLD_I = r"[iIı\x{130}]"

# Program and DFA memory per pattern; RE2's default. A pattern that needs more fails to compile.
MAX_MEM = 8 << 20


def options(*, ignore_case: bool = False, max_mem: int = MAX_MEM) -> re2.Options:
    """RE2 options: UTF-8, leftmost-first (Perl) semantics, errors raised rather than logged."""
    opts = re2.Options()
    opts.log_errors = False
    opts.case_sensitive = not ignore_case
    opts.max_mem = max_mem
    return opts


def compile(pattern: str, *, ignore_case: bool = False, max_mem: int = MAX_MEM) -> Pattern:
    """Compile with RE2; raises `re2.error` (message as text) when RE2 cannot compile `pattern`."""
    try:
        return re2.compile(pattern, options(ignore_case=ignore_case, max_mem=max_mem))
    except re2.error as exc:
        raise re2.error(error_text(exc)) from None


def error_text(exc: BaseException) -> str:
    """The message of a `re2.error` as text (the binding passes RE2's message as bytes)."""
    arg = exc.args[0] if exc.args else ""
    return arg.decode("utf-8", "replace") if isinstance(arg, bytes) else str(arg)


def ci(literal: str) -> str:
    """RE2 syntax matching `literal` case-insensitively the way Python's `re.IGNORECASE` does."""
    parts = []
    for ch in literal:
        parts.append(_FOLD_I if ch in "iIıİ" else re2.escape(ch))
    return "(?i:" + "".join(parts) + ")"


# RE2 messages for Python-only syntax, with what to do instead.
_SYNTAX_HINTS = (
    ("(?<=", "lookbehind is not supported"),
    ("(?<!", "lookbehind is not supported"),
    ("(?=", "lookahead is not supported"),
    ("(?!", "lookahead is not supported"),
    ("invalid escape sequence: \\Z", "write \\z for the end of the text"),
    ("invalid escape sequence: \\1", "backreferences are not supported"),
    ("invalid escape sequence: \\2", "backreferences are not supported"),
)


def compile_forbidden(pattern: str, *, regex: bool, ignore_case: bool) -> Pattern:
    """Compile an operator's forbidden string (escaped) or regular expression (RE2 syntax).

    Raises ValueError saying why RE2 refuses it. Differences from Python's `re` an operator may
    notice: no lookaround, backreferences or atomic groups; `\\w \\d \\s \\b` are ASCII (use
    `\\p{L}`, `\\p{Nd}` for Unicode); `\\z` (not `\\Z`) ends the text and `$` matches only there;
    `a{,5}` is not a repetition. `\\C` (one byte) is refused: spans must fall on characters.
    """
    if regex:
        source = pattern
        i = 0
        while i < len(source):
            if source[i] == "\\":
                if source[i + 1 : i + 2] == "C":
                    raise ValueError("\\C (any byte) is not allowed")
                i += 2
            else:
                i += 1
    else:
        # Escape each character; under ignore_case give i Python's wider folding (ı, İ) as `ci` does.
        source = "".join(_FOLD_I if ignore_case and ch in "iIıİ" else re2.escape(ch) for ch in pattern)
    try:
        return compile(source, ignore_case=ignore_case)
    except re2.error as exc:
        message = error_text(exc)
        hints = [hint for key, hint in _SYNTAX_HINTS if key in message]
        if "(?P=" in pattern:
            hints.insert(0, "backreferences are not supported")
        suffix = f" ({hints[0]}: patterns use RE2 syntax)" if hints else " (patterns use RE2 syntax)"
        raise ValueError(message + suffix) from None


def _replace_unencodable(exc: UnicodeError) -> tuple[bytes, int]:
    if isinstance(exc, UnicodeEncodeError):
        # One U+FFFD (as bytes: the UTF-8 encoder takes only ASCII str replacements) per code point
        # keeps str offsets unchanged.
        return "\ufffd".encode() * (exc.end - exc.start), exc.end
    raise exc


codecs.register_error("guardrails.linear_regex", _replace_unencodable)


def to_utf8(text: str) -> bytes:
    """UTF-8 of `text`, lone surrogates replaced by U+FFFD (neither is a word, digit or space)."""
    return text.encode("utf-8", "guardrails.linear_regex")


def char_offsets(data: bytes, base: int = 0) -> Callable[[int], int]:
    """Map byte offsets into `data` (from `base` on, non-decreasing calls) to str offsets from `base`."""
    if data.isascii():
        return lambda b: b - base
    state = [base, 0]  # last byte offset, its str offset

    def convert(b: int) -> int:
        last, chars = state
        if b < last:
            last, chars = base, 0
        chars += len(data[last:b].decode("utf-8"))
        state[0], state[1] = b, chars
        return chars

    return convert


def _char_start(data: bytes, b: int) -> int:
    # Start of the UTF-8 sequence containing byte b.
    while b > 0 and data[b] & 0xC0 == 0x80:
        b -= 1
    return b


def lead_subject(text: str) -> bytes:
    """`text` prepared for `finditer_spans`: UTF-8 with one NUL in front. Build it once per text."""
    return b"\x00" + to_utf8(text)


def _matcher(pattern: Pattern) -> Callable[[bytes, int], list[tuple[int, int]]]:
    """`match(data, pos)`: spans of every group of the leftmost match at or after `pos`, [(-1, -1)] if none.

    Calls the binding's RE2::Match directly when the wrapper exposes it: the wrapper's `search` builds a
    generator and a match object per call, which triples the cost on texts with thousands of candidates.
    """
    raw = getattr(pattern, "_regexp", None)
    anchor = getattr(getattr(re2, "_Anchor", None), "UNANCHORED", None)
    if raw is not None and anchor is not None and hasattr(raw, "Match"):
        return lambda data, pos: raw.Match(anchor, data, pos, len(data))
    groups = pattern.groups

    def match(data: bytes, pos: int) -> list[tuple[int, int]]:
        m = pattern.search(data, pos)
        return [m.span(g) for g in range(groups + 1)] if m is not None else [(-1, -1)]

    return match


def found_in(pattern: Pattern, data: bytes) -> bool:
    """Whether `pattern` matches anywhere in `data` (one RE2 search, no match object)."""
    return _matcher(pattern)(data, 0)[0][0] >= 0


def finditer_spans(pattern: Pattern, data: bytes, group: int = 1) -> Iterator[tuple[int, int]]:
    """Span (str offsets) of `group` in each match of a lookaround-emulating pattern.

    `pattern` has the form ``LEAD(BODY)TRAIL``: LEAD consumes exactly the one character before the
    match (write `[^X]` for a lookbehind `(?<!X)`, `(?s:.)` for none), group 1 is what `re` would
    have matched, and TRAIL consumes what a lookahead would have checked. `data` is the text with a
    NUL character in front (`lead_subject`), so LEAD has a character to consume at the start (NUL
    must therefore be allowed by every LEAD). Each search resumes at the last character of the
    previous group 1, so that the next LEAD may consume it: exactly `re.finditer` resuming at the end
    of the previous match, with its lookbehind looking back. `group` must lie within group 1.
    """
    match = _matcher(pattern)
    to_char = char_offsets(data, base=1)
    pos = 0
    while True:
        spans = match(data, pos)
        if spans[0][0] < 0:
            return
        start, end = spans[1]
        if end <= start:
            raise ValueError("a lookaround-emulating pattern must not match the empty string")
        g_start, g_end = spans[group]
        if g_start >= 0:
            yield to_char(g_start), to_char(g_end)
        pos = _char_start(data, end - 1)


def finditer_plain(pattern: Pattern, data: bytes) -> Iterator[tuple[int, int]]:
    """Non-empty match spans (str offsets) of an ordinary pattern in `to_utf8(text)`.

    Like `re.finditer` without its empty matches. After an empty match the search moves on one
    character, so a non-empty match starting at the same place is not seen (`re` would report it);
    that only matters for a pattern that prefers matching nothing, which a forbidden pattern should not.
    """
    match = _matcher(pattern)
    to_char = char_offsets(data)
    pos, size = 0, len(data)
    while pos <= size:
        start, end = match(data, pos)[0]
        if start < 0:
            return
        if end > start:
            yield to_char(start), to_char(end)
            pos = end
        else:
            # Step over one character (not one byte) after an empty match.
            pos = end + 1
            while pos < size and data[pos] & 0xC0 == 0x80:
                pos += 1
