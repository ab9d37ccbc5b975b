"""The two instant servers of ``benchmarks/overhead.py --backend instant``, so a proxy's own time
is not drowned by an engine's:

    python benchmarks/instant_backend.py backend --port 9000
        an OpenAI-compatible chat completions server that answers at once with a fixed short
        answer, streamed or not, or with max_tokens chunks when streaming (what LiteLLM's proxy
        is put in front of);
    python benchmarks/instant_backend.py gateway --config gateway.yaml --dashboard-port 8266
        the gateway exactly as ``python -m gateway run`` serves it, with the tests' scripted
        (instant) engine injected through ``engine_cls`` instead of vLLM.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ANSWER = "Hi"
SCRIPTED_ENGINE = "engines.scripted_engine:ScriptedEngine"


def backend_app():
    """The instant backend: one fixed token for every chat, as OpenAI's wire format."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> Response:
        return Response(orjson.dumps({"object": "list", "data": []}), media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        base = {"id": "chatcmpl-instant", "created": int(time.time()), "model": body.get("model", "instant")}
        n = (body.get("max_tokens") or 1) if body.get("stream") else 1
        usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
        if not body.get("stream"):
            message = {"role": "assistant", "content": ANSWER}
            choice = {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
            return Response(
                orjson.dumps({**base, "object": "chat.completion", "choices": [choice], "usage": usage}),
                media_type="application/json",
            )
        chunk = {**base, "object": "chat.completion.chunk"}
        # Streams: max_tokens content chunks ("t0 ", "t1 ", ... as the scripted engine's
        # [[tokens:N]]), for the per-chunk phase; one ("Hi") without it.
        pieces = [ANSWER] if n == 1 else [f"t{i} " for i in range(n)]
        deltas = [{"role": "assistant", "content": ""}, *({"content": p} for p in pieces)]
        events = [{**chunk, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
        events.append({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({**chunk, "choices": [], "usage": usage})
        payload = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"

        async def stream():
            yield payload

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def run_backend(args: argparse.Namespace) -> int:
    import uvicorn

    uvicorn.run(backend_app(), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    return 0


def run_gateway(args: argparse.Namespace) -> int:
    """``python -m gateway run`` with the scripted engine: Ray, Serve, ``deploy.apply``, wait."""
    from gateway.__main__ import RAY_ENV_DEFAULTS

    for key, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    import ray
    from ray import serve

    from gateway import deploy
    from gateway.config import load_config

    config = load_config(args.config)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    context = ray.init(
        num_cpus=(os.cpu_count() or 1) + 2,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=args.dashboard_port,
        logging_level=logging.WARNING,
    )
    try:
        serve.start(http_options={"host": config.gateway.host, "port": config.gateway.port})
        deploy.apply(config, address="http://" + context.dashboard_url, engine_cls=SCRIPTED_ENGINE)
        print("gateway (scripted engine) ready", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    backend = sub.add_parser("backend", help="the instant OpenAI-compatible backend")
    backend.add_argument("--port", type=int, required=True)
    gateway = sub.add_parser("gateway", help="the gateway on the scripted engine")
    gateway.add_argument("--config", required=True)
    gateway.add_argument("--dashboard-port", type=int, required=True)
    args = parser.parse_args()
    return run_backend(args) if args.command == "backend" else run_gateway(args)


if __name__ == "__main__":
    sys.exit(main())
