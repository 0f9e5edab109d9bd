# Two entry points do all set-up on a fresh machine (Python 3.11, no GPU):
#   make main   runs the project's main job
#   make test   lints and runs the test suite (what CI runs), the real SGLang server's tests too
#   make sglang-env  the real SGLang server + router in .venv-sglang/ (make test does it)
#   make test-fast  lint + every test not marked slow (the inner loop, under 2 minutes)
#   make test-kernel-paths  the hardware-sensitive tests on torch's and MKL's AVX2 kernels
#   make rehearsal  every node of the 30B launcher, its colocated variant and GLM-4.5's, run for
#                   real on this machine (tools/rehearse_launchers.py; part of make test)
#   make wheel-check  the wheel lane (.ci/wheel): sdist + wheel, installed into a fresh venv
#                     outside the checkout, `megatron-rl` train / plan / convert run from there
# Both create .venv/ inside the checkout on first use; torch stays on the 2.13.0 CPU build.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: main report test test-fast test-kernel-paths lint bench clean sglang-env wheel-check rehearsal

$(STAMP): setup.py constraints-cpu.txt megatron_rl/kernels/grouped_gemm_cpu.cpp
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints-cpu.txt torch==2.13.0
	# transformers held at the release the suite passes with (the in-process engine's model code;
	# .venv-sglang holds sglang's own pin): a new release must not change CI unannounced
	$(PY) -m pip install --quiet -c constraints-cpu.txt -e '.[dev]' transformers==5.25.0
	# SGLang's own code for the contract tests, without its GPU dependencies (never imported
	# whole: the tests read its functions and dataclasses from the installed sources)
	$(PY) -m pip install --quiet --no-deps sglang==0.5.23 sglang-router==0.3.2
	# the CPU grouped GEMM kernel (megatron_rl/kernels), built once here instead of on first use
	$(PY) -m megatron_rl.kernels.grouped_gemm
	touch $@

# The real SGLang server + sglang-router on CPU, in their own lean venv (tests/real_sglang)
SGLANG_STAMP := .venv-sglang/.installed

$(SGLANG_STAMP): tests/real_sglang/install.sh tests/real_sglang/requirements.txt constraints-cpu.txt
	bash tests/real_sglang/install.sh

sglang-env: $(SGLANG_STAMP)

# runs/main again: the previous run's metrics are kept as runs/main/metrics.jsonl.<UTC time>.bak
main: $(STAMP)
	$(PY) -m megatron_rl.train --run-dir runs/main --overwrite-run-dir --eval-interval 10

report: $(STAMP)
	$(PY) tools/loss_report.py --out runs/loss_report

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# the real SGLang server and router tests are part of the suite: a missing venv is an error;
# the 30 slowest tests are listed at the end (the suite's time budget is watched there)
# runs/suite.xml keeps each test's time: tools/suite_time.py prints the suite's time by module
test: lint $(SGLANG_STAMP)
	mkdir -p runs
	MEGATRON_RL_REAL_SGLANG=require $(PY) -m pytest -n 2 --dist loadgroup -q --durations=30 \
		--junitxml=runs/suite.xml
	$(PY) tools/suite_time.py runs/suite.xml --top 20

# the tests whose verdict the CPU's float rounding could move (marked hardware_sensitive, listed in
# docs/testing.md), on torch's and MKL's AVX2 kernels instead of the machine's widest ones
test-kernel-paths: $(STAMP) $(SGLANG_STAMP)
	ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 MEGATRON_RL_REAL_SGLANG=require \
		$(PY) -m pytest -n 2 --dist loadgroup -q --durations=10 -m hardware_sensitive

test-fast: lint
	$(PY) -m pytest -n 2 --dist loadgroup -q -m "not slow"

rehearsal: $(STAMP) $(SGLANG_STAMP)
	for launcher in 30b 30b-colocated glm-4.5; do \
		$(PY) tools/rehearse_launchers.py --launcher $$launcher || exit 1; done

bench: $(STAMP)
	$(PY) -m megatron_rl.cli bench losses

# the package as a user installs it: built here (python -m build, from .venv's [dev] extra),
# installed into a fresh venv in a temp folder, run from outside the checkout (several minutes)
wheel-check: $(STAMP)
	PYTHON=$(PYTHON) BUILD_PYTHON=$(PY) bash .ci/wheel

clean:
	rm -rf $(VENV) runs
