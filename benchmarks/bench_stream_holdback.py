"""What the streaming output rail holds back: rails off vs the fixed window vs minimal hold-back.

Realistic answers (the kind SmolLM2-135M-Instruct writes to chat prompts) are cut into the
model's own token pieces with its tokenizer, then pushed one token at a time through:

- rails off (every token visible as it arrives);
- the fixed 64-character window that the output rail used before (``--before REF``: the
  ``guardrails/output_rail.py`` of a git revision, loaded beside the current one);
- the current rail (minimal hold-back: only a possible match waits);
- the current rail with e-mail addresses allowed in answers (``email: allow``), which is what
  the one token of hold-back at a stream's head costs.

Both rails use the embedded model's output policy (configs/models/smollm2-135m-instruct.yaml).
Per answer it counts the tokens generated before the first visible character, the chunks that
carry visible text, and the characters held back after each token; time to first visible token
is the engine's time to first token plus that many extra tokens times its time per output token
(defaults: the gateway's medians at concurrency 1 in the README's serving benchmark).

    python benchmarks/bench_stream_holdback.py [--before d1c38cc] [--ttft-ms 354] [--tpot-ms 83]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ANSWERS = [
    "The capital of France is Paris.",
    "Sure! Why don't scientists trust atoms? Because they make up everything.",
    "Paris is the capital and largest city of France. It is known for the Eiffel Tower, the Louvre "
    "museum and its cafés, and about two million people live in the city itself.",
    'To reset your password, open Settings, choose Account, then click "Reset password". You will '
    "get an e-mail with a link that is valid for 24 hours.",
    "Here is a simple recipe:\n\n1. Boil 200 g of pasta for 9 minutes.\n2. Fry two cloves of garlic "
    "in olive oil.\n3. Mix, add parmesan and serve.",
    "You can use a list comprehension:\n\n```python\nsquares = [x * x for x in range(10)]\nprint(squares)\n```",
    "For questions about your order, write to support@example.com or call +1 415 555 2671 on weekdays.",
    "Photosynthesis is the process by which plants turn light, water and carbon dioxide into glucose "
    "and oxygen. It happens mostly in the leaves, inside the chloroplasts.",
]


def tokenizer_pieces(texts: list[str]) -> list[list[str]]:
    """Each text as the decoded pieces the engine would stream (incremental detokenisation)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ROOT / ".models/SmolLM2-135M-Instruct")
    out = []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        pieces, prev = [], ""
        for i in range(1, len(ids) + 1):
            cur = tok.decode(ids[:i])
            if cur.endswith("\ufffd"):
                continue  # an incomplete UTF-8 sequence: the engine waits for the next token
            pieces.append(cur[len(prev) :])
            prev = cur
        assert "".join(pieces) == text
        out.append(pieces)
    return out


def load_guard_class(rev: str):
    """StreamGuard from guardrails/output_rail.py at git revision `rev`."""
    source = subprocess.run(
        ["git", "show", f"{rev}:guardrails/output_rail.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "output_rail_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("output_rail_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.StreamGuard


def measure(make_guard, pieces: list[str]) -> dict[str, float]:
    guard = make_guard() if make_guard else None
    first, chunks, held, push_s = None, 0, [], 0.0
    for i, piece in enumerate(pieces):
        t = time.perf_counter()
        out = guard.push(piece).text if guard else piece
        push_s += time.perf_counter() - t
        held.append(guard.held_chars if guard else 0)
        if out:
            chunks += 1
            first = i if first is None else first
    if guard and guard.finish().text:
        chunks += 1
    # Tokens generated after the first one before anything was visible (the end counts as the last token).
    extra = (len(pieces) - 1) if first is None else first
    return {
        "extra_tokens": extra,
        "chunks": chunks,
        "held_mean": statistics.mean(held),
        "held_max": max(held),
        "push_us": push_s * 1e6 / len(pieces),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # d1c38cc: the last revision whose output rail held a fixed window (a8117ee replaced it).
    parser.add_argument("--before", default="d1c38cc", help="git revision with the fixed-window rail")
    parser.add_argument("--ttft-ms", type=float, default=354.0, help="engine time to first token")
    parser.add_argument("--tpot-ms", type=float, default=83.0, help="engine time per output token")
    args = parser.parse_args()

    from guardrails.config import load_policy
    from guardrails.output_rail import StreamGuard

    model = yaml.safe_load((ROOT / "configs/models/smollm2-135m-instruct.yaml").read_text())
    policy = load_policy(model["guardrails"])
    # The same policy with e-mail addresses allowed in answers: any word could still grow into an
    # address's local part, so with e-mail redaction on each word waits for the token that ends it.
    guards = model["guardrails"]
    no_email = load_policy(
        {**guards, "pii": {**guards["pii"], "output": {**guards["pii"]["output"], "email": "allow"}}}
    )
    before_cls = load_guard_class(args.before)
    variants = {
        "rails off": None,
        f"window ({args.before})": lambda: before_cls.from_policy(policy),
        "minimal hold-back": lambda: StreamGuard.from_policy(policy),
        "minimal, email: allow": lambda: StreamGuard.from_policy(no_email),
    }
    all_pieces = tokenizer_pieces(ANSWERS)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for make in variants.values():  # warm-up: pattern compilation and RE2's caches
        measure(make, all_pieces[0])
    for pieces in all_pieces:
        for name, make in variants.items():
            rows[name].append(measure(make, pieces))

    tokens = [len(p) for p in all_pieces]
    print(f"{len(ANSWERS)} answers, {min(tokens)}-{max(tokens)} tokens (median {statistics.median(tokens)})")
    print(f"policy: configs/models/smollm2-135m-instruct.yaml; TTFT {args.ttft_ms} ms, TPOT {args.tpot_ms} ms")
    header = (
        f"{'':>22} {'extra tokens':>13} {'TTFVT ms':>9} {'chunks':>7} {'held mean':>10} {'held max':>9} {'us/push':>8}"
    )
    print(header + "\n" + " " * 22 + " (medians over answers; chunks: total over answers)")
    for name, r in rows.items():
        extra = statistics.median(x["extra_tokens"] for x in r)
        ttfvt = args.ttft_ms + extra * args.tpot_ms
        print(
            f"{name:>22} {extra:13.1f} {ttfvt:9.0f} {sum(x['chunks'] for x in r):7d} "
            f"{statistics.median(x['held_mean'] for x in r):10.1f} {max(x['held_max'] for x in r):9d} "
            f"{statistics.median(x['push_us'] for x in r):8.1f}"
        )
    print("\nper answer: extra tokens before the first visible character (" + " / ".join(variants) + ")")
    for i, pieces in enumerate(all_pieces):
        vals = " / ".join(str(rows[n][i]["extra_tokens"]) for n in variants)
        print(f"  {len(pieces):3d} tokens: {vals}   {ANSWERS[i][:48]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
