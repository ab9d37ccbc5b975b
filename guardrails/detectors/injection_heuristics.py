"""The injection rail's phrase heuristics: high-precision patterns for the canonical attacks,
matched on the folded text (text_fold.py) in linear time (RE2, linear_regex.py). The classifier
(injection.py, injection_ensemble.py) handles paraphrases; these catch the canonical phrasings
even when it is unsure, and judge instruction roles the classifier was not trained on."""

from __future__ import annotations

from guardrails.detectors import linear_regex as lrx
from guardrails.detectors.text_fold import fold

# Each was checked against the benign evaluation prompts.
#
# RE2 (linear time) spelling of the former `re` patterns, with the same yes/no answer on every text
# (only `search` is used, never a span, so boundaries may consume the character they inspect).
# Case-insensitivity is scoped to the literal words (`ci`, Python's folding); `\b` next to a word
# becomes a consumed non-word character (or text start/end) over Python's Unicode `\w`.
_W = lrx.WORD
_S = f"[{lrx.SPACE}]"
_B = rf"(?:^|[^{_W}])"  # \b before a word
_E = rf"(?:\z|[^{_W}])"  # \b after a word


def _words(*words: str) -> str:
    """Case-insensitive alternation; a trailing "?" makes a word's last letter optional ("rules?")."""
    alts = [lrx.ci(w[:-2]) + lrx.ci(w[-2]) + "?" if w.endswith("?") else lrx.ci(w) for w in words]
    return "(?:" + "|".join(alts) + ")"


def _gap(most: int, excluded: str) -> str:
    r"""`\b[^X]{0,most}?\b` between two words: 1..most characters, the first and last not word characters."""
    edge = f"[^{_W}{excluded}]"
    return f"{edge}(?:[^{excluded}]{{0,{most - 2}}}?{edge})??"


_ci = lrx.ci
_LINE_GAP = r".\n"  # [^.\n]: within one sentence and line

_HEURISTICS: dict[str, lrx.Pattern] = {
    "ignore_instructions": lrx.compile(
        _B
        + _words("ignore", "disregard", "forget", "override", "bypass")
        + _gap(40, _LINE_GAP)
        + _words(
            "previous",
            "prior",
            "above",
            "earlier",
            "preceding",
            "initial",
            "original",
            "system",
            "foregoing",
            "following",
        )
        + _S
        + "+"
        + _words(
            "instructions?",
            "prompts?",
            "directions?",
            "directives?",
            "rules",
            "guidelines",
            "commands?",
            "constraints",
        )
    ),
    "do_anything_now": lrx.compile(
        _B
        + "DAN"
        + _gap(60, r"\n")
        + _ci("do anything now")
        + _E
        + "|"
        + _B
        + "Do Anything Now"
        + _E
        + "|"
        + _B
        + _words("you are", "you're", "act as", "pretend to be", "become")
        + _S
        + "+(?:"
        + _ci("now")
        + _S
        + "+)?(?:DAN|STAN|DUDE)"
        + _E
    ),
    # In `re` this was `... mode (?:enabled|activated)\b(?=[\s\S]*\b(?:OpenAI|...)\b)`; for a yes/no
    # search the lookahead may consume: a later keyword, preceded by a non-word character.
    "mode_switch": lrx.compile(
        _B
        + _words("ChatGPT", "AI", "assistant", "chatbot", "language model")
        + _S
        + "+"
        + _ci("with")
        + _S
        + "+"
        + _words("developer", "dev", "god", "DAN", "jailbreak")
        + _S
        + "+"
        + _ci("mode")
        + _E
        + "|"
        + _B
        + _words("developer", "DAN", "jailbreak", "god")
        + _S
        + "+"
        + _ci("mode")
        + _S
        + "+"
        + _words("enabled", "activated")
        + f"[^{_W}](?:(?s:.)*[^{_W}])?"
        + _words("OpenAI", "ChatGPT", "content polic", "restrictions", "uncensored", "unfiltered", "guidelines")
        + _E
    ),
    "unrestricted_persona": lrx.compile(
        _B
        + "(?:"
        + _words("you are", "you're", "act as")
        + "|"
        + _ci("pretend ")
        + _words("to be", "you are")
        + "|"
        + _ci("from now on")
        + ",?"
        + _ci(" you")
        + ")"
        + _gap(60, _LINE_GAP)
        + "(?:"
        + _words("unfiltered", "uncensored", "unrestricted", "amoral")
        + "|"
        + _ci("without ")
        + "(?:"
        + _ci("any ")
        + ")?"
        + _words("restrictions", "filters", "limitations", "ethical", "moral")
        + ")"
    ),
    "rules_release": lrx.compile(
        _B
        + "(?:"
        + _ci("you ")
        + _words("are", "will")
        + _ci(" no longer")
        + "|"
        + _ci("you ")
        + _words("don't", "do not")
        + _ci(" have to")
        + "|"
        + _words("you are not bound by", "you are free from")
        + "|"
        + _words("have", "has")
        + _ci(" been freed from")
        + ")"
        + _gap(40, _LINE_GAP)
        + _words("rules", "restrictions", "guidelines", "policies", "polic", "filters", "OpenAI", "ethic")
    ),
    "system_prompt_exfiltration": lrx.compile(
        _B
        + _words(
            "reveal",
            "print",
            "output",
            "repeat",
            "display",
            "leak",
            "show me",
            "tell me",
            "give me",
            "spell check",
            "translate",
        )
        + _gap(40, _LINE_GAP)
        + _words("your", "the")
        + _S
        + "+"
        + "(?:"
        + _ci("system")
        + _S
        + "+"
        + _ci("prompt")
        + "|"
        + _ci("initial")
        + _S
        + "+"
        + _words("instructions", "prompt")
        + "|"
        + _ci("hidden")
        + _S
        + "+"
        + _words("instructions", "prompt")
        + "|"
        + _ci("original")
        + _S
        + "+"
        + _ci("instructions")
        + "|"
        + _ci("pre")
        + "-?"
        + _ci("prompt")
        + "|"
        + _ci("previous")
        + _S
        + "+"
        + _ci("instructions")
        + ")"
    ),
    # Indirect injection: text inside a pasted document that speaks to the model reading it.
    "addressed_to_model": lrx.compile(
        _B
        + _words("note", "message", "instructions?", "command")
        + _S
        + "+"
        + _words("to", "for")
        + _S
        + "+"
        + "(?:"
        + _words("the", "any")
        + _S
        + "+)?"
        + _words("AI", "assistant", "language model", "LLM", "chatbot", "model")
        + _E
        + "|"
        + _B
        + _ci("if you are a")
        + _ci("n")
        + "? "
        + _words("AI", "language model", "LLM", "assistant", "chatbot")
        + _E
        + "|"
        + _B
        + _words("AI", "LLM", "language model")
        + _ci("s")
        + "?"
        + _S
        + "+"
        + "(?:"
        + _words("assistants?", "agents?")
        + _S
        + "+)?"
        + "(?:"
        + _words("reading", "processing")
        + "|"
        + _ci("summari")
        + "(?i:[sz])"
        + _ci("ing")
        + ")"
        + _ci(" this")
        + _E
    ),
    "chat_template_tokens": lrx.compile(
        r"<\|im_start\|>" + _S + r"*system|<<SYS>>|<\|system\|>|<\|start_header_id\|>system"
    ),
}


def heuristic_hits(text: str) -> list[str]:
    """Names of the heuristics that match `text`, folded (text_fold.py), or empty when none."""
    data = lrx.to_utf8(fold(text))
    return [name for name, pattern in _HEURISTICS.items() if pattern.search(data)]
