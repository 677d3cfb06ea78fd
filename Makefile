# The two quickstart commands (README): `make demo` and `make test`. Both install first, into .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch 2.13.0: here the local CPU wheel; elsewhere PyPI's, the CUDA build (2.7 GB with its nvidia-* wheels).
# `make install TORCH_INDEX=https://download.pytorch.org/whl/cpu` takes the CPU build from PyTorch's index instead
# (a .../whl/cu<version> index: that CUDA build): pip prefers 2.13.0+cpu to PyPI's plain 2.13.0, a higher version.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
# The versions CI tested (every package, pinned). `make install CONSTRAINTS=` installs without them.
CONSTRAINTS ?= constraints.txt
TORCH_INDEX_ARG := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
PIP_ARGS := $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) $(TORCH_INDEX_ARG)
NPROC ?= 2

.PHONY: install demo test test-fast docs docs-serve constraints
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first (same command): an unpinned `torch` requirement would pull the newest (CUDA) build.
	$(PY) -m pip install $(PIP_ARGS) "$(TORCH_SPEC)" -e ".[dev]"
	touch $@

# Re-resolve constraints.txt: a fresh venv gets the newest releases within pyproject.toml's ranges (torch as
# TORCH_SPEC), and every package it installed but pip is pinned, torch without its +cpu/+cuXXX label. Run it when
# pyproject.toml's dependencies change or to move to newer releases; then `make test`, and commit both files.
LOCK_VENV ?= /tmp/dist_train-constraints-venv
constraints:
	rm -rf $(LOCK_VENV)
	python3 -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install -q $(TORCH_INDEX_ARG) "$(TORCH_SPEC)" -e ".[dev]"
	{ grep '^#' constraints.txt; $(LOCK_VENV)/bin/python -m pip freeze --all --exclude pip --exclude-editable \
	    | sed -E 's/^torch==([^+]+)\+.*/torch==\1/'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt
	rm -rf $(LOCK_VENV)

# A 2-process DDP run on CPU (gloo), logged to metrics.jsonl, summary.json and an offline W&B run.
demo: install
	OMP_NUM_THREADS=1 $(PY) -m dist_train.torchrun --standalone --nproc_per_node=$(NPROC) launch/train.py strategy=ddp

# The unit tests and the Slurm jobs run beside the launched training runs (tests/suite.sh says why).
test: install
	$(VENV)/bin/ruff check dist_train launch tests bench
	PY=$(PY) tests/suite.sh

# The unit tests only (tests/unit: no training process started): for iterating.
test-fast: install
	$(VENV)/bin/ruff check dist_train launch tests bench
	$(PY) -m pytest -q tests/unit

# The documentation site (mkdocs.yml, docs/): built as tests/unit/test_docs.py builds it, or served while editing.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve
