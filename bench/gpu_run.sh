#!/usr/bin/env bash
# One batch for a GPU machine: build with the cuda backend, run the GPU-labelled tests, the
# benchmarks and the Python tests, and leave logs and JSON lines in $OUT (default ./gpu-out).
# Works on any Linux machine with an NVIDIA GPU and its driver (r525 or newer); no CUDA toolkit is
# needed (the notoolkit step proves it: a build with the toolkit hidden, run there).
#   bench/gpu_run.sh [steps...]   (the steps run in the order below, whatever the order given)
# C steps (the pinmem tool; `build` makes it, with the test programs when `tests` is asked for):
#   build tests info notoolkit alloc copy overlap sweep loader file blocks
# Python steps (each builds pinmem's extension module in $BUILD-py first, once per run):
#   python (the whole suite), torch, train, workers, files (bench file + compare_checkpoint.py),
#   kv (test_kv.py, examples/kv_offload.py), kvpin (kv_pin.py), offload (test_offload.py,
#   offload_activations.py), dcp (test_dcp.py, probes/dcp_async_return.py, compare_dcp.py),
#   safetensors (test_files.py, test_safetensors.py, test_lazy_bits.py, probes/save_host.py,
#   probes/load_first.py), loaderpy
#   (test_loader_dataloader.py, test_loader_hostile.py, test_loader_iterable.py). With `python`
#   in the same run, the others leave their test files to it.
# Default: all but sweep and python (the whole suite; the other Python steps run their own files).
# The steps that run the pinmem tool (info alloc copy overlap sweep loader file blocks torch) need
# `build` in the same run, or an earlier run's $BUILD.
#
# Minutes on one H200 (driver r580, 16 CPUs), measured 2026-12-05 where a figure has no "~":
# build with tests and tests together 1.3; info 0.1; notoolkit 0.5; alloc 0.2; copy 0.8; loader 0.4;
# file 0.5; blocks 2.3; the extension and kv 0.4; offload 1.1; dcp 3.7 (4 ranks, 4G; on an H100
# 6.0 with the extension's build and its tests, DCP_PROBE=0; the probe adds a minute); train 0.5;
# loaderpy 0.7; kvpin 1.2 at 16G; estimated: overlap ~1, safetensors ~4 (its tests 0.7 on an
# H100, then its probes), workers ~7, python ~4, kvpin ~4 at 64G. Calls of under ~9 minutes, in
# this order of need:
#   A  build tests info notoolkit alloc copy loader file   3.2   the driver loaded at run time
#   B  build blocks kv offload                              3.9   KV store, offload
#   B' dcp  (DCP_ARGS ... --size 4G)                        ~7    DCP
#   C  build train safetensors loaderpy kvpin files         ~8
#   D  workers python                                       ~9
# B to D need .whl (bench/README.md, "GPU runs"). TIME_LIMIT_S (default 570) bounds the whole run:
# each step's timeout is cut to what is left, a step that cannot start in time is skipped (SKIP in
# summary.txt), and the archive is packed before a 600 s command limit. TIME_LIMIT_S=0: no limit.
#
# Environment: BUILD (build-gpu), PYTHON (python3), CKPT_DIR (the work tree: files and dcp write
# there), WHEELS (.whl: wheels installed into WHEEL_SITE, default /tmp/site, for the Python steps),
# DLPACK_INCLUDE_DIR (else .carry/dlpack/dlpack.h where carried, else apache-tvm-ffi's from
# .whl), PINMEM_BACKEND (cuda; host: a dry run of the script on a machine without a GPU, with
# small sizes), BLOCKS_ARENA (64G) and BLOCKS_BUDGET (100G), KV_PIN_ARENA (64G with 150 GiB of
# RAM or more, else 32G: torch's pin_memory() row holds the pageable source and its pinned copy),
# DCP_ARGS (--device cuda --ranks 4 --size 8G), DCP_PROBE (1; 0: the dcp step without the
# probe's minute), DCP_TESTS (1; 0: without test_dcp.py's three minutes), DCP_UNITS (0; 1: the
# dcp step also runs probes/dcp_write_units.py, with and without --pinned, and
# probes/dcp_read_units.py, 4 ranks, 4G), OFFLOAD_ARGS (--json), HANG_S, TEST_TIMEOUT.
set -uo pipefail
known="build tests info notoolkit alloc copy overlap sweep loader file blocks python torch train"
known+=" workers files kv kvpin offload dcp safetensors loaderpy"
default=${known/ sweep/}
default=${default/ python/}
STEPS=${*:-$default}
tool_steps="info alloc copy overlap sweep loader file blocks torch" # these run ./$BUILD/pinmem
for s in $STEPS; do
  [[ " $known " == *" $s "* ]] || { echo "gpu_run.sh: unknown step '$s' (steps: $known)" >&2; exit 2; }
done
# Everything lands in $OUT/run and is packed into $OUT/gpu-run.tgz at exit (a remote machine may
# hand back only a few files), with the JSON lines of the pinmem tool's benches and the summary
# (one PASS/FAIL/SKIP line per step, then every TARGET line) also left beside it.
DEST=${OUT:-$PWD/gpu-out}
OUT=$DEST/run
mkdir -p "$OUT"
: >"$OUT/summary.txt"
# shellcheck disable=SC2317 # pack runs from the EXIT trap
pack() {
  {
    echo
    echo "TARGET lines:"
    # The benches' own (notoolkit's short bench left out: its sizes are not the targets').
    grep -H "TARGET" "$OUT"/*.err 2>/dev/null | grep -v '^[^:]*/notoolkit-' | sed "s|^$OUT/||"
  } >>"$OUT/summary.txt"
  printf '\n=== summary\n'
  cat "$OUT/summary.txt"
  tar czf "$DEST/gpu-run.tgz" -C "$OUT" . 2>/dev/null
  cat "$OUT"/bench-*.jsonl >"$DEST/bench.jsonl" 2>/dev/null
  cp "$OUT/summary.txt" "$DEST/summary.txt"
  rm -rf "$OUT"
}
trap pack EXIT
BUILD=${BUILD:-build-gpu}
TIME_LIMIT_S=${TIME_LIMIT_S:-570}
CKPT_DIR=${CKPT_DIR:-$PWD}
WHEELS=${WHEELS:-.whl}
WHEEL_SITE=${WHEEL_SITE:-/tmp/site}
PY=$(command -v "${PYTHON:-python3}" || echo "${PYTHON:-python3}")
export PINMEM_BACKEND=${PINMEM_BACKEND:-cuda}
export PYTHONUNBUFFERED=1
dry=0
[[ $PINMEM_BACKEND == host ]] && dry=1 # host: the same steps on small sizes, to check the script

log() { printf '\n=== %s (%s)\n' "$*" "$(date +%T)"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
status=0
result() { # STEP PASS|FAIL|SKIP DETAIL
  printf '%-12s %-4s %s\n' "$1" "$2" "$3" | tee -a "$OUT/summary.txt"
  [[ $2 == FAIL ]] && status=1
  return 0
}
# Seconds a command may run: N, or what is left of TIME_LIMIT_S less 25 s for packing.
limit() {
  local n=$1
  if ((TIME_LIMIT_S > 0)) && ((TIME_LIMIT_S - SECONDS - 25 < n)); then
    n=$((TIME_LIMIT_S - SECONDS - 25))
  fi
  echo $((n > 1 ? n : 1))
}
# step NAME [MIN_SECONDS]: whether the step was asked for and has at least MIN_SECONDS left.
step() {
  has "$1" || return 1
  if [[ " $tool_steps " == *" $1 "* && ! -x ./$BUILD/pinmem ]]; then
    result "$1" FAIL "no ./$BUILD/pinmem: the build step makes it"
    return 1
  fi
  if (($(limit 100000) < ${2:-60})); then
    result "$1" SKIP "$(limit 100000) s left of TIME_LIMIT_S=$TIME_LIMIT_S"
    return 1
  fi
  log "$1"
}
# run_to NAME SECONDS OUTFILE ERRFILE CMD...: CMD within its time, stdout and stderr to files.
run_to() {
  local name=$1 secs=$2 out=$3 err=$4
  shift 4
  timeout -k 15 "$(limit "$secs")" "$@" >"$out" 2>"$err"
  local rc=$?
  if ((rc == 0)); then
    result "$name" PASS "$(basename "$out")"
  else
    result "$name" FAIL "exit $rc$( ((rc == 124 || rc == 137)) && echo ' (timed out)'): $(basename "$err")"
  fi
  return $rc
}

{
  log machine
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv || true
  nproc; free -g | head -2; uname -r
  cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null
  ulimit -l
  df -h "$CKPT_DIR" | tail -1
  echo "nvcc: $(command -v nvcc || echo none)"
  ldconfig -p 2>/dev/null | grep -E 'libcuda\.so' || true
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

# ---- the Python side: carried wheels, then the extension module, built once ----------------------
py_steps="python torch train workers files kv kvpin offload dcp safetensors loaderpy"
wants_python=0
for s in $py_steps; do has "$s" && wants_python=1; done
if ((wants_python)); then
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$WHEEL_SITE" "$WHEELS"/*.whl >"$OUT/wheels.log" 2>&1; then
      export PYTHONPATH=$WHEEL_SITE${PYTHONPATH:+:$PYTHONPATH}
      result wheels PASS "$(cd "$WHEELS" && echo *.whl)"
    else
      tail -5 "$OUT/wheels.log"
      result wheels FAIL "pip install of $WHEELS/*.whl (wheels.log)"
    fi
  fi
  "$PY" - >"$OUT/python-env.txt" 2>&1 <<'PY'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "numpy", "safetensors", "hypothesis", "pytest", "isal", "tvm_ffi", "PIL",
             "torchvision"):
    try:
        m = importlib.import_module(name)
        print("%-12s %s" % (name, getattr(m, "__version__", "?")))
    except Exception as e:  # a missing package is a finding, not a failure of this report
        print("%-12s MISSING (%s)" % (name, e))
try:
    import torch
    print("torch.cuda", torch.cuda.is_available(), torch.version.cuda,
          torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
except Exception as e:
    print("torch.cuda: %s" % e)
PY
  cat "$OUT/python-env.txt"
fi
py_state=unbuilt
pyext() { # pinmem's extension module in $BUILD-py on PYTHONPATH; 0 when it imports
  if [[ $py_state == unbuilt ]]; then
    py_state=failed
    # The DLPack 1.x header: DLPACK_INCLUDE_DIR, else .carry/dlpack/, else (empty) the
    # apache-tvm-ffi package that WHEELS installed. Always passed, so no stale cache entry wins.
    local dl=${DLPACK_INCLUDE_DIR:-}
    [[ -z $dl && -f .carry/dlpack/dlpack.h ]] && dl=$PWD/.carry
    log "python extension ($BUILD-py)"
    if timeout "$(limit 300)" cmake -S . -B "$BUILD-py" -DCMAKE_BUILD_TYPE=Release \
      -DPINMEM_PYTHON=ON -DPINMEM_TESTS=OFF -DPINMEM_DLPACK_INCLUDE_DIR="$dl" \
      -DPython_EXECUTABLE="$PY" >"$OUT/pyext.log" 2>&1 &&
      timeout "$(limit 300)" cmake --build "$BUILD-py" -j "$(nproc)" --target _pinmem \
        >>"$OUT/pyext.log" 2>&1 &&
      PYTHONPATH=$PWD/$BUILD-py/python${PYTHONPATH:+:$PYTHONPATH} "$PY" -c \
        'import pinmem; print("pinmem", pinmem.__file__, "backend", pinmem.backend())' \
        >>"$OUT/pyext.log" 2>&1; then
      py_state=ok
      export PYTHONPATH=$PWD/$BUILD-py/python${PYTHONPATH:+:$PYTHONPATH}
      result pyext PASS "$(tail -1 "$OUT/pyext.log")"
    else
      tail -30 "$OUT/pyext.log"
      result pyext FAIL "pyext.log"
    fi
  fi
  [[ $py_state == ok ]]
}
# pytests NAME SECONDS FILES...: pytest on $PINMEM_BACKEND. SIGINT at the limit, so pytest still
# prints its summary; a test running past PYTEST_HANG_S gets every thread's stack in the log.
pytests() {
  local name=$1 secs=$2
  shift 2
  timeout -s INT -k 30 "$(limit "$secs")" "$PY" -m pytest -v -rfEs -p no:cacheprovider \
    -o faulthandler_timeout="${PYTEST_HANG_S:-150}" "$@" >"$OUT/pytest-$name.log" 2>&1
  local rc=$?
  grep -E '^(SKIPPED|FAILED|ERROR)' "$OUT/pytest-$name.log" | head -20
  local line
  line=$(grep -E '^=+ .*(passed|failed|error|skipped|no tests ran).* in [0-9.]+s' \
    "$OUT/pytest-$name.log" | tail -1 | tr -d '=')
  if ((rc == 0)); then
    result "pytest-$name" PASS "${line:-exit 0}"
  else
    tail -5 "$OUT/pytest-$name.log"
    result "pytest-$name" FAIL "exit $rc:${line:- no summary} (pytest-$name.log)"
  fi
}

# ---- C steps ---------------------------------------------------------------------------------
if step build 90; then
  # The test programs only where the tests run; else the pinmem tool alone.
  target=()
  has tests || target=(--target pinmem_cli)
  if timeout "$(limit 400)" cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 &&
    timeout "$(limit 400)" cmake --build "$BUILD" -j "$(nproc)" "${target[@]}" >>"$OUT/build.log" 2>&1; then
    result build PASS "${target[*]:-all targets}"
    grep -i -E "warning|error" "$OUT/build.log" | head -20
  else
    tail -50 "$OUT/build.log"
    result build FAIL "build.log"
    exit 1
  fi
fi

if step tests 120; then
  # A test still running after HANG_S seconds has its threads' stacks dumped (gdb, else
  # cuda-gdb, which GPU images without gdb carry), so a hang on a remote machine leaves evidence.
  (sleep "${HANG_S:-90}"; dbg=$(command -v gdb || command -v cuda-gdb) || exit 0
   for pid in $(pgrep -f "$BUILD/tests/" || true); do
     "$dbg" -p "$pid" -batch -ex "thread apply all bt" >"$OUT/hang-$pid.txt" 2>&1
   done) &
  watchdog=$!
  (cd "$BUILD" && timeout -k 15 "$(limit 480)" ctest --output-on-failure -L gpu -j 4 \
    --timeout "${TEST_TIMEOUT:-300}") >"$OUT/tests.log" 2>&1
  rc=$?
  kill "$watchdog" 2>/dev/null
  tail -40 "$OUT/tests.log"
  line=$(grep -E 'tests passed|tests failed' "$OUT/tests.log" | tail -1)
  if ((rc == 0)); then result tests PASS "$line"; else result tests FAIL "exit $rc: $line"; fi
  # The driver loaded at run time has its own test (stand-in drivers, then the real one).
  grep -E 'gpu_test_driver' "$OUT/tests.log" | tail -1
fi

if step info 10; then
  # The cuda backend line says which driver was loaded, which optional calls it lacks
  # (cuMemcpyBatchAsync among them) and whether the driver's JIT took pinmem's PTX.
  timeout 60 "./$BUILD/pinmem" info >"$OUT/info.txt" 2>&1 &&
    timeout 60 "./$BUILD/pinmem" info --json >"$OUT/info.jsonl" 2>>"$OUT/info.txt"
  rc=$?
  grep -E '^(backend|cuda backend|devices|  *[0-9]+ )' "$OUT/info.txt" | head -8
  if ((rc == 0)) && { ((dry)) || grep -q '^backend  *cuda' "$OUT/info.txt"; }; then
    result info PASS "$(grep '^cuda backend' "$OUT/info.txt" | cut -c25-)"
  else
    result info FAIL "exit $rc; backend $(grep '^backend' "$OUT/info.txt" | cut -c25-)"
  fi
fi

# The notoolkit step's body, run in a private mount namespace where the toolkit's folder is
# covered by an empty one (tests/test_no_toolkit.sh's way), else with nvcc off PATH alone.
# shellcheck disable=SC2317 # runs in a child bash, through declare -f
notoolkit_body() { # SRC BUILD OUT TOOLKIT DRY
  local src=$1 build=$2 out=$3 toolkit=$4 dry=$5 d newpath=""
  if [[ -n $toolkit ]]; then
    mkdir -p /tmp/pinmem-no-toolkit
    mount --make-rprivate / 2>/dev/null
    mount --bind /tmp/pinmem-no-toolkit "$toolkit" || { echo "FAIL: cannot cover $toolkit"; return 1; }
    [[ -z $(ls -A "$toolkit") ]] || { echo "FAIL: $toolkit still visible"; return 1; }
  fi
  unset CUDA_HOME CUDA_PATH CUDACXX
  IFS=: read -ra dirs <<<"$PATH"
  for d in "${dirs[@]}"; do [[ -x $d/nvcc ]] || newpath=${newpath:+$newpath:}$d; done
  export PATH=$newpath
  if command -v nvcc; then echo "FAIL: nvcc still on PATH"; return 1; fi
  echo "toolkit hidden: ${toolkit:-no folder covered (PATH only)}; nvcc: none; CUDA_HOME unset"
  echo "libcuda as the loader sees it now:"; ldconfig -p | grep -E 'libcuda\.so' || echo "  none"
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  rm -rf "$build"
  if ! { cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DPINMEM_TESTS=OFF &&
    cmake --build "$build" -j "$(nproc)" --target pinmem_cli; } >"$out/notoolkit-build.log" 2>&1; then
    tail -30 "$out/notoolkit-build.log"
    echo "FAIL: build"
    return 1
  fi
  grep 'pinmem: cuda backend' "$out/notoolkit-build.log"
  echo "linked:"
  ldd "$build/pinmem" | grep -i -E 'cuda|not found' || echo "  no CUDA library (the driver comes at run time)"
  # auto, as a user gets it: it must pick cuda, the kernels' PTX loaded by the driver's JIT.
  env -u PINMEM_BACKEND "$build/pinmem" info >"$out/notoolkit-info.txt" 2>&1 || { echo "FAIL: info"; return 1; }
  env -u PINMEM_BACKEND "$build/pinmem" info --json >"$out/notoolkit-info.jsonl" 2>&1
  grep -E '^(backend|cuda backend)' "$out/notoolkit-info.txt"
  local sizes=64M,1G
  ((dry)) && sizes=4M,64M
  "$build/pinmem" bench copy --json --sizes "$sizes" --repeat 3 >"$out/notoolkit-copy.jsonl" \
    2>"$out/notoolkit-copy.err" || { tail -5 "$out/notoolkit-copy.err"; echo "FAIL: bench copy"; return 1; }
  "$build/pinmem" bench blocks --json --sizes 16K --blocks 1024 --arena 64M --repeat 3 \
    >"$out/notoolkit-blocks.jsonl" 2>"$out/notoolkit-blocks.err" ||
    { tail -5 "$out/notoolkit-blocks.err"; echo "FAIL: bench blocks"; return 1; }
  grep -h TARGET "$out/notoolkit-copy.err" "$out/notoolkit-blocks.err" | head -6
  [[ $dry == 1 ]] || grep -q '^backend  *cuda' "$out/notoolkit-info.txt" ||
    { echo "FAIL: auto did not pick cuda in the build without the toolkit"; return 1; }
  echo "notoolkit: passed"
}
if step notoolkit 120; then
  nvcc=$(command -v nvcc || true)
  toolkit=""
  [[ -n $nvcc ]] && toolkit=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
  case $toolkit in
  / | /usr | /usr/local | /opt) toolkit="" ;; # a system folder is never covered: PATH alone
  esac
  body="$(declare -f notoolkit_body); notoolkit_body $(printf '%q ' "$PWD" "$PWD/$BUILD-notk" "$OUT")"
  if [[ -n $toolkit ]] && unshare -m true 2>/dev/null; then
    cmd=(unshare -m bash -c "$body $(printf '%q' "$toolkit") $dry")
  else
    [[ -n $toolkit ]] && echo "no mount namespace here (unshare -m): nvcc off PATH only, $toolkit stays"
    cmd=(bash -c "$body '' $dry")
  fi
  timeout -k 15 "$(limit 300)" "${cmd[@]}" >"$OUT/notoolkit.log" 2>&1
  rc=$?
  cat "$OUT/notoolkit.log"
  if ((rc == 0)); then
    result notoolkit PASS "$(grep '^toolkit hidden' "$OUT/notoolkit.log" | cut -d';' -f1);$(
      grep '^backend' "$OUT/notoolkit-info.txt" | cut -c24- | cut -c1-60)"
  else
    result notoolkit FAIL "exit $rc: $(grep FAIL "$OUT/notoolkit.log" | head -1) (notoolkit.log)"
  fi
fi

for b in alloc copy overlap; do
  step "$b" 90 || continue
  run_to "$b" 400 "$OUT/bench-$b.jsonl" "$OUT/bench-$b.err" "./$BUILD/pinmem" bench "$b" --json ||
    tail -20 "$OUT/bench-$b.err"
  if [[ $b == alloc ]]; then
    timeout 30 "./$BUILD/pinmem" bench alloc --summarize "$OUT/bench-$b.jsonl"
  else
    tail -40 "$OUT/bench-$b.err" # the text targets; the rows are in the .jsonl
  fi
done
if step sweep 120; then
  run_to sweep 300 "$OUT/bench-sweep.jsonl" "$OUT/sweep.err" bash bench/gpu_sweep.sh "./$BUILD/pinmem" 1G
  "$PY" - "$OUT/bench-sweep.jsonl" <<'PY' || true
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

if step loader 120; then
  run_to loader 300 "$OUT/bench-loader.jsonl" "$OUT/bench-loader.err" "./$BUILD/pinmem" bench loader --json ||
    tail -20 "$OUT/bench-loader.err"
  tail -12 "$OUT/bench-loader.err"
fi

if has file || has files; then
  if step file 90 || step files 90; then
    run_to file 400 "$OUT/bench-file.jsonl" "$OUT/bench-file.err" \
      "./$BUILD/pinmem" bench file --json --dir "$CKPT_DIR" || tail -20 "$OUT/bench-file.err"
    grep -h TARGET "$OUT/bench-file.err" | head
  fi
fi

if step blocks 120; then
  # KV blocks at 4/16/64/256 KiB by a copy per block, cudaMemcpyBatchAsync and the block store;
  # then a 64 GiB arena against one cudaHostAlloc, which needs a budget above half of RAM.
  if ((dry)); then
    run_to blocks 300 "$OUT/bench-blocks.jsonl" "$OUT/bench-blocks.err" "./$BUILD/pinmem" bench blocks --json
  else
    run_to blocks 420 "$OUT/bench-blocks.jsonl" "$OUT/bench-blocks.err" env \
      PINMEM_BUDGET="${BLOCKS_BUDGET:-100G}" "./$BUILD/pinmem" bench blocks --json --arena "${BLOCKS_ARENA:-64G}"
  fi
  tail -14 "$OUT/bench-blocks.err"
fi

# ---- Python steps ----------------------------------------------------------------------------
if step python 120 && pyext; then
  pytests python 480 python/tests
fi

if step torch 60 && pyext; then
  run_to torch 240 "$OUT/compare-torch.jsonl" "$OUT/compare-torch.err" \
    "$PY" bench/compare_torch.py --pinmem "./$BUILD/pinmem" --json
  tail -15 "$OUT/compare-torch.err"
  run_to pin-vs-torch 120 "$OUT/pin-vs-torch.jsonl" "$OUT/pin-vs-torch.err" \
    "$PY" bench/pin_vs_torch.py --size 1G
  tail -8 "$OUT/pin-vs-torch.err"; tail -4 "$OUT/pin-vs-torch.jsonl"
fi
if step train 60 && pyext; then
  run_to train 300 "$OUT/train-ceiling.jsonl" "$OUT/train-ceiling.err" "$PY" bench/train_ceiling.py --json
  tail -12 "$OUT/train-ceiling.err"
fi
if step workers 120 && pyext; then
  run_to workers 420 "$OUT/compare-workers.jsonl" "$OUT/compare-workers.err" "$PY" bench/compare_workers.py --json
  grep -vE '^  (torch|pinmem) +[0-9]+ workers, run' "$OUT/compare-workers.err" | tail -30
fi
if step files 120 && pyext; then
  run_to checkpoint 540 "$OUT/compare-checkpoint.jsonl" "$OUT/compare-checkpoint.err" \
    "$PY" bench/compare_checkpoint.py --json --dir "$CKPT_DIR"
  tail -30 "$OUT/compare-checkpoint.err"
fi

if step kv 60 && pyext; then
  has python || pytests kv 240 python/tests/test_kv.py
  # A paged attention layer's KV cache out to the block store and back: outputs bit for bit.
  run_to kv-example 120 "$OUT/kv-offload.txt" "$OUT/kv-offload.err" "$PY" python/examples/kv_offload.py
  tail -n 5 "$OUT/kv-offload.txt" "$OUT/kv-offload.err"
fi
if step kvpin 120 && pyext; then
  if [[ -n ${KV_PIN_ARENA:-} ]]; then
    arena=$KV_PIN_ARENA
  elif ((dry)); then
    arena=64M
  elif (($(awk '/^MemTotal:/ {print $2}' /proc/meminfo) >= 150 << 20)); then
    arena=64G
  else
    # 2 x 64 GiB does not fit beside the rest in 128 GiB of RAM. A power of two, as torch's host
    # allocator rounds each pinned block up to one (48G would pin 64 GiB for torch's rows).
    arena=32G
  fi
  echo "kv_pin.py --arena $arena"
  run_to kvpin 400 "$OUT/kv-pin.jsonl" "$OUT/kv-pin.err" env PINMEM_BUDGET="${KV_PIN_BUDGET:-100G}" \
    "$PY" bench/kv_pin.py --arena "$arena"
  cat "$OUT/kv-pin.err"
  cut -c1-160 "$OUT/kv-pin.jsonl"
fi

if step offload 90 && pyext; then
  has python || pytests offload 300 python/tests/test_offload.py
  read -ra offload_args <<<"${OFFLOAD_ARGS:---json}"
  ((dry)) && [[ -z ${OFFLOAD_ARGS:-} ]] && offload_args=(--json --cpu --tiny)
  run_to offload 360 "$OUT/offload-activations.jsonl" "$OUT/offload-activations.err" \
    "$PY" bench/offload_activations.py "${offload_args[@]}"
  tail -12 "$OUT/offload-activations.err"
fi

if step dcp 120 && pyext; then
  # DCP_TESTS=0 leaves test_dcp.py (under three minutes) to another run, so the compare fits.
  has python || [[ ${DCP_TESTS:-1} == 0 ]] || pytests dcp 240 python/tests/test_dcp.py
  read -ra dcp_args <<<"${DCP_ARGS:---device cuda --ranks 4 --size 8G}"
  ((dry)) && [[ -z ${DCP_ARGS:-} ]] && dcp_args=(--device cpu --ranks 2 --size 64M --repeat 1 --no-train)
  # Where async_save's return goes, with and without the writer's hand-over (a minute), with
  # the executor compare_dcp is given.
  executor=thread
  [[ " ${dcp_args[*]} " == *" --executor process "* ]] && executor=process
  probe_args=(cuda 4 1 "$executor")
  ((dry)) && probe_args=(cpu 2 0.0625 "$executor")
  if [[ ${DCP_PROBE:-1} == 1 ]]; then
    run_to dcp-return 150 "$OUT/dcp-async-return.txt" "$OUT/dcp-async-return.err" \
      "$PY" bench/probes/dcp_async_return.py "${probe_args[@]}"
    tail -2 "$OUT/dcp-async-return.txt"
  fi
  # A model's and its optimizer's state dict: many small tensors (half a minute)
  many_args=(--device cuda --ranks 4 --rounds 3)
  ((dry)) && many_args=(--device cpu --ranks 2 --layers 4 --rounds 1)
  run_to dcp-many-tensors 120 "$OUT/dcp-many-tensors.txt" "$OUT/dcp-many-tensors.err" \
    "$PY" bench/probes/dcp_many_tensors.py --dir "$CKPT_DIR" "${many_args[@]}"
  cat "$OUT/dcp-many-tensors.txt"
  # The request sizes of the writer and the reader, each case in turn round by round (about
  # four minutes on 4 ranks at 4G).
  if [[ ${DCP_UNITS:-0} == 1 ]]; then
    units_args=(--dir "$CKPT_DIR" --ranks 4 --size 4G --rounds 5)
    ((dry)) && units_args=(--dir "$CKPT_DIR" --ranks 2 --size 64M --rounds 1)
    units() { # NAME PROBE [ARGS...]
      local name=$1 probe=$2
      shift 2
      run_to "$name" 200 "$OUT/$name.txt" "$OUT/$name.err" "$PY" "bench/probes/$probe" \
        "${units_args[@]}" "$@"
      cat "$OUT/$name.txt"
    }
    units dcp-write-units dcp_write_units.py
    units dcp-write-units-pinned dcp_write_units.py --pinned
    units dcp-read-units dcp_read_units.py
  fi
  # About five times --size on disk at once (the disk's files, torch's and pinmem's folders,
  # two async folders): 8 GiB needs some 40 GiB free.
  df -h "$CKPT_DIR" | tail -1
  run_to dcp 540 "$OUT/compare-dcp.jsonl" "$OUT/compare-dcp.err" \
    "$PY" bench/compare_dcp.py "${dcp_args[@]}" --dir "$CKPT_DIR" --json
  grep -v -E 'Warning|^  local_plan = ' "$OUT/compare-dcp.err" | tail -24
fi

if step safetensors 60; then
  if has python; then
    result safetensors SKIP "the python step runs these files"
  elif pyext; then
    pytests safetensors 300 python/tests/test_files.py python/tests/test_safetensors.py \
      python/tests/test_lazy_bits.py
    grep -E 'test_cuda_lazy_views' "$OUT/pytest-safetensors.log" | tail -1
  fi
  if pyext; then # save_file of CPU tensors, load_file(device="cpu") as a first call (3 minutes)
    probe_size=1G
    ((dry)) && probe_size=64M
    run_to save-host 120 "$OUT/save-host.txt" "$OUT/save-host.err" \
      "$PY" bench/probes/save_host.py --dir "$CKPT_DIR" --size "$probe_size"
    # a process a case and round (CUDA's start-up each): 3 rounds of 4 cases, about 2 minutes
    run_to load-first 180 "$OUT/load-first.txt" "$OUT/load-first.err" \
      "$PY" bench/probes/load_first.py --dir "$CKPT_DIR" --size "$probe_size" --rounds 3 \
      --cases first,whole,later,package
    cat "$OUT/save-host.txt" "$OUT/load-first.txt"
  fi
fi

if step loaderpy 60; then
  if has python; then
    result loaderpy SKIP "the python step runs these files"
  elif pyext; then
    pytests loaderpy 420 python/tests/test_loader_dataloader.py python/tests/test_loader_hostile.py \
      python/tests/test_loader_iterable.py
  fi
fi

[[ -x ./$BUILD/pinmem ]] && "./$BUILD/pinmem" info --json >"$OUT/info-end.jsonl" 2>&1
exit $status
