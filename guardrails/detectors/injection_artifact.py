"""The injection ensemble's artifact: one compressed `.npz` of its weights, stackers and
metadata (JSON), no pickle. Which arrays there are says which stages the ensemble has."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from guardrails.detectors.injection import InjectionClassifier
from guardrails.detectors.tuned_e5 import TURNS, WINDOWS

# Weights saved and loaded together, each group when its first is present (scalars as floats).
OPTIONAL_ARRAYS = (
    ("use_weights", "use_bias"),
    ("use_hidden_weights", "use_hidden_bias"),
    ("char_weights", "char_bias"),
    ("doc_stack_weights", "doc_stack_bias"),
    ("turn_hidden_weights", "turn_hidden_bias", "turn_weights", "turn_bias", "turn_stack_weights", "turn_stack_bias"),
    ("doc_hidden_weights", "doc_hidden_bias", "doc_weights", "doc_bias"),
    ("doc_e5_hidden_weights", "doc_e5_hidden_bias", "doc_e5_weights", "doc_e5_bias"),
)


def ensemble_arrays(ensemble: Any) -> dict[str, np.ndarray]:
    """The arrays an ensemble is saved as."""
    arrays: dict[str, np.ndarray] = {
        "kind": np.array("injection_ensemble"),
        "components": np.array(json.dumps(list(ensemble.components))),
        "stack_weights": ensemble.stack_weights.astype(np.float32),
        "stack_bias": np.float32(ensemble.stack_bias),
        "metadata": np.array(json.dumps(ensemble.metadata, sort_keys=True)),
    }
    if ensemble.minilm is not None:
        arrays |= {"weights": ensemble.minilm.weights, "bias": np.float32(ensemble.minilm.bias)}
    for group in OPTIONAL_ARRAYS:
        if getattr(ensemble, group[0]) is not None:
            arrays |= {name: np.asarray(getattr(ensemble, name), dtype=np.float32) for name in group}
    for kind, tuned in ((TURNS, ensemble.turn_e5), (WINDOWS, ensemble.window_e5)):
        if tuned is not None:  # a fine-tuned e5's adapters and head (tuned_e5.py)
            arrays |= {name: np.asarray(tuned[name], dtype=np.float32) for name in kind.fields}
    return arrays


def ensemble_fields(data: Any, known_components: tuple[str, ...]) -> dict[str, Any]:
    """An ensemble's constructor arguments from its saved arrays."""
    components = tuple(json.loads(str(data["components"])))
    unknown = set(components) - set(known_components)
    if unknown:
        raise ValueError(f"unknown ensemble components {sorted(unknown)}")
    has = set(data.files)
    minilm = (
        InjectionClassifier(data["weights"].astype(np.float32), float(data["bias"]), {"threshold": 0.5})
        if "weights" in has
        else None
    )
    optional = {
        name: data[name].astype(np.float32) if data[name].ndim else float(data[name])
        for group in OPTIONAL_ARRAYS
        if group[0] in has
        for name in group
    }
    return {
        "components": components,
        "minilm": minilm,
        "stack_weights": data["stack_weights"].astype(np.float32),
        "stack_bias": float(data["stack_bias"]),
        "metadata": json.loads(str(data["metadata"])),
        **{
            field: {n: data[n].astype(np.float32) for n in kind.fields} if kind.fields[0] in has else None
            for field, kind in (("turn_e5", TURNS), ("window_e5", WINDOWS))
        },
        **optional,
    }
