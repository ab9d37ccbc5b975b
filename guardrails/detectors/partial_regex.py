"""Partial matching on RE2: where, at the end of a text, a match could still be growing.

A stream guard must hold back the tail of the text that more text could turn into a match, and
nothing else. For a regular expression R the prefixes of its matches form a regular language
too, written from R's syntax tree:

    Pref(c)          = ε | c              c: a character, a class, `.`, an escape like \\p{L}
    Pref(A B)        = Pref(A) | A Pref(B)
    Pref(A | B)      = Pref(A) | Pref(B)
    Pref(A*)         = A* Pref(A)         (A+ and A{n,} alike)
    Pref(A{n,m})     = A{0,m-1} Pref(A)
    Pref(assertion)  = ε                  (^ $ \\b \\B \\A \\z: the prefix may stop before it)

`prefix_source(R)` writes Pref(R) in RE2 syntax, and `compile_open_tail` compiles
``(?:Pref(R))\\z``: RE2's leftmost match of it starts at the earliest position s such that
``text[s:]`` is a prefix of some match of R (s = len(text) when none is). That search is an RE2
search like any other, linear in the text whatever the text holds; the prefix pattern is at most
a few times R's size (every node appears once whole and once as a prefix in its parent).

Flags (`(?i)`, `(?s:...)`, ...) are carried onto every atom they govern, so the rewritten pattern
matches characters exactly as R does; captures become plain groups and lazy quantifiers greedy,
which changes no language. The result over-approximates only around assertions (an assertion is
checked against the end of the held text, which is not the end of the stream), which can only
hold back more, never less.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import re2

from guardrails.detectors import linear_regex as lrx

__all__ = ["compile_open_tail", "open_tail_start", "prefix_source"]


@dataclass(frozen=True, slots=True)
class _Atom:
    src: str  # RE2 syntax for one character (or an assertion), flags already applied
    consumes: bool = True


@dataclass(frozen=True, slots=True)
class _Concat:
    items: tuple


@dataclass(frozen=True, slots=True)
class _Alt:
    branches: tuple


@dataclass(frozen=True, slots=True)
class _Repeat:
    node: object
    lo: int
    hi: int | None  # None: unbounded


_REPEAT = re.compile(r"\{(\d+)(?:(,)(\d*))?\}")
_FLAGS = re.compile(r"[A-Za-z]*(?:-[A-Za-z]*)?")
_ZERO_WIDTH_ESCAPES = "bBAz"


class _Parser:
    """Recursive-descent reader of RE2 syntax, enough to rebuild the pattern's structure.

    It assumes `source` already compiles with RE2 (callers compile it first), so it only needs
    to find where each atom, group and quantifier begins and ends.
    """

    def __init__(self, source: str) -> None:
        self.s = source
        self.i = 0

    def parse(self) -> object:
        node = self._alternation(())
        if self.i != len(self.s):
            raise ValueError(f"unbalanced ')' at offset {self.i}")
        return node

    def _alternation(self, flags: tuple[str, ...]) -> object:
        branches: list[object] = []
        items: list[object] = []
        s = self.s
        while self.i < len(s):
            c = s[self.i]
            if c == "|":
                branches.append(_Concat(tuple(items)))
                items = []
                self.i += 1
                continue
            if c == ")":
                break
            if c == "(":
                directive = self._group_directive()
                if directive is not None:  # a bare (?flags): governs the rest of this group
                    flags = (*flags, directive) if directive else flags
                    continue
                atoms = [self._group(flags)]
            elif c == "[":
                atoms = [_Atom(_wrap(self._class(), flags))]
            elif c == "\\":
                atoms = self._escape(flags)
            elif c == ".":
                self.i += 1
                atoms = [_Atom(_wrap(".", flags))]
            elif c in "^$":
                self.i += 1
                atoms = [_Atom(_wrap(c, flags), consumes=False)]
            else:
                self.i += 1
                # `{` that is not a repetition, `}` and `]` are literals in RE2; escape them.
                atoms = [_Atom(_wrap(re2.escape(c) if c in "{}]" else c, flags))]
            items.extend(atoms[:-1])
            items.append(self._quantified(atoms[-1]))
        branches.append(_Concat(tuple(items)))
        return branches[0] if len(branches) == 1 else _Alt(tuple(branches))

    def _group_directive(self) -> str | None:
        # At "(": for "(?flags)" consume it and return the flags; otherwise consume nothing.
        s, i = self.s, self.i
        if not s.startswith("(?", i) or s.startswith(("(?P<", "(?<"), i):
            return None
        m = _FLAGS.match(s, i + 2)
        if m and m.end() < len(s) and s[m.end()] == ")":
            self.i = m.end() + 1
            return m.group()
        return None

    def _group(self, flags: tuple[str, ...]) -> object:
        s = self.s
        self.i += 1  # "("
        if s.startswith("?P<", self.i) or s.startswith("?<", self.i):
            self.i = s.index(">", self.i) + 1
        elif s.startswith("?", self.i):
            m = _FLAGS.match(s, self.i + 1)
            end = m.end() if m else self.i + 1
            if end >= len(s) or s[end] != ":":
                raise ValueError(f"unsupported group syntax at offset {self.i - 1}")
            if m and m.group():
                flags = (*flags, m.group())
            self.i = end + 1
        node = self._alternation(flags)
        if self.i >= len(s) or s[self.i] != ")":
            raise ValueError("missing ')'")
        self.i += 1
        return node

    def _class(self) -> str:
        s, start = self.s, self.i
        j = start + 1
        if s.startswith("^", j):
            j += 1
        if s.startswith("]", j):  # a leading "]" is a literal
            j += 1
        while j < len(s) and s[j] != "]":
            if s.startswith("[:", j):
                j = s.index(":]", j + 2) + 2
            elif s[j] == "\\":
                j = self._escape_end(j)
            else:
                j += 1
        if j >= len(s):
            raise ValueError("missing ']'")
        self.i = j + 1
        return s[start : j + 1]

    def _escape_end(self, j: int) -> int:
        # End of the escape sequence starting at s[j] == "\\" (not \Q, handled by the caller).
        s = self.s
        n = s[j + 1 : j + 2]
        if n in ("p", "P", "x") and s.startswith("{", j + 2):
            return s.index("}", j + 2) + 1
        if n in ("p", "P"):
            return j + 3
        if n == "x":
            return j + 4
        if n.isdigit():
            k = j + 1
            while k < len(s) and k < j + 4 and s[k] in "01234567":
                k += 1
            return max(k, j + 2)
        return j + 2

    def _escape(self, flags: tuple[str, ...]) -> list[_Atom]:
        s, i = self.s, self.i
        if s.startswith("\\Q", i):
            end = s.find("\\E", i + 2)
            text = s[i + 2 :] if end < 0 else s[i + 2 : end]
            self.i = len(s) if end < 0 else end + 2
            return [_Atom(_wrap(re2.escape(ch), flags)) for ch in text] or [_Atom("", consumes=False)]
        self.i = self._escape_end(i)
        src = s[i : self.i]
        return [_Atom(_wrap(src, flags), consumes=src[1:2] not in _ZERO_WIDTH_ESCAPES or len(src) != 2)]

    def _quantified(self, node: object) -> object:
        s = self.s
        while self.i < len(s):
            c = s[self.i]
            if c in "*+?":
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
                self.i += 1
            elif c == "{" and (m := _REPEAT.match(s, self.i)):
                lo = int(m.group(1))
                hi = lo if not m.group(2) else (int(m.group(3)) if m.group(3) else None)
                self.i = m.end()
            else:
                break
            if s.startswith("?", self.i):  # lazy: same language
                self.i += 1
            node = _Repeat(node, lo, hi)
        return node


def _wrap(src: str, flags: tuple[str, ...]) -> str:
    for f in reversed(flags):
        src = f"(?{f}:{src})"
    return src


def _full(node: object) -> str:
    if isinstance(node, _Atom):
        return node.src
    if isinstance(node, _Concat):
        return "".join(_full(x) for x in node.items)
    if isinstance(node, _Alt):
        return "(?:" + "|".join(_full(b) for b in node.branches) + ")"
    inner = _full(node.node)
    if not inner:
        return ""
    hi = "" if node.hi is None else str(node.hi)
    return f"(?:{inner}){{{node.lo},{hi}}}" if node.hi != node.lo else f"(?:{inner}){{{node.lo}}}"


def _pref(node: object) -> str:
    if isinstance(node, _Atom):
        return f"(?:{node.src})?" if node.consumes else ""
    if isinstance(node, _Concat):
        if not node.items:
            return ""
        acc = _pref(node.items[-1])
        for x in reversed(node.items[:-1]):
            acc = f"(?:{_pref(x)}|{_full(x)}{acc})"
        return acc
    if isinstance(node, _Alt):
        return "(?:" + "|".join(_pref(b) for b in node.branches) + ")"
    if node.hi == 0:
        return ""
    inner, inner_pref = _full(node.node), _pref(node.node)
    if not inner:
        return ""
    if node.hi is None:
        return f"(?:(?:{inner})*{inner_pref})"
    if node.hi == 1:
        return inner_pref
    return f"(?:(?:{inner}){{0,{node.hi - 1}}}{inner_pref})"


def prefix_source(source: str) -> str:
    """RE2 syntax for Pref(source): every prefix of every match of `source` (always matches "")."""
    return _pref(_Parser(source).parse())


def compile_open_tail(source: str, *, ignore_case: bool = False, max_mem: int = lrx.MAX_MEM) -> lrx.Pattern:
    """``(?:Pref(source))\\z`` compiled with RE2 under the options `source` itself is compiled with.

    Raises ValueError when `source` cannot be read or re2.error when the prefix pattern is too
    large for `max_mem` (a pattern with many large counted repetitions).
    """
    return lrx.compile(f"(?:{prefix_source(source)})\\z", ignore_case=ignore_case, max_mem=max_mem)


def open_tail_start(pattern: lrx.Pattern, data: bytes, pos: int = 0) -> int:
    """Byte offset of the leftmost match of an open-tail pattern in `data` from `pos` (len(data) if
    it matches only the empty string at the end)."""
    match = lrx._matcher(pattern)
    start, _ = match(data, pos)[0]
    return len(data) if start < 0 else start
