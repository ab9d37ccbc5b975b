"""The gateway as Serve applications, and applying a config to a running gateway.

One Serve application per model (its ``LLMServer``), plus the ``gateway`` application (the
ingress and the stage deployments). A config becomes a Serve config (``serve_config``), which
``apply`` sends to Serve's REST API, as ``serve deploy`` does, so it works against any cluster
whose dashboard address is reachable. What that changes falls in one of three tiers, decided by
what Serve does with it, not by the operator:

- **policy** (a model file's guardrails, retrieval, requests, aliases): the ingress deployment's
  ``user_config``. Serve hands it to ``Gateway.reconfigure`` on every replica, on every node,
  without restarting one; a request in flight keeps the policy it started with.
- **engine** (a model file's source, engine, placement, deployment): the model's own application's
  arguments, so Serve replaces that model's replicas (rolling) and no other.
- **gateway** (``gateway.yaml`` apart from its model list): the gateway application's arguments;
  its ingress and stage replicas are replaced (rolling). Adding or removing a model is a new or
  deleted model application plus a policy change, and restarts nothing else.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.config import ConfigError
from gateway.config import LoadedConfig

GATEWAY_APP = "gateway"
INGRESS_DEPLOYMENT = "Gateway"
ENGINE_APP_PREFIX = "model-"
DEFAULT_DASHBOARD = "http://127.0.0.1:8265"


def engine_app_name(model_id: str) -> str:
    """The Serve application of one model: a name safe in Serve's REST paths and metric labels."""
    slug = re.sub(r"[^A-Za-z0-9._-]", "_", model_id)
    if slug != model_id:
        slug += "-" + hashlib.sha256(model_id.encode()).hexdigest()[:6]
    return ENGINE_APP_PREFIX + slug


def engine_deployment_name(model_id: str) -> str:
    return "Engine:" + engine_app_name(model_id).removeprefix(ENGINE_APP_PREFIX)


def _portable(path: Path) -> str:
    """A path as the replicas should see it: relative to the working directory when it is inside
    it (a cluster's working_dir has the same layout), absolute otherwise."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path.resolve())


def policy_user_config(config: LoadedConfig) -> dict[str, Any]:
    """The ingress's ``user_config``: every model's whole file (the ingress reads the policy parts
    and ``max_model_len``) and where its engine is. A digest of it names the whole policy tier."""
    models = [
        {
            "app": engine_app_name(m.model_id),
            "deployment": engine_deployment_name(m.model_id),
            "source": _portable(path),
            "file": m.model_dump(mode="json"),
        }
        for path, m in zip(config.model_files, config.models)
    ]
    return {"models": models}


def serve_config(config: LoadedConfig, *, engine_cls: str | None = None) -> dict[str, Any]:
    """The Serve config (``serve deploy`` format) for a loaded gateway config."""
    gw = config.gateway
    models_dir = _portable(config.models_dir) if gw.models_dir else None
    apps: list[dict[str, Any]] = []
    for model in config.models:
        args: dict[str, Any] = {"engine": model.engine_spec().model_dump(mode="json"), "models_dir": models_dir}
        args["deployment_name"] = engine_deployment_name(model.model_id)
        if engine_cls:
            args["engine_cls"] = engine_cls
        apps.append(
            {
                "name": engine_app_name(model.model_id),
                "route_prefix": None,  # reached only through the gateway's handles
                "import_path": "engines.app:build_engine_app",
                "args": args,
            }
        )
    settings = gw.model_dump(mode="json", exclude={"models"})
    apps.append(
        {
            "name": GATEWAY_APP,
            "route_prefix": "/",
            "import_path": "gateway.app:build_app",
            "args": {"settings": settings, "base_dir": _portable(config.path.parent)},
            "deployments": [{"name": INGRESS_DEPLOYMENT, "user_config": policy_user_config(config)}],
        }
    )
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": gw.host, "port": gw.port},
        "applications": apps,
    }


# --- what a change does ---------------------------------------------------------------


@dataclass
class Plan:
    """What applying a config changes, by tier."""

    policy: dict[str, list[str]] = field(default_factory=dict)  # model id -> changed keys
    engine: dict[str, list[str]] = field(default_factory=dict)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    gateway: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.policy or self.engine or self.added or self.removed or self.gateway)

    def lines(self) -> list[str]:
        out = []
        for m in self.added:
            out.append(f"model {m}: added (new application {engine_app_name(m)}; nothing else restarts)")
        for m in self.removed:
            out.append(f"model {m}: removed (its application is deleted; nothing else restarts)")
        for m, keys in self.engine.items():
            out.append(f"model {m}: engine tier, replaces only its replicas (rolling): {', '.join(keys)}")
        for m, keys in self.policy.items():
            out.append(f"model {m}: policy tier, pushed to every ingress replica, no restart: {', '.join(keys)}")
        if self.gateway:
            out.append(f"gateway: replaces the ingress and stage replicas (rolling): {', '.join(self.gateway)}")
        return out or ["no changes"]


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Leaf values by dotted path (an empty mapping has none: `{}` and `{a: 1}` differ in `a`)."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def changed_keys(old: Any, new: Any) -> list[str]:
    a, b = _flatten(old), _flatten(new)
    return sorted(k for k in a.keys() | b.keys() if a.get(k, _MISSING) != b.get(k, _MISSING))


_MISSING = object()


def _changed_args(old: dict | None, new: dict | None, main: str) -> list[str]:
    """Changed keys of an application's args, those under ``main`` without its prefix."""
    old, new = old or {}, new or {}
    rest = changed_keys({k: v for k, v in old.items() if k != main}, {k: v for k, v in new.items() if k != main})
    return changed_keys(old.get(main), new.get(main)) + rest


def deployed_models(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    for app in config.get("applications", []):
        if app.get("name") == GATEWAY_APP:
            for dep in app.get("deployments") or []:
                if dep.get("name") == INGRESS_DEPLOYMENT:
                    return {m["file"]["model_id"]: m["file"] for m in (dep.get("user_config") or {}).get("models", [])}
    return {}


def _app(config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((a for a in config.get("applications", []) if a.get("name") == name), None)


def plan(current: dict[str, Any] | None, new: dict[str, Any]) -> Plan:
    """Compare the deployed Serve config with a new one."""
    result = Plan()
    old_models = deployed_models(current or {})
    new_models = deployed_models(new)
    result.added = sorted(set(new_models) - set(old_models))
    result.removed = sorted(set(old_models) - set(new_models))
    for model_id in sorted(set(new_models) & set(old_models)):
        old_app = _app(current or {}, engine_app_name(model_id)) or {}
        new_app = _app(new, engine_app_name(model_id)) or {}
        engine = _changed_args(old_app.get("args"), new_app.get("args"), "engine")
        if engine:
            result.engine[model_id] = engine
        keys = changed_keys(old_models[model_id], new_models[model_id])
        policy = [k for k in keys if k.split(".")[0] in ("aliases", "guardrails", "retrieval", "requests")]
        if policy:
            result.policy[model_id] = policy
    old_gw = (_app(current or {}, GATEWAY_APP) or {}).get("args")
    new_gw = (_app(new, GATEWAY_APP) or {}).get("args")
    if current is not None and old_gw is not None:
        result.gateway = _changed_args(old_gw, new_gw, "settings")
    elif current is None or old_gw is None:
        result.gateway = ["(new deployment)"]
    return result


# --- Serve's REST API -------------------------------------------------------------------


def ray_auth_token() -> str | None:
    """Ray's cluster token, where Ray's own CLI finds it (Ray 2.60 turns token auth on for local
    clusters): ``$RAY_AUTH_TOKEN``, the file ``$RAY_AUTH_TOKEN_PATH``, or ``~/.ray/auth_token``."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


class ServeAPI:
    """The few calls of Serve's REST API (on the Ray dashboard) that ``serve deploy`` and
    ``serve status`` make."""

    def __init__(self, address: str | None = None, timeout_s: float = 30):
        import httpx

        self.address = (address or os.environ.get("RAY_DASHBOARD_ADDRESS") or DEFAULT_DASHBOARD).rstrip("/")
        token = ray_auth_token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.address, timeout=timeout_s, headers=headers)

    def details(self) -> dict[str, Any]:
        r = self._http.get("/api/serve/applications/")
        r.raise_for_status()
        return r.json()

    def deployed_config(self) -> dict[str, Any] | None:
        """The config the controller holds (what the last apply sent), or None."""
        apps = [
            a["deployed_app_config"]
            for a in (self.details().get("applications") or {}).values()
            if a.get("deployed_app_config")
        ]
        return {"applications": apps} if apps else None

    def put(self, config: dict[str, Any]) -> None:
        r = self._http.put("/api/serve/applications/", json=config)
        if r.status_code >= 400:
            raise ConfigError(f"Serve refused the config ({r.status_code}): {r.text[:2000]}")

    def wait_running(
        self, names: list[str], since: float, timeout_s: float = 900, tick=None, gone: list[str] = ()
    ) -> dict[str, str]:
        """Wait until every named application was deployed at or after ``since`` and is RUNNING,
        and those in ``gone`` are deleted; raise with Serve's message if one fails."""
        deadline = time.monotonic() + timeout_s
        while True:
            apps = self.details().get("applications") or {}
            states = {n: (apps.get(n) or {}).get("status", "MISSING") for n in names}
            states.update({n: "DELETING" for n in gone if n in apps})
            failed = {n: apps[n].get("message", "") for n, s in states.items() if s in ("DEPLOY_FAILED", "UNHEALTHY")}
            if failed:
                raise RuntimeError(f"deployment failed: {failed}")
            fresh = all((apps.get(n) or {}).get("last_deployed_time_s", 0) >= since - 1 for n in names)
            if fresh and all(s == "RUNNING" for n, s in states.items() if n not in gone) and not set(gone) & set(apps):
                return states
            if time.monotonic() > deadline:
                raise TimeoutError(f"not running after {timeout_s:.0f}s: {states}")
            if tick:
                tick(states)
            time.sleep(0.5)


def apply(
    config: LoadedConfig,
    *,
    address: str | None = None,
    engine_cls: str | None = None,
    dry_run: bool = False,
    wait: bool = True,
    timeout_s: float = 900,
    tick=None,
) -> Plan:
    """Validate (already done by loading ``config``), compare with what runs, and apply."""
    config.check_auth()
    api = ServeAPI(address)
    new = serve_config(config, engine_cls=engine_cls)
    current = api.deployed_config()
    result = plan(current, new)
    if dry_run or result.empty:
        return result
    since = time.time()
    api.put(new)
    if wait:
        removed = [engine_app_name(m) for m in result.removed]
        api.wait_running([a["name"] for a in new["applications"]], since, timeout_s, tick, gone=removed)
    return result
