#!/usr/bin/env bash
# The wheel as a user gets it (make test-wheel): a fresh venv of PYTHON's version, whose PATH
# then holds python alone (no compiler, no cmake, no nvcc); the wheel and pytest installed with
# pip; `pinmem info` through the console script must show the cuda backend compiled in; then
# README.md's first ```python block and the buffer and copy tests against the installed package
# (devices simulated with PINMEM_BACKEND=host where auto falls back: a machine without a GPU).
#
#   tests/test_wheel.sh WHEEL PYTHON WORKDIR
set -euo pipefail
usage="usage: test_wheel.sh WHEEL PYTHON WORKDIR"
wheel=$(realpath "${1:?$usage}")
python=${2:?$usage}
work=${3:?$usage}
src=$(cd "$(dirname "$0")/.." && pwd)

rm -rf "$work"
mkdir -p "$work/onlypy" "$work/run"
work=$(cd "$work" && pwd)
"$python" -m venv "$work/venv"
# A wrapper, not a symlink: python finds its venv from the path it was started by.
printf '#!/bin/sh\nexec "%s" "$@"\n' "$work/venv/bin/python" >"$work/onlypy/python"
chmod +x "$work/onlypy/python"
cp "$src/python/tests/conftest.py" "$src/python/tests/test_buffers.py" \
  "$src/python/tests/test_copy.py" "$work/run/"
awk '/^```python$/ {c = 1; next} c && /^```$/ {exit} c {print}' "$src/README.md" \
  >"$work/run/quickstart.py"
[[ -s $work/run/quickstart.py ]] || { echo "test_wheel: README.md has no python block"; exit 1; }

cd "$work/run"
unset CC CXX CUDA_HOME CUDA_PATH PYTHONPATH
export PATH=$work/onlypy
for tool in cc gcc clang cmake nvcc; do
  if command -v "$tool" >/dev/null; then
    echo "test_wheel: FAIL: $tool is on PATH"
    exit 1
  fi
done
python -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' ||
  { echo "test_wheel: FAIL: python on PATH is not the fresh venv's"; exit 1; }
echo "== pip install ${wheel##*/} pytest (PATH=$PATH)"
python -m pip install -q --disable-pip-version-check "$wheel" pytest
echo "== pinmem info (console script)"
info=$("$work/venv/bin/pinmem" info)
while IFS= read -r line; do
  if [[ $line == "cuda backend"* ]]; then echo "$line"; fi
done <<<"$info"
[[ $info == *$'\ncuda backend'*"compiled in"* ]] ||
  { echo "test_wheel: FAIL: pinmem info does not show the cuda backend compiled in"; exit 1; }
fb=$(python -c 'import pinmem; print(int(pinmem.backend_info()["fallback"]))')
if [[ $fb == 1 ]]; then
  echo "(no usable GPU here: PINMEM_BACKEND=host for the example and the tests)"
  export PINMEM_BACKEND=host
fi
echo "== README.md's Python example"
python quickstart.py
echo "== test_buffers.py test_copy.py against the installed wheel"
python -m pytest -q -rs -p no:cacheprovider test_buffers.py test_copy.py
echo "test_wheel: passed"
