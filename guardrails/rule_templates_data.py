"""The rule-template experiment's rows (issue 14; `build_injection_data --rule-templates`, not in
the shipped build: guardrails/data/README.md has its figures)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

from guardrails.build_injection_data import HANDWRITTEN, SEED, Row, _folder_chat, _groups, _lang, _parts, _split_of

# Templated user turns of chat UIs and RAG apps (issue 14), built only with `--rule-templates`
# (an experiment, not in the shipped build: guardrails/data/README.md has its figures): a task
# line, a list of rules, the documents in tags, the question, in varied frames, composed from
# `rules/parts_*.txt` (groups `<lang>:<task|rule|question|header>:<n>`), with the same
# templates carrying a planted payload in place of one rule as attacks, and `rules/benign.txt`
# and `rules/injection.txt`: rule-shaped chat turns. In the shipped data nearly every rule list
# is a jailbreak, and a RAG template sent as a user message is refused.
RULES = HANDWRITTEN / "rules"
_BULLETS = ("- ", "* ", "\u2022 ", "{n}. ", "{n}) ", "")
_HEADERS_EN = ("Instructions", "Rules", "Context", "Question", "Documents", "Answer", "Source")
_FRAMES = (
    "### {I}:\n{task}\n\n### {R}:\n{rules}\n\n### {C}:\n{docs}\n\n### {Q}:\n{q}",
    "{task}\n\n{R}:\n{rules}\n\n{C}:\n{docs}\n\n{Q}: {q}\n{A}:",
    "<instructions>\n{task}\n{rules}\n</instructions>\n<context>\n{docs}\n</context>\n<question>{q}</question>",
    "{task} {R}:\n{rules}\n\n{docs}\n\n{q}",
    "**{I}**\n{task}\n\n**{R}**\n{rules}\n\n**{D}**\n{docs}\n\n**{Q}**\n{q}",
    "{docs}\n\n{task}\n{rules}\n\n{Q}: {q}",
    "[{I}]\n{task}\n[{R}]\n{rules}\n[{C}]\n{docs}\n[{Q}]\n{q}",
    "{task}\n\n{docs}\n\n{R}:\n{rules}\n\nUser: {q}",
)


def _rule_parts() -> dict[str, dict[str, list[str]]]:
    """language -> kind -> lines of `rules/parts_*.txt`."""
    out: dict[str, dict[str, list[str]]] = {}
    for path in sorted(RULES.glob("parts_*.txt")):
        for group, lines in _groups(path).items():
            lang, kind, _ = group.split(":")
            out.setdefault(lang, {}).setdefault(kind, []).extend(lines)
    return out


def _documents_block(docs: list[str], source: str, rng: random.Random) -> str:
    style = rng.randrange(7)
    if style == 0:
        return "\n".join(f'<source id="{i}">{d}</source>' for i, d in enumerate(docs, 1))
    if style == 1:
        return "\n".join(f"[{i}] {d}" for i, d in enumerate(docs, 1))
    if style == 2:
        return "\n".join(f"<document index={i}>\n{d}\n</document>" for i, d in enumerate(docs, 1))
    if style == 3:
        return "\n\n".join(f"{source} {i}: {d}" for i, d in enumerate(docs, 1))
    if style == 4:
        return "\n".join(f'"""\n{d}\n"""' for d in docs)
    if style == 5:
        return "\n---\n".join(docs)
    return json.dumps([{"id": i, "text": d} for i, d in enumerate(docs, 1)], ensure_ascii=False)


def _template(parts: dict[str, list[str]], docs: list[str], rules: list[str], rng: random.Random) -> str:
    local = parts.get("header", [])
    names = local[0].split("|") if local and rng.random() < 0.5 else list(_HEADERS_EN)
    bullet = rng.choice(_BULLETS)
    listed = "\n".join(bullet.replace("{n}", str(i)) + r for i, r in enumerate(rules, 1))
    return rng.choice(_FRAMES).format(
        task=rng.choice(parts["task"]),
        rules=listed,
        docs=_documents_block(docs, names[6], rng),
        q=rng.choice(parts["question"]),
        **dict(zip("IRCQDA", names[:6], strict=True)),
    )


def _rule_templates() -> Iterator[tuple[str, Row]]:
    """Benign templates per document group (its split and group), attacks per payload group."""
    parts = _rule_parts()
    yield from _folder_chat(RULES / "benign.txt", 0, "rule_turn_benign", "benign_chat")
    yield from _folder_chat(RULES / "injection.txt", 1, "rule_turn_attack", "injection")
    docs = _parts("documents", "documents.txt")
    payloads = _parts("payloads", "payloads.txt")
    rng = random.Random(SEED)

    def pick(lang: str) -> tuple[dict[str, list[str]], list[str]]:
        own = parts.get(lang, {})
        same = [d for g, ds in docs.items() if _lang(g) == lang for d in ds]
        complete = {"task", "rule", "question"} <= set(own)
        return own if complete else parts["en"], same or [d for ds in docs.values() for d in ds]

    for index, (name, lines) in enumerate(docs.items()):
        lang_parts, _ = pick(_lang(name))
        for _ in range(2):
            chosen = rng.sample(lines, min(len(lines), rng.randint(1, 3)))
            rules = rng.sample(lang_parts["rule"], rng.randint(2, 6))
            text = _template(lang_parts, chosen, rules, rng)
            yield _split_of(index), Row(text, 0, "rule_template", f"mldoc:{name}", "benign_chat")
    for index, (name, lines) in enumerate(payloads.items()):
        lang_parts, same = pick(_lang(name))
        for payload in lines:
            chosen = rng.sample(same, rng.randint(1, 3))
            rules = rng.sample(lang_parts["rule"], rng.randint(2, 6))
            rules[rng.randrange(len(rules))] = payload
            text = _template(lang_parts, chosen, rules, rng)
            yield _split_of(index), Row(text, 1, "rule_template_attack", f"mlpay:{name}", "injection")
