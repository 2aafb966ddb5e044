#!/usr/bin/env bash
# `make bench`, the README's command for a report on this machine, runs to the end and prints
# one (run by `make test`): the machine's summary, then the bench with its TARGET lines. Where
# there is no usable GPU it runs the bench on the host backend on purpose and says so first
# (pinmem refuses device memory after falling back, so a plain run would stop at the bench's
# first device allocation); on a GPU machine it runs on the cuda backend and says nothing of
# the host.
#   tests/test_make_bench.sh [BUILD]   (BUILD: the build folder make uses, default build)
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 1
build=${1:-build}
failures=0
fail() { failures=$((failures + 1)); echo "test_make_bench: FAIL: $*" >&2; }

out=$(${MAKE:-make} --no-print-directory bench BUILD="$build" 2>&1)
rc=$?
[[ $rc -eq 0 ]] || fail "make bench: exit $rc; its last lines:
$(tail -5 <<<"$out")"
grep -q '^pinmem [0-9.]*, backend ' <<<"$out" || fail "make bench printed no machine summary"
grep -q '^TARGET ' <<<"$out" || fail "make bench printed no TARGET line"
# The bench's last step ran: its final target line is there.
grep -q '^TARGET pool overhead' <<<"$out" || fail "make bench stopped before the bench's end"

summary=$("./$build/pinmem" --json info --summary)
if grep -q '"fallback": *true' <<<"$summary"; then
  grep -q '^make bench: no usable GPU here, so the bench runs on the host backend' <<<"$out" ||
    fail "no GPU here, and make bench did not say it runs on the host backend"
  grep -q '^PINMEM_BACKEND=host \./'"$build"'/pinmem bench alloc$' <<<"$out" ||
    fail "no GPU here, and make bench did not run the bench with PINMEM_BACKEND=host"
else
  if grep -q 'no usable GPU here' <<<"$out"; then
    fail "make bench said there is no usable GPU where pinmem runs its $(sed -n 's/.*"backend": *"\([a-z]*\)".*/\1/p' <<<"$summary") backend without falling back"
  fi
fi

((failures)) && exit 1
echo "test_make_bench: make bench ran to its end ($(grep -c '^TARGET ' <<<"$out") TARGET lines)"
