"""Deterministic splitting of a document into overlapping, token-bounded chunks.

Sizes are counted in tokens given by a ``token_spans`` function (character offsets of each token).
The embedding deployment passes ``SentenceEncoder.token_spans`` so chunk sizes match what the model
sees; ``word_spans`` is a tokenizer-free stand-in (words and punctuation) for tests and tools.

Where a chunk ends: the best boundary in the second half of the size window, preferring a
paragraph break, then a sentence end, then whitespace, then anywhere between tokens (the last
resort for long words or text without spaces). Where the next one starts: at most
``chunk_overlap_tokens`` tokens back, at the best boundary there, as early as possible.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from retrieval.config import ChunkingConfig

TokenSpans = Callable[[str], list[tuple[int, int]]]

_WORD_OR_PUNCT = re.compile(r"\w+|[^\w\s]", re.UNICODE)
_PARAGRAPH_GAP = re.compile(r"\n[ \t\r\f\v]*\n")
_SENTENCE_END = (".", "!", "?", "\u3002", "\uff01", "\uff1f")
_CLOSERS = "\"')]\u2019\u201d\u00bb"

# Boundary strengths between two tokens.
_INSIDE_WORD, _WHITESPACE, _SENTENCE, _PARAGRAPH = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk of a document: its text and where it sits in the source, in characters."""

    index: int
    text: str
    start: int
    end: int
    token_count: int


def word_spans(text: str) -> list[tuple[int, int]]:
    """Approximate tokens: runs of word characters and single punctuation marks."""
    return [m.span() for m in _WORD_OR_PUNCT.finditer(text)]


def chunk_text(text: str, config: ChunkingConfig, token_spans: TokenSpans = word_spans) -> list[Chunk]:
    """Split ``text`` into chunks of at most ``config.max_chunk_size_tokens`` tokens."""
    spans = token_spans(text)
    total = len(spans)
    if total == 0:
        return []
    size = config.max_chunk_size_tokens
    overlap = config.chunk_overlap_tokens
    # strength[i] rates cutting just before token i (1 <= i < total).
    strength = [_INSIDE_WORD] + [_boundary(text, spans[i - 1], spans[i]) for i in range(1, total)]

    chunks: list[Chunk] = []
    start = 0
    while True:
        if total - start <= size:
            end = total
        else:
            lowest = start + max(1, size // 2)
            # Strongest boundary, latest on ties: fuller chunks at equal quality.
            end = max(range(lowest, start + size + 1), key=lambda i: (strength[i], i))
        char_start, char_end = spans[start][0], spans[end - 1][1]
        chunks.append(
            Chunk(
                index=len(chunks),
                text=text[char_start:char_end],
                start=char_start,
                end=char_end,
                token_count=end - start,
            )
        )
        if end == total:
            return chunks
        if overlap == 0:
            start = end
            continue
        # Strongest boundary, earliest on ties: keep as much of the requested overlap as we can.
        first = max(end - overlap, start + 1)
        start = min(range(first, end), key=lambda i: (-strength[i], i))


def _boundary(text: str, before: tuple[int, int], after: tuple[int, int]) -> int:
    gap = text[before[1] : after[0]]
    if not gap:
        return _INSIDE_WORD
    if _PARAGRAPH_GAP.search(gap):
        return _PARAGRAPH
    if "\n" in gap:
        return _SENTENCE
    tail = text[max(0, before[1] - 4) : before[1]].rstrip(_CLOSERS)
    if tail.endswith(_SENTENCE_END):
        return _SENTENCE
    return _WHITESPACE
