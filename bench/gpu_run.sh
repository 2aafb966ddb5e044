#!/usr/bin/env bash
# One batch for a GPU machine: build with the cuda backend, run the GPU-labelled tests and the
# benchmarks, and leave logs and JSON lines in $OUT (default ./gpu-out). Works on any
# Linux machine with an NVIDIA GPU and its driver (r525 or newer); no CUDA toolkit is needed.
#   bench/gpu_run.sh [steps...]
#   steps: build tests alloc copy overlap sweep loader torch python train workers files
#   (default: all but sweep; train, torch, workers and files use the Python package that the
#   python step builds; files writes its checkpoints under $CKPT_DIR, default the work tree;
#   where a machine limits how long one command may run, split them, e.g.
#   "build tests copy overlap sweep", "build loader python torch", "build python train workers")
# The Python steps need a DLPack 1.x dlpack/dlpack.h where no PyPI is reachable: carry it in
# .carry/dlpack/ (DLPACK_INCLUDE_DIR), e.g. from the apache-tvm-ffi wheel's tvm_ffi/include.
set -uo pipefail
# Everything lands in $OUT/run and is packed into $OUT/gpu-run.tgz at exit (a remote
# machine may hand back only a few files), with the JSON lines also left beside it.
DEST=${OUT:-$PWD/gpu-out}
OUT=$DEST/run
mkdir -p "$OUT"
pack() {
  tar czf "$DEST/gpu-run.tgz" -C "$OUT" . 2>/dev/null
  cat "$OUT"/bench-*.jsonl >"$DEST/bench.jsonl" 2>/dev/null
  rm -rf "$OUT"
}
trap pack EXIT
BUILD=${BUILD:-build-gpu}
STEPS=${*:-build tests alloc copy overlap loader python torch train workers files}
[[ " $STEPS " == *" torch "* && " $STEPS " != *" python "* ]] &&
  echo "note: the torch step uses the Python package that the python step builds" >&2
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
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
    cmake --build "$BUILD" -j "$(nproc)" >>"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  grep -i -E "warning|error" "$OUT/build.log" | head -20
fi

if has tests; then
  log "gpu tests"
  # A test still running after HANG_S seconds has its threads' stacks dumped (gdb, if present),
  # so a hang on a remote machine leaves evidence behind.
  (sleep "${HANG_S:-90}"; command -v gdb >/dev/null || exit 0
   for pid in $(pgrep -f "$BUILD/tests/" || true); do
     gdb -p "$pid" -batch -ex "thread apply all bt" >"$OUT/hang-$pid.txt" 2>&1
   done) &
  watchdog=$!
  (cd "$BUILD" && ctest --output-on-failure -L gpu -j 4 --timeout "${TEST_TIMEOUT:-300}") >"$OUT/tests.log" 2>&1 || status=1
  kill "$watchdog" 2>/dev/null
  tail -40 "$OUT/tests.log"
fi

for b in alloc copy overlap; do
  has "$b" || continue
  log "bench $b"
  timeout 400 "./$BUILD/pinmem" bench "$b" --json >"$OUT/bench-$b.jsonl" 2>"$OUT/bench-$b.err" || { status=1; tail -20 "$OUT/bench-$b.err"; }
  if [[ $b == alloc ]]; then
    timeout 30 "./$BUILD/pinmem" bench alloc --summarize "$OUT/bench-$b.jsonl"
  else
    tail -40 "$OUT/bench-$b.err" # the text targets; the rows are in the .jsonl
  fi
done
if has sweep; then
  log "staging sweep (bench/gpu_sweep.sh)"
  timeout 300 bash bench/gpu_sweep.sh "./$BUILD/pinmem" 1G >"$OUT/bench-sweep.jsonl" 2>"$OUT/sweep.err" || status=1
  python3 - "$OUT/bench-sweep.jsonl" <<'PY' || true
import json, sys
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    print("%-4s %-6s %2s thr %5d KiB x %-3s %-22s %6.2f GB/s" % (r["dir"], r["copy_memcpy"],
          r["copy_threads"], r["copy_chunk"] // 1024, r["copy_slots"], r["case"], r["gbps"]))
PY
fi

if has loader; then
  log "bench loader"
  timeout 300 "./$BUILD/pinmem" bench loader --json >"$OUT/bench-loader.jsonl" 2>"$OUT/bench-loader.err" || { status=1; tail -20 "$OUT/bench-loader.err"; }
  tail -12 "$OUT/bench-loader.err"
  grep -h TARGET "$OUT/bench-loader.err" "$OUT/bench-loader.jsonl" 2>/dev/null | head
fi

if has python; then
  log "python extension and tests"
  export DLPACK_INCLUDE_DIR=${DLPACK_INCLUDE_DIR:-$PWD/.carry}
  cmake -S . -B "$BUILD-py" -DCMAKE_BUILD_TYPE=Release \
    -DPINMEM_PYTHON=ON -DPINMEM_TESTS=OFF -DPINMEM_DLPACK_INCLUDE_DIR="$DLPACK_INCLUDE_DIR" \
    -DPython_EXECUTABLE="$(command -v python3)" >"$OUT/python.log" 2>&1 &&
    cmake --build "$BUILD-py" -j "$(nproc)" --target _pinmem >>"$OUT/python.log" 2>&1 &&
    PYTHONPATH=$PWD/$BUILD-py/python timeout 300 python3 -m pytest -q -p no:cacheprovider python/tests >>"$OUT/python.log" 2>&1 || status=1
  tail -15 "$OUT/python.log"
fi

if has torch; then
  log "torch side by side"
  export PYTHONPATH=$PWD/$BUILD-py/python${PYTHONPATH:+:$PYTHONPATH}
  timeout 240 python3 bench/compare_torch.py --pinmem "./$BUILD/pinmem" --json >"$OUT/compare-torch.jsonl" 2>"$OUT/compare-torch.err" || status=1
  tail -15 "$OUT/compare-torch.err"
  timeout 120 python3 bench/pin_vs_torch.py --size 1G >"$OUT/pin-vs-torch.jsonl" 2>"$OUT/pin-vs-torch.err" || status=1
  tail -8 "$OUT/pin-vs-torch.err"; tail -4 "$OUT/pin-vs-torch.jsonl"
fi
if has train; then
  log "training loop against its ceiling (bench/train_ceiling.py)"
  export PYTHONPATH=$PWD/$BUILD-py/python${PYTHONPATH:+:$PYTHONPATH}
  timeout 300 python3 bench/train_ceiling.py --json >"$OUT/train-ceiling.jsonl" 2>"$OUT/train-ceiling.err" || status=1
  tail -12 "$OUT/train-ceiling.err"
fi
if has workers; then
  log "Python datasets with worker processes (bench/compare_workers.py)"
  export PYTHONPATH=$PWD/$BUILD-py/python${PYTHONPATH:+:$PYTHONPATH}
  timeout 420 python3 bench/compare_workers.py --json >"$OUT/compare-workers.jsonl" 2>"$OUT/compare-workers.err" || status=1
  grep -vE '^  (torch|pinmem) +[0-9]+ workers, run' "$OUT/compare-workers.err" | tail -30
fi
if has files; then
  log "files <-> device (pinmem bench file) and checkpoints (bench/compare_checkpoint.py)"
  timeout 400 "./$BUILD/pinmem" bench file --json --dir "${CKPT_DIR:-$PWD}" \
    >"$OUT/bench-file.jsonl" 2>"$OUT/bench-file.err" || { status=1; tail -20 "$OUT/bench-file.err"; }
  grep -h TARGET "$OUT/bench-file.err" "$OUT/bench-file.jsonl" 2>/dev/null | head
  export PYTHONPATH=$PWD/$BUILD-py/python${PYTHONPATH:+:$PYTHONPATH}
  timeout 540 python3 bench/compare_checkpoint.py --json --dir "${CKPT_DIR:-$PWD}" \
    >"$OUT/compare-checkpoint.jsonl" 2>"$OUT/compare-checkpoint.err" || status=1
  tail -30 "$OUT/compare-checkpoint.err"
fi
"./$BUILD/pinmem" info --json >"$OUT/info.jsonl" 2>&1 || true
exit $status
