# Each entry point creates its own environment and installs from
# constraints.txt, the one list of pinned versions (its NVRTC pins are the
# builds the kernel gates check). A venv is rebuilt when pyproject.toml or a
# constraints file changes.
#
#   make test               mypy on the whole package, then the whole suite (what CI runs)
#   make test-fast          the suite but for the tests marked slow (builds, ranks)
#   make test-nvrtc-latest  the kernel gates again under the newest NVRTC of
#                           each major (one venv holds one NVRTC per major)
#   make test-cpu-isa       the optimizer, drop-in and compile tests again with
#                           PyTorch's CPU kernels for AVX2 and for no vector ISA
#   make test-floor         the tests that need neither PyTorch nor JAX at the
#                           lowest NumPy pyproject.toml admits (constraints-floor.txt)
#   make bench              the benchmark against PyTorch, JAX and NumPy
#
# torch==2.13.0 is taken from a local wheel index where one offers the CPU
# build (about 0.7 GB in the venv); from PyPI it is the CUDA 13 build with
# NVIDIA's libraries (about 5.7 GB), whose own NVRTC pin is the one in
# constraints.txt. The test environment also holds both NVRTC wheels and
# nvdisasm (about 0.2 GB), which compile and disassemble the kernels without a
# GPU, and JAX and MPI for the interop and multi-process tests.
PYTHON ?= python3
TEST_VENV := .venv-test
LATEST_VENV := .venv-nvrtc-latest
BENCH_VENV := .venv-bench
PIN := -c constraints.txt
GATE_TESTS := tests/test_kernel_resources.py tests/test_kernel_sass.py tests/test_kernel_loader.py
FLOOR_VENV := .venv-floor
# The tests that compare with PyTorch's CPU kernels, which round differently
# per CPU: make test runs them with the kernels for this machine's CPU, this
# target with those for AVX2 and for none (ATEN_CPU_CAPABILITY), leaving out
# the tests marked slow (Inductor's g++ builds, ranks) to fit CI's time.
CPU_ISA_TESTS := tests/test_torch_optim.py tests/test_torch_optim_compile.py tests/test_torch_optim_precision.py \
	tests/test_precision_training.py tests/test_torch.py tests/test_torch_ops.py
CPU_ISAS := default avx2
# Core, NumPy, host-backend and emulated-kernel tests: what runs without
# PyTorch or JAX (about 1,650 tests).
FLOOR_TESTS := tests/test_tree.py tests/test_plan.py tests/test_layout.py tests/test_numpy_backend.py \
	tests/test_host_backend.py tests/test_host_compiler.py tests/test_binding.py tests/test_dtypes.py \
	tests/test_identity.py tests/test_ops_out.py tests/test_ops_rounding.py tests/test_ops_sumsq.py \
	tests/test_seen.py tests/test_caches.py tests/test_ops.py tests/test_reliability.py tests/test_memory_order.py \
	tests/test_optim.py tests/test_runtime.py tests/test_emulator.py

.PHONY: test test-fast test-nvrtc-latest test-cpu-isa test-floor bench clean

$(TEST_VENV)/.ready: pyproject.toml constraints.txt
	rm -rf $(TEST_VENV)
	$(PYTHON) -m venv $(TEST_VENV)
	$(TEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(TEST_VENV)/bin/python -m pip install -q $(PIN) -e '.[test]'
	touch $@

test: $(TEST_VENV)/.ready
	$(TEST_VENV)/bin/mypy
	$(TEST_VENV)/bin/python -m pytest -q

# The edit loop: the suite without the tests that build with g++ or NVRTC or
# launch ranks (marked slow), with the build cache warm.
test-fast: $(TEST_VENV)/.ready
	$(TEST_VENV)/bin/python -m pytest -q -m "not slow"

# The gates' environment: the package, its test tools and the newest NVRTCs,
# with every other pin of constraints.txt.
$(LATEST_VENV)/.ready: pyproject.toml constraints.txt constraints-nvrtc-latest.txt
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade pip
	grep -v '^nvidia-cuda-nvrtc' constraints.txt > $(LATEST_VENV)/constraints.txt
	$(LATEST_VENV)/bin/python -m pip install -q -c $(LATEST_VENV)/constraints.txt -c constraints-nvrtc-latest.txt \
		-e '.[gates]'
	touch $@

test-nvrtc-latest: $(LATEST_VENV)/.ready
	$(LATEST_VENV)/bin/python -m pytest -q $(GATE_TESTS)

test-cpu-isa: $(TEST_VENV)/.ready
	set -e; for isa in $(CPU_ISAS); do \
		echo "ATEN_CPU_CAPABILITY=$$isa"; \
		ATEN_CPU_CAPABILITY=$$isa $(TEST_VENV)/bin/python -m pytest -q -m "not slow" $(CPU_ISA_TESTS); \
	done

# The floor's environment: the package and its test tools with the versions
# of constraints-floor.txt, every other pin from constraints.txt.
$(FLOOR_VENV)/.ready: pyproject.toml constraints.txt constraints-floor.txt
	rm -rf $(FLOOR_VENV)
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q --upgrade pip
	sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/^\1==/p' constraints-floor.txt > $(FLOOR_VENV)/floor-names.txt
	grep -v -i -f $(FLOOR_VENV)/floor-names.txt constraints.txt > $(FLOOR_VENV)/constraints.txt
	$(FLOOR_VENV)/bin/python -m pip install -q -c $(FLOOR_VENV)/constraints.txt -c constraints-floor.txt \
		-e '.[gates]'
	touch $@

test-floor: $(FLOOR_VENV)/.ready
	$(FLOOR_VENV)/bin/python -c "import numpy; print('NumPy', numpy.__version__)"
	GPUFLAT_LANE_WITHOUT=torch,jax $(FLOOR_VENV)/bin/python -m pytest -q -rs $(FLOOR_TESTS)

$(BENCH_VENV)/.ready: pyproject.toml constraints.txt
	rm -rf $(BENCH_VENV)
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install -q $(PIN) -e '.[bench,peers]'
	touch $@

bench: $(BENCH_VENV)/.ready
	$(BENCH_VENV)/bin/python -m bench

clean:
	rm -rf $(TEST_VENV) $(LATEST_VENV) $(FLOOR_VENV) $(BENCH_VENV) build dist
