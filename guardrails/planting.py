"""How the data build hides an instruction in a document, and gives a benign document as a JSON
tool result (guardrails/build_injection_data.py; split out to keep that module readable).

A planted instruction is wrapped in markup (a comment, a hidden span, a fake ``[system]`` tag)
at a document's start, middle or end; in a JSON tool result it goes where an attacker who
controls part of the result would put it. Benign documents are given as tool results too, so
that JSON is no sign of an attack in the data.
"""

from __future__ import annotations

import json
import random

from guardrails.detectors.documents import sentences

# How a planted instruction is hidden in a document or a pasted page (``WRAPS[1:5]`` in a
# pasted page)...
WRAPS = (
    "{p}",
    "<!-- {p} -->",
    "[{p}]",
    '<span style="display:none">{p}</span>',
    "[//]: # ({p})",
    "\n\n{p}\n",
    '<div style="font-size:0;color:#fff">{p}</div>',
    "[system] {p}",
)
# ...and in a JSON tool result: as a field of its own, under one of these names, in any object
# of it; as a record of its own in a list of records; or appended to one of its strings.
JSON_KEYS = ("note", "instructions", "system_note", "assistant_note", "comment", "description", "_meta", "message")


def plant(doc: str, payload: str, rng: random.Random) -> str:
    """``doc`` with ``payload`` hidden in it: a JSON tool result gets it where an attacker who
    controls part of it would put it (``_plant_json``) and stays valid JSON in its own
    format; other text gets it wrapped at its start, middle or end."""
    if doc.lstrip()[:1] in ("{", "["):
        try:
            value = json.loads(doc)
        except ValueError:
            value = None
        if isinstance(value, (dict, list)):
            _plant_json(value, payload, rng)
            return _dumps_like(doc, value)
    hidden = rng.choice(WRAPS).replace("{p}", payload)
    cut = rng.choice([0, len(doc) // 2, len(doc)])
    cut = doc.rfind(" ", 0, cut) + 1 if 0 < cut < len(doc) else cut
    return f"{doc[:cut]} {hidden} {doc[cut:]}".strip()


def _plant_json(value: dict | list, payload: str, rng: random.Random) -> None:
    """Put ``payload`` into the JSON ``value`` (in place): a new field of one of its objects
    (never replacing one of the document's own), a new record of a list of records, or the
    end of one of its strings; the document's own fields keep their values otherwise."""
    objects: list[dict] = []
    lists: list[list] = []
    strings: list[tuple[dict | list, str | int]] = []
    stack: list = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            objects.append(item)
            strings += [(item, k) for k, v in item.items() if isinstance(v, str) and len(v) >= 20]
            stack.extend(item.values())
        elif isinstance(item, list):
            if item and all(isinstance(x, dict) for x in item):
                lists.append(item)
            strings += [(item, i) for i, v in enumerate(item) if isinstance(v, str) and len(v) >= 20]
            stack.extend(item)
    mode = rng.random()
    if lists and mode < 0.3:
        records = rng.choice(lists)
        record = dict(rng.choice(records))  # a sibling's fields, its longest text the payload
        texts = [k for k, v in record.items() if isinstance(v, str)]
        record[max(texts, key=lambda k: len(record[k])) if texts else rng.choice(JSON_KEYS)] = payload
        records.insert(rng.randint(0, len(records)), record)
    elif strings and mode < 0.6:
        holder, key = rng.choice(strings)
        hidden = rng.choice(WRAPS[:5]).replace("{p}", payload)
        holder[key] = f"{holder[key]} {hidden}"
    elif objects:
        target = rng.choice(objects)
        key = rng.choice(JSON_KEYS)
        while key in target:
            key = f"_{key}"
        items = list(target.items())
        items.insert(rng.randint(0, len(items)), (key, payload))
        target.clear()
        target.update(items)
    else:  # a list of plain values
        value.insert(rng.randint(0, len(value)), payload)


def written_forms(text: str) -> tuple[str, str, str]:
    """The ways ``_plant`` may have written ``text`` into a document: as it is, or escaped as a
    JSON string with non-ASCII characters kept or escaped too."""
    return text, json.dumps(text, ensure_ascii=False)[1:-1], json.dumps(text)[1:-1]


def _dumps_like(doc: str, value: dict | list) -> str:
    """``value`` as JSON in ``doc``'s format: indented or not, non-ASCII escaped or not."""
    indent = 2 if "\n" in doc.strip() else None
    escaped = doc.isascii() and "\\u" in doc
    return json.dumps(value, ensure_ascii=escaped, indent=indent)


# Benign documents are also given as JSON tool results (``tool_result``), this share of them:
# otherwise almost every JSON document in the data carries a planted instruction (the build
# plants into the documents it has, and the hand-written ones hold few tool results), and the
# classifier learns that JSON is an attack: ordinary search results were refused.
TOOL_RESULT_SHARE = 0.5
PLANTED_TOOL_RESULT_SHARE = 0.75
_HOSTS = ("example.com", "docs.example.org", "help.example.net", "wiki.example.org", "news.example.com")


def tool_result(doc: str, rng: random.Random) -> str:
    """A benign document as a tool might return it: search hits, knowledge-base articles, one
    record, rows with paging, or a bare list; compact or indented, sometimes ASCII-escaped as
    Python's ``json.dumps`` writes it by default."""
    parts = sentences(doc) or [doc]
    title = lambda t: " ".join(t.split()[:6]).rstrip(".,;:!?。")  # noqa: E731
    url = lambda: f"https://{rng.choice(_HOSTS)}/{rng.choice(['page', 'kb', 'a', 'doc'])}/{rng.randrange(10, 9999)}"  # noqa: E731
    shape = rng.randrange(5)
    if shape == 0:
        value: dict | list = {
            "query": title(parts[0]).lower(),
            "results": [{"title": title(p), "url": url(), "snippet": p} for p in parts],
        }
    elif shape == 1:
        pairs = [" ".join(parts[i : i + 2]) for i in range(0, len(parts), 2)]
        value = {"articles": [{"id": f"KB-{rng.randrange(100, 999)}", "title": title(b), "body": b} for b in pairs]}
    elif shape == 2:
        value = {
            "id": rng.randrange(1000, 99999),
            "type": rng.choice(["product", "policy", "page", "note", "ticket"]),
            "name": title(parts[0]),
            "description": doc,
            "updated_at": f"2025-{rng.randrange(1, 13):02d}-{rng.randrange(1, 29):02d}",
            "tags": [w.strip(".,:;").lower() for w in parts[0].split()[:3]],
        }
    elif shape == 3:
        value = {
            "data": [{"line": i + 1, "text": p} for i, p in enumerate(parts)],
            "meta": {"page": 1, "per_page": 20, "total": len(parts)},
        }
    else:
        value = [{"id": i + 1, "content": p, "score": round(rng.uniform(0.5, 0.99), 2)} for i, p in enumerate(parts)]
    return json.dumps(value, ensure_ascii=rng.random() < 0.25, indent=2 if rng.random() < 0.5 else None)
