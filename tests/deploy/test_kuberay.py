"""The KubeRay RayService manifest: valid against the RayService CRD's schema, current with its
generator, and carrying a Serve config Serve accepts. No cluster needed."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from gateway import kuberay
from gateway.config import load_config

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "deploy" / "kuberay" / "rayservice.yaml"
CONFIG = REPO / "deploy" / "kuberay" / "gateway.yaml"
# Vendored (Apache-2.0, see tests/fixtures/kuberay/README.md): CI clones only this repository.
CRD = REPO / "tests" / "fixtures" / "kuberay" / "ray.io_rayservices.yaml"
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@pytest.fixture(scope="module")
def validator() -> jsonschema.Validator:
    crd = yaml.load(CRD.read_text(), Loader=Loader)
    version = next(v for v in crd["spec"]["versions"] if v["storage"])
    assert version["name"] == "v1"
    # OpenAPI v3 schemas are JSON Schema but for `nullable` and the x-kubernetes-* keys,
    # which validators ignore as unknown keywords.
    schema = version["schema"]["openAPIV3Schema"]
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.fixture(scope="module")
def manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def _errors(validator, doc) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_manifest_is_what_the_generator_makes_now():
    generated = kuberay.render(load_config(CONFIG))
    assert MANIFEST.read_text() == generated, (
        "deploy/kuberay/rayservice.yaml is stale: run "
        "`python -m gateway render --kuberay --config deploy/kuberay/gateway.yaml > deploy/kuberay/rayservice.yaml`"
    )


def test_manifest_matches_the_rayservice_crd(validator, manifest):
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    assert _errors(validator, manifest) == []


@pytest.mark.parametrize(
    "break_it",
    [
        lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].pop("groupName"),
        lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][1].__setitem__("replicas", "two"),
        lambda m: m["spec"].__setitem__("serveConfigV2", {"applications": []}),
        lambda m: m["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0].pop("name"),
    ],
)
def test_the_schema_check_catches_broken_manifests(validator, manifest, break_it):
    broken = copy.deepcopy(manifest)
    break_it(broken)
    assert _errors(validator, broken)


def test_serve_config_is_what_render_prints_and_serve_accepts(manifest):
    serve = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve)
    assert serve == kuberay.serve_config_for_pods(load_config(CONFIG))
    names = [a["name"] for a in serve["applications"]]
    assert names[-1] == "gateway" and all(n.startswith("model-") for n in names[:-1])
    gateway = serve["applications"][-1]["args"]
    # Paths as the pods see them: the repository at /app, state on the shared volume.
    assert gateway["base_dir"] == "/app/deploy/kuberay"
    assert gateway["settings"]["retrieval"]["storage_dir"].startswith("/mnt/shared/")
    assert gateway["settings"]["auth"]["keys_file"].startswith("/etc/gateway-keys/")


def _groups(manifest):
    cluster = manifest["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}


def test_groups_env_secrets_and_readiness(manifest):
    groups = _groups(manifest)
    assert set(groups) == {"head", "stages", "gpu-engines"}
    assert groups["head"]["rayStartParams"]["num-cpus"] == "0"  # no replica on the head
    assert groups["stages"]["resources"] == {"stages": "1"}
    gpu = groups["gpu-engines"]["template"]["spec"]["containers"][0]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert "nvidia.com/gpu" not in str(groups["stages"]["template"])
    for name, group in groups.items():
        spec = group["template"]["spec"]
        secrets = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        assert kuberay.KEYS_SECRET in secrets, name
        for container in spec["containers"]:
            env = {e["name"]: e for e in container["env"]}
            assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"]["value"] == "1", name
            assert env["RAY_worker_niceness"]["value"] == "0", name
            assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == kuberay.HF_SECRET
            assert "GATEWAY_API_KEYS" not in env  # keys come from the mounted Secret, as digests
            probe = container.get("readinessProbe")
            if name == "head":
                assert probe is None  # KubeRay's own head probe: the head must be up before Serve is
            else:
                assert probe["httpGet"] == {"path": "/ready", "port": 8000}, name


def test_stages_ask_for_the_stage_nodes(manifest):
    settings = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][-1]["args"]["settings"]
    for stage in ("ingress", "embedding", "retrieval", "guardrails"):
        assert settings[stage]["resources"] == {"stages": 0.01}, stage


def test_the_readiness_route_exists():
    from gateway.http import PUBLIC_PATHS

    # Without a key: the kubelet's probe carries none.
    assert "/ready" in PUBLIC_PATHS
