"""Chunking: size and overlap bounds, full coverage, preferred boundaries, determinism."""

from __future__ import annotations

import pytest

from retrieval.chunking import chunk_text, word_spans
from retrieval.config import ChunkingConfig

PARAGRAPHS = [" ".join(f"Paragraph {p} sentence {s} has a few plain words in it." for s in range(6)) for p in range(8)]
TEXT = "\n\n".join(PARAGRAPHS)


def token_ids(chunk, spans):
    return [i for i, (s, e) in enumerate(spans) if s >= chunk.start and e <= chunk.end]


@pytest.mark.parametrize("size,overlap", [(20, 0), (20, 5), (50, 10), (64, 32), (1000, 100)])
def test_chunks_respect_size_overlap_and_cover_everything(size, overlap):
    config = ChunkingConfig(max_chunk_size_tokens=size, chunk_overlap_tokens=overlap)
    chunks = chunk_text(TEXT, config)
    spans = word_spans(TEXT)
    covered: set[int] = set()
    previous: list[int] = []
    for n, chunk in enumerate(chunks):
        assert chunk.index == n
        assert chunk.text == TEXT[chunk.start : chunk.end]
        ids = token_ids(chunk, spans)
        assert len(ids) == chunk.token_count <= size
        if previous:
            shared = len(set(previous) & set(ids))
            assert shared <= overlap
            assert (shared > 0) == (overlap > 0)
            assert ids[0] > previous[0]  # always moves forward
        covered.update(ids)
        previous = ids
    assert covered == set(range(len(spans)))
    if size >= len(spans):
        assert len(chunks) == 1 and chunks[0].text == TEXT


def test_prefers_paragraph_then_sentence_boundaries():
    config = ChunkingConfig(max_chunk_size_tokens=100, chunk_overlap_tokens=0)
    chunks = chunk_text(TEXT, config)
    # Each paragraph is 72 word/punctuation tokens: the second half of a 100-token window
    # holds one paragraph break and several sentence ends; the break wins.
    assert [c.text for c in chunks] == PARAGRAPHS
    config = ChunkingConfig(max_chunk_size_tokens=30, chunk_overlap_tokens=0)
    for chunk in chunk_text(TEXT, config):
        assert chunk.text.endswith(".")
        assert chunk.text.startswith("Paragraph")


def test_overlap_starts_at_a_sentence_when_it_can():
    config = ChunkingConfig(max_chunk_size_tokens=40, chunk_overlap_tokens=20)
    chunks = chunk_text(PARAGRAPHS[0], config)
    assert len(chunks) > 2
    for chunk in chunks:
        assert chunk.text.startswith("Paragraph 0 sentence") and chunk.text.endswith(".")


def test_deterministic_and_handles_edge_cases():
    config = ChunkingConfig(max_chunk_size_tokens=16, chunk_overlap_tokens=4)
    assert chunk_text(TEXT, config) == chunk_text(TEXT, config)
    assert chunk_text("", config) == []
    assert chunk_text(" \n\n\t ", config) == []
    # Text without any boundary (character tokens, no spaces) still splits within the limits.
    blob = "x" * 100
    chars = chunk_text(blob, config, token_spans=lambda t: [(i, i + 1) for i in range(len(t))])
    assert all(c.token_count <= 16 for c in chars)
    assert chars[0].start == 0 and chars[-1].end == 100


def test_config_rejects_overlap_above_half():
    with pytest.raises(ValueError):
        ChunkingConfig(max_chunk_size_tokens=100, chunk_overlap_tokens=51)
    with pytest.raises(ValueError):
        ChunkingConfig(max_chunk_size_tokens=100, chunk_overlap_tokens=10, unit="chars")
