#!/usr/bin/env bash
# Checks of the pinmem command-line tool (CTest: host_cli, $1 = the binary). It must run, print
# valid JSON lines with the documented keys and verified data, reject bad command lines with
# exit 2 and the usage, report failures as "pinmem: <status name>: <detail>" with exit 1, and
# show why an invalid PINMEM_* value was ignored. Every failed check is printed; any fails the
# test.
set -uo pipefail

bin=${1:?usage: test_cli.sh PATH_TO_PINMEM_BINARY}
[[ -x $bin ]] || { echo "test_cli: FAIL: $bin is not an executable" >&2; exit 1; }
command -v python3 >/dev/null || { echo "test_cli: FAIL: python3 is needed to parse JSON" >&2; exit 1; }
export PINMEM_BACKEND=host
unset PINMEM_BUDGET PINMEM_BUDGET_POLICY PINMEM_PIN_THREADS PINMEM_FAST_PIN_MIN || true

tmp=$(mktemp -d "${TMPDIR:-/tmp}/pinmem-cli.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
failures=0
checks=0

fail() {
  failures=$((failures + 1))
  echo "test_cli: FAIL: $*" >&2
}

# run NAME CMD...: run CMD with stdout/stderr in $tmp/NAME.out/.err; status in $rc.
run() {
  local name=$1
  shift
  "$@" >"$tmp/$name.out" 2>"$tmp/$name.err"
  rc=$?
}

show() {
  echo "---- stdout of $1:" >&2
  head -c 4000 "$tmp/$1.out" >&2
  echo "---- stderr of $1:" >&2
  head -c 4000 "$tmp/$1.err" >&2
}

expect_rc() { # NAME WANT
  checks=$((checks + 1))
  if [[ $rc -ne $2 ]]; then
    fail "$1: exit status $rc, want $2"
    show "$1"
    return 1
  fi
}

expect_grep() { # NAME FILE(out|err) EXTENDED-REGEX
  checks=$((checks + 1))
  if ! grep -Eq -- "$3" "$tmp/$1.$2"; then
    fail "$1: $2 does not match /$3/"
    show "$1"
  fi
}

# json_check NAME PYTHON: every line of NAME.out must parse as a JSON object; then PYTHON runs
# with `rows` (the parsed lines) and may call bad("why") for each problem it finds.
json_check() {
  checks=$((checks + 1))
  if ! python3 - "$tmp/$1.out" "$2" <<'PY' >&2; then
import json, math, sys
path, code = sys.argv[1], sys.argv[2]
problems = []
def bad(why):
    problems.append(why)
rows = []
with open(path, encoding="utf-8") as f:
    lines = f.read().split("\n")
if lines and lines[-1] == "":
    lines.pop()
if not lines:
    bad("no output lines")
for n, line in enumerate(lines, 1):
    try:
        obj = json.loads(line)
    except ValueError as e:
        bad("line %d is not JSON (%s): %r" % (n, e, line[:200]))
        continue
    if not isinstance(obj, dict):
        bad("line %d is not a JSON object: %r" % (n, line[:200]))
        continue
    rows.append(obj)
if not problems:
    exec(code)
for p in problems:
    print("  " + p)
sys.exit(1 if problems else 0)
PY
    fail "$1: JSON check failed (problems above)"
    show "$1"
  fi
}

# ---- --version, help --------------------------------------------------------------------------
run version "$bin" --version
expect_rc version 0 && expect_grep version out '^pinmem [0-9]+\.[0-9]+\.[0-9]+$'
version=$(sed -n 's/^pinmem //p' "$tmp/version.out")

run version_json "$bin" --version --json
expect_rc version_json 0 &&
  json_check version_json "
if len(rows) != 1 or rows[0].get('version') != '$version':
    bad('want one line {\"version\": \"$version\"}, got %r' % rows)"

run help "$bin" help
expect_rc help 0 && expect_grep help out '^usage: pinmem' && expect_grep help out 'bench alloc'

# ---- info ----------------------------------------------------------------------------------------
run info "$bin" info
if expect_rc info 0; then
  expect_grep info out "^pinmem $version"
  expect_grep info out '^backend +host \(PINMEM_BACKEND=host\)$'
  expect_grep info out '^RLIMIT_MEMLOCK +'
  expect_grep info out '^transparent huge pages +'
  expect_grep info out '^physical memory +[0-9]'
  expect_grep info out '^devices: [1-9]'
  expect_grep info out '^ +budget +[1-9][0-9]* bytes'
  expect_grep info out '^NUMA: (single node|[2-9][0-9]* nodes|no NUMA information)$'
  expect_grep info out '^ +device 0 +no PCI location \(the host backend'
  expect_grep info out '^ +NAME +ENV +VALUE +SOURCE +DEFAULT'
  for opt in backend budget budget_policy pin_threads fast_pin_min huge_pages; do
    expect_grep info out "^ +$opt +PINMEM_[A-Z_]+ +"
  done
fi

run info_json "$bin" info --json
expect_rc info_json 0 &&
  json_check info_json "
kinds = [r.get('info') for r in rows]
if None in kinds:
    bad('a line without an \"info\" key')
head = [r for r in rows if r.get('info') == 'pinmem']
if len(head) != 1:
    bad('want one {\"info\":\"pinmem\"} line, got %d' % len(head))
elif head[0].get('version') != '$version' or head[0].get('backend') != 'host':
    bad('pinmem line: %r' % head[0])
elif head[0].get('backend_reason') != 'PINMEM_BACKEND=host':
    bad('pinmem line: backend_reason %r' % head[0].get('backend_reason'))
for k in ('system', 'memlock', 'pool'):
    if kinds.count(k) != 1:
        bad('want one %r line, got %d' % (k, kinds.count(k)))
sysl = [r for r in rows if r.get('info') == 'system']
if sysl and not (isinstance(sysl[0].get('physical_memory'), int) and sysl[0]['physical_memory'] > 0):
    bad('system.physical_memory: %r' % sysl[0])
ml = [r for r in rows if r.get('info') == 'memlock']
if ml and not all(k in ml[0] for k in ('rlimit_bytes', 'cap_ipc_lock', 'cap_ipc_lock_lifts_limit')):
    bad('memlock line lacks keys: %r' % ml[0])
pool = [r for r in rows if r.get('info') == 'pool']
if pool and not (isinstance(pool[0].get('budget'), int) and pool[0]['budget'] > 0):
    bad('pool.budget: %r' % pool[0])
devs = [r for r in rows if r.get('info') == 'device']
if not devs:
    bad('no device line')
for d in devs:
    for k in ('index', 'name', 'cc', 'total_memory', 'pcie_gen', 'pcie_width', 'pcie_max_gen',
              'pcie_max_width', 'copy_engines', 'can_map_host_memory', 'managed_memory',
              'host_register_read_only'):
        if k not in d:
            bad('device line lacks %r: %r' % (k, d))
numa = [r for r in rows if r.get('info') == 'numa']
nnodes = [r for r in rows if r.get('info') == 'numa_node']
ndevs = [r for r in rows if r.get('info') == 'numa_device']
if len(numa) != 1:
    bad('want one numa line, got %d' % len(numa))
elif numa[0].get('nodes') != len(nnodes) or numa[0].get('multi_node') != (len(nnodes) > 1):
    bad('numa line %r does not match its %d numa_node lines' % (numa[0], len(nnodes)))
for n in nnodes:
    if not isinstance(n.get('node'), int) or 'cpus' not in n or 'mem_total' not in n:
        bad('numa_node line: %r' % n)
if len(ndevs) != len(devs):
    bad('%d numa_device lines for %d devices' % (len(ndevs), len(devs)))
for d in ndevs:
    if d.get('pci_location') is not False or d.get('pci_bus_id') is not None or d.get('node') != -1:
        bad('host device should have no PCI location: %r' % d)
place = [r for r in rows if r.get('info') == 'numa_placement']
if len(place) != 1:
    bad('want one numa_placement line, got %d' % len(place))
else:
    pl = place[0]
    if pl.get('mode') != 'auto' or not isinstance(pl.get('libnuma'), bool):
        bad('numa_placement line: %r' % pl)
    if pl.get('libnuma') is False and not pl.get('libnuma_problem'):
        bad('numa_placement: libnuma not loaded and no reason: %r' % pl)
    if len(nnodes) <= 1 and 'nothing to do' not in pl.get('summary', ''):
        bad('numa_placement on one node should say it has nothing to do: %r' % pl)
    if len(nnodes) <= 1 and any(d.get('placement_node') != -1 for d in ndevs):
        bad('numa_device: a placement node on a single-node machine: %r' % ndevs)
opts = [r for r in rows if r.get('info') == 'option']
names = [o.get('name') for o in opts]
for want in ('backend', 'device', 'budget', 'budget_policy', 'budget_timeout', 'pin_threads',
             'fast_pin_min', 'huge_pages'):
    if want not in names:
        bad('option %r missing' % want)
for o in opts:
    for k in ('name', 'env', 'value', 'source', 'default', 'doc'):
        if not isinstance(o.get(k), str) or (k != 'value' and not o[k]):
            bad('option line: bad %r: %r' % (k, o))
    if o.get('env') != 'PINMEM_' + str(o.get('name')).upper():
        bad('option %r: env %r' % (o.get('name'), o.get('env')))
    if o.get('source') not in ('default', 'env', 'set'):
        bad('option %r: source %r' % (o.get('name'), o.get('source')))
b = [o for o in opts if o.get('name') == 'backend']
if b and (b[0].get('value') != 'host' or b[0].get('source') != 'env'):
    bad('backend option should be host from env: %r' % b[0])"

# docs/options.md lists every option with its variable and default (tests/check_docs.py checks
# the same against src/core/config.c; this checks the binary's table in force).
options_md=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/docs/options.md
if [[ -f $options_md ]]; then
  json_check info_json "
import re
table = {}
for line in open('$options_md', encoding='utf-8'):
    m = re.match(r'^\| \x60([a-z_]+)\x60 \| \x60(PINMEM_[A-Z_]+)\x60 \| \x60([^\x60]*)\x60 \|', line)
    if m:
        table[m.group(1)] = (m.group(2), m.group(3))
for o in rows:
    if o.get('info') != 'option':
        continue
    want = (o['env'], o['default'])
    if table.get(o['name']) != want:
        bad('docs/options.md: option %r should read %r, has %r' % (o['name'], want, table.get(o['name'])))
names = {o.get('name') for o in rows if o.get('info') == 'option'}
for extra in set(table) - names:
    bad('docs/options.md lists %r, which is not an option' % extra)"
else
  fail "docs/options.md is missing"
fi

# Where auto falls back (no driver), the simulated devices are not on offer: a bench over all
# devices says why instead of running over none.
run devices_fallback env -u PINMEM_BACKEND PINMEM_CUDA_DRIVER=/nonexistent/libcuda.so.1 "$bin" \
  bench copy --devices all --sizes 4K --repeat 1
expect_rc devices_fallback 1 &&
  expect_grep devices_fallback err '^pinmem: PM_ERR_NO_DEVICE: .*(no NVIDIA driver found|built without the cuda backend)'

# An invalid option value: the default stays in force and both outputs say why.
run bad_env env PINMEM_BUDGET=xyz "$bin" info
expect_rc bad_env 0 && expect_grep bad_env out "^ +budget +PINMEM_BUDGET +auto \(PINMEM_BUDGET='xyz' ignored: [^)]+\) +default"
run bad_env_json env PINMEM_BUDGET=xyz "$bin" info --json
expect_rc bad_env_json 0 &&
  json_check bad_env_json "
o = [r for r in rows if r.get('info') == 'option' and r.get('name') == 'budget']
if len(o) != 1:
    bad('no budget option line')
else:
    o = o[0]
    if o.get('source') != 'default' or o.get('env_value') != 'xyz' or o.get('env_ignored') is not True:
        bad('budget line does not show the ignored value: %r' % o)
    if 'ignored' not in o.get('value', '') or 'xyz' not in o.get('value', ''):
        bad('budget value text lacks the reason: %r' % o.get('value'))"

# Strings are escaped: quotes, backslashes, control characters and bytes that are not UTF-8.
run weird_env env PINMEM_BUDGET_POLICY=$'a"b\\c\x01\t\xff\xc3\xa9' "$bin" info --json
expect_rc weird_env 0 &&
  json_check weird_env "
o = [r for r in rows if r.get('info') == 'option' and r.get('name') == 'budget_policy']
if not o or o[0].get('env_value') != 'a\"b\\\\c\x01\t\ufffd\u00e9':
    bad('escaped env value read back as %r' % (o and o[0].get('env_value')))"

# A valid one is taken, with its source.
run good_env env PINMEM_PIN_THREADS=3 "$bin" info --json
expect_rc good_env 0 &&
  json_check good_env "
o = [r for r in rows if r.get('info') == 'option' and r.get('name') == 'pin_threads']
if not o or o[0].get('value') != '3' or o[0].get('source') != 'env' or o[0].get('env_ignored') is not False:
    bad('pin_threads from the environment: %r' % o)"

# ---- bench alloc ---------------------------------------------------------------------------------
bench_args=(bench alloc --sizes 4M --repeat 1 --overhead-total 64M)
run bench_json "$bin" "${bench_args[@]}" --json
expect_rc bench_json 0 &&
  json_check bench_json "
need = ('bench', 'case', 'bytes', 'seconds', 'gbps', 'verified', 'backend', 'ratio_vs_cudaHostAlloc')
for r in rows:
    for k in need:
        if k not in r:
            bad('row lacks %r: %r' % (k, r))
    if r.get('bench') != 'alloc' or r.get('backend') != 'host':
        bad('bench/backend: %r' % r)
    if r.get('verified') is not True or r.get('verify_method') != 'full':
        bad('not verified (a boolean, with verify_method full): %r' % r)
    s = r.get('seconds')
    if not isinstance(s, (int, float)) or not (s > 0 and math.isfinite(s)):
        bad('seconds: %r' % r)
    if not isinstance(r.get('bytes'), int) or r['bytes'] <= 0:
        bad('bytes: %r' % r)
    g = r.get('gbps')
    if g is not None and not (isinstance(g, (int, float)) and g > 0):
        bad('gbps: %r' % r)
    q = r.get('ratio_vs_cudaHostAlloc')
    if q is not None and not (isinstance(q, (int, float)) and q > 0):
        bad('ratio: %r' % r)
have = {(r.get('case'), r.get('bytes')) for r in rows}
M = 1 << 20
for c in ('pinmem_cold_pin', 'host_alloc', 'malloc+host_register', 'pinmem_free+destroy',
          'host_free', 'host_unregister+free'):
    if (c, 4 * M) not in have:
        bad('missing case %s at 4 MiB' % c)
for size in (4096, 65536, M, 16 * M):
    for c in ('pinmem_cached_pair', 'host_alloc+host_free'):
        if (c, size) not in have:
            bad('missing case %s at %d bytes' % (c, size))
cold = [r for r in rows if r.get('case') == 'pinmem_cold_pin']
if cold and cold[0].get('gbps') is None:
    bad('cold pin row has no gbps: %r' % cold[0])
base = [r for r in rows if r.get('case') == 'host_alloc']
if base and base[0].get('ratio_vs_cudaHostAlloc') != 1:
    bad('the baseline ratio must be 1: %r' % base[0])
pairs = [r for r in rows if r.get('case') == 'pinmem_cached_pair']
for p in pairs:
    if p.get('backend_allocs') != 0 or p.get('cache_hits', 0) < 1000:
        bad('cached pairs did not come from the cache: %r' % p)
over = [r for r in rows if r.get('case') == 'pinmem_overhead']
if len(over) != 1:
    bad('want one pinmem_overhead row')
else:
    o = over[0]
    if not (o.get('requested_bytes', 0) >= M and o.get('pinned_bytes', 0) >= o['requested_bytes']):
        bad('overhead accounting: %r' % o)
    elif abs(o['overhead'] - o['pinned_bytes'] / o['requested_bytes']) > 1e-6:
        bad('overhead is not pinned/requested: %r' % o)
    elif o['overhead'] > 1.125:
        bad('pool overhead %.4f above 1.125 (size classes must waste at most 12.5%%): %r' % (o['overhead'], o))
if not any(r.get('case') == 'pinmem_overhead_churn' for r in rows):
    bad('no pinmem_overhead_churn row')"

run bench_text "$bin" "${bench_args[@]}"
if expect_rc bench_text 0; then
  expect_grep bench_text out '^SIZE +CASE +MEDIAN'
  expect_grep bench_text out '^4\.00 MiB +pinmem_cold_pin +'
  expect_grep bench_text out '^TARGET cold pin 1 GiB .*not measured'
  expect_grep bench_text out '^TARGET cached alloc\+free pair median <= 1 us: .*cuda backend only'
  expect_grep bench_text out '^TARGET pool overhead .*<= 1\.125: [0-9.]+  (PASS|MISS)$'
  checks=$((checks + 1))
  if grep -q ' NO$' "$tmp/bench_text.out"; then fail "bench_text: a row is not verified"; show bench_text; fi
fi

# The JSON lines read back give the table and the TARGET lines again.
run summarize "$bin" bench alloc --summarize "$tmp/bench_json.out"
if expect_rc summarize 0; then
  expect_grep summarize out '^4\.00 MiB +pinmem_cold_pin +'
  expect_grep summarize out '^16\.0 MiB +pinmem_cached_pair +'
  expect_grep summarize out '^TARGET pool overhead .*<= 1\.125: [0-9.]+  (PASS|MISS)$'
fi
run summarize_missing "$bin" bench alloc --summarize "$tmp/no-such-file"
expect_rc summarize_missing 1 && expect_grep summarize_missing err '^pinmem: .*no-such-file'

# ---- failures: status name and detail, exit 1 -------------------------------------------------
# A request larger than the whole budget of the pool.
run budget env PINMEM_BUDGET=1M "$bin" bench alloc --sizes 4M --repeat 1 --json
expect_rc budget 1 && expect_grep budget err '^pinmem: PM_ERR_(BUDGET|INVALID): .*budget'
checks=$((checks + 1))
[[ $(wc -l <"$tmp/budget.err") -eq 1 ]] || { fail "budget: want one line on stderr"; show budget; }

# cuda asked for: fine where a GPU is usable, otherwise a clear failure.
run cuda env PINMEM_BACKEND=cuda "$bin" info --json
if [[ $rc -ne 0 ]]; then
  expect_rc cuda 1 && expect_grep cuda err '^pinmem: PM_ERR_[A-Z_]+: .+'
  json_check cuda "
if not any(r.get('info') == 'option' for r in rows):
    bad('the option table should still be printed when the backend fails')"
fi

# ---- bad command lines: usage on stderr, exit 2, nothing on stdout ------------------------------
bad_lines=(
  ""
  "frobnicate"
  "info extra"
  "info --bogus"
  "bench"
  "bench nope"
  "bench alloc --repeat 0"
  "bench alloc --repeat x"
  "bench alloc --repeat"
  "bench alloc --threads -1"
  "bench alloc --sizes 12Q"
  "bench alloc --sizes 0"
  "bench alloc --sizes ,"
  "info --sizes 4M"
  "--version info"
  "bench alloc --summarize"
  "bench alloc --summarize x --sizes 4M"
  "bench copy --sizes 0"
  "bench copy --repeat 0"
  "bench copy --cases"
  "bench copy extra"
  "bench copy --devices 7"
  "bench copy --devices"
  "bench copy --devices 0,0"
  "bench copy --devices 0,"
  "bench copy --devices ,0"
  "bench copy --devices all --cases x"
  "bench overlap --bytes x"
  # empty list items, repeated options, unknown cases, --quiet outside a bench
  "bench alloc --sizes 1M,,2M"
  "bench alloc --sizes 1M,"
  "bench copy --sizes 1M,,2M"
  "bench copy --cases plain_pinned,,pinmem_pinned"
  "bench alloc --sizes 4M --sizes 8M"
  "bench alloc --repeat=1 --repeat 2"
  "bench alloc --summarize a --summarize b"
  "bench copy --repeat 1 --repeat 2"
  "bench copy --sizes 4K --sizes=8K"
  "bench overlap --bytes 1M --bytes 2M"
  "bench loader --batch 2 --batch 3"
  "bench loader --data a,,b"
  "bench copy --cases bogus"
  "info --quiet"
  "bench file --cases bogus"
  "bench file --bytes 0"
  "bench file --repeat x"
  "bench file --chunk 1K"
  "bench file extra"
  "bench file --cases load_direct,,save_direct"
  "bench file --threads 2,,4"
  "bench file --part 1K"
  "bench blocks --sizes 4K,,16K"
  "bench blocks --sizes 5"
  "bench blocks --blocks 0"
  "bench blocks --arena x"
  "bench blocks extra"
  "bench file --slots 5000"
)
# ---- bench copy and bench overlap: on the host backend they prove correctness, not speed -------
# Every case of bench copy at 4 KiB, one staged size and one above the mover rows' 8 MiB floor;
# every row must say its bytes were checked (or why the case cannot run here), the staged and
# direct paths must be the ones pinmem picked, and the TARGET lines must say they apply to cuda.
run copy_json env PINMEM_COPY_STAGE_MIN=1M "$bin" bench copy --json --sizes 4K,3M,9M --repeat 2
expect_rc copy_json 0 &&
  json_check copy_json "
rows = [r for r in rows if r.get('bench') == 'copy']
MIB = 1 << 20
for r in rows:
    if r.get('backend') != 'host':
        bad('backend: %r' % r)
    # verified is one boolean in every bench; the check that ran is verify_method.
    if not isinstance(r.get('verified'), bool) or r.get('verify_method') not in ('full', 'sampled', 'checksum', 'none'):
        bad('verified must be a bool with a verify_method: %r' % r)
    # GPU-only cases are kept but marked: their speed means nothing on the host backend.
    gpu_only = r.get('case') in ('zerocopy_mapped', 'managed_prefetch')
    if r.get('applicable') is not (not gpu_only):
        bad('applicable should be %r: %r' % (not gpu_only, r))
    if r.get('skipped'):
        if r.get('case') not in ('zerocopy_mapped',) or r.get('verified') is not False:
            bad('unexpected skip: %r' % r)
        continue
    if r.get('verified') is not True:
        bad('row not verified: %r' % r)
    if r.get('verify_method') == 'none' and r.get('case') != 'read_under_dma':
        bad('only the read-only load has nothing to verify: %r' % r)
    if not (isinstance(r.get('gbps'), float) and r['gbps'] > 0):
        bad('gbps: %r' % r)
def one(case, d, n):
    got = [r for r in rows if r['case'] == case and r['dir'] == d and r['bytes'] == n]
    if len(got) != 1:
        bad('want one %s %s %d row, got %d' % (case, d, n, len(got)))
        return {}
    return got[0]
for d in ('h2d', 'd2h'):
    for n in (4096, 3 * MIB, 9 * MIB):
        for c in ('plain_pageable', 'plain_pinned', 'pinmem_pageable', 'pinmem_pageable_ring',
                  'pinmem_pinned', 'managed_prefetch'):
            one(c, d, n)
    if one('pinmem_pageable', d, 9 * MIB).get('path') != 'staged':
        bad('a 9 MiB pageable copy should be staged')
    if one('pinmem_pinned', d, 9 * MIB).get('path') != 'direct':
        bad('a pinned copy should be direct')
    # Each managed run is one prefetch: a repeat would find the pages already moved.
    for n in (4096, 3 * MIB, 9 * MIB):
        if one('managed_prefetch', d, n).get('copies_per_run') != 1:
            bad('managed_prefetch %s %d: one prefetch per run' % (d, n))
    if one('plain_pinned', d, 4096).get('copies_per_run', 0) <= 1:
        bad('small copies repeat within a run')
for n in (4096, 3 * MIB, 9 * MIB):
    one('pinmem_pageable_units', 'h2d', n)
if any(r['case'] == 'pinmem_pageable_units' and r['dir'] != 'h2d' for r in rows):
    bad('the unit layout is an H2D case')
for n in (4096, 3 * MIB, 9 * MIB):
    for c in ('plain_pageable', 'plain_pinned', 'pinmem_pageable', 'pinmem_pinned'):
        one(c, 'bidir', 2 * n)
r = one('pinmem_pinned', 'h2d', 9 * MIB)
if r and r.get('baseline') != 'plain_pinned':
    bad('pinmem_pinned is measured against plain_pinned: %r' % r)
for c in ('memcpy_libc', 'memcpy_movsb', 'memcpy_stream', 'h2h_under_dma'):
    one(c, 'h2h', 9 * MIB)
one('read_under_dma', 'read', 9 * MIB)
for c in ('dma_under_h2h', 'dma_under_read'):
    if one(c, 'h2d', 9 * MIB).get('baseline') != 'plain_pinned':
        bad('%s is measured against plain_pinned' % c)
for c in ('batch_pinned_loop', 'batch_pinned_pinmem', 'batch_pinned_dma', 'batch_pinned_kernel'):
    for d in ('h2d', 'd2h'):
        if one(c, d, 1024 * 64 * 1024).get('items') != 1024:
            bad('%s %s: want 1024 items' % (c, d))
for c in ('batch_pageable_loop', 'batch_pageable_pinmem'):
    one(c, 'h2d', 1024 * 64 * 1024)
if any(r.get('order') != 'interleaved' for r in rows
       if r['dir'] in ('h2d', 'd2h', 'bidir') and 'items' not in r and 'load' not in r
       and not r.get('skipped')):
    bad('the case rows should say their runs were interleaved')"
expect_grep copy_json err '^TARGET pinmem from pinned .*cuda backend only\)$'
expect_grep copy_json err '^TARGET pageable H2D 1 GiB .*: not measured in this run$'

# The verifier can fail: with every backend copy made to succeed with wrong bytes (the fault
# op "corrupt": the source shifted by one byte), each row that copies says verified false, the
# command says so on stderr and exits 1. Only the prefetch (no copy) still verifies.
run copy_corrupt env PINMEM_FAULT=corrupt=1+ PINMEM_COPY_STAGE_MIN=1M "$bin" bench copy --json \
  --sizes 4K,3M --repeat 1 --cases plain_pinned,pinmem_pageable,pinmem_pinned,managed_prefetch
expect_rc copy_corrupt 1 &&
  json_check copy_corrupt "
rows = [r for r in rows if r.get('bench') == 'copy']
cases = {(r['case'], r['dir'], r['bytes']): r for r in rows}
for c in ('plain_pinned', 'pinmem_pageable', 'pinmem_pinned', 'managed_prefetch'):
    for d in ('h2d', 'd2h'):
        for n in (4096, 3 << 20):
            r = cases.get((c, d, n))
            if r is None:
                bad('no %s %s %d row' % (c, d, n))
            elif r.get('verified') is not (c == 'managed_prefetch') or r.get('verify_method') != 'full':
                bad('with wrong bytes, %s should say verified %r: %r' % (c, c == 'managed_prefetch', r))"
expect_grep copy_corrupt err '^pinmem: VERIFY FAILED: h2d 4\.00 KiB plain_pinned: byte 0 of 4096 is'

run copy_text "$bin" bench copy --sizes 64K --repeat 1 --cases plain_pinned,pinmem_pinned,managed_prefetch
if expect_rc copy_text 0; then
  expect_grep copy_text out '^h2d +64\.0 KiB +plain_pinned +[0-9.]+ +- +plain +full$'
  expect_grep copy_text out '^d2h +64\.0 KiB +pinmem_pinned +[0-9.]+ +[0-9.]+x +direct +full$'
  if grep -q 'pinmem_pageable' "$tmp/copy_text.out"; then fail "copy_text: --cases was not kept"; fi
fi

run overlap_json "$bin" bench overlap --json --bytes 8M --repeat 2
expect_rc overlap_json 0 &&
  json_check overlap_json "
rows = [r for r in rows if r.get('bench') == 'overlap']
want = ['serial_one_stream', 'pinned_two_streams', 'pageable_plain_two_streams',
        'pageable_pinmem_two_streams']
if [r.get('case') for r in rows] != want:
    bad('cases: %r' % [r.get('case') for r in rows])
for r in rows:
    if r.get('verified') is not True or r.get('verify_method') != 'full' or r.get('bytes') != 8 << 20 or r.get('backend') != 'host':
        bad('row: %r' % r)
    if not (r.get('ratio_vs_max', 0) > 0 and r.get('copy_seconds', 0) > 0 and r.get('kernel_seconds', 0) > 0):
        bad('times: %r' % r)"
expect_grep overlap_json err '^TARGET pinned copy \+ equal kernel .*cuda backend only\)$'

# bench file: every case verified (the disk-only rows say none), the TARGET lines present.
run file_json "$bin" --json bench file --bytes 3M --repeat 1 --chunk 64K --dir "$tmp"
expect_rc file_json 0 &&
  json_check file_json "
rows = [r for r in rows if r.get('bench') == 'file']
want = ['load_hot_buffered', 'load_direct', 'load_cold_buffered', 'plain_load_hot',
        'plain_load_cold', 'disk_read_direct', 'save_buffered', 'save_direct', 'plain_save',
        'disk_write_direct', 'load_hot_auto', 'load_cold_auto', 'save_auto', 'load_hot_mmap']
if [r.get('case') for r in rows] != want:
    bad('cases: %r' % [r.get('case') for r in rows])
for r in rows:
    disk = r['case'].startswith('disk')
    if r.get('verified') is not (None if disk else True) or r.get('bytes') != 3 << 20 or r.get('backend') != 'host':
        bad('row: %r' % r)
    if r.get('verify_method') != ('none' if r['case'].startswith('disk') else 'full'):
        bad('verify_method: %r' % r)"
expect_grep file_json err '^TARGET hot load .*cuda backend only\)$'
expect_grep file_json err '^TARGET save .*cuda backend only\)$'
if ls "$tmp" | grep -q pinmem-bench-file; then fail "file_json: left its files behind"; fi
# bench file's sweep: one row per combination for loads (chunk x threads x slots x part), saves
# without the part axis, each verified and saying what it ran (defaults resolved); io=auto below
# 64 MiB stays buffered.
run file_sweep "$bin" --json bench file --bytes 3M --repeat 1 --chunk 64K,128K --threads 2,3 \
  --slots 0,2 --part 0,16K --cases load_hot_buffered,save_direct,load_hot_auto --dir "$tmp"
expect_rc file_sweep 0 &&
  json_check file_sweep "
rows = [r for r in rows if r.get('bench') == 'file']
def combos(case):
    return sorted((r['chunk'], r['threads'], r['slots'], r['part']) for r in rows if r['case'] == case)
# slots 0 is the default, and the rows say what it came to: threads + 2, and for loads through
# the page cache up to 2 a thread while they hold at most 96 MiB
def default_slots(c, t, cached):
    return max(t + 2, min(-(-(96 << 20) // c), 2 * t)) if cached else t + 2
want = sorted((c, t, s or default_slots(c, t, True), p) for c in (65536, 131072) for t in (2, 3)
              for s in (0, 2) for p in (0, 16384))
if combos('load_hot_buffered') != want: bad('load combos: %r' % combos('load_hot_buffered'))
want = sorted((c, t, s or default_slots(c, t, False), 0) for c in (65536, 131072)
              for t in (2, 3) for s in (0, 2))
if combos('save_direct') != want:
    bad('save combos: %r' % combos('save_direct'))
for r in rows:
    if r.get('verified') is not True: bad('row: %r' % r)
    if r['case'] == 'load_hot_auto' and r.get('direct_share') != 0: bad('auto went direct: %r' % r)
    if r['case'] == 'save_direct' and r.get('direct_share') != (0 if r.get('direct_refused') else 1):
        bad('save_direct: %r' % r)"
expect_grep file_sweep err '^TARGET hot load .*chunk [0-9]+ threads [23] slots [2-6] part .*cuda backend only\)$'

# The loader's CI target: 3 shuffled epochs, 2 ranks x 2 workers, every delivered sample
# checked against its source, each exactly once per epoch.
run loader_verify "$bin" bench loader --verify --world 2 --workers 2 --epochs 3 --pin on
expect_rc loader_verify 0 &&
  expect_grep loader_verify out '^TARGET --verify: 3 epochs, shuffle, 2 ranks x 2 workers: .* PASS$'
run loader_verify_json "$bin" --json bench loader --verify --world 2 --workers 2 --epochs 2 --pin both
expect_rc loader_verify_json 0 &&
  json_check loader_verify_json '
cases = [r for r in rows if r.get("bench") == "loader"]
if len(cases) < 2: bad("expected loader rows for pinned and pageable, got %d" % len(cases))
for r in cases:
    for k in ("case", "bytes", "seconds", "gbps", "verified"):
        if k not in r: bad("loader row without %s: %r" % (k, r))
    if r.get("verified") is not True: bad("loader row not verified: %r" % r)
    if r.get("verify_method") != "full": bad("loader --verify row: verify_method %r" % r.get("verify_method"))
'

# One batch per epoch: the first step is the warm-up, so nothing is timed and the rates are
# null, not 0 GB/s; the batch is still checked.
run loader_one_step "$bin" --json bench loader --samples 1 --batch 2 --epochs 1 --pin on --quiet
expect_rc loader_one_step 0 &&
  json_check loader_one_step '
images = [r for r in rows if r.get("bench") == "loader" and r["case"].startswith("images_")]
if not images: bad("no images rows")
for r in images:
    if r.get("batches") != 0 or r.get("gbps") is not None or r.get("batches_per_s") is not None:
        bad("a run that timed no batch: %r" % {k: r.get(k) for k in ("case", "batches", "gbps", "batches_per_s")})
    if r.get("verified") is not True: bad("loader row not verified: %r" % r)
'

# ---- tools that talk: help, refusals, host labels, progress ----------------------------------
# Each bench's --help lists its cases and its options with the defaults of this (host) backend.
run help_alloc "$bin" bench alloc --help
expect_rc help_alloc 0 && {
  expect_grep help_alloc out '^usage: pinmem bench alloc'
  expect_grep help_alloc out 'pinmem_cold_pin'
  expect_grep help_alloc out '^  host_alloc +the backend'
  expect_grep help_alloc out '--sizes LIST .*\(16M,256M,1G\)'
  expect_grep help_alloc out '--quiet'
}
run help_copy "$bin" bench copy --help
expect_rc help_copy 0 && {
  expect_grep help_copy out 'backend that starts here: host'
  for c in plain_pageable pinmem_pinned managed_prefetch zerocopy_mapped memcpy_stream \
    dma_under_read batch_pageable_pinmem; do
    expect_grep help_copy out "(^|[ ,])$c(,|$)"
  done
  expect_grep help_copy out '--sizes LIST .*default 4K,64K,1M,8M,64M;'
  expect_grep help_copy out '--repeat N .*default 5\)'
  expect_grep help_copy out '--quiet'
}
run help_overlap "$bin" bench overlap --help
expect_rc help_overlap 0 && {
  expect_grep help_overlap out 'pinned_two_streams'
  expect_grep help_overlap out '--sizes LIST .*default 64M;'
}
run help_loader "$bin" bench loader --help
expect_rc help_loader 0 && {
  expect_grep help_loader out 'images_pinned_compute'
  expect_grep help_loader out 'tokens_pinned'
  expect_grep help_loader out '^defaults on the backend that starts here \(host\): batch 64, epochs 2'
}

# An unknown --cases name is refused with the list of the valid ones.
run cases_bogus "$bin" bench copy --cases plain_pinned,bogus --sizes 4K --repeat 1
expect_rc cases_bogus 2 && expect_grep cases_bogus err "^pinmem: --cases: unknown case 'bogus' \(--help lists"
run cases_typo "$bin" bench copy --cases plain_pinnned --sizes 4K --repeat 1
expect_rc cases_typo 2 &&
  expect_grep cases_typo err "^pinmem: --cases: unknown case 'plain_pinnned' \(did you mean 'plain_pinned'\?\)$"
run empty_item "$bin" bench copy --sizes 1M,,2M
expect_rc empty_item 2 && expect_grep empty_item err "item 2 of '1M,,2M' is empty"
run twice "$bin" bench alloc --sizes 4M --sizes 8M
expect_rc twice 2 && expect_grep twice err '^pinmem: --sizes given twice'

# On the host backend each bench says once that its figures prove correctness, not speed (on
# stdout with the table, on stderr with --json); GPU-only cases read n/a, not a ratio.
for b in alloc_text:bench_text copy_text:copy_text; do
  name=${b#*:}
  checks=$((checks + 1))
  n=$(grep -c 'correctness, not speed' "$tmp/$name.out")
  [[ $n -eq 1 ]] || { fail "$name: want the host note once on stdout, got $n"; show "$name"; }
done
for name in bench_json copy_json overlap_json loader_verify_json; do
  expect_grep "$name" err '^host backend: .*correctness, not speed'
done
run overlap_text "$bin" bench overlap --bytes 1M --repeat 1
expect_rc overlap_text 0 && expect_grep overlap_text out 'correctness, not speed'
expect_grep loader_verify out 'correctness, not speed'
expect_grep copy_text out '^h2d +64\.0 KiB +managed_prefetch +n/a +n/a +prefetch +full$'
expect_grep copy_text out '^d2h +64\.0 KiB +managed_prefetch +n/a +n/a +prefetch +full$'
# The TARGET lines name the baseline the ratio was taken against: host_alloc here.
expect_grep bench_text out '^TARGET cold pin 1 GiB .*1/6 of host_alloc'
checks=$((checks + 1))
if grep -q '^TARGET.*cudaHostAlloc' "$tmp/bench_text.out" "$tmp/summarize.out"; then
  fail "bench alloc on the host backend names cudaHostAlloc in a TARGET line"
  show bench_text
fi

# pinmem info says why the backend in force was taken: auto gives the driver's trouble (no
# driver, too old, no device), or that the build has no cuda backend, or that a device is present.
run info_auto env -u PINMEM_BACKEND "$bin" info
expect_rc info_auto 0 &&
  expect_grep info_auto out '^backend +(host|cuda) \(auto: (no NVIDIA driver found \(.+\)|NVIDIA driver .+|this pinmem was built without the cuda backend .+|a CUDA device is present)\)$'
run info_auto_json env -u PINMEM_BACKEND "$bin" info --json
expect_rc info_auto_json 0 &&
  json_check info_auto_json "
head = [r for r in rows if r.get('info') == 'pinmem']
if not head or not str(head[0].get('backend_reason', '')).startswith('auto: '):
    bad('backend_reason under auto: %r' % head)"
if [[ -s $tmp/cuda.err ]]; then
  # cuda asked for and not startable (checked above with --json): the text says so too.
  run cuda_text env PINMEM_BACKEND=cuda "$bin" info
  expect_rc cuda_text 1 && expect_grep cuda_text out '^backend +none \(PINMEM_BACKEND=cuda cannot start: PM_ERR_'
fi

# Progress: one line per case on stderr when it is not a terminal (every bench above wrote its
# text table with stderr to a file), never a \r there; a line rewritten with \r on a terminal;
# none with --quiet.
for name in bench_text copy_text overlap_text loader_verify; do
  expect_grep "$name" err '^pinmem: (\[[0-9]+/[0-9]+\] )?[^ ].* \([0-9]+\.[0-9] s\)$'
  checks=$((checks + 1))
  if grep -q $'\r' "$tmp/$name.err"; then fail "$name: a \\r on stderr that is not a terminal"; show "$name"; fi
  checks=$((checks + 1))
  runs=$(grep -Ec 'run [0-9]+/|round [0-9]+/' "$tmp/$name.err")
  if ((runs)); then fail "$name: a progress line per run, not per case"; show "$name"; fi
done
run quiet_pipe "$bin" bench overlap --sizes 1M --repeat 1 --quiet
expect_rc quiet_pipe 0
checks=$((checks + 1))
if [[ -s $tmp/quiet_pipe.err ]]; then fail "quiet_pipe: --quiet, yet stderr got output"; show quiet_pipe; fi
# A small .npy for the loader's runs here: 256 samples of 64 bytes, not zeros.
python3 - "$tmp/small.npy" <<'PY'
import struct, sys
h = "{'descr': '<u4', 'fortran_order': False, 'shape': (256, 16), }"
h += " " * ((64 - (10 + len(h) + 1) % 64) % 64) + "\n"
with open(sys.argv[1], "wb") as f:
    f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h.encode())
    f.write(struct.pack("<4096I", *[(i * 2654435761 + 12345) & 0xffffffff for i in range(4096)]))
PY
have_script=0
command -v script >/dev/null && script -qec true /dev/null >/dev/null 2>&1 && have_script=1
for q in alloc copy overlap loader; do
  case $q in
    alloc) args=(bench alloc --sizes 4M --repeat 1 --overhead-total 64M) ;;
    copy) args=(bench copy --sizes 64K --repeat 1 --cases plain_pinned) ;;
    overlap) args=(bench overlap --bytes 1M --repeat 1) ;;
    loader) args=(bench loader --data "$tmp/small.npy" --pin on --epochs 2 --batch 16) ;;
  esac
  if ((have_script)); then
    # script(1) gives the command a terminal; its stdout and stderr both land in the file.
    run "tty_$q" script -qec "$(printf '%q ' "$bin" "${args[@]}")" /dev/null
    expect_rc "tty_$q" 0 && expect_grep "tty_$q" out $'\r  \\[[0-9]+/[0-9]+\\] .+ \\([0-9]+\\.[0-9] s\\)'
    run "tty_quiet_$q" script -qec "$(printf '%q ' "$bin" "${args[@]}" --quiet)" /dev/null
    expect_rc "tty_quiet_$q" 0
    checks=$((checks + 1))
    if grep -q $'\r  \\[' "$tmp/tty_quiet_$q.out"; then
      fail "tty_quiet_$q: progress printed despite --quiet"
      show "tty_quiet_$q"
    fi
  else
    # No script(1): at least --quiet is taken and nothing reaches a stderr that is no terminal.
    run "quiet_$q" "$bin" "${args[@]}" --quiet
    expect_rc "quiet_$q" 0
    checks=$((checks + 1))
    [[ -s $tmp/quiet_$q.err ]] && { fail "quiet_$q: --quiet run wrote to stderr"; show "quiet_$q"; }
  fi
done

# ---- bench loader: what it refuses, what it keeps ----------------------------------------------
# A device or a FIFO as --data is refused at once (it used to be read for ever while warming).
run data_zero timeout 60 "$bin" bench loader --data /dev/zero --pin on --epochs 1
expect_rc data_zero 2 && expect_grep data_zero err "^pinmem: --data: '/dev/zero' is a character device"
mkfifo "$tmp/fifo"
run data_fifo timeout 60 "$bin" bench loader --data "$tmp/fifo" --pin on --epochs 1
expect_rc data_fifo 2 && expect_grep data_fifo err "is a FIFO"
run tokens_dir timeout 60 "$bin" bench loader --tokens "$tmp" --seq-len 8
expect_rc tokens_dir 2 && expect_grep tokens_dir err "is a folder"
# 300 one-sample .npy files: every one of them is in the dataset.
python3 - "$tmp/npy" <<'PY'
import os, struct, sys
d = sys.argv[1]
os.mkdir(d)
for i in range(300):
    h = "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 4), }"
    h += " " * ((64 - (10 + len(h) + 1) % 64) % 64) + "\n"
    with open(os.path.join(d, "f%03d.npy" % i), "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h.encode())
        f.write(struct.pack("<4f", i, i + 0.25, i + 0.5, i + 0.75))
PY
files=$(printf '%s,' "$tmp"/npy/f*.npy)
run data_300 timeout 120 "$bin" bench loader --json --data "${files%,}" --pin on --epochs 1 --batch 16
expect_rc data_300 0 &&
  json_check data_300 "
rows = [r for r in rows if r.get('bench') == 'loader']
if not rows:
    bad('no loader rows')
for r in rows:
    if r.get('samples') != 300:
        bad('want all 300 files (one sample each) in the dataset, got samples=%r' % r.get('samples'))
    if r.get('verified') is not True or r.get('verify_method') != 'first_batch+coverage':
        bad('row: %r' % r)"

# ---- bench alloc --summarize of a damaged file ---------------------------------------------------
{ head -n 1 "$tmp/bench_json.out"; echo 'not json at all'; tail -n +2 "$tmp/bench_json.out"; } >"$tmp/damaged.jsonl"
run summ_damaged "$bin" bench alloc --summarize "$tmp/damaged.jsonl"
expect_rc summ_damaged 1 && expect_grep summ_damaged err "damaged\.jsonl:2: not a flat JSON object"
{ cat "$tmp/bench_json.out"; echo '{"bench":"alloc","case":"x"}'; } >"$tmp/partial.jsonl"
run summ_partial "$bin" bench alloc --summarize "$tmp/partial.jsonl"
expect_rc summ_partial 1 &&
  expect_grep summ_partial err "partial\.jsonl:$(($(wc -l <"$tmp/bench_json.out") + 1)): a bench alloc row without \"bytes\""
# Lines of other benches and blank lines are passed over.
{ cat "$tmp/bench_json.out"; echo; head -n 2 "$tmp/copy_json.out"; } >"$tmp/mixed.jsonl"
run summ_mixed "$bin" bench alloc --summarize "$tmp/mixed.jsonl"
expect_rc summ_mixed 0 && expect_grep summ_mixed out '^4\.00 MiB +pinmem_cold_pin +'

# bench copy --devices: three simulated devices, each alone and all at once, every row verified,
# a together / alone ratio on each together row, an aggregate row per case.
run devices env PINMEM_HOST_DEVICES=3 "$bin" --json bench copy --devices all --size 256K --repeat 1
expect_rc devices 0 && json_check devices '
cases = {"h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable"}
for r in rows:
    if r.get("bench") != "copy_devices": bad("bench %r" % r.get("bench"))
    if r.get("verified") is not True: bad("not verified: %r" % r)
    if r.get("case") not in cases: bad("case %r" % r.get("case"))
for c in cases:
    mine = [r for r in rows if r.get("case") == c]
    modes = sorted((r["mode"], r["device"] if r["device"] is not None else -1) for r in mine)
    want = sorted([("alone", d) for d in range(3)] + [("together", d) for d in range(3)] +
                  [("aggregate", -1)])
    if modes != want: bad("%s: rows %r" % (c, modes))
    for r in mine:
        if r["mode"] == "together" and not (r.get("ratio") or 0) > 0: bad("no ratio: %r" % r)
        if r["mode"] == "aggregate" and r["bytes"] != 3 * 256 * 1024: bad("aggregate %r" % r)
'
run devices_one "$bin" bench copy --devices 0 --size 64K --repeat 1
expect_rc devices_one 0 && expect_grep devices_one out '^one device \(0\)'

i=0
# One style for every bad command line: the error on the first line, then at most three lines
# of usage, then "see pinmem [CMD] --help" naming the command that was given.
usage_style() { # NAME COMMAND-LINE
  checks=$((checks + 1))
  local err=$tmp/$1.err lines want
  lines=$(wc -l <"$err")
  want="^see pinmem( (info|bench( (alloc|copy|overlap|loader|file|blocks))?))? --help\$"
  if ! head -1 "$err" | grep -Eq '^pinmem: [^ ].+' || ((lines < 3 || lines > 5)) ||
    ! sed -n 2p "$err" | grep -Eq '^usage: pinmem ' || ! tail -1 "$err" | grep -Eq "$want"; then
    fail "$1 (pinmem $2): stderr is not the error, 1-3 lines of usage, then 'see pinmem ... --help'"
    show "$1"
  fi
  # The help named is the command's own: `bench copy ...` points to `pinmem bench copy --help`.
  local cmd
  cmd=$(sed -E 's/^(--(json|quiet) )*//' <<<"$2" | awk '{ if ($1 == "bench" && $2 ~ /^(alloc|copy|overlap|loader|file|blocks)$/) print $1 " " $2; else if ($1 == "info" || $1 == "bench") print $1 }')
  if [[ -n $cmd ]] && ! tail -1 "$err" | grep -q "^see pinmem $cmd --help\$"; then
    fail "$1 (pinmem $2): want 'see pinmem $cmd --help' last"
    show "$1"
  fi
}
for line in "${bad_lines[@]}"; do
  i=$((i + 1))
  # shellcheck disable=SC2086
  run "bad$i" "$bin" $line
  expect_rc "bad$i" 2 || { echo "  (command line: pinmem $line)" >&2; continue; }
  expect_grep "bad$i" err '^usage: pinmem'
  expect_grep "bad$i" err '^pinmem: .+'
  usage_style "bad$i" "$line"
  checks=$((checks + 1))
  if [[ -s $tmp/bad$i.out ]]; then fail "bad$i (pinmem $line): wrote to stdout"; show "bad$i"; fi
done

# The messages: "did you mean" from the known names, the rule that was broken, and an unknown
# option never taken for a known one that lacks its value.
# msg NAME WANT-RC EXTENDED-REGEX ARGS...: pinmem ARGS exits WANT-RC with the regex on stderr.
msg() {
  local name=$1 want=$2 re=$3
  shift 3
  run "$name" "$bin" "$@"
  expect_rc "$name" "$want" && expect_grep "$name" err "$re"
}
msg dym_cmd 2 "^pinmem: unknown command 'inof' \(did you mean 'info'\?\)$" inof
msg json_help 2 "^pinmem: help prints text; there is no --json form of it$" --json help
msg json_help_flag 2 "^pinmem: help prints text; there is no --json form of it$" --json --help
msg dym_bench 2 "^pinmem: unknown benchmark 'lodaer' \(did you mean 'loader'\?\)$" bench lodaer
msg dym_global 2 "^pinmem: unknown option '--jsno' \(did you mean '--json'\?\)$" --jsno info
msg dym_info 2 "^pinmem: unknown option '--optoins' \(did you mean '--options'\?\)$" info --optoins
msg dym_alloc 2 "^pinmem: unknown option '--repaet' \(did you mean '--repeat'\?\)$" bench alloc --repaet 2
msg dym_copy 2 "^pinmem: unknown option '--szes=4K' \(did you mean '--sizes'\?\)$" bench copy --szes=4K
msg dym_overlap 2 "^pinmem: unknown option '--repat' \(did you mean '--repeat'\?\)$" bench overlap --repat 1
msg dym_loader 2 "^pinmem: unknown option '--bach' \(did you mean '--batch'\?\)$" bench loader --bach 3
msg dym_file 2 "^pinmem: unknown option '--jsn' \(did you mean '--json'\?\)$" bench file --jsn
msg dym_file_case 2 "^pinmem: unknown case 'load_drect' \(did you mean 'load_direct'\?\)$" bench file --cases load_drect
msg far_alloc 2 "^pinmem: unknown option '--frobnicate'$" bench alloc --frobnicate
msg far_cmd 2 "^pinmem: unknown command 'frobnicate' \(known: info, bench, help, version\)$" frobnicate
checks=$((checks + 1))
if grep -q 'needs a value' "$tmp/dym_file.err"; then fail "bench file --jsn: taken for an option that lacks its value"; show dym_file; fi
msg rule_copy0 2 "^pinmem: --sizes: sizes must be > 0, not '0'$" bench copy --sizes 0
msg rule_alloc0 2 "^pinmem: --sizes: sizes must be > 0, not '0'$" bench alloc --sizes 4M,0
msg rule_file0 2 "^pinmem: --sizes: sizes must be > 0, not '0'$" bench file --bytes 0
msg rule_overlap_q 2 "^pinmem: --sizes: '12Q' is not a size: unexpected 'Q' \(want e\.g\. 4096, 64K, 1\.5M, 2G, 1T\)$" bench overlap --size 12Q
# The reason comes from the parser, not from cutting its message at the first "'): ": a size text
# holding those characters kept part of itself in the reason.
msg rule_size_quote 2 "^pinmem: --sizes: '1'\): 2' is not a size: unexpected ''\): 2' \(want e\.g\. 4096, 64K, 1\.5M, 2G, 1T\)$" bench alloc --sizes "1'): 2"
msg rule_file_quote 2 "^pinmem: --chunk: '1'\): 2' is not a size: unexpected ''\): 2' \(want e\.g\. 4096, 64K, 1\.5M, 2G, 1T\)$" bench file --chunk "1'): 2"
msg rule_devices0 2 "^pinmem: --sizes: sizes must be > 0, not '0'$" bench copy --devices 0 --size 0
msg rule_chunk 2 "^pinmem: --chunk: sizes must be 0 \(the default\) or >= 4K, not '1K'$" bench file --chunk 1K
msg rule_repeat 2 "^pinmem: --repeat must be a whole number from 1 to 10000, not '0'$" bench copy --repeat 0
msg rule_workers 2 "^pinmem: --workers must be a whole number from 0 to 256, not '999'$" bench loader --workers 999
msg alias_twice 2 "^pinmem: --sizes given twice \(--bytes and --size are other names for it\)$" bench overlap --bytes 1M --sizes 2M
msg info_both 2 "^pinmem: --summary and --options exclude each other$" info --summary --options
# Every bench reads its options by the same rules (tools/output.c, cli_opts_next).
msg twice_blocks 2 "^pinmem: --repeat given twice$" bench blocks --repeat 2 --repeat 3
msg twice_file 2 "^pinmem: --dir given twice$" bench file --dir /tmp --dir=/var/tmp
msg twice_loader_flag 2 "^pinmem: --verify given twice$" bench loader --verify --verify
msg flag_value 2 "^pinmem: --json takes no value, not '1'$" bench file --json=1
msg bare_blocks 2 "^pinmem: bench blocks takes no argument 'stray'$" bench blocks stray
msg dev_twice 2 "^pinmem: --repeat given twice$" bench copy --devices 0 --repeat 1 --repeat 2
msg dev_cases 2 "^pinmem: --cases does not apply to --devices" bench copy --devices 0 --cases plain_pinned
msg last_value 2 "^pinmem: --arena needs a value$" bench blocks --arena
# `pinmem --help bench` is `pinmem bench --help` (it said a benchmark name was missing).
run help_bench_flag "$bin" --help bench
expect_rc help_bench_flag 0 && expect_grep help_bench_flag out '^usage: pinmem'
# Repeated flags before a command and in info, as in the benches; empty device items.
msg twice_global 2 "^pinmem: --json given twice$" --json --json info
msg twice_info_json 2 "^pinmem: --json given twice$" --json info --json
msg twice_summary 2 "^pinmem: --summary given twice$" info --summary --summary
msg twice_quiet 2 "^pinmem: --quiet given twice$" --quiet --quiet bench overlap
msg dir_empty 2 "^pinmem: --dir needs a folder, not ''$" bench file --dir ""
msg dev_empty 2 "^pinmem: --devices: item 2 of '0,' is empty$" bench copy --devices 0, --size 4K

# One set of size flags: --sizes takes a list in every bench; --bytes and --size are the same flag.
run alias_copy "$bin" --json bench copy --bytes 4K,8K --repeat 1 --cases plain_pinned
expect_rc alias_copy 0 && json_check alias_copy "
got = sorted({r['bytes'] for r in rows if r.get('bench') == 'copy' and r.get('dir') == 'h2d'})
if got != [4096, 8192]:
    bad('bench copy --bytes 4K,8K: h2d sizes %r' % got)"
run alias_alloc "$bin" --json bench alloc --size 4M --repeat 1 --overhead-total 8M
expect_rc alias_alloc 0 && json_check alias_alloc "
if not any(r.get('case') == 'pinmem_cold_pin' and r.get('bytes') == 4 << 20 for r in rows):
    bad('bench alloc --size 4M: no 4 MiB cold pin row')"
run sizes_overlap "$bin" --json bench overlap --sizes 1M,2M --repeat 1
expect_rc sizes_overlap 0 && json_check sizes_overlap "
for n in (1 << 20, 2 << 20):
    got = [r for r in rows if r.get('bytes') == n]
    if len(got) != 4 or not all(r.get('verified') is True for r in got):
        bad('bench overlap --sizes 1M,2M: want 4 verified rows of %d bytes, got %r' % (n, got))"
run sizes_file "$bin" --json bench file --sizes 1M,2M --repeat 1 --cases load_hot_buffered --dir "$tmp"
expect_rc sizes_file 0 && json_check sizes_file "
got = sorted(r.get('bytes') for r in rows if r.get('case') == 'load_hot_buffered')
if got != [1 << 20, 2 << 20]:
    bad('bench file --sizes 1M,2M: sizes %r' % got)"

# pinmem info --summary: a few lines for a benchmark's log; --options: the option table alone.
run info_summary "$bin" info --summary
expect_rc info_summary 0 && {
  expect_grep info_summary out '^pinmem [0-9.]+, backend host \('
  expect_grep info_summary out '^device 0: .+, PCIe .+, NUMA node .+'
  expect_grep info_summary out '^limits: RLIMIT_MEMLOCK .+; pool budget '
  checks=$((checks + 1))
  if (($(wc -l <"$tmp/info_summary.out") > 12)); then fail "info --summary: more than 12 lines"; show info_summary; fi
}
# A node the machine does not have: the summary says so, as plain info does (it claimed "all
# pinned memory on it").
run info_summary_node env PINMEM_NUMA=63 "$bin" info --summary
expect_rc info_summary_node 0 &&
  expect_grep info_summary_node out '^NUMA placement: node 63: .*\(this machine has no node 63: '
run info_options "$bin" info --options
expect_rc info_options 0 && {
  expect_grep info_options out '^ +file_chunk +PINMEM_FILE_CHUNK '
  checks=$((checks + 1))
  if grep -Eq '^(backend|devices|NUMA)' "$tmp/info_options.out"; then fail "info --options: machine lines"; show info_options; fi
}
run info_options_json "$bin" --json info --options
expect_rc info_options_json 0 && json_check info_options_json "
if not rows or any(r.get('info') != 'option' for r in rows):
    bad('info --options --json: want option lines only')"

# ---- bench blocks: every path both ways, bytes checked; the arena rows --------------------------
run blocks_json "$bin" --json bench blocks --sizes 4K,64K --blocks 64 --arena 4M --repeat 1
expect_rc blocks_json 0 &&
  json_check blocks_json "
cases = {r.get('case') for r in rows}
for p in ('memcpy_loop', 'batch_dma', 'pinmem'):
    for d in ('out', 'in'):
        if p + '_' + d not in cases:
            bad('bench blocks: no row %s_%s' % (p, d))
for c in ('arena_first_block', 'arena_whole', 'host_alloc_whole'):
    if c not in cases:
        bad('bench blocks: no row ' + c)
for r in rows:
    if r.get('bench') != 'blocks' or r.get('verified') is not True:
        bad('bench blocks: row not verified: %r' % r)
if len([r for r in rows if r.get('block_bytes') == 4096]) != 6:
    bad('bench blocks: want 6 rows of 4 KiB blocks')"
expect_grep blocks_json err '^TARGET pinmem D2H at 4 KiB >= 5x batch_dma: '
# An arena of one block (its first block is its last): verified, exit 0
run blocks_one "$bin" --json bench blocks --sizes 4K --blocks 64 --arena 1 --repeat 1
expect_rc blocks_one 0 &&
  json_check blocks_one "
arena = [r for r in rows if str(r.get('case', '')).startswith('arena')]
if not arena or any(r.get('verified') is not True for r in arena):
    bad('bench blocks --arena 1: arena rows not verified: %r' % arena)"
run blocks_help "$bin" bench blocks --help
expect_rc blocks_help 0 && expect_grep blocks_help out 'cudaMemcpyBatchAsync'

if ((failures)); then
  echo "test_cli: $failures of $checks checks FAILED" >&2
  exit 1
fi
echo "test_cli: all $checks checks passed"
