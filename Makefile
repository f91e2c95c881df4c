# Two commands for a fresh machine: `make demo` and `make test` (see README.md).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: setup test lint format demo bench clean

setup: $(STAMP)

# Re-runs only when the pins or the package metadata change, so a second `make setup` takes seconds.
$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip install --quiet --no-deps torchrec==1.8.0
	$(BIN)/pip install --quiet --no-deps -e .
	$(BIN)/python -c "import torch, fbgemm_gpu, torchrec, ray, pyarrow; print('stack ok: torch', torch.__version__, 'torchrec', torchrec.__version__ if hasattr(torchrec, '__version__') else '1.8.0', 'ray', ray.__version__)"
	touch $(STAMP)

test: setup
	$(BIN)/ruff check bigrank tests benchmarks pipelines
	$(BIN)/ruff format --check bigrank tests benchmarks pipelines
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check bigrank tests benchmarks pipelines
	$(BIN)/ruff format --check bigrank tests benchmarks pipelines

format: setup
	$(BIN)/ruff format bigrank tests benchmarks pipelines
	$(BIN)/ruff check --fix bigrank tests benchmarks pipelines

demo: setup
	$(BIN)/python -m pipelines.demo

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
