# tinyscale: the two commands a reader needs are `make demo` and `make test`.
# Everything else here is what those two do, plus the site and the notebooks.
#
# torch is special: a bare `pip install torch` with no torch present pulls a multi-GB CUDA
# build. So setup installs TORCH_SPEC (the CPU build pinned here) only when `import torch`
# fails inside .venv. GPU users: install your CUDA build of torch into .venv first and it
# is kept (see docs/getting-started.md).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tinyscale-installed

.PHONY: setup demo test test-thorough docs notebooks bench clean help

help:
	@echo "make demo           set up .venv and train the GPT on 4 CPU ranks, compared with 1 process"
	@echo "make test           set up .venv and run the full test suite"
	@echo "make test-thorough  the suite with many more hypothesis examples (slow)"
	@echo "make docs           build the lesson site into site/ (mkdocs build --strict)"
	@echo "make notebooks      execute every notebook in notebooks/"

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,docs,notebooks,triton,monitor]"  # triton: tinyscale.kernels, run on the CPU by its interpreter
	touch $(STAMP)

demo: setup
	$(VENV)/bin/tinyscale train --preset ddp --world-size 4

test: setup
	$(PY) -m pytest

test-thorough: setup
	$(PY) -m pytest --thorough

docs: setup
	bash scripts/fetch_site_assets.sh
	$(VENV)/bin/mkdocs build --strict

notebooks: setup
	$(PY) scripts/run_notebooks.py

bench: setup
	@for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf site runs .pytest_cache .hypothesis
