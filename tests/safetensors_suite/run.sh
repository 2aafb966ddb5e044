#!/bin/sh
# The safetensors package's own Python tests (bindings/python/tests), run against pinmem through
# safetensors_shim.py. The suite is not part of pinmem: pass its folder as SAFETENSORS_SUITE, or
# let this script clone it (the branch or tag in SAFETENSORS_REF; by default the tag of the
# installed package's version, else main) into SAFETENSORS_SUITE_DEST (default
# build-py/safetensors-suite).
# Usage: tests/safetensors_suite/run.sh [pytest arguments]
# Needs pinmem importable (PYTHONPATH=build-py/python, or installed), torch, numpy, pytest and the
# safetensors package (its SafetensorError is the base of pinmem's).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
dest=${SAFETENSORS_SUITE_DEST:-$root/build-py/safetensors-suite}
suite=${SAFETENSORS_SUITE:-$dest/bindings/python/tests}
if [ ! -d "$suite" ]; then
    # The suite of the installed package's version (tag v<version>), else the main branch.
    version=$("$python" -c 'import safetensors; print(safetensors.__version__)')
    url=https://github.com/huggingface/safetensors
    rm -rf "$dest"
    for ref in ${SAFETENSORS_REF:-v$version main}; do
        echo "safetensors suite: cloning $url ($ref) into $dest"
        git clone --quiet --depth 1 --branch "$ref" "$url" "$dest" && break
    done
    [ -d "$suite" ] ||
        { echo "safetensors suite: no copy of the suite (set SAFETENSORS_SUITE=<.../bindings/python/tests>)"; exit 2; }
fi
# The suite runs from bindings/python and writes its files into ./ and ./tests/data: a folder
# of its own stands in for it, so that the suite's copy stays as fetched.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/tests/data"
cd "$work"
PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" PINMEM_BACKEND=${PINMEM_BACKEND:-host} \
    "$python" -m pytest -p safetensors_shim -p no:cacheprovider -q -rs --rootdir "$suite" \
    "$suite" "$@"
