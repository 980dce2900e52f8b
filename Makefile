# `make demo` and `make test` each set up .venv on first use, then run.
# TORCH picks the PyTorch build installed first (a CPU wheel by default, so pip never pulls a
# multi-GB CUDA build); `make TORCH=` keeps whatever torch the environment already has.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mpt-installed
DEMO_DIR ?= runs/demo

.PHONY: setup demo test test-kernels lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if [ -n "$(TORCH)" ]; then $(PY) -m pip install -q "$(TORCH)"; fi
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

# Train the gpt-small-cpu preset over a 2-stage 1F1B pipeline on this interpreter's own
# standard-library sources (present on every machine), with LAMB, global-norm clipping and
# --precision auto (bf16 where the device multiplies bf16 fast, else fp32); about two minutes
# on 2 CPU cores. `make demo DEMO_PRECISION=bf16` forces bf16.
DEMO_PRECISION ?= auto
demo: $(STAMP)
	$(VENV)/bin/mpt train --model gpt-small-cpu --pp 2 --schedule 1f1b --microbatches 4 \
		--micro-batch 8 --seq-len 128 --steps 110 --optimizer lamb --lr 1e-2 --warmup-steps 8 \
		--lr-decay cosine --min-lr 1e-3 --clip-grad 1.0 --precision $(DEMO_PRECISION) \
		--data stdlib --threads 1 --metrics $(DEMO_DIR)/metrics.jsonl --plot $(DEMO_DIR)/loss.png

# Two pytest workers (pytest-xdist), each taking whole test files so that a file's shared set-up
# (its module fixtures) runs once; many multi-process tests mostly wait, so two workers overlap them.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope

# ruff over the whole tree, configured in pyproject.toml (pyflakes, pycodestyle, import order, bugbear).
lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The oracle files again on ATen's portable kernels (no SIMD): their tolerances come from a floor
# measured in each test (DESIGN.md invariant 10), so they must hold on any CPU's kernels, not only
# on the ones this machine picks (AVX2 here, AVX-512/AMX on another). CI runs it after `make test`,
# its tests spread over the workers one by one (the grid oracle is one file of long cells).
KERNEL_TESTS ?= tests/test_oracle.py tests/test_oracle_tp_dp.py tests/test_numerics_pipeline.py
test-kernels: $(STAMP)
	ATEN_CPU_CAPABILITY=default $(PY) -m pytest -q -n $(TEST_WORKERS) --dist load $(KERNEL_TESTS)

clean:
	rm -rf $(VENV) runs .pytest_cache
