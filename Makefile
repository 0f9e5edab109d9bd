# Two entry points do all set-up on a fresh machine (Python 3.11, no GPU):
#   make main   runs the project's main job
#   make test   lints and runs the test suite (what CI runs)
#   make test-fast  lint + every test not marked slow (the inner loop, under 2 minutes)
# Both create .venv/ inside the checkout on first use; torch stays on the 2.13.0 CPU build.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: main report test test-fast lint bench clean

$(STAMP): setup.py constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints-cpu.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints-cpu.txt -e '.[dev]'
	# SGLang's own code for the contract tests, without its GPU dependencies (never imported
	# whole: the tests read its functions and dataclasses from the installed sources)
	$(PY) -m pip install --quiet --no-deps sglang==0.5.23 sglang-router==0.3.2
	touch $@

main: $(STAMP)
	$(PY) -m megatron_rl.train --run-dir runs/main

report: $(STAMP)
	$(PY) tools/loss_report.py --out runs/loss_report

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest -n 2 -q

test-fast: lint
	$(PY) -m pytest -n 2 -q -m "not slow"

bench: $(STAMP)
	$(PY) tools/bench_losses.py

clean:
	rm -rf $(VENV) runs
