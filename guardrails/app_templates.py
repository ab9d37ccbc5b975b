"""Prompt templates an application wraps around its user's text, recognised line by line.

A chat UI's RAG feature sends one user message that holds three kinds of text: the UI's own
instructions (a fixed list of rules), the attached documents, and the user's question. Judged
as one user turn, the rules read like a jailbreak to a classifier trained on user turns
(Open WebUI's default scores 0.75), so the request is refused. A policy that names the
template (``injection.app_templates``) lets the injection rail judge each part as what it is:

- lines of the template's own text: instructions, judged by the phrase heuristics (as a
  system prompt is);
- the text between a block placeholder's opening and closing lines (``<context>`` /
  ``{{CONTEXT}}`` / ``</context>``): documents, each ``<source ...>...</source>`` element on
  its own, judged by the document calibration, as retrieved passages and tool results are;
- every other line (the question, text around the template, a rule the template does not
  have): one user turn, judged by the classifier as any user message is.

Only exact lines of the template count as its text (whitespace collapsed), so an attacker who
writes the template by hand gains nothing for text of their own: it is judged as a user turn,
and what they put between the context lines is judged as a document, as a ``tool`` message of
theirs would be. A message matches only when it carries at least one block and at least half of
the template's distinct lines; otherwise it is one user turn, as without templates. Matching is
a single pass over the lines with set lookups: linear in the message.

A template is its text with placeholders on lines of their own; ``{{CONTEXT}}`` marks
documents, any other ``{{NAME}}`` user text. Several versions of one template (a UI that
changed its default) are tried in turn; the best-covered one is used.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from guardrails.detectors.documents import stripped_span

BUILTIN_DIR = Path(__file__).resolve().parent / "templates"
DOCUMENT_PLACEHOLDERS = frozenset({"CONTEXT"})
# A message must carry at least this share of a template's distinct lines to match it.
MIN_COVERAGE = 0.5

Kind = Literal["instructions", "document", "user"]


def builtin_names() -> list[str]:
    """Templates shipped in ``guardrails/templates/<name>/`` (one file per known version)."""
    return sorted(p.name for p in BUILTIN_DIR.iterdir() if p.is_dir() and any(p.glob("*.txt")))


@functools.cache
def _builtin(name: str) -> tuple[tuple[str, str], ...]:
    """A built-in template's versions, (source, text), read once per process: every policy that
    names it (and every default policy) is validated and built from them."""
    folder = BUILTIN_DIR / name
    files = sorted(folder.glob("*.txt")) if folder.is_dir() else []
    if not files:
        raise ValueError(f"no built-in app template {name!r} (built-ins: {', '.join(builtin_names())})")
    return tuple((f"{name}/{f.name}", f.read_text(encoding="utf-8")) for f in files)


def _norm(line: str) -> str:
    return " ".join(line.split())


def _placeholder(line: str) -> str | None:
    s = line.strip()
    if s.startswith("{{") and s.endswith("}}") and s[2:-2].isidentifier():
        return s[2:-2]
    return None


@dataclass(frozen=True)
class Piece:
    """One part of a message and how the injection rail judges it. A document's ``span`` is
    where it stands in the message, to remove it from there (``text == message[start:end]``
    when ``part`` is "whole")."""

    text: str
    kind: Kind
    span: tuple[int, int] | None = None
    # What of the span ``text`` is: a ``<source>`` element's text without its tags, or its
    # attribute values; a context block judged whole (its elements' text without their tags).
    part: Literal["whole", "text", "attributes", "block"] = "whole"

    @property
    def block(self) -> bool:
        return self.part == "block"


@dataclass(frozen=True)
class _Version:
    lines: frozenset[str]  # the template's own lines, normalised (block openers and closers too)
    blocks: dict[str, tuple[str, Kind]]  # opening line -> (closing line, what the block holds)


def _parse(text: str, source: str) -> _Version:
    raw = text.splitlines()
    lines: set[str] = set()
    blocks: dict[str, tuple[str, Kind]] = {}
    for i, line in enumerate(raw):
        name = _placeholder(line)
        if name is None:
            if _norm(line):
                if "{{" in line and "}}" in line:
                    raise ValueError(f"{source}: a placeholder must stand on a line of its own: {line.strip()!r}")
                lines.add(_norm(line))
            continue
        before = next((_norm(x) for x in reversed(raw[:i]) if _norm(x)), None)
        after = next((_norm(x) for x in raw[i + 1 :] if _norm(x)), None)
        if before is None or after is None or _placeholder(before) or _placeholder(after):
            raise ValueError(f"{source}: {{{{{name}}}}} needs an opening line before it and a closing line after it")
        if before in blocks:
            raise ValueError(f"{source}: two placeholders share the opening line {before!r}")
        blocks[before] = (after, "document" if name in DOCUMENT_PLACEHOLDERS else "user")
    if not blocks:
        raise ValueError(f"{source}: a template needs at least one placeholder such as {{{{CONTEXT}}}}")
    return _Version(frozenset(lines), blocks)


class TemplateMatcher:
    """Splits a message written from one of the given templates into judged pieces."""

    def __init__(self, versions: Iterable[tuple[str, str]]) -> None:
        """``versions``: (source name, template text) pairs; raises ValueError on a bad template."""
        self._versions = [_parse(text, source) for source, text in versions]
        if not self._versions:
            raise ValueError("no templates")
        self._openers = frozenset(o for v in self._versions for o in v.blocks)

    @classmethod
    def from_policy(cls, templates: Iterable[tuple[str, str | None]]) -> TemplateMatcher | None:
        """``templates``: (name, text) pairs; a None text names a built-in template."""
        versions: list[tuple[str, str]] = []
        for name, text in templates:
            if text is not None:
                versions.append((name, text))
                continue
            versions += _builtin(name)
        return cls(versions) if versions else None

    def split(self, text: str, *, instructions: bool = False) -> list[Piece] | None:
        """The pieces of ``text`` if it was written from one of the templates, else None.
        ``instructions``: the text comes from an instruction role (a system prompt), so its
        non-template lines stay instructions; its documents are still judged as documents."""
        if "\n" not in text:
            return None
        # Split on "\n" alone, so each piece is the message's own text, character for character
        # ("\r" and other separators stay inside lines, where the normalisation ignores them):
        # a flagged document must be found again in the message to be removed.
        lines = text.split("\n")
        normed = [_norm(x) for x in lines]
        if not self._openers.intersection(normed):
            return None
        starts = [0]
        for line in lines[:-1]:
            starts.append(starts[-1] + len(line) + 1)
        best: tuple[float, list[Piece]] | None = None
        for version in self._versions:
            found = self._split(version, text, lines, starts, normed, instructions)
            if found is not None and (best is None or found[0] > best[0]):
                best = found
        return best[1] if best is not None else None

    @staticmethod
    def _split(
        version: _Version, text: str, lines: list[str], starts: list[int], normed: list[str], instructions: bool
    ) -> tuple[float, list[Piece]] | None:
        own: list[str] = []
        seen: set[str] = set()
        other: list[str] = []
        documents: list[Piece] = []
        n, i, blocks = len(lines), 0, 0
        # Per closing line, the next index at or after each position holding it: one pass
        # each, so a message of many unclosed openers stays linear.
        following: dict[str, list[int]] = {}
        for closer, _ in version.blocks.values():
            if closer not in following:
                at, nxt = [n] * (n + 1), n
                for j in range(n - 1, -1, -1):
                    if normed[j] == closer:
                        nxt = j
                    at[j] = nxt
                following[closer] = at
        while i < n:
            line = normed[i]
            block = version.blocks.get(line)
            if block is not None:
                closer, kind = block
                end = following[closer][i + 1]
                if end < n:
                    body_start = starts[i + 1] if i + 1 < end else starts[end]
                    body_end = starts[end] - 1 if i + 1 < end else starts[end]
                    if kind == "document":
                        documents += _documents(text, body_start, body_end)
                    elif text[body_start:body_end].strip():
                        other.append(text[body_start:body_end])
                    own.append(lines[i])
                    seen.add(line)
                    blocks += 1
                    if closer in version.blocks:
                        i = end  # the closing line opens the next block: read it again
                    else:
                        own.append(lines[end])
                        seen.add(closer)
                        i = end + 1
                    continue
            if line in version.lines:
                own.append(lines[i])
                seen.add(line)
            elif line:
                other.append(lines[i])
            i += 1
        coverage = len(seen) / len(version.lines)
        if blocks == 0 or coverage < MIN_COVERAGE:
            return None
        pieces = [Piece("\n".join(own), "instructions"), *documents]
        if other:
            pieces.append(Piece("\n".join(other), "instructions" if instructions else "user"))
        return coverage, pieces


def _documents(text: str, start: int, end: int) -> list[Piece]:
    """A context block's documents (``text[start:end]``), each with its span: every
    ``<source ...>...</source>`` element, every run of other text between them, and, when there
    are several, the whole block as well, so a document cut into elements by a
    ``</source><source>`` of its own is also judged whole. An element is judged as its text
    (without tags), and its attribute values (a file name an attacker chose) as a text of their
    own: markup around a document makes a classifier read it as a hidden instruction (eval2's
    benign documents, flagged 7.8% bare and 23.5% in tags). Linear: str.find."""
    pieces: list[Piece] = []
    spans: list[tuple[int, int]] = []
    elements: set[tuple[int, int]] = set()
    pos = start
    while pos < end:
        open_at = text.find("<source", pos, end)
        close_at = text.find("</source>", open_at, end) if open_at >= 0 else -1
        if open_at < 0 or close_at < 0:
            spans.append(stripped_span(text, pos, end))
            break
        spans.append(stripped_span(text, pos, open_at))
        span = (open_at, close_at + len("</source>"))
        spans.append(span)
        elements.add(span)
        tag_end = text.find(">", open_at, close_at)
        body = untagged(text[tag_end + 1 : close_at]).strip() if tag_end >= 0 else ""
        attributes = attribute_text(text[open_at + len("<source") : tag_end if tag_end >= 0 else close_at])
        pieces += [
            Piece(t, "document", span, part=part) for t, part in ((body, "text"), (attributes, "attributes")) if t
        ]
        pos = span[1]
    spans = [(a, b) for a, b in spans if b > a]
    pieces += [Piece(text[a:b], "document", (a, b)) for a, b in spans if (a, b) not in elements]
    pieces.sort(key=lambda p: p.span)
    if len(spans) > 1:
        a, b = stripped_span(text, start, end)
        pieces.append(Piece(untagged(text[a:b]), "document", (a, b), part="block"))
    return pieces


_ATTRIBUTE = re.compile(r"""[\w:.-]+\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+))""")


def attribute_text(tag: str) -> str:
    """What a tag says (``tag``: what stands between ``<source`` and ``>``): its attributes'
    values and any other words in it, one per line, without the attribute names and the
    values that are numbers (an ``id``)."""
    spoken = _ATTRIBUTE.sub(lambda m: "\n" + "".join(m.groups(default="")) + "\n", tag)
    lines = (line.strip() for line in spoken.split("\n"))
    return "\n".join(line for line in lines if line and not line.isdigit())


def untagged(text: str) -> str:
    """``text`` without its ``<source ...>`` and ``</source>`` tags (a tag runs to the next ``>``)."""
    out, pos = [], 0
    while True:
        at = text.find("<source", pos)
        close = text.find("</source>", pos)
        if at < 0 and close < 0:
            return "".join(out) + text[pos:]
        if close >= 0 and (at < 0 or close < at):
            out.append(text[pos:close])
            pos = close + len("</source>")
            continue
        end = text.find(">", at)
        if end < 0:
            return "".join(out) + text[pos:]
        out.append(text[pos:at])
        pos = end + 1
