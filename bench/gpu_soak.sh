#!/usr/bin/env bash
# Soak and sanitizer runs for a GPU machine (docs/RELIABILITY.md, "GPU" rows): build with the
# cuda backend, then
#   loader      the data loader for many epochs with --verify (every delivered sample checked)
#   copy        tests/soak_copy: many thousand random pm_copy_async / batch copies with checksums
#   stress      tests/test_stress for longer (16 threads, faults phase included) on cuda
#   memcheck    compute-sanitizer memcheck (leak check on) over every gpu-labelled test
#   racecheck   compute-sanitizer racecheck over the same tests
# Logs, JSON lines and a summary (summary.txt: one PASS/FAIL line per step) are packed into
# $OUT/soak.tgz (default ./soak-out), the summary also left as $OUT/summary.txt. Exit status 0
# only if every step passed.
#   bench/gpu_soak.sh [steps...]      steps: build loader copy stress memcheck racecheck
# Knobs (environment): SOAK_EPOCHS (50), SOAK_COPIES (20000), SOAK_MAX_BYTES (64M), SOAK_SEED (1),
# STRESS_SECONDS (30), SANITIZER_TIMEOUT (900 s per test), SANITIZE_ONLY (test names, space
# separated: only those under the sanitizers), BUILD (build-soak).
set -uo pipefail
# Everything lands in $OUT/soak and is packed into $OUT/soak.tgz at exit (a remote machine may
# hand back only a few files), with the summary also left beside it.
DEST=${OUT:-$PWD/soak-out}
OUT=$DEST/soak
mkdir -p "$OUT"
pack() {
  tar czf "$DEST/soak.tgz" -C "$OUT" . 2>/dev/null
  cp "$OUT/summary.txt" "$DEST/summary.txt" 2>/dev/null
  rm -rf "$OUT"
}
trap pack EXIT
BUILD=${BUILD:-build-soak}
STEPS=${*:-build loader copy stress memcheck racecheck}
SOAK_EPOCHS=${SOAK_EPOCHS:-50}
SOAK_COPIES=${SOAK_COPIES:-20000}
SOAK_MAX_BYTES=${SOAK_MAX_BYTES:-64M}
SOAK_SEED=${SOAK_SEED:-1}
STRESS_SECONDS=${STRESS_SECONDS:-30}
SANITIZER_TIMEOUT=${SANITIZER_TIMEOUT:-900}
export PINMEM_BACKEND=${PINMEM_BACKEND:-cuda} # host: a dry run of the script on a machine without a GPU

log() { printf '\n=== %s (%s)\n' "$*" "$(date +%T)"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
status=0
: >"$OUT/summary.txt"
result() { # STEP PASS|FAIL|SKIP DETAIL
  printf '%-10s %-4s %s\n' "$1" "$2" "$3" | tee -a "$OUT/summary.txt"
  [[ $2 == FAIL ]] && status=1
  return 0
}

{
  log machine
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv || true
  nproc; free -g | head -2; uname -r; ulimit -l
  command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || echo "no compute-sanitizer"
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

if has build; then
  log build
  # RelWithDebInfo: the sanitizer reports name source lines.
  if cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$OUT/build.log" 2>&1 &&
     cmake --build "$BUILD" -j "$(nproc)" >>"$OUT/build.log" 2>&1; then
    result build PASS "$(grep -ci warning "$OUT/build.log") warning lines"
  else
    tail -50 "$OUT/build.log"
    result build FAIL "see build.log"
    exit 1
  fi
fi
BIN="./$BUILD/pinmem"
TESTS="./$BUILD/tests"

if has loader; then
  log "loader soak: $SOAK_EPOCHS epochs, --verify"
  if "$BIN" bench loader --help 2>&1 | grep -q -- --verify; then
    ok=1
    # The synthetic images (.npy) and tokens cases; two ranks in one process; O_DIRECT reads.
    n=0
    for args in "" "--world 2" "--io direct --pin on"; do
      n=$((n + 1))
      timeout 3000 "$BIN" --json bench loader --verify --repeat 1 --epochs "$SOAK_EPOCHS" $args \
        >"$OUT/loader$n.jsonl" 2>"$OUT/loader$n.err"
      rc=$?
      bad=$(grep -c '"verified":false' "$OUT/loader$n.jsonl")
      good=$(grep -c '"verified":true' "$OUT/loader$n.jsonl")
      echo "bench loader --verify $args: exit $rc, $good verified lines, $bad unverified"
      if [[ $rc -ne 0 || $bad -ne 0 || $good -eq 0 ]]; then
        ok=0
        tail -20 "$OUT/loader$n.err"
      fi
    done
    [[ $ok == 1 ]] && result loader PASS "$SOAK_EPOCHS epochs per case, every sample verified" ||
      result loader FAIL "see loader*.jsonl / .err"
  else
    result loader SKIP "this pinmem has no 'bench loader'"
  fi
fi

if has copy; then
  log "copy soak: $SOAK_COPIES copies up to $SOAK_MAX_BYTES"
  if timeout 3000 "$TESTS/soak_copy" "$SOAK_COPIES" "$SOAK_MAX_BYTES" "$SOAK_SEED" \
       >"$OUT/soak_copy.log" 2>&1; then
    result copy PASS "$(grep '^soak_copy: .* verified' "$OUT/soak_copy.log")"
  else
    tail -30 "$OUT/soak_copy.log"
    result copy FAIL "see soak_copy.log"
  fi
  grep '^{' "$OUT/soak_copy.log" >"$OUT/soak_copy.jsonl" || true
fi

if has stress; then
  log "stress: ${STRESS_SECONDS} s per phase"
  if PINMEM_STRESS_SECONDS=$STRESS_SECONDS timeout $((STRESS_SECONDS * 6 + 300)) \
       "$TESTS/test_stress" >"$OUT/stress.log" 2>&1; then
    result stress PASS "$(grep -c 'wrong' "$OUT/stress.log") phases, 0 wrong, 0 unexpected"
  else
    tail -30 "$OUT/stress.log"
    result stress FAIL "see stress.log"
  fi
  if timeout 900 "$TESTS/test_faults" >"$OUT/faults.log" 2>&1; then
    result faults PASS "$(grep '^total:' "$OUT/faults.log" | cut -c1-160)"
  else
    tail -30 "$OUT/faults.log"
    result faults FAIL "see faults.log"
  fi
fi

# compute-sanitizer over every test binary on the cuda backend (the gpu-labelled suite).
sanitize() { # TOOL EXTRA-ARGS...
  local tool=$1
  shift
  local cs
  cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  if [[ ! -x $cs ]]; then
    result "$tool" SKIP "compute-sanitizer not found"
    return
  fi
  mkdir -p "$OUT/$tool"
  local failed=0 ran=0 skipped=0 timedout=0
  for t in "$TESTS"/test_*; do
    [[ -x $t && ! -d $t ]] || continue
    local name
    name=$(basename "$t")
    [[ -z ${SANITIZE_ONLY:-} || " $SANITIZE_ONLY " == *" $name "* ]] || continue
    # PINMEM_TEST_SMALL: the sanitizer slows device work and host threads a lot.
    PINMEM_TEST_SMALL=1 PINMEM_STRESS_SECONDS=2 timeout "$SANITIZER_TIMEOUT" \
      "$cs" --tool "$tool" --error-exitcode 99 "$@" "$t" >"$OUT/$tool/$name.log" 2>&1
    local rc=$?
    if [[ $rc -eq 77 ]]; then
      skipped=$((skipped + 1))
    elif [[ $rc -eq 124 ]]; then
      timedout=$((timedout + 1))
      echo "$tool $name: no result within ${SANITIZER_TIMEOUT} s"
      tail -3 "$OUT/$tool/$name.log"
    elif [[ $rc -ne 0 ]]; then
      failed=$((failed + 1))
      echo "$tool $name: exit $rc"
      grep -E "ERROR SUMMARY|=========" "$OUT/$tool/$name.log" | head -20
    else
      ran=$((ran + 1))
    fi
  done
  if [[ $failed -eq 0 && $timedout -eq 0 && $ran -gt 0 ]]; then
    result "$tool" PASS "$ran tests clean, $skipped skipped"
  else
    result "$tool" FAIL "$ran clean, $failed reported errors, $timedout timed out (${SANITIZER_TIMEOUT} s), $skipped skipped; see $tool/"
  fi
}

if has memcheck; then
  log "compute-sanitizer memcheck"
  sanitize memcheck --leak-check full --report-api-errors no
fi
if has racecheck; then
  log "compute-sanitizer racecheck"
  sanitize racecheck --racecheck-report analysis
fi

log summary
cat "$OUT/summary.txt"
exit $status
