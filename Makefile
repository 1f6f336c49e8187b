# `make test` and `make demo` set everything up on a fresh machine (a .venv with the project and its
# dev extras), then run. CI calls `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev

.PHONY: test demo venv hf golden clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) -m talaria_jax.launch.generate

# torch (CPU wheel on this machine's disk) + transformers: live HF parity tests and golden regeneration.
hf: $(STAMP)
	$(PY) -m pip install -q -e '.[dev,hf]'

golden: hf
	$(PY) tests/assets/make_golden.py

clean:
	rm -rf $(VENV) .pytest_cache
