# `make install` builds .venv/ at the repo root. torch is installed first from the pinned
# local CPU build (plain `torch` would pull gigabytes of CUDA), then the project with its
# extras and the dev tools.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_PIN ?= torch==2.13.0

.PHONY: install demo test bench-guard clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PIP) install "$(TORCH_PIN)"
	$(PIP) install -e ".[ml,sqlite,openai,plots,dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/intent demo

test: install
	$(PY) -m pytest

bench-guard: install
	$(PY) -m eval.bench_guard

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
