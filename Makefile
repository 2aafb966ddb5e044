# The README's commands:
#   make        - build into $(BUILD); installs nothing: it only checks and names what is missing
#   make bench  - build, then the pinned-memory report for this machine
#   make test   - build and run every test that can run here (host backend; the same tests
#                 under ASan+UBSan, TSan and valgrind; the GPU tests when a GPU is present)
# make bench and make test first install what they need and lack (tools/deps.sh: the one list),
# saying so package by package: Debian packages through apt-get as root or with passwordless
# sudo, Python packages into the project's own venv $(VENV). PINMEM_NO_INSTALL=1 refuses: they
# then only check and name what is missing, as do all targets without the rights to install.
# The last line of make test names the suites that ran and those that did not (tests/suites.py).
BUILD      ?= build
JOBS       ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_ARGS ?=
CTEST      := ctest --output-on-failure --no-tests=error
# The Python suites run in the project's venv (made and filled by tools/deps.sh); another
# PYTHON (one that has the packages) is checked, never installed into.
VENV       ?= .venv
PYTHON     ?= $(abspath $(VENV))/bin/python
# The interpreter a user has: the base of $(VENV) and of the fresh venv of test-python-install.
SYSTEM_PYTHON ?= python3
DEPS       := PINMEM_SYSTEM_PYTHON=$(SYSTEM_PYTHON) ./tools/deps.sh --venv $(VENV) --python $(PYTHON)
# Each suite records what it ran (tests/suites.py): the last line of `make test` names the suites
# that ran, those that did not and why, and the checks and tests skipped inside them.
SUITES     := $(BUILD)-suites
RECORD     := python3 tests/suites.py

.PHONY: all build deps deps-c deps-check deps-test deps-wheel test test-reset test-no-toolkit test-install-messages test-host test-bench test-asan test-tsan test-valgrind test-fuzz test-gpu test-python test-python-install test-safetensors-suite wheel test-wheel ptx bench install clean

all: build

# What each target needs (tools/deps.sh): c for the C build, test for the suites, python for
# the Python suites, wheel for `make wheel` alone (its build packages, not the suites' torch).
# `make test` checks all three first, in its first seconds; the later checks of a part find it
# present (a few milliseconds).
deps-c:
	@$(DEPS) c
deps-check:
	@PINMEM_NO_INSTALL=1 $(DEPS) c
deps-test:
	@$(DEPS) c test
deps:
	@$(DEPS) c test python
deps-wheel:
	@$(DEPS) c wheel

# The C build, for build (which only checks) and for the targets that install first.
define build_c
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS)
endef

build: deps-check
	$(build_c)

test: test-reset deps check-docs test-no-toolkit test-install-messages test-host test-bench test-asan test-tsan test-valgrind test-fuzz test-gpu test-python test-python-install test-wheel
	@$(RECORD) report $(SUITES)

test-reset:
	@$(RECORD) reset $(SUITES)

# The host-label tests, then the C examples of README.md and docs/*.md, each compiled with
# -std=c11 -Wall -Wextra -Werror against include/ and this build's libpinmem.a and run on the host
# backend (tests/check_doc_examples.py: how a fragment gets its includes and main, or is not run).
test-host: deps-test
	$(build_c)
	cd $(BUILD) && $(CTEST) -L host -j $(JOBS)
	@$(RECORD) ctest $(SUITES) host $(BUILD)
	python3 tests/check_doc_examples.py --c $(BUILD) --jobs $(JOBS)
	@$(RECORD) ran $(SUITES) doc-c-examples "the C examples of README.md and docs/*.md"

# The README's `make bench` runs to its end here (tests/test_make_bench.sh): on the host backend,
# saying so, where there is no usable GPU.
test-bench: deps-c
	MAKE="$(MAKE)" ./tests/test_make_bench.sh $(BUILD)
	@$(RECORD) ran $(SUITES) bench "make bench ran to its end on this machine"

test-asan: deps-test
	cmake -S . -B $(BUILD)-asan -DCMAKE_BUILD_TYPE=Debug -DPINMEM_SANITIZE=address $(CMAKE_ARGS)
	cmake --build $(BUILD)-asan -j $(JOBS)
	cd $(BUILD)-asan && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 $(CTEST) -L host -j $(JOBS)
	@$(RECORD) ctest $(SUITES) asan $(BUILD)-asan

test-tsan: deps-test
	cmake -S . -B $(BUILD)-tsan -DCMAKE_BUILD_TYPE=Debug -DPINMEM_SANITIZE=thread $(CMAKE_ARGS)
	cmake --build $(BUILD)-tsan -j $(JOBS)
	cd $(BUILD)-tsan && TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 $(CTEST) -L host -j $(JOBS)
	@$(RECORD) ctest $(SUITES) tsan $(BUILD)-tsan

# valgrind over the host-label tests. The cuda backend is compiled in as in every build; those
# tests run on PINMEM_BACKEND=host (or stand-in drivers), so no real driver is loaded under it.
test-valgrind: deps-test
	cmake -S . -B $(BUILD)-host -DCMAKE_BUILD_TYPE=Debug $(CMAKE_ARGS)
	cmake --build $(BUILD)-host -j $(JOBS)
	cd $(BUILD)-host && PINMEM_TEST_SMALL=1 $(CTEST) -L host -E cli -j $(JOBS) -T memcheck --overwrite MemoryCheckCommand=$$(command -v valgrind) \
	  --overwrite MemoryCheckCommandOptions="--error-exitcode=97 --leak-check=full --errors-for-leak-kinds=definite,indirect --track-origins=no --suppressions=$(CURDIR)/tests/valgrind.supp"
	@$(RECORD) ctest $(SUITES) valgrind $(BUILD)-host

# The cuda backend builds with a C compiler alone: a fresh build with the CUDA toolkit hidden
# (mount namespace, PATH, CUDA_HOME) must have it compiled in (tests/test_no_toolkit.sh; it says
# so and skips where no mount namespace can be made).
test-no-toolkit: deps-c
	@JOBS=$(JOBS) ./tests/test_no_toolkit.sh; rc=$$?; \
	  if [ $$rc -eq 0 ]; then $(RECORD) ran $(SUITES) no-toolkit "a build with the CUDA toolkit hidden has the cuda backend"; \
	  elif [ $$rc -eq 77 ]; then $(RECORD) not-run $(SUITES) no-toolkit "no mount namespace here (unshare -m refused)"; \
	  else exit $$rc; fi

# A machine without a C compiler or without the Python headers, where `pip install .` fails, is
# told what to install by pinmem's configure (tests/test_install_messages.sh: each hidden in a
# mount namespace; it says so and skips where none can be made).
test-install-messages: deps-test
	@./tests/test_install_messages.sh $(SYSTEM_PYTHON); rc=$$?; \
	  if [ $$rc -eq 0 ]; then $(RECORD) ran $(SUITES) install-messages "no compiler, no Python headers: configure says what to install"; \
	  elif [ $$rc -eq 77 ]; then $(RECORD) not-run $(SUITES) install-messages "no mount namespace here (unshare -m refused)"; \
	  else exit $$rc; fi

# libFuzzer smoke runs (tests/fuzz): clang, ASan+UBSan, FUZZ_SECONDS per target from the
# committed seed corpus.
FUZZ_SECONDS ?= 20
test-fuzz: deps-test
	cmake -S . -B $(BUILD)-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPINMEM_CUDA=OFF -DPINMEM_SANITIZE=address -DPINMEM_FUZZ=ON -DPINMEM_FUZZ_SECONDS=$(FUZZ_SECONDS) $(CMAKE_ARGS)
	cmake --build $(BUILD)-fuzz -j $(JOBS) --target fuzz_targets
	cd $(BUILD)-fuzz && $(CTEST) -L fuzz -j $(JOBS)
	@$(RECORD) ctest $(SUITES) fuzz $(BUILD)-fuzz

# GPU tests: run when a CUDA device is visible, otherwise say so plainly.
test-gpu: deps-test
	$(build_c)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  (cd $(BUILD) && $(CTEST) -L gpu) && $(RECORD) ctest $(SUITES) gpu $(BUILD); \
	else \
	  echo "test-gpu: no NVIDIA GPU on this machine: the gpu-labelled tests did not run (run 'make test-gpu' on a GPU machine)"; \
	  $(RECORD) not-run $(SUITES) gpu "no NVIDIA GPU here: nvidia-smi lists none"; \
	fi

# Python package: the extension module from the same CMake build (PINMEM_PYTHON=ON) in
# $(BUILD)-py, then pytest over python/tests with that tree on PYTHONPATH (the cuda backend where
# a GPU is present, else the host backend; torch tests skip, saying why, without torch+CUDA).
# Then the Python examples of README.md and docs/*.md, each in a fresh interpreter on the host
# backend (tests/check_doc_examples.py: how a block is marked not run, or run with a stand-in).
# Then the packaging itself: `pip wheel .` through scikit-build-core (no toolkit needed: the cuda
# backend loads the driver at run time), and the buffer and copy tests against the unpacked wheel.
test-python: deps
	cmake -S . -B $(BUILD)-py -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPINMEM_PYTHON=ON -DPINMEM_TESTS=OFF \
	  -DPython_EXECUTABLE="$$(command -v $(PYTHON))" $(CMAKE_ARGS)
	cmake --build $(BUILD)-py -j $(JOBS) --target _pinmem
	PYTHONPATH=$(CURDIR)/$(BUILD)-py/python $(PYTHON) -m pytest -q -rs -p no:cacheprovider \
	  --junitxml=$(CURDIR)/$(BUILD)-py/pytest.xml python/tests
	@$(RECORD) pytest $(SUITES) python $(BUILD)-py/pytest.xml
	PYTHONPATH=$(CURDIR)/$(BUILD)-py/python $(PYTHON) tests/check_doc_examples.py --jobs $(JOBS)
	@$(RECORD) ran $(SUITES) doc-examples "the Python examples of README.md and docs/*.md"
	rm -rf $(BUILD)-py/wheel $(BUILD)-py/site
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(PYTHON) -m pip wheel -q --no-build-isolation --no-deps \
	  -w $(BUILD)-py/wheel -Cbuild-dir=$(BUILD)-py/wheel-build .
	$(PYTHON) -m zipfile -e $(BUILD)-py/wheel/pinmem-*.whl $(BUILD)-py/site
	PYTHONPATH=$(CURDIR)/$(BUILD)-py/site $(PYTHON) -m pytest -q -rs -p no:cacheprovider \
	  --junitxml=$(CURDIR)/$(BUILD)-py/pytest-wheel.xml python/tests/test_buffers.py python/tests/test_copy.py
	@$(RECORD) pytest $(SUITES) python-wheel $(BUILD)-py/pytest-wheel.xml

# The safetensors package's own Python tests (bindings/python/tests) against pinmem.safetensors,
# through tests/safetensors_suite/safetensors_shim.py. The suite is not pinmem's and is never
# committed: run.sh clones it into $(BUILD)-py/safetensors-suite, or SAFETENSORS_SUITE=<its tests
# folder> names a copy. Not part of `make test` (it needs that copy, or the network).
test-safetensors-suite: deps
	cmake -S . -B $(BUILD)-py -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPINMEM_PYTHON=ON -DPINMEM_TESTS=OFF \
	  -DPython_EXECUTABLE="$$(command -v $(PYTHON))" $(CMAKE_ARGS)
	cmake --build $(BUILD)-py -j $(JOBS) --target _pinmem
	PYTHON="$$(command -v $(PYTHON))" PYTHONPATH=$(CURDIR)/$(BUILD)-py/python \
	  SAFETENSORS_SUITE_DEST=$(CURDIR)/$(BUILD)-py/safetensors-suite tests/safetensors_suite/run.sh

# The documented install, as a user runs it: a fresh venv from $(SYSTEM_PYTHON), `pip install .`
# of this source tree (build requirements from PyPI, no system DLPack header; the cuda backend
# compiled in, no toolkit needed), then the first ```python block of
# README.md (the quickstart), verbatim, with that venv's python; then numpy.from_dlpack of a
# pinmem buffer must be writable (DLPack 1.x versioned capsule); then `pinmem info` through the
# console script, and again after `pip install -e .` over that install.
FRESH := $(BUILD)-py/fresh-venv
test-python-install: deps
	rm -rf $(FRESH) $(BUILD)-py/quickstart.py
	$(SYSTEM_PYTHON) -m venv $(FRESH)
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(FRESH)/bin/python -m pip install --disable-pip-version-check .
	@mkdir -p $(BUILD)-py && awk '/^```python$$/ {c = 1; next} c && /^```$$/ {exit} c {print}' README.md >$(BUILD)-py/quickstart.py
	@test -s $(BUILD)-py/quickstart.py || { echo "test-python-install: README.md has no python code block"; exit 1; }
	@echo "== README.md's Python quickstart ($(BUILD)-py/quickstart.py) with $(FRESH)/bin/python:"
	@sed 's/^/   | /' $(BUILD)-py/quickstart.py
	@# Without a usable GPU auto falls back and refuses device memory: simulate devices on purpose.
	cd $(BUILD)-py && fb=$$($(CURDIR)/$(FRESH)/bin/python -c 'import pinmem; print(int(pinmem.backend_info()["fallback"]))') && \
	  if [ "$$fb" = 1 ]; then echo "(no usable GPU: PINMEM_BACKEND=host)"; export PINMEM_BACKEND=host; fi && \
	  $(CURDIR)/$(FRESH)/bin/python quickstart.py
	cd $(BUILD)-py && $(CURDIR)/$(FRESH)/bin/python -c 'import numpy as np, pinmem; \
	  a = np.from_dlpack(pinmem.empty(4, "float32")); a[:] = 1; assert a.sum() == 4; \
	  assert pinmem._pinmem.DLPACK_VERSIONED == 1; print("numpy.from_dlpack: writable")'
	@# The console script of both installs runs the tool (the editable one runs _cli.py from the
	@# source tree, while the tool is in site-packages' pinmem folder).
	cd $(BUILD)-py && $(CURDIR)/$(FRESH)/bin/pinmem info | grep '^cuda backend *compiled in'
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(FRESH)/bin/python -m pip install -q --disable-pip-version-check -e .
	cd $(BUILD)-py && $(CURDIR)/$(FRESH)/bin/python -c 'import pinmem, sys; \
	  assert pinmem.__file__ == sys.argv[1], pinmem.__file__' $(CURDIR)/python/pinmem/__init__.py
	cd $(BUILD)-py && $(CURDIR)/$(FRESH)/bin/pinmem info | grep '^cuda backend *compiled in'
	@echo "test-python-install: passed"
	@$(RECORD) ran $(SUITES) python-install "README quickstart in a fresh venv; pinmem info after pip install . and -e ."

# The kernels' PTX (src/backend/kernels_ptx.h) from kernels.cu, where nvcc is on PATH; commit it
# with the .cu (tests: host_ptx).
ptx:
	python3 tools/gen_ptx.py

# The wheel: `pip wheel .` with the venv's build requirements (no toolkit needed: the cuda backend
# loads the driver at run time), made a manylinux wheel by `auditwheel repair`, in dist/. One
# wheel per CPython version (the venv's): not abi3, as pyproject.toml says why. It installs the
# build requirements only (deps-wheel): the Python group's test packages (torch, GBs) are for
# the suites.
WHEEL_DIR := $(BUILD)-wheel
wheel: deps-wheel
	rm -rf $(WHEEL_DIR) dist/pinmem-*.whl
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(PYTHON) -m pip wheel -q --no-build-isolation --no-deps \
	  -w $(WHEEL_DIR)/raw -Cbuild-dir=$(WHEEL_DIR)/build .
	PATH="$(dir $(PYTHON)):$$PATH" $(PYTHON) -m auditwheel repair -w dist $(WHEEL_DIR)/raw/pinmem-*.whl
	@ls dist/pinmem-*.whl

# The wheel as a user gets it (tests/test_wheel.sh): a fresh venv whose PATH holds python alone,
# `pinmem info` through the console script, README.md's first ```python block, and the buffer and
# copy tests against the installed package. That venv gets the wheel (with numpy, its dependency)
# and pytest, nothing else.
test-wheel: wheel
	./tests/test_wheel.sh $(wildcard dist/pinmem-*.whl) $(PYTHON) $(WHEEL_DIR)/test
	@$(RECORD) ran $(SUITES) wheel "the wheel in a fresh venv without a compiler: README quickstart, buffer and copy tests"

# A few lines about the machine (backend, devices, link, NUMA, limits), then the benchmark;
# `pinmem info` shows all of it and `pinmem info --options` the option table. Without a usable
# GPU pinmem refuses device memory rather than fake it, so the bench would stop at its first
# device allocation: it then runs on the host backend on purpose (PINMEM_BACKEND=host, devices
# simulated in host memory) and says so first.
bench: deps-c
	$(build_c)
	@./$(BUILD)/pinmem info --summary
	@echo
	@host=; if ./$(BUILD)/pinmem --json info --summary | grep -q '"fallback": *true'; then \
	  echo "make bench: no usable GPU here, so the bench runs on the host backend"; \
	  echo "  (PINMEM_BACKEND=host: devices simulated in host memory; the figures check the code"; \
	  echo "  paths and this machine's pinning, not a GPU's speed)"; \
	  host=PINMEM_BACKEND=host; \
	fi; \
	echo "$${host:+$$host }./$(BUILD)/pinmem bench alloc"; \
	env $$host ./$(BUILD)/pinmem bench alloc

install: build
	cmake --install $(BUILD)

clean:
	rm -rf $(BUILD) $(BUILD)-asan $(BUILD)-tsan $(BUILD)-host $(BUILD)-py $(BUILD)-fuzz $(BUILD)-wheel $(SUITES)

# The docs cannot go stale unseen (tests/check_docs.py): links and the results files they name
# exist, every option default they quote is the option table's, every option they name exists,
# install.md lists tools/deps.sh's packages, prose lines stay short; tests/test_check_docs.py
# shows that each of those checks catches a change, tests/test_check_doc_examples.py that
# tests/check_doc_examples.py (run by test-python and test-host) catches a broken example;
# tests/test_install_story.sh that plain make installs nothing and PINMEM_NO_INSTALL=1 refuses.
# (--unused lists results files no doc names.)
.PHONY: check-docs
check-docs: deps-test
	python3 tests/check_docs.py
	python3 tests/test_check_docs.py
	python3 tests/test_check_doc_examples.py
	bash tests/test_install_story.sh
	@$(RECORD) ran $(SUITES) check-docs
