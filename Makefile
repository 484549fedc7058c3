# Two entry points, each creating its own environment: `make test` and `make bench`.
# torch is pinned first in both, to the CPU build; an unpinned torch would pull
# a CUDA build of several GB.
PYTHON ?= python3
TEST_VENV := .venv-test
BENCH_VENV := .venv-bench

.PHONY: test bench clean

$(TEST_VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(TEST_VENV)
	$(TEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(TEST_VENV)/bin/python -m pip install -q torch==2.13.0
	$(TEST_VENV)/bin/python -m pip install -q -e '.[test]'
	touch $@

test: $(TEST_VENV)/.ready
	$(TEST_VENV)/bin/python -m pytest -q

$(BENCH_VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install -q torch==2.13.0
	$(BENCH_VENV)/bin/python -m pip install -q -e '.[bench,peers]'
	touch $@

bench: $(BENCH_VENV)/.ready
	$(BENCH_VENV)/bin/python -m bench

clean:
	rm -rf $(TEST_VENV) $(BENCH_VENV) build dist
