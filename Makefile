# The README's two commands. Both set up a virtual environment from scratch when it
# is missing. torch is installed first and pinned: on these machines
# `pip install torch==2.13.0` takes the local CPU wheel, while an unpinned torch
# requirement would pull several GB of CUDA packages.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup run test lint bench clean

$(BIN)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

setup: $(BIN)/.installed

# Main job on the built-in tiny random-weight model.
run: setup
	$(BIN)/seer_engine generate --model tiny --n 2 --max-tokens 32 \
		--prompt "The rollout phase of reinforcement learning" --prompt "Once upon a time"

lint: setup
	$(BIN)/ruff check seer_engine tests benchmarks

test: lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: setup
	$(BIN)/python benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
