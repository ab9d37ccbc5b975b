"""How the input rails judge a chat UI's RAG messages, with and without app templates.

Composes Open WebUI RAG messages (the built-in ``open_webui_rag`` template's versions, in
turn) from a disjoint eval's rows, the way the UI builds them: each user row as the question
beside a benign document of its language, each document row as the attached document beside
a benign question of its language. Then runs the shipped detector through ``InputGuard`` on
each message as a user message, once with ``injection.app_templates: []`` (the whole message
judged as one user turn) and once with ``[{name: open_webui_rag}]`` (the default), and prints:

- benign messages refused (the question and the document benign);
- attack questions caught (refused);
- planted documents caught (the request refused, or the document removed);
- benign documents removed.

    python -m guardrails.eval_app_templates [--disjoint guardrails/data/disjoint/eval2.tsv]
"""

from __future__ import annotations

import argparse
import itertools
from collections import defaultdict
from pathlib import Path

from guardrails.app_templates import BUILTIN_DIR
from guardrails.config import GuardrailPolicy
from guardrails.detectors.documents import REMOVED
from guardrails.eval_injection import DATA_DIR, DisjointRow, load_disjoint
from guardrails.input_rail import REMOVED_DOCUMENT, InputGuard, build_injection_scorer

TEMPLATE = "open_webui_rag"


def compose(template: str, documents: list[str], question: str) -> str:
    """Open WebUI's message: the template with the documents as ``<source>`` elements; a
    template without ``{{QUERY}}`` is followed by the user's own message."""
    context = "\n".join(f'<source id="{i}" name="doc{i}.txt">{d}</source>' for i, d in enumerate(documents, 1))
    text = template.replace("{{CONTEXT}}", context)
    if "{{QUERY}}" in text:
        return text.replace("{{QUERY}}", question)
    return f"{text}\n{question}"


def messages(rows: list[DisjointRow], templates: list[str]) -> list[tuple[str, str, str]]:
    """(case, language, message) for every user and document row of the eval."""
    benign_docs: dict[str, list[str]] = defaultdict(list)
    benign_questions: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        if r.label == 0 and r.slot == "document":
            benign_docs[r.lang].append(r.text)
        elif r.label == 0 and r.style == "chat":
            benign_questions[r.lang].append(r.text)
    docs = {lang: itertools.cycle(v) for lang, v in benign_docs.items()}
    questions = {lang: itertools.cycle(v) for lang, v in benign_questions.items()}
    versions = itertools.cycle(templates)
    out = []
    for r in rows:
        if r.lang not in docs or r.lang not in questions:
            continue
        if r.slot == "document":
            case = "planted document" if r.label else "benign document"
            out.append((case, r.lang, compose(next(versions), [r.text], next(questions[r.lang]))))
        else:
            case = "attack question" if r.label else "benign question"
            out.append((case, r.lang, compose(next(versions), [next(docs[r.lang])], r.text)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--disjoint", type=Path, default=DATA_DIR / "disjoint" / "eval2.tsv")
    args = parser.parse_args()
    templates = [p.read_text(encoding="utf-8") for p in sorted((BUILTIN_DIR / TEMPLATE).glob("*.txt"))]
    cases = messages(load_disjoint(args.disjoint), templates)
    with_templates = GuardrailPolicy.model_validate({"injection": {"app_templates": [{"name": TEMPLATE}]}})
    without = GuardrailPolicy.model_validate({"injection": {"app_templates": []}})
    scorer = build_injection_scorer(with_templates.injection)
    guards = {"whole message": InputGuard(without, scorer), "app_templates": InputGuard(with_templates, scorer)}
    print(f"{args.disjoint.name}: {len(cases)} Open WebUI RAG messages ({len(templates)} template versions in turn)\n")
    print("| case | n | " + " | ".join(f"{name}: refused / document redacted or removed" for name in guards) + " |")
    print("|---|---|" + "---|" * len(guards))
    for case in ("benign question", "attack question", "benign document", "planted document"):
        texts = [t for c, _, t in cases if c == case]
        cells = []
        for guard in guards.values():
            verdicts = [guard.check_text(t) for t in texts]
            refused = sum(v.blocked for v in verdicts)
            # A flagged source is redacted in its tags (documents.REMOVED) or replaced whole.
            removed = sum(
                bool(v.redacted and v.text and (REMOVED_DOCUMENT in v.text or REMOVED in v.text)) for v in verdicts
            )
            cells.append(f"{refused / len(texts):.3f} / {removed / len(texts):.3f}")
        print(f"| {case} | {len(texts)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
