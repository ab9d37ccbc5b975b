"""Who is calling: API keys as named principals with scopes.

Keys never appear in the gateway's YAML, in Serve's deployment arguments or in logs. They come
from a keys file (only SHA-256 digests of the keys are stored in it) or, for a single-user setup,
from an environment variable. The keys file is re-read when it changes, so keys rotate without a
restart; a file that no longer validates keeps the last good set (and says so in the log).

A presented key is hashed at once and compared by digest in constant time; the plain key is not
kept past that call.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateway.config import is_loopback
from gateway.errors import AUTHENTICATION, PERMISSION, APIError
from gateway.limiter_config import KeyLimits

logger = logging.getLogger(__name__)

Scope = Literal["chat", "documents", "admin"]
ALL_SCOPES: frozenset[str] = frozenset({"chat", "documents", "admin"})
# The principal every request acts as when auth is off (loopback only, see GatewayConfig).
LOCAL = "local"


@dataclass(frozen=True)
class Principal:
    """A caller: a name (what logs, limits and ownership key on) and what it may do.

    ``models`` is None for every model. ``admin`` manages the operator's shared vector stores
    (those a model's retrieval policy names) and reads the gateway's effective config.
    """

    name: str
    scopes: frozenset[str] = ALL_SCOPES
    models: frozenset[str] | None = None
    # Overrides of gateway.yaml's `limits.default` for this key (gateway/limits.py).
    limits: KeyLimits | None = field(default=None, compare=False, hash=False)

    @property
    def admin(self) -> bool:
        return "admin" in self.scopes

    def may_use(self, model_id: str) -> bool:
        return "chat" in self.scopes and (self.models is None or model_id in self.models)

    def require(self, scope: str) -> None:
        if scope not in self.scopes:
            raise APIError(
                403,
                f"This API key is not allowed to do this (missing scope: {scope}).",
                type=PERMISSION,
                code="insufficient_permissions",
            )


def key_digest(key: str) -> str:
    """The stored form of a key: SHA-256, hex. Keys are random 32-byte tokens, so a fast hash
    is enough (no dictionary to guess from); a slow KDF would cost every request."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "sk-gw-" + secrets.token_urlsafe(32)


class _PrincipalEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.@:-]+$")
    # Several digests per principal let a key be rotated: add the new one, move clients, drop the old.
    key_sha256: list[str] = Field(min_length=1)
    scopes: list[Scope] = Field(default_factory=lambda: ["chat", "documents"])
    models: list[str] = Field(default_factory=lambda: ["*"], min_length=1)
    limits: KeyLimits | None = None  # rate limits and budget, over gateway.yaml's defaults

    @field_validator("key_sha256", mode="before")
    @classmethod
    def _one_or_many(cls, value):
        return [value] if isinstance(value, str) else value

    @field_validator("key_sha256")
    @classmethod
    def _hex_digests(cls, value: list[str]) -> list[str]:
        for digest in value:
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError("key_sha256 must be the 64-character lowercase hex SHA-256 of the key")
        return value

    def principal(self) -> Principal:
        models = None if "*" in self.models else frozenset(self.models)
        return Principal(self.name, frozenset(self.scopes), models, self.limits)


class KeysFile(BaseModel):
    """The keys file: ``principals: [{name, key_sha256, scopes, models}]``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    principals: list[_PrincipalEntry] = Field(default_factory=list)


def read_keys_file(path: Path) -> dict[str, Principal]:
    """Digest -> principal. Raises ValueError naming the file, key and reason."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
        parsed = KeysFile.model_validate(data)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML ({exc})") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise ValueError(f"{path}: {key}: {err['msg']}") from None
    out: dict[str, Principal] = {}
    names: set[str] = set()
    for entry in parsed.principals:
        if entry.name in names:
            raise ValueError(f"{path}: principals: name {entry.name!r} appears twice")
        names.add(entry.name)
        for digest in entry.key_sha256:
            if digest in out:
                raise ValueError(f"{path}: principals: a key digest is listed twice")
            out[digest] = entry.principal()
    return out


def env_principals(variable: str) -> dict[str, Principal]:
    """Keys from an environment variable: comma-separated ``name=key`` or bare keys. Each is a
    principal with every scope (the single-operator setup); use the keys file for tenants."""
    out: dict[str, Principal] = {}
    for item in os.environ.get(variable, "").split(","):
        item = item.strip()
        if not item or item.startswith("#"):
            continue
        name, sep, key = item.partition("=")
        if not sep:
            key = item
            name = "env-" + key_digest(key)[:8]
        out[key_digest(key.strip())] = Principal(name.strip(), ALL_SCOPES, None)
    return out


class KeyRing:
    """The current keys, re-read from the keys file when its mtime changes (checked at most
    every ``recheck_s`` seconds, on the request path: one ``stat``)."""

    def __init__(
        self,
        keys_file: Path | None,
        env_variable: str | None,
        *,
        recheck_s: float = 1.0,
        loopback_only: bool = True,
    ):
        self._file = keys_file
        # With no keys, only callers on this host are served (unless the config allows anyone).
        self._loopback_only = loopback_only
        self._env = env_principals(env_variable) if env_variable else {}
        self._recheck_s = recheck_s
        self._checked = 0.0
        self._mtime: int | None = None
        self._from_file: dict[str, Principal] = {}
        if keys_file is not None:
            # Fail at start-up, loudly, rather than serve with no keys.
            self._from_file = read_keys_file(keys_file)
            self._mtime = _mtime(keys_file)
            self._checked = time.monotonic()

    @property
    def enabled(self) -> bool:
        return self._file is not None or bool(self._env)

    def __len__(self) -> int:
        return len(self._env) + len(self._from_file)

    def authenticate(self, authorization: str | None, peer: str | None = None) -> Principal:
        """The principal for an ``Authorization`` header value; 401 otherwise. ``peer`` is the
        connection's address: with auth off it must be loopback (a replica's own HTTP port
        listens on every interface when Serve's HAProxy sits in front)."""
        if not self.enabled:
            if self._loopback_only and not (peer is not None and is_loopback(peer)):
                raise APIError(
                    401,
                    "This gateway has no API keys configured and serves callers on its own host only.",
                    type=AUTHENTICATION,
                    code="invalid_api_key",
                )
            return Principal(LOCAL)
        self._maybe_reload()
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise APIError(
                401,
                "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.",
                type=AUTHENTICATION,
                code="invalid_api_key",
            )
        digest = key_digest(key)
        del key
        found: Principal | None = None
        # Compare against every digest so the time taken does not depend on which matched.
        for table in (self._env, self._from_file):
            for stored, principal in table.items():
                if hmac.compare_digest(stored, digest):
                    found = principal
        if found is None:
            raise APIError(401, "Incorrect API key provided.", type=AUTHENTICATION, code="invalid_api_key")
        return found

    def _maybe_reload(self) -> None:
        if self._file is None:
            return
        now = time.monotonic()
        if now - self._checked < self._recheck_s:
            return
        self._checked = now
        mtime = _mtime(self._file)
        if mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            self._from_file = read_keys_file(self._file)
        except ValueError as exc:
            # Keep the last good keys: a half-written or broken file must not lock everyone out
            # (or, worse, let everyone in).
            logger.error("keeping the previous API keys: %s", exc)
            return
        logger.info("API keys reloaded from %s: %d keys", self._file, len(self._from_file))


def _mtime(path: Path) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None
