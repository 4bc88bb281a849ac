# `make test` on a fresh machine: creates .venv, installs the CPU build of torch and
# the package in editable mode with its test extras, then runs the fast test suite.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Development pin: the CPU wheel of this version is cached locally. Users install
# attnlab with any torch satisfying the lower bound in pyproject.toml.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# make test spreads the tests over 2 worker processes (pytest-xdist); TEST_WORKERS=0 runs them in one.
TEST_WORKERS ?= 2

# The oldest torch the project supports, which the GPU machines run: `make test-compat` installs it
# (a CUDA build from PyPI, about 6 GB; it runs on the CPU) in its own venv and runs under it the tests
# of what older torch traces differently: one compiled graph per model, no host sync in a step, and a
# compiled training step of every config in configs/ and every variant of the GPU-scale specs
# (tests/test_compiled_training.py, which runs its compiles only where ATTNLAB_COMPAT_TRAIN=1).
COMPAT_TORCH ?= torch==2.11.0
COMPAT_VENV  ?= .venv-compat
COMPAT_TESTS ?= tests/test_compile_counts.py tests/test_compile.py tests/test_no_host_sync.py tests/test_ext.py::test_kernels_build_here tests/test_window_cpu.py tests/test_static_window_kernel.py::test_a_compiled_step_through_the_kernel_equals_eager tests/test_static_decode.py::test_compiled_steps_of_every_static_state_equal_generate \
	tests/test_compiled_training.py

# The tests that compare two implementations by the keys they choose (decoders, caches, selectors, the
# window ops), run again under the instruction sets other than the machine's own: a float32 sum's order,
# and so an ulp of a key, depends on the vector width (ATEN_CPU_CAPABILITY is how PyTorch pins one).
ISA_TESTS ?= tests/test_selection_ties.py tests/test_static_decode.py tests/test_static_prefill.py \
	tests/test_window_nearest.py tests/test_cache_sorted.py tests/test_cache_eviction.py tests/test_selected_decode.py \
	tests/test_selectors.py tests/test_window.py tests/test_decode_step.py tests/test_search_decode_paths.py \
	tests/test_search_native.py
ISAS ?= default avx2

# kvpress (NVIDIA's KV-cache presses on Hugging Face models), the library the pretrained-model decoding
# comparison measures attnlab's selectors against, wants transformers < 5.3 while the project tests with
# 5.24: `make kvpress-env` gives it an environment of its own, attnlab installed into it in editable mode.
KVPRESS_VENV ?= .venv-kvpress
KVPRESS_SPEC ?= kvpress==0.5.5
KVPRESS_TRANSFORMERS ?= transformers>=4.56,<5.3

.PHONY: venv test test-heavy test-isa test-compat test-slow quickstart bench docs clean kvpress-env

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	touch $@

venv: $(BIN)/.installed

test: venv
	$(BIN)/python -m pytest -q -m "not slow and not heavy" -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The tests of seconds each that `make test` leaves out (end-to-end commands, subprocesses, DDP,
# compiles, interpreted kernels at larger shapes); CI runs them after `make test`.
test-heavy: venv
	$(BIN)/python -m pytest -q -m "heavy and not slow" -n $(TEST_WORKERS) $(PYTEST_ARGS)

test-isa: venv
	@for isa in $(ISAS); do echo "ATEN_CPU_CAPABILITY=$$isa"; \
	  ATEN_CPU_CAPABILITY=$$isa $(BIN)/python -m pytest -q -m "not slow and not heavy" -n $(TEST_WORKERS) \
	    -p no:cacheprovider $(PYTEST_ARGS) $(ISA_TESTS) || exit 1; done

$(COMPAT_VENV)/bin/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install -q --upgrade pip
	$(COMPAT_VENV)/bin/pip install -q "$(COMPAT_TORCH)"
	$(COMPAT_VENV)/bin/pip install -q -c constraints.txt -e ".[dev]"
	touch $@

test-compat: $(COMPAT_VENV)/bin/.installed
	$(COMPAT_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	ATTNLAB_COMPAT_TRAIN=1 $(COMPAT_VENV)/bin/python -m pytest -q -m "not slow" -n $(TEST_WORKERS) -p no:cacheprovider $(COMPAT_TESTS)

$(KVPRESS_VENV)/bin/.installed: pyproject.toml
	$(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_VENV)/bin/pip install -q --upgrade pip
	$(KVPRESS_VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(KVPRESS_VENV)/bin/pip install -q "$(KVPRESS_SPEC)" "$(KVPRESS_TRANSFORMERS)"
	$(KVPRESS_VENV)/bin/pip install -q -e ".[hf]" "$(KVPRESS_TRANSFORMERS)"
	$(KVPRESS_VENV)/bin/python -c "import kvpress, transformers, attnlab; print('kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else '$(KVPRESS_SPEC)', 'transformers', transformers.__version__)"
	touch $@

kvpress-env: $(KVPRESS_VENV)/bin/.installed

test-slow: venv
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

quickstart: venv
	$(BIN)/attnlab quickstart

# The documentation site (mkdocs.yml, docs/) into site/; --strict fails on any broken link or anchor.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: venv
	$(BIN)/python benchmarks/ops.py
	$(BIN)/python benchmarks/decode.py
	$(BIN)/python benchmarks/train_speed.py

clean:
	rm -rf $(VENV) $(COMPAT_VENV) $(KVPRESS_VENV) build site *.egg-info src/*.egg-info .pytest_cache
