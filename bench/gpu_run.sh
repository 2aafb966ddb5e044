#!/usr/bin/env bash
# One batch for a GPU machine: build with the cuda backend, run the GPU-labelled tests and the
# benchmarks, and leave logs and JSON lines in $OUT (default ./gpu-out). Used on the lent H200;
# works on any Linux machine with a CUDA toolkit and an NVIDIA GPU.
#   bench/gpu_run.sh [steps...]   steps: build tests alloc copy overlap (default: all)
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-gpu}
STEPS=${*:-build tests alloc copy overlap}
log() { printf '\n=== %s (%s)\n' "$*" "$(date +%T)"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
status=0

{
  log machine
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv || true
  nproc; free -g | head -2; uname -r
  cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null
  ulimit -l
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

if has build; then
  log build
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 >"$OUT/build.log" 2>&1 &&
    cmake --build "$BUILD" -j "$(nproc)" >>"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  grep -i -E "warning|error" "$OUT/build.log" | head -20
fi

if has tests; then
  log "gpu tests"
  (cd "$BUILD" && ctest --output-on-failure -L gpu -j 4 --timeout 300) >"$OUT/tests.log" 2>&1 || status=1
  tail -40 "$OUT/tests.log"
fi

for b in alloc copy overlap; do
  has "$b" || continue
  log "bench $b"
  timeout 400 "./$BUILD/pinmem" bench "$b" --json >"$OUT/bench-$b.jsonl" 2>"$OUT/bench-$b.err" || { status=1; tail -20 "$OUT/bench-$b.err"; }
  timeout 30 "./$BUILD/pinmem" bench "$b" --summarize "$OUT/bench-$b.jsonl" 2>/dev/null || tail -40 "$OUT/bench-$b.jsonl"
done
"./$BUILD/pinmem" info --json >"$OUT/info.jsonl" 2>&1 || true
exit $status
