"""Per-model guardrail policy: the `guardrails:` section of a model's YAML file.

Every model forbids unknown keys so that a typo in YAML fails at load instead of silently disabling a
rail. `load_policy` turns pydantic's error into one line naming the file, the key and the reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from guardrails.app_templates import TemplateMatcher
from guardrails.detectors.linear_regex import compile_forbidden
from guardrails.entities import EntityType, RuleAction

DEFAULT_INPUT_PII: dict[EntityType, RuleAction] = {
    EntityType.CREDIT_CARD: RuleAction.BLOCK,
    EntityType.API_KEY: RuleAction.BLOCK,
    EntityType.PRIVATE_KEY: RuleAction.BLOCK,
    EntityType.US_SSN: RuleAction.BLOCK,
    EntityType.IBAN: RuleAction.REDACT,
    EntityType.NL_BSN: RuleAction.REDACT,
    EntityType.ES_NIF: RuleAction.REDACT,
    EntityType.EMAIL: RuleAction.REDACT,
    EntityType.PHONE: RuleAction.REDACT,
    # IP addresses are everyday content in technical chat; opt in per model if needed.
    EntityType.IP_ADDRESS: RuleAction.ALLOW,
}
DEFAULT_OUTPUT_PII: dict[EntityType, RuleAction] = dict(DEFAULT_INPUT_PII)


class StrictModel(BaseModel):
    """Base for every policy model: unknown keys are an error, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _fill_defaults(value: Any, defaults: Mapping[EntityType, RuleAction]) -> Any:
    # A YAML that lists only `email: allow` keeps the defaults for every other entity.
    if value is None:
        return dict(defaults)
    if isinstance(value, Mapping):
        return {**defaults, **value}
    return value


class PiiPolicy(StrictModel):
    """Per-entity actions, for user input and for model output separately."""

    enabled: bool = True
    input: dict[EntityType, RuleAction] = Field(default_factory=lambda: dict(DEFAULT_INPUT_PII))
    output: dict[EntityType, RuleAction] = Field(default_factory=lambda: dict(DEFAULT_OUTPUT_PII))

    @field_validator("input", mode="before")
    @classmethod
    def _input_defaults(cls, value: Any) -> Any:
        return _fill_defaults(value, DEFAULT_INPUT_PII)

    @field_validator("output", mode="before")
    @classmethod
    def _output_defaults(cls, value: Any) -> Any:
        return _fill_defaults(value, DEFAULT_OUTPUT_PII)

    @field_validator("output")
    @classmethod
    def _private_key_not_redacted(cls, value: dict[EntityType, RuleAction]) -> dict[EntityType, RuleAction]:
        # A PEM block runs to thousands of characters; the stream cannot hold it back to rewrite it.
        if value.get(EntityType.PRIVATE_KEY) is RuleAction.REDACT:
            raise ValueError("private_key cannot be redacted in output (too long to hold back); use block or allow")
        return value


class InjectionDetectorKind(StrEnum):
    """Which scorer backs the injection rail."""

    EMBEDDING_CLASSIFIER = "embedding_classifier"
    HF_SEQUENCE_CLASSIFIER = "hf_sequence_classifier"


class HfClassifierConfig(StrictModel):
    """A local Hugging Face sequence classifier, e.g. a copy of meta-llama/Prompt-Guard-86M."""

    model_path: str = Field(min_length=1)
    # Labels whose probabilities add up to the injection score (Prompt Guard v1: INJECTION, JAILBREAK).
    injection_labels: list[str] = Field(default_factory=lambda: ["INJECTION", "JAILBREAK"], min_length=1)
    max_length: PositiveInt = 512
    device: str = "cpu"


class AppTemplate(StrictModel):
    """A prompt template an application wraps around its user's text (a chat UI's RAG
    template): see ``guardrails.app_templates``. Without ``text``, ``name`` is a built-in
    (``guardrails/templates/<name>/``, e.g. ``open_webui_rag``)."""

    name: str = Field(min_length=1)
    # The template with placeholders on lines of their own: {{CONTEXT}} for documents, any
    # other {{NAME}} for the user's text, each between an opening and a closing line.
    text: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _parses(self) -> AppTemplate:
        TemplateMatcher.from_policy([(self.name, self.text)])  # raises ValueError with the reason
        return self


class InjectionPolicy(StrictModel):
    """Prompt-injection / jailbreak rail."""

    enabled: bool = True
    # None: the scorer's own calibrated threshold. For the embedding classifier that is the one
    # `make models` picked by cross-validation for a ~3% benign false-positive rate (stored in
    # the artifact, so retraining moves it with the weights); 0.5 for an HF classifier.
    threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    # Retrieved passages and tool results. None: the artifact's document calibration (when
    # `threshold` is also None), else `threshold`.
    document_threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    heuristics: bool = True
    detector: InjectionDetectorKind = InjectionDetectorKind.EMBEDDING_CLASSIFIER
    # None means the artifact shipped in guardrails/data/.
    classifier_path: str | None = None
    hf: HfClassifierConfig | None = None
    # Roles whose text is instructions by design (an app's system prompt reads like a persona
    # jailbreak to a classifier trained on user turns: "You are X. Never reveal ..."). Their
    # text gets the high-precision heuristics, PII and topic rails, not the classifier.
    instruction_roles: frozenset[Literal["system", "developer"]] = frozenset({"system", "developer"})
    # Templates whose own lines are an app's instructions, not its user's: a message written
    # from one is judged in parts (template lines by the heuristics, its context block as
    # documents, every other line as a user turn). Needs a scorer that reads text, not a
    # MiniLM embedding of the whole message. Default: Open WebUI's RAG and autocompletion
    # templates ([] turns them off).
    app_templates: list[AppTemplate] = Field(
        default_factory=lambda: [AppTemplate(name="open_webui_rag"), AppTemplate(name="open_webui_autocomplete")]
    )
    # Documents are also scored two sentences at a time, so an instruction planted in a long
    # document is not diluted by the rest; the ensemble's document stage was trained on these
    # windows (README, Guardrails, has it on and off). Ensemble scorer only.
    document_windows: bool = True
    # A flagged retrieved passage or tool result loses only the sentences (in a JSON tool
    # result: the strings) that set the rail off, when what is left passes the same check; else
    # it is dropped (a passage) or refused (a tool result), as with false; an app template's
    # `<source>` is redacted inside its tags, or removed. Needs a scorer that reads text (the
    # ensemble, an HF classifier), not a MiniLM embedding of the whole document.
    document_redaction: bool = True

    @field_serializer("instruction_roles")
    def _sorted_roles(self, roles: frozenset[str]) -> list[str]:
        # A set's order differs between processes; the Serve config and version digests must not.
        return sorted(roles)

    @model_validator(mode="after")
    def _hf_needs_config(self) -> InjectionPolicy:
        if self.detector is InjectionDetectorKind.HF_SEQUENCE_CLASSIFIER and self.hf is None:
            raise ValueError("detector 'hf_sequence_classifier' needs an 'hf' section with model_path")
        return self


class DeniedTopic(StrictModel):
    """A topic the model must not discuss, described in a few example sentences."""

    name: str = Field(min_length=1)
    descriptions: list[str] = Field(min_length=1)
    # Overrides the section threshold for this topic only.
    threshold: float | None = Field(default=None, ge=0.0, le=1.0)


class DeniedTopicsPolicy(StrictModel):
    """Denied topics matched by embedding similarity."""

    threshold: float = Field(default=0.5, ge=0.0, le=1.0)
    topics: list[DeniedTopic] = Field(default_factory=list)

    @field_validator("topics")
    @classmethod
    def _unique_names(cls, topics: list[DeniedTopic]) -> list[DeniedTopic]:
        names = [t.name for t in topics]
        if len(names) != len(set(names)):
            raise ValueError("topic names must be unique")
        return topics


class LimitsPolicy(StrictModel):
    """Size limits on the request, checked before anything expensive runs."""

    max_input_chars: PositiveInt = 32_000
    max_input_tokens: PositiveInt = 8_000
    max_messages: PositiveInt = 64
    # Wall time the input rails may spend on one request; past it the request is refused
    # (or let through with fail_open). A backstop: every pattern is linear-time already, and
    # embedding a full 32 KB request for the classifier takes about 2 s on one slow CPU core.
    time_budget_ms: PositiveInt = 5000


class ForbiddenPattern(StrictModel):
    """A string or regular expression the model must never emit.

    Both run on RE2, a linear-time engine, so a pattern cannot be made slow by what the model writes.
    Regular expressions therefore use RE2 syntax: no lookaround or backreferences, ASCII `\\w \\d
    \\s \\b` (`\\p{L}`, `\\p{Nd}` for Unicode), `\\z` for the end of the text. A pattern RE2 cannot
    compile is rejected at load (see `guardrails.detectors.linear_regex.compile_forbidden`).
    """

    pattern: str = Field(min_length=1)
    regex: bool = False
    ignore_case: bool = True
    action: RuleAction = RuleAction.BLOCK
    # Longest text the regex can match: a possible match of it is held back up to this many
    # characters (if more than output.holdback_chars). Default 64 for a regex; a literal's length.
    max_match_chars: PositiveInt | None = None

    @model_validator(mode="after")
    def _compiles(self) -> ForbiddenPattern:
        try:
            compile_forbidden(self.pattern, regex=self.regex, ignore_case=self.ignore_case)
        except ValueError as exc:
            raise ValueError(f"pattern does not compile: {exc}") from None
        if self.action is RuleAction.ALLOW:
            raise ValueError("a forbidden pattern's action must be block or redact")
        return self


class OutputPolicy(StrictModel):
    """Streaming output rail."""

    enabled: bool = True
    # The longest a possible match is held back on a stream. Only text that could still become
    # part of a match waits (partial matching); everything before it goes out at once. A match
    # recognisable within this many characters of its start never leaks, however it is split.
    holdback_chars: PositiveInt = 64
    forbidden: list[ForbiddenPattern] = Field(default_factory=list)
    # Images the answer points at on other hosts (Markdown `![..](https://..)`, HTML `<img src=
    # "//..">`): a chat UI that renders the answer fetches them at once, so an instruction planted
    # in a document can make the model leak the conversation in the image's URL with no click.
    # redact (default) defuses the image, block ends the answer, allow lets it through.
    external_images: RuleAction = RuleAction.REDACT
    # Longest redaction the stream may hold back before giving up and blocking instead.
    max_redact_chars: PositiveInt = 512


class GuardrailPolicy(StrictModel):
    """The whole `guardrails:` section of a per-model YAML file."""

    enabled: bool = True
    # An exception inside a rail blocks the request unless this is true.
    fail_open: bool = False
    # Input rails check every message whatever its role. Roles listed here skip PII, injection
    # and topic rails (size limits still count them). Any client can write any role, so an
    # exempt role is a way around the rails for whoever calls this model: exempt only what a
    # trusted backend writes, e.g. `system` behind an app that sets its own system prompt.
    exempt_roles: frozenset[Literal["system", "developer", "user", "assistant", "tool", "function"]] = frozenset()

    @field_serializer("exempt_roles")
    def _sorted_roles(self, roles: frozenset[str]) -> list[str]:
        return sorted(roles)  # as InjectionPolicy.instruction_roles

    pii: PiiPolicy = Field(default_factory=PiiPolicy)
    injection: InjectionPolicy = Field(default_factory=InjectionPolicy)
    denied_topics: DeniedTopicsPolicy = Field(default_factory=DeniedTopicsPolicy)
    limits: LimitsPolicy = Field(default_factory=LimitsPolicy)
    output: OutputPolicy = Field(default_factory=OutputPolicy)


class GuardrailConfigError(ValueError):
    """A guardrails section that does not validate; the message names source, key and reason."""


def load_policy(data: Mapping[str, Any] | None, source: str = "<guardrails>") -> GuardrailPolicy:
    """Validate a `guardrails:` mapping (already parsed from YAML) into a `GuardrailPolicy`.

    Raises `GuardrailConfigError` with one line per problem, e.g.
    ``models/qwen.yaml: guardrails.injection.treshold: Extra inputs are not permitted``.
    """
    try:
        return GuardrailPolicy.model_validate(data or {})
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            key = ".".join(str(part) for part in ("guardrails", *err["loc"]))
            lines.append(f"{source}: {key}: {err['msg']}")
        raise GuardrailConfigError("\n".join(lines)) from None
