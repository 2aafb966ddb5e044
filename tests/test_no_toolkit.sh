#!/usr/bin/env bash
# The cuda backend builds with a C compiler alone: configure and build pinmem in a fresh folder
# with the CUDA toolkit hidden (a private mount namespace with an empty folder mounted over the
# toolkit's, nvcc's folder off PATH, CUDA_HOME/CUDA_PATH unset), then check that `pinmem info`
# reports the cuda backend compiled in. Needs root (or unshare rights) for the mount namespace;
# elsewhere it says why and exits 77 (skipped). With --wheel it also builds the Python wheel
# there (pip wheel, no build isolation) and checks backend_info()["cuda_compiled"] from it.
#
#   tests/test_no_toolkit.sh [--wheel] [SOURCE_DIR]
set -euo pipefail

wheel=0
if [[ ${1:-} == --wheel ]]; then
  wheel=1
  shift
fi
src=$(cd "${1:-$(dirname "$0")/..}" && pwd)
python=${PYTHON:-$src/.venv/bin/python}

if [[ -z ${PINMEM_IN_NS:-} ]]; then
  nvcc=$(command -v nvcc || true)
  if [[ -z $nvcc ]]; then
    echo "test_no_toolkit: no nvcc on PATH: nothing to hide; building as is"
    toolkit=""
  else
    # The folder the toolkit lives in (/usr/local/cuda-13.0 for /usr/local/cuda/bin/nvcc).
    toolkit=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
  fi
  if [[ -n $toolkit ]] && ! unshare -m true 2>/dev/null; then
    echo "SKIP: test_no_toolkit: cannot make a mount namespace here (unshare -m needs root)"
    exit 77
  fi
  export PINMEM_IN_NS=1 PINMEM_TOOLKIT=$toolkit
  if [[ -n $toolkit ]]; then
    exec unshare -m "$0" $([[ $wheel == 1 ]] && echo --wheel) "$src"
  fi
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/pinmem-notoolkit.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
if [[ -n ${PINMEM_TOOLKIT:-} ]]; then
  mkdir -p "$tmp/empty"
  mount --make-rprivate / 2>/dev/null || true
  mount --bind "$tmp/empty" "$PINMEM_TOOLKIT"
  [[ -z $(ls -A "$PINMEM_TOOLKIT") ]] || { echo "test_no_toolkit: FAIL: toolkit still visible"; exit 1; }
fi
unset CUDA_HOME CUDA_PATH CUDACXX
# PATH without any folder that holds nvcc.
newpath=""
IFS=: read -ra dirs <<<"$PATH"
for d in "${dirs[@]}"; do
  [[ -x $d/nvcc ]] || newpath=${newpath:+$newpath:}$d
done
export PATH=$newpath
if command -v nvcc >/dev/null; then
  echo "test_no_toolkit: FAIL: nvcc still found at $(command -v nvcc)"
  exit 1
fi
echo "== toolkit hidden (${PINMEM_TOOLKIT:-none found}); nvcc: none; CUDA_HOME unset"

cmake -S "$src" -B "$tmp/build" -DCMAKE_BUILD_TYPE=Release -DPINMEM_TESTS=OFF >"$tmp/configure.log" 2>&1 ||
  { cat "$tmp/configure.log"; echo "test_no_toolkit: FAIL: configure"; exit 1; }
grep 'pinmem: cuda backend' "$tmp/configure.log"
cmake --build "$tmp/build" -j "${JOBS:-2}" --target pinmem_cli >"$tmp/build.log" 2>&1 ||
  { tail -n 30 "$tmp/build.log"; echo "test_no_toolkit: FAIL: build"; exit 1; }
line=$(env -u PINMEM_BACKEND "$tmp/build/pinmem" info | grep '^cuda backend')
echo "$line"
[[ $line == *"compiled in"* ]] || { echo "test_no_toolkit: FAIL: the cuda backend is not in this build"; exit 1; }

if [[ $wheel == 1 ]]; then
  echo "== pip wheel . (toolkit hidden)"
  "$python" -m pip wheel -q --no-build-isolation --no-deps -w "$tmp/wheel" \
    -Cbuild-dir="$tmp/wheel-build" "$src" >"$tmp/wheel.log" 2>&1 ||
    { tail -n 30 "$tmp/wheel.log"; echo "test_no_toolkit: FAIL: pip wheel"; exit 1; }
  "$python" -m zipfile -e "$tmp"/wheel/pinmem-*.whl "$tmp/site"
  (cd "$tmp" && PYTHONPATH=$tmp/site "$python" -c 'import pinmem; i = pinmem.backend_info(); print("wheel:", i["cuda_compiled"], i["reason"]); assert i["cuda_compiled"]')
fi
echo "test_no_toolkit: passed"
