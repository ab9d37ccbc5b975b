"""Typed configuration of the retrieval core: embedding model, index, chunking, per-model policy.

Every model forbids unknown keys so that a typo in a YAML file fails at load with the key's name.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from retrieval.records import Hit, Passage

# Placeholders understood by RetrievalPolicy templates.
PASSAGES_PLACEHOLDER = "{passages}"
_PASSAGE_FIELDS = re.compile(r"\{(index|source|text|score|doc_id)\}")

# [CLS] and [SEP]: chunk sizes count the text's own tokens, the encoder's limit counts these too.
SPECIAL_TOKENS_PER_INPUT = 2


class EmbeddingModelConfig(BaseModel):
    """Which sentence-embedding model to load and how to batch requests to it.

    The ``max_batch_*`` fields configure the Ray Serve ``@serve.batch`` wrapper of the embedding
    deployment; ``encode_batch_size`` is the inner batch the encoder feeds to torch at once.
    """

    model_config = ConfigDict(extra="forbid")

    model_path: Path | None = Field(
        default=None, description="sentence-transformers folder; None means the embedded MiniLM."
    )
    max_tokens: int = Field(default=256, ge=8, le=8192, description="Per input, special tokens included (MiniLM: 256).")
    truncate: bool = Field(
        default=False,
        description="Truncate over-long inputs instead of rejecting them (the API answers 400).",
    )
    num_threads: int | None = Field(
        default=None, ge=1, le=256, description="Intra-op threads (torch, or ONNX Runtime: default 1)."
    )
    backend: Literal["torch", "onnx", "onnx-int8"] = Field(
        default="torch",
        description="torch (fastest in batches), onnx or onnx-int8 (the exports `make models` "
        "writes; 3-4x faster for one short text; int8 vectors are within cosine 0.99).",
    )
    encode_batch_size: int = Field(default=32, ge=1, le=4096)
    max_batch_size: int = Field(default=32, ge=1, le=4096)
    batch_wait_timeout_s: float = Field(default=0.005, ge=0.0, le=10.0)
    max_concurrent_batches: int = Field(default=1, ge=1, le=64)
    max_batch_tokens: int = Field(
        default=8192, ge=8, description="Token budget of one @serve.batch call (batch_size_fn)."
    )

    @model_validator(mode="after")
    def _batch_tokens_fit_one_input(self) -> EmbeddingModelConfig:
        # Otherwise a single maximal input could never be scheduled.
        if self.max_batch_tokens < self.max_tokens:
            raise ValueError("max_batch_tokens must be >= max_tokens")
        return self


class IndexConfig(BaseModel):
    """FAISS index kind and HNSW parameters; ``flat`` is exact inner product."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["flat", "hnsw"] = "flat"
    hnsw_m: int = Field(default=32, ge=4, le=256)
    ef_construction: int = Field(default=64, ge=8, le=4096)
    ef_search: int = Field(default=128, ge=1, le=4096)
    compact_tombstone_ratio: float = Field(
        default=0.2,
        gt=0.0,
        le=0.9,
        description="HNSW only: rebuild the index once deleted vectors exceed this share of it.",
    )


class ChunkingConfig(BaseModel):
    """Chunk size and overlap, counted in tokens of the embedding model's tokenizer.

    Tokens (not characters) because that is what OpenAI's ``static`` chunking strategy counts and
    what bounds the encoder: a chunk of at most ``max_tokens - 2`` tokens is embedded whole.
    Special tokens are not counted here.
    """

    model_config = ConfigDict(extra="forbid")

    max_chunk_size_tokens: int = Field(default=200, ge=8, le=4096)
    chunk_overlap_tokens: int = Field(default=40, ge=0)

    @model_validator(mode="after")
    def _overlap_at_most_half(self) -> ChunkingConfig:
        # Same rule as OpenAI's; it also guarantees the chunker always moves forward.
        if self.chunk_overlap_tokens * 2 > self.max_chunk_size_tokens:
            raise ValueError("chunk_overlap_tokens must not exceed half of max_chunk_size_tokens")
        return self


class IngestLimits(BaseModel):
    """Bounds on uploads and on indexing one file, so one client cannot make the single Retriever
    replica tokenize or embed without end."""

    model_config = ConfigDict(extra="forbid")

    max_upload_bytes: int = Field(default=64 * 1024 * 1024, ge=1024, description="one uploaded file (413 past it)")
    max_index_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024, description="a file larger than this is not indexed (failed, invalid_file)"
    )
    max_chunks_per_file: int = Field(default=8192, ge=1)
    # Chunks of one file being embedded at once: memory and the Embedder's queue stay bounded.
    embed_concurrency: int = Field(default=64, ge=1, le=4096)
    max_files_per_request: int = Field(default=100, ge=1, description="file_ids of one create vector store")


class RetrievalPolicy(BaseModel):
    """Whether and how one chat model gets retrieved passages placed into its prompt.

    ``template`` must contain ``{passages}``; each hit is rendered with ``passage_template``
    (fields ``{index}`` 1-based, ``{source}``, ``{text}``, ``{score}``, ``{doc_id}``) and the
    rendered passages are joined with ``passage_separator``. Substitution is literal, not
    ``str.format``, so braces in documents or templates are harmless.
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    collections: list[str] = Field(default_factory=list, description="Collection names or ids.")
    top_k: int = Field(default=4, ge=1, le=50)
    min_score: float | None = Field(default=None, ge=-1.0, le=1.0)
    template: str = "Use the following passages to answer if they are relevant.\n\n{passages}"
    passage_template: str = "[{index}] {source}\n{text}"
    passage_separator: str = "\n\n"
    allow_request_override: bool = False
    # Whether answers carry their sources (store and file ids, filenames) to every client:
    # off by default, since they name documents; a request may still ask with
    # extra_body.retrieval.return_sources.
    return_sources: bool = False
    # When retrieval or the check of its passages fails or times out: answer without passages
    # (logged), or refuse the request (503/504).
    on_error: Literal["answer_without", "fail"] = "answer_without"

    @field_validator("template")
    @classmethod
    def _template_has_placeholder(cls, value: str) -> str:
        if PASSAGES_PLACEHOLDER not in value:
            raise ValueError(f"template must contain {PASSAGES_PLACEHOLDER}")
        return value

    @field_validator("passage_template")
    @classmethod
    def _passage_template_has_text(cls, value: str) -> str:
        if "{text}" not in value:
            raise ValueError("passage_template must contain {text}")
        return value

    @model_validator(mode="after")
    def _enabled_needs_collections(self) -> RetrievalPolicy:
        if self.enabled and not self.collections:
            raise ValueError("an enabled retrieval policy needs at least one collection")
        if len(set(self.collections)) != len(self.collections):
            raise ValueError("collections must not repeat")
        return self

    def render(self, hits: Sequence[Hit | Passage]) -> str:
        """Return the context block for ``hits`` (best first), or "" when there are none."""
        if not hits:
            return ""
        rendered = []
        for position, hit in enumerate(hits, start=1):
            values = {
                "index": str(position),
                "source": hit.source,
                "text": hit.text,
                "score": f"{hit.score:.3f}",
                "doc_id": hit.doc_id,
            }
            # One pass, so a "{text}" inside a document is never substituted again.
            rendered.append(_PASSAGE_FIELDS.sub(lambda m, v=values: v[m.group(1)], self.passage_template))
        return self.template.replace(PASSAGES_PLACEHOLDER, self.passage_separator.join(rendered))


class RetrievalConfig(BaseModel):
    """Everything the retrieval deployments need, as read from one YAML section."""

    model_config = ConfigDict(extra="forbid")

    storage_dir: Path
    embedding: EmbeddingModelConfig = Field(default_factory=EmbeddingModelConfig)
    # Search queries are embedded in the Retriever replica with this encoder (the same model,
    # e.g. its int8 ONNX export: retrieval.embeddings.LocalEmbeddings); None: by the Embedder.
    query_encoder: EmbeddingModelConfig | None = None
    index: IndexConfig = Field(default_factory=IndexConfig)
    chunking: ChunkingConfig = Field(default_factory=ChunkingConfig)
    ingest: IngestLimits = Field(default_factory=IngestLimits)

    @model_validator(mode="after")
    def _chunks_fit_encoder(self) -> RetrievalConfig:
        # A chunk longer than the encoder's window would be silently cut when embedded.
        limit = self.embedding.max_tokens - SPECIAL_TOKENS_PER_INPUT
        if self.chunking.max_chunk_size_tokens > limit:
            raise ValueError(
                f"chunking.max_chunk_size_tokens ({self.chunking.max_chunk_size_tokens}) exceeds "
                f"what the embedding model takes per input ({limit} + 2 special tokens)"
            )
        return self
