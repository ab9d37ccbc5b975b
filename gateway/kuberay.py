"""The gateway as a KubeRay ``RayService`` manifest, generated from a gateway config.

``python -m gateway render --kuberay --config deploy/kuberay/gateway.yaml`` prints it; the
committed ``deploy/kuberay/rayservice.yaml`` is that output (``tests/deploy/test_kuberay.py``
fails when they differ). The Serve config inside (``serveConfigV2``) is exactly what
``python -m gateway render`` prints for the same config, with paths as the pods see them.

The cluster: a head that runs no replicas (``num-cpus: 0``, Ray's advice for Serve on KubeRay),
a CPU worker group started with the ``stages`` custom resource (the ingress and the stage
deployments ask for a sliver of it, so they land there) and a GPU worker group for the engines
(their placement bundles ask for GPUs). Every container gets the Ray settings the CLI sets for a
local Ray (``RAY_SERVE_THROUGHPUT_OPTIMIZED``, ``RAY_worker_niceness``), ``HF_TOKEN`` from a
Secret, the API keys file from a Secret (digests only; the ingress re-reads it when Kubernetes
updates the mount, so keys rotate without a restart) and the shared volume the Retriever
replicas keep vector stores on. Worker pods are ready when the gateway's ``/ready`` says every
deployment answers.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from gateway import deploy
from gateway.config import LoadedConfig

DEFAULT_IMAGE = "ray-llm-gateway:0.1.0-gpu"  # this repository, `pip install -e .[gpu]` and `make models`
APP_DIR = "/app"  # the repository inside the image, and every container's working directory
RAY_VERSION = "2.60.0"
REPO_ROOT = Path(__file__).resolve().parent.parent

KEYS_SECRET = "gateway-api-keys"  # kubectl create secret generic gateway-api-keys --from-file=keys.yaml
HF_SECRET = "hf-token"  # kubectl create secret generic hf-token --from-literal=token=hf_...
SHARED_CLAIM = "gateway-shared"  # a ReadWriteMany PersistentVolumeClaim (NFS, EFS, Filestore)
STAGES_RESOURCE = "stages"
SERVE_PORT = 8000

# The CLI's Ray settings (gateway/__main__.py RAY_ENV_DEFAULTS) that belong on every node.
# Not HF_HUB_OFFLINE: a cluster model may come from the hub.
RAY_ENV = (
    "RAY_SERVE_THROUGHPUT_OPTIMIZED",
    "RAY_SERVE_ENABLE_HA_PROXY",
    "RAY_worker_niceness",
    "RAY_USAGE_STATS_ENABLED",
)


def _in_image(path: str, app_dir: str) -> str:
    """A path ``serve_config`` wrote (relative to the working directory when inside the
    repository) as the pods see it: absolute, under ``app_dir``."""
    p = Path(path)
    if not p.is_absolute():
        p = (Path.cwd() / p).resolve()
    try:
        return str(PurePosixPath(app_dir) / p.relative_to(REPO_ROOT).as_posix())
    except ValueError:
        raise ValueError(f"{path} is outside the repository; the image holds only the repository") from None


def serve_config_for_pods(config: LoadedConfig, app_dir: str = APP_DIR) -> dict[str, Any]:
    """``deploy.serve_config`` with its repository paths rewritten for the image."""
    serve = deploy.serve_config(config)
    for app in serve["applications"]:
        args = app.get("args") or {}
        if args.get("base_dir"):
            args["base_dir"] = _in_image(args["base_dir"], app_dir)
        if args.get("models_dir"):
            args["models_dir"] = _in_image(args["models_dir"], app_dir)
        for dep in app.get("deployments") or []:
            for model in (dep.get("user_config") or {}).get("models", []):
                model["source"] = _in_image(model["source"], app_dir)
    return serve


def _env() -> list[dict[str, Any]]:
    from gateway.__main__ import RAY_ENV_DEFAULTS

    env: list[dict[str, Any]] = [{"name": k, "value": RAY_ENV_DEFAULTS[k]} for k in RAY_ENV]
    # Model files say `HF_TOKEN: ${HF_TOKEN}`: Ray fills it in from the node's environment.
    env.append(
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": HF_SECRET, "key": "token", "optional": True}}}
    )
    return env


def _container(name: str, image: str, app_dir: str, resources: dict[str, Any], *, ready: bool) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": name,
        "image": image,
        "workingDir": app_dir,
        "env": _env(),
        "resources": {"limits": resources, "requests": resources},
        "volumeMounts": [
            {"name": "api-keys", "mountPath": "/etc/gateway-keys", "readOnly": True},
            {"name": "shared", "mountPath": "/mnt/shared"},
        ],
    }
    if ready:
        # The gateway's readiness: every model's engine and every stage answers (README
        # "Health"); /health would only say the ingress runs.
        container["readinessProbe"] = {
            "httpGet": {"path": "/ready", "port": SERVE_PORT},
            "initialDelaySeconds": 10,
            "periodSeconds": 5,
            "timeoutSeconds": 3,  # /ready's own checks take at most 2 s
            "failureThreshold": 3,
        }
    return container


def _volumes(extra: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    return [
        {"name": "api-keys", "secret": {"secretName": KEYS_SECRET}},
        {"name": "shared", "persistentVolumeClaim": {"claimName": SHARED_CLAIM}},
        *(extra or []),
    ]


def rayservice(
    config: LoadedConfig, *, image: str = DEFAULT_IMAGE, app_dir: str = APP_DIR, name: str = "llm-gateway"
) -> dict[str, Any]:
    """The RayService manifest for ``config``."""
    serve = serve_config_for_pods(config, app_dir)
    head = _container("ray-head", image, app_dir, {"cpu": "2", "memory": "8Gi"}, ready=False)
    head["ports"] = [
        {"containerPort": 6379, "name": "gcs-server"},
        {"containerPort": 8265, "name": "dashboard"},
        {"containerPort": 10001, "name": "client"},
        {"containerPort": SERVE_PORT, "name": "serve"},
    ]
    stages = _container("ray-worker", image, app_dir, {"cpu": "8", "memory": "16Gi"}, ready=True)
    gpu = _container("ray-worker", image, app_dir, {"cpu": "16", "memory": "256Gi", "nvidia.com/gpu": "4"}, ready=True)
    # vLLM's tensor-parallel workers talk through shared memory; the container default is 64 MiB.
    gpu["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
    for c in (stages, gpu):
        c["ports"] = [{"containerPort": SERVE_PORT, "name": "serve"}]
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name},
        "spec": {
            # The head runs a proxy but no replica; route clients to the workers.
            "excludeHeadPodFromServeSvc": True,
            "serveConfigV2": yaml.safe_dump(serve, sort_keys=False),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                # Serve asks for replicas, the autoscaler for the pods to hold them.
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {"idleTimeoutSeconds": 300},
                "headGroupSpec": {
                    "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
                    "template": {"spec": {"containers": [head], "volumes": _volumes()}},
                },
                "workerGroupSpecs": [
                    {
                        "groupName": "stages",
                        "replicas": 2,
                        "minReplicas": 2,
                        "maxReplicas": 6,
                        "rayStartParams": {},
                        # What the ingress and stage deployments' `resources` ask for.
                        "resources": {STAGES_RESOURCE: "1"},
                        "template": {"spec": {"containers": [stages], "volumes": _volumes()}},
                    },
                    {
                        "groupName": "gpu-engines",
                        "replicas": 2,
                        "minReplicas": 2,  # one replica of the example model: 8 GPUs on two nodes
                        "maxReplicas": 8,
                        "rayStartParams": {},
                        "template": {
                            "spec": {
                                "containers": [gpu],
                                "volumes": _volumes([{"name": "dshm", "emptyDir": {"medium": "Memory"}}]),
                                "tolerations": [
                                    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
                                ],
                            }
                        },
                    },
                ],
            },
        },
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (``serveConfigV2``) as literal blocks, readable in the manifest; no
    YAML anchors (kubectl reads them, but people diff this file)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(config: LoadedConfig, *, image: str = DEFAULT_IMAGE, app_dir: str = APP_DIR) -> str:
    """The manifest as committed: YAML with a header saying how it was made."""
    source = _in_image(str(config.path), app_dir).removeprefix(app_dir.rstrip("/") + "/")
    header = (
        f"# Generated by `python -m gateway render --kuberay --config {source}`: do not edit by hand.\n"
        "# tests/deploy/test_kuberay.py fails when this file and the generator's output differ.\n"
        f"# Before applying: the Secret {KEYS_SECRET} (keys.yaml, from `python -m gateway keys add`), the\n"
        f"# Secret {HF_SECRET} (token) and the ReadWriteMany PersistentVolumeClaim {SHARED_CLAIM}.\n"
    )
    manifest = rayservice(config, image=image, app_dir=app_dir)
    return header + yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, width=120)
