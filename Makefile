# The two quickstart commands (README): `make demo` and `make test`. Both install first, into .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch 2.13.0; on a CUDA machine use `make install TORCH_SPEC=torch` (or a CUDA pin).
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 2

.PHONY: install demo test test-fast docs docs-serve
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first (same command): an unpinned `torch` requirement would pull the CUDA build.
	$(PY) -m pip install "$(TORCH_SPEC)" -e ".[dev]"
	touch $@

# A 2-process DDP run on CPU (gloo), logged to metrics.jsonl, summary.json and an offline W&B run.
demo: install
	OMP_NUM_THREADS=1 $(PY) -m dist_train.torchrun --standalone --nproc_per_node=$(NPROC) launch/train.py strategy=ddp

test: install
	$(VENV)/bin/ruff check dist_train launch tests bench
	$(PY) -m pytest -q

# The unit tests only (no multi-process runs): for iterating.
test-fast: install
	$(VENV)/bin/ruff check dist_train launch tests bench
	$(PY) -m pytest -q -m "not multiproc"

# The documentation site (mkdocs.yml, docs/): built as tests/test_docs.py builds it, or served while editing.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve
