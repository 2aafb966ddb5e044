# The README's two commands:
#   make bench  - build, then the pinned-memory report for this machine
#   make test   - build and run every test that can run here (host backend; the same tests
#                 under ASan+UBSan, TSan and valgrind; the GPU tests when a GPU is present)
BUILD      ?= build
JOBS       ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_ARGS ?=
CTEST      := ctest --output-on-failure --no-tests=error
PYTHON     ?= python3

.PHONY: all build test test-host test-asan test-tsan test-valgrind test-fuzz test-gpu test-python bench install clean

all: build

build:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS)

test: test-host test-asan test-tsan test-valgrind test-fuzz test-gpu test-python
	@echo "make test: all suites passed"

test-host: build
	cd $(BUILD) && $(CTEST) -L host -j $(JOBS)

test-asan:
	cmake -S . -B $(BUILD)-asan -DCMAKE_BUILD_TYPE=Debug -DPINMEM_CUDA=OFF -DPINMEM_SANITIZE=address $(CMAKE_ARGS)
	cmake --build $(BUILD)-asan -j $(JOBS)
	cd $(BUILD)-asan && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 $(CTEST) -L host -j $(JOBS)

test-tsan:
	cmake -S . -B $(BUILD)-tsan -DCMAKE_BUILD_TYPE=Debug -DPINMEM_CUDA=OFF -DPINMEM_SANITIZE=thread $(CMAKE_ARGS)
	cmake --build $(BUILD)-tsan -j $(JOBS)
	cd $(BUILD)-tsan && TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 $(CTEST) -L host -j $(JOBS)

# valgrind over the host-backend build without CUDA (cudart is not valgrind clean by itself).
test-valgrind:
	cmake -S . -B $(BUILD)-host -DCMAKE_BUILD_TYPE=Debug -DPINMEM_CUDA=OFF $(CMAKE_ARGS)
	cmake --build $(BUILD)-host -j $(JOBS)
	cd $(BUILD)-host && PINMEM_TEST_SMALL=1 $(CTEST) -L host -E cli -j $(JOBS) -T memcheck --overwrite MemoryCheckCommand=$$(command -v valgrind) \
	  --overwrite MemoryCheckCommandOptions="--error-exitcode=97 --leak-check=full --errors-for-leak-kinds=definite,indirect --track-origins=no"

# libFuzzer smoke runs (tests/fuzz): clang, ASan+UBSan, FUZZ_SECONDS per target from the
# committed seed corpus.
FUZZ_SECONDS ?= 20
test-fuzz:
	cmake -S . -B $(BUILD)-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPINMEM_CUDA=OFF -DPINMEM_SANITIZE=address -DPINMEM_FUZZ=ON -DPINMEM_FUZZ_SECONDS=$(FUZZ_SECONDS) $(CMAKE_ARGS)
	cmake --build $(BUILD)-fuzz -j $(JOBS) --target fuzz_targets
	cd $(BUILD)-fuzz && $(CTEST) -L fuzz -j $(JOBS)

# GPU tests: run when a CUDA device is visible, otherwise say so plainly.
test-gpu: build
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  cd $(BUILD) && $(CTEST) -L gpu; \
	else \
	  echo "test-gpu: no NVIDIA GPU on this machine: the gpu-labelled tests did not run (run 'make test-gpu' on a GPU machine)"; \
	fi

# Python package: the extension module from the same CMake build (PINMEM_PYTHON=ON) in
# $(BUILD)-py, then pytest over python/tests with that tree on PYTHONPATH (the cuda backend where
# a GPU is present, else the host backend; torch tests skip, saying why, without torch+CUDA).
# Then the packaging itself: `pip wheel .` through scikit-build-core with PINMEM_CUDA=OFF (as on
# a machine without a toolkit), and the buffer and copy tests again against the unpacked wheel.
test-python:
	cmake -S . -B $(BUILD)-py -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPINMEM_PYTHON=ON -DPINMEM_TESTS=OFF \
	  -DPython_EXECUTABLE="$$(command -v $(PYTHON))" $(CMAKE_ARGS)
	cmake --build $(BUILD)-py -j $(JOBS) --target _pinmem
	PYTHONPATH=$(CURDIR)/$(BUILD)-py/python $(PYTHON) -m pytest -q -p no:cacheprovider python/tests
	rm -rf $(BUILD)-py/wheel $(BUILD)-py/site
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(PYTHON) -m pip wheel -q --no-build-isolation --no-deps \
	  -w $(BUILD)-py/wheel -Ccmake.define.PINMEM_CUDA=OFF -Cbuild-dir=$(BUILD)-py/wheel-build .
	$(PYTHON) -m zipfile -e $(BUILD)-py/wheel/pinmem-*.whl $(BUILD)-py/site
	PYTHONPATH=$(CURDIR)/$(BUILD)-py/site $(PYTHON) -m pytest -q -p no:cacheprovider \
	  python/tests/test_buffers.py python/tests/test_copy.py

bench: build
	./$(BUILD)/pinmem info
	./$(BUILD)/pinmem bench alloc

install: build
	cmake --install $(BUILD)

clean:
	rm -rf $(BUILD) $(BUILD)-asan $(BUILD)-tsan $(BUILD)-host $(BUILD)-py $(BUILD)-fuzz

# The docs' relative links and the results files they name exist (tests/check_docs.py;
# --unused lists results files no doc names).
.PHONY: check-docs
check-docs:
	$(PYTHON) tests/check_docs.py
