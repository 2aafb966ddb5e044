#!/usr/bin/env bash
# What a user without build tools is told (make test-install-messages): `pip install .` runs
# CMake, so a machine without a C compiler, or without the Python headers, must be told by
# pinmem's configure what to install (build-essential, python3-dev), not only that
# CMAKE_C_COMPILER is unset or that Python's Development.Module is missing. Each case
# configures in a private mount namespace where the compilers or the headers are hidden: an empty
# folder bound over the folder of Python.h, a non-executable empty file over each compiler, with
# CC unset and with CC=gcc as under pip (scikit-build-core sets CC to Python's compiler). Needs
# root (or unshare rights); elsewhere it says why and exits 77 (skipped).
#
#   tests/test_install_messages.sh [PYTHON]
#
# The scratch folder is made and removed outside the namespace: inside it, a folder mounted
# over or from must never be removed recursively (that reaches through the mount).
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)

if [[ ${1:-} != --inner ]]; then
  python=$(command -v "${1:-python3}")
  if ! unshare -m true 2>/dev/null; then
    echo "SKIP: test_install_messages: cannot make a mount namespace here (unshare -m needs root)"
    exit 77
  fi
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/pinmem-messages.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  unshare -m --propagation private "$0" --inner "$tmp" "$python"
  exit
fi
tmp=$2
python=$3
mount --make-rprivate / 2>/dev/null || true
failures=0
fail() { failures=$((failures + 1)); echo "test_install_messages: FAIL: $*" >&2; }
# expect NAME RC WANT...: the configure's output (in $tmp/NAME.log) failed and holds every WANT.
expect() {
  local name=$1 rc=$2 want before=$failures
  shift 2
  [[ $rc -ne 0 ]] || fail "$name: configure succeeded"
  for want in "$@"; do
    grep -qF -- "$want" <(tr -s ' \n' ' ' <"$tmp/$name.log") ||
      { fail "$name: the output lacks '$want':"; sed 's/^/  | /' "$tmp/$name.log" >&2; }
  done
  ((failures > before)) || echo "test_install_messages: $name: says what to install"
}

# The Python headers hidden (as without python3-dev); the compiler is needed to get there.
include=$("$python" -c 'import sysconfig; print(sysconfig.get_path("include"))')
[[ -e $include/Python.h ]] || { echo "test_install_messages: FAIL: no $include/Python.h to hide"; exit 1; }
mkdir "$tmp/empty"
mount --bind "$tmp/empty" "$include"
[[ ! -e $include/Python.h ]] || { echo "test_install_messages: FAIL: $include/Python.h still there"; exit 1; }
rc=0
cmake -S "$src" -B "$tmp/nohdr" -DPINMEM_PYTHON=ON -DPINMEM_TESTS=OFF \
  -DPython_EXECUTABLE="$python" >"$tmp/nohdr.log" 2>&1 || rc=$?
expect nohdr $rc "the headers of Python" "no Python.h in $include" "apt-get install python3-dev" \
  "dnf install python3-devel"
umount "$include"

# Every C compiler on PATH hidden (cc, gcc, clang, c99, c89 and the files they link to).
: >"$tmp/nonexec"
chmod 644 "$tmp/nonexec"
for c in cc gcc clang c99 c89; do
  p=$(command -v "$c" 2>/dev/null) || continue
  [[ -x $p ]] && mount --bind "$tmp/nonexec" "$(readlink -f "$p")"
done
for c in cc gcc clang c99 c89; do
  p=$(command -v "$c" 2>/dev/null) || continue
  [[ ! -x $p ]] || fail "$c still runs: $p"
done
rc=0
env -u CC cmake -S "$src" -B "$tmp/nocc" -DPINMEM_TESTS=OFF >"$tmp/nocc.log" 2>&1 || rc=$?
expect nocc $rc "pinmem needs a C compiler and none was found." "apt-get install build-essential"
rc=0
CC=gcc cmake -S "$src" -B "$tmp/nocc-pip" -DPINMEM_TESTS=OFF >"$tmp/nocc-pip.log" 2>&1 || rc=$?
expect nocc-pip $rc "pinmem needs a C compiler and none was found (CC='gcc' was tried" \
  "apt-get install build-essential"

((failures == 0)) || exit 1
echo "test_install_messages: passed"
