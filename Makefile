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

.PHONY: setup demo test test-thorough docs notebooks bench bench-medians figures clean help

help:
	@echo "make demo           set up .venv and train the GPT on 4 CPU ranks, compared with 1 process"
	@echo "make test           set up .venv and run the full test suite"
	@echo "make test-thorough  the suite with many more hypothesis examples (slow)"
	@echo "make docs           build the lesson site into site/ (mkdocs build --strict)"
	@echo "make notebooks      execute every notebook in notebooks/"
	@echo "make bench          run every benchmark; their ratios merged into runs/bench.json"
	@echo "make bench-medians  issue 30's benchmarks 3 times, round robin: values and medians in runs/bench.json"
	@echo "make figures        refresh the lessons' figures that benchmarks draw"

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,docs,notebooks,triton,hf,monitor]"  # triton: tinyscale.kernels, run on the CPU by its interpreter; hf: AutoTP's models
	# peers: DeepSpeed, for -k deepspeed_agreement. PyPI has only its source; it builds against the
	# torch in .venv (no build isolation, which would fetch a second, CUDA, torch to build with).
	$(PY) -m pip install --quiet setuptools wheel
	$(PY) -m pip install --quiet --no-build-isolation -e ".[peers]"
	# DeepSpeed compiles its CPU shared-memory op on first use (about 50 s on 2 cores): here, not in the tests
	DS_ACCELERATOR=cpu $(PY) -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load()" >/dev/null
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

# Every benchmark, each writing its ratios to runs/bench/NAME.json, merged into runs/bench.json.
# Outputs go to runs/ only; `make figures` refreshes the lessons' figures, on purpose.
bench: setup
	@mkdir -p runs/bench
	@for b in benchmarks/*.py; do n=$$(basename $$b .py); echo "== $$b"; \
	  $(PY) $$b --json runs/bench/$$n.json || exit 1; done
	$(PY) -m tinyscale.bench merge runs/bench.json runs/bench/*.json

# Issue 30's rows, 3 runs round robin (tinyscale.bench.REPEAT: benchmarks and sizes): each ratio's
# three values and median, the date, CPU model, cores, load before/after and torch in runs/bench.json.
bench-medians: setup
	$(PY) -m tinyscale.bench repeat --runs 3 --out runs/bench.json

figures: setup
	$(PY) benchmarks/lr_schedules.py --out lessons/figures/02-lr-schedules.svg
	$(PY) benchmarks/watch_run.py --out lessons/figures/12-watching-a-run.svg
	$(PY) benchmarks/batch_change.py --out lessons/figures/12-batch-change.png

clean:
	rm -rf site runs .pytest_cache .hypothesis
