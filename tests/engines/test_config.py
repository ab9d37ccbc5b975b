"""Config files load into strict models; GPU placement comes out as the bundles Ray needs."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.config import ConfigError
from engines.deployments import deployment_config, llm_config, placement_group_config
from gateway.config import load_config
from gateway.model_file import ModelFile as ModelConfig
from gateway.model_file import load_model_file as load_model_config

ROOT = Path(__file__).resolve().parents[2]
GPU_EXAMPLE = ROOT / "configs/models/examples/llama-3.1-70b-instruct-gpu.yaml"


def write(tmp_path: Path, text: str, name: str = "model.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_shipped_configs_load():
    config = load_config(ROOT / "configs/gateway.yaml")
    assert [m.model_id for m in config.models] == ["SmolLM2-135M-Instruct"]
    smol = config.models[0]
    assert smol.engine.kwargs["dtype"] == "float32" and smol.placement.accelerator == "cpu"
    assert load_model_config(GPU_EXAMPLE).placement.world_size == 8


def test_unknown_key_names_file_key_and_reason(tmp_path):
    path = write(tmp_path, "model_id: m\nsource: {path: /x}\nplacement: {acelerator: gpu}\n")
    with pytest.raises(ConfigError) as err:
        load_model_config(path)
    message = str(err.value)
    assert str(path) in message and "placement.acelerator" in message and "Extra inputs are not permitted" in message


def test_bad_yaml_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_model_config(write(tmp_path, "model_id: [unclosed\n"))
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_model_config(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="cannot read"):
        load_model_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("model_id: m\nsource: {path: /x, hf_repo: a/b}\n", "exactly one of"),
        ("model_id: m\nsource: {}\n", "exactly one of"),
        ("model_id: m\nsource: {path: /x}\nplacement: {tensor_parallel_size: 2}\n", "parallel sizes must be 1"),
        (
            "model_id: m\nsource: {path: /x}\nplacement: {accelerator_type: A100-80G}\n",
            "only applies to accelerator: gpu",
        ),
        (
            "model_id: m\nsource: {path: /x}\ndeployment: {autoscaling: {min_replicas: 3, max_replicas: 2}}\n",
            "must not exceed",
        ),
        ("model_id: m\nsource: {path: /x}\ndeployment: {max_ongoing_requests: 0}\n", "deployment.max_ongoing_requests"),
        ("source: {path: /x}\n", "model_id"),
    ],
)
def test_invalid_values_are_rejected(tmp_path, text, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        load_model_config(write(tmp_path, text))


def test_gateway_config_errors(tmp_path):
    write(tmp_path, "model_id: m\nsource: {path: /x}\n", "a.yaml")
    write(tmp_path, "model_id: m\nsource: {path: /y}\n", "b.yaml")
    with pytest.raises(ConfigError, match="used by more than one model"):
        load_config(write(tmp_path, "models: [a.yaml, b.yaml]\n", "gw.yaml"))
    with pytest.raises(ConfigError, match="gw2.yaml: invalid configuration\n  port"):
        load_config(write(tmp_path, "models: [a.yaml]\nport: 99999\n", "gw2.yaml"))
    with pytest.raises(ConfigError, match="c.yaml: cannot read"):
        load_config(write(tmp_path, "models: [c.yaml]\n", "gw3.yaml"))


def test_gpu_example_placement_bundles():
    model = load_model_config(GPU_EXAMPLE)
    pg = placement_group_config(model)
    assert pg["strategy"] == "PACK"
    assert pg["bundles"] == [{"CPU": 2.0, "GPU": 1, "accelerator_type:A100-80G": 0.001}] * 8
    cfg = llm_config(model, Path("/models"))
    assert cfg.engine_kwargs["tensor_parallel_size"] == 4 and cfg.engine_kwargs["pipeline_parallel_size"] == 2
    assert cfg.accelerator_type == "A100-80G"
    assert cfg.deployment_config["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 32.0,
    }
    assert cfg.runtime_env == {"env_vars": {"HF_TOKEN": "${HF_TOKEN}"}}  # expanded by Ray on the node


def test_cpu_placement_is_one_cpu_bundle():
    model = ModelConfig(model_id="m", source={"embedded": "SmolLM2-135M-Instruct"})
    assert placement_group_config(model) == {"bundles": [{"CPU": 1.0}], "strategy": "PACK"}
    cfg = llm_config(model, Path("/models"))
    assert cfg.accelerator_config.kind == "cpu"
    assert cfg.model_loading_config.model_source == "/models/SmolLM2-135M-Instruct"
    assert deployment_config(model)["num_replicas"] == 1


def test_ray_serve_llm_accepts_our_gpu_placement(ray_session):
    """Ray Serve LLM's own deployment options from our config: the bundles Serve will reserve."""
    from ray.serve.llm import LLMServer

    tp_pp = ModelConfig(
        model_id="big",
        source={"path": str(ROOT / "tests/fixtures")},  # no weights are loaded
        placement={
            "accelerator": "gpu",
            "accelerator_type": "H100",
            "tensor_parallel_size": 2,
            "pipeline_parallel_size": 2,
            "cpus_per_worker": 1,
        },
    )
    options = LLMServer.get_deployment_options(llm_config(tp_pp, Path("/models")))
    bundles = options["placement_group_bundles"]
    assert len(bundles) == 4 and all(b["GPU"] == 1 and b["accelerator_type:H100"] == 0.001 for b in bundles)
    # The replica actor itself (0 CPUs, see REPLICA_ACTOR_CPUS) shares the first bundle.
    assert bundles[0]["CPU"] == 1 and options["placement_group_strategy"] == "PACK"
    assert options["max_ongoing_requests"] == 64
