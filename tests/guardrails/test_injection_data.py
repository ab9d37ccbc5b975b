"""The committed data splits: well-formed, both classes, and no group or text shared between splits."""

import json
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[2] / "guardrails" / "data"


def rows(split):
    path = DATA / f"injection_{split}.jsonl"
    if not path.exists():
        pytest.fail(f"missing {path}; run python -m guardrails.build_injection_data")
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def test_rows_are_well_formed_and_balanced():
    for split in ("train", "eval"):
        data = rows(split)
        assert all(set(r) == {"text", "label", "source", "group", "category"} for r in data)
        assert all(r["label"] in (0, 1) and r["text"].strip() for r in data)
        labels = [r["label"] for r in data]
        assert 0.3 < sum(labels) / len(labels) < 0.7


def test_no_group_or_text_leaks_between_splits():
    train, test = rows("train"), rows("eval")
    assert not {r["group"] for r in train} & {r["group"] for r in test}
    assert not {r["text"] for r in train} & {r["text"] for r in test}
