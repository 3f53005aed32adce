# `make install` builds .venv/ at the repo root. torch is installed first from the pinned
# local CPU build (plain `torch` would pull gigabytes of CUDA), then the project with its
# extras and the dev tools.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_PIN ?= torch==2.13.0

DEMO_METHODS ?= raw,prompt,tracker,dfsdt,bats,mco,intent
DEMO_TASKS ?= 300
DEMO_OUT ?= runs/demo

.PHONY: install demo demo-guard test bench-guard bench-throughput clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PIP) install "$(TORCH_PIN)"
	$(PIP) install -e ".[ml,sqlite,openai,plots,dev]"
	touch $@

install: $(VENV)/.installed

# The main job on the built-in default: every method that exists so far on the synthetic
# market with the simulated agent. It starts from a clean $(DEMO_OUT).
demo: install
	rm -rf $(DEMO_OUT)
	$(VENV)/bin/intent bench --market synthetic --methods $(DEMO_METHODS) --tasks $(DEMO_TASKS) \
		--workers 2 --seed 0 --out $(DEMO_OUT)

# A walk-through of the guard alone: a scripted agent, each decision and the ledger.
demo-guard: install
	$(VENV)/bin/intent demo

test: install
	$(PY) -m pytest

bench-guard: install
	$(PY) -m eval.bench_guard

bench-throughput: install
	$(PY) -m eval.bench_throughput

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
