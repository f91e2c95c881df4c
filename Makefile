# Two commands for a fresh machine: `make demo` and `make test` (see README.md).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: setup setup-cuda test lint format demo bench clean

setup: $(STAMP)

# torch's CPU build: PyPI's torch for Linux is the CUDA build (several GB with its nvidia-* libraries); the CPU
# build comes from PyTorch's CPU index, unless a local wheel directory (PIP_FIND_LINKS, as on the development
# machines) already holds it. Override with `make setup TORCH_INDEX=...` (empty: PyPI's build). When that index
# cannot be reached, the install goes on with requirements.txt's torch==2.13.0 (as before this step existed).
TORCH_CPU   := torch==2.13.0+cpu
TORCH_INDEX ?= $(if $(wildcard $(PIP_FIND_LINKS)/torch-2.13.0+cpu-*.whl),,https://download.pytorch.org/whl/cpu)

# The CUDA stack (torch 2.13.0 CUDA build, fbgemm-gpu 1.8.0, torchrec 1.8.0) in its own .venv-cuda, so that
# `make setup`/`make test` keep their CPU .venv. Checks imports and versions; a GPU is needed only to train.
VENV_CUDA  := .venv-cuda
BIN_CUDA   := $(VENV_CUDA)/bin
STAMP_CUDA := $(VENV_CUDA)/.installed

setup-cuda: $(STAMP_CUDA)

$(STAMP_CUDA): requirements-cuda.txt pyproject.toml
	test -x $(BIN_CUDA)/python || $(PY) -m venv $(VENV_CUDA)
	$(BIN_CUDA)/pip install --quiet --upgrade pip
	$(BIN_CUDA)/pip install --quiet -r requirements-cuda.txt
	$(BIN_CUDA)/pip install --quiet --no-deps torchrec==1.8.0
	$(BIN_CUDA)/pip install --quiet --no-deps -e .
	$(BIN_CUDA)/python -c "import torch, fbgemm_gpu, torchrec, ray, pyarrow; assert torch.version.cuda, 'torch is a CPU build'; print('cuda stack ok: torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus visible', torch.cuda.device_count(), 'ray', ray.__version__)"
	touch $(STAMP_CUDA)

# Re-runs only when the pins or the package metadata change, so a second `make setup` takes seconds.
$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --retries 1 --timeout 30 "$(TORCH_CPU)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) \
		|| echo "torch's CPU build not reachable ($(TORCH_INDEX)): requirements.txt's torch==2.13.0 instead"
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip install --quiet --no-deps torchrec==1.8.0
	$(BIN)/pip install --quiet --no-deps -e .
	$(BIN)/python -c "import torch, fbgemm_gpu, torchrec, ray, pyarrow; print('stack ok: torch', torch.__version__, 'torchrec', torchrec.__version__ if hasattr(torchrec, '__version__') else '1.8.0', 'ray', ray.__version__)"
	touch $(STAMP)

test: setup
	$(BIN)/ruff check bigrank tests benchmarks pipelines
	$(BIN)/ruff format --check bigrank tests benchmarks pipelines
	$(BIN)/python -m pytest -q --durations=15

lint: setup
	$(BIN)/ruff check bigrank tests benchmarks pipelines
	$(BIN)/ruff format --check bigrank tests benchmarks pipelines

format: setup
	$(BIN)/ruff format bigrank tests benchmarks pipelines
	$(BIN)/ruff check --fix bigrank tests benchmarks pipelines

demo: setup
	$(BIN)/python -m pipelines.demo

clean:
	rm -rf $(VENV) $(VENV_CUDA) .pytest_cache build *.egg-info
