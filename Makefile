# Two entry points, each creating its own environment: `make test` and `make bench`.
PYTHON ?= python3
TEST_VENV := .venv-test
BENCH_VENV := .venv-bench

.PHONY: test bench clean

$(TEST_VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(TEST_VENV)
	$(TEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(TEST_VENV)/bin/python -m pip install -q -e '.[test]'
	touch $@

test: $(TEST_VENV)/.ready
	$(TEST_VENV)/bin/python -m pytest -q

clean:
	rm -rf $(TEST_VENV) $(BENCH_VENV) build dist
