/*
 * The pieces `pinmem bench copy` and `pinmem bench overlap` share (bench_copy_common.h names the
 * files of each job): their options and --help, the byte pattern every copied byte is checked
 * against, the buffers, streams and events, the rows' text and JSON output, and the TARGET lines.
 *
 * The pattern: byte k is a pure function of k, so any range of any buffer can be checked against
 * its absolute offset without a reference copy; a full compare up to 256 MiB (in parallel),
 * beyond that the first and last 64 KiB and 4096 random 4 KiB windows.
 */
#include "bench_copy_common.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define PAT_SEED 0x5DEECE66Dull

static const char *copy_usage =
    "pinmem bench copy [--json] [--quiet] [--sizes LIST] [--repeat N] [--cases LIST]\n"
    "pinmem bench copy --devices LIST|all [--sizes LIST] [--repeat N] [--json]";
static const char *ov_usage = "pinmem bench overlap [--json] [--quiet] [--sizes LIST] [--repeat N]";

/* `pinmem bench copy|overlap --help`: the cases and the options with their defaults on the
 * backend that starts here. */
static void print_help(bool is_copy) {
  pm_status_t st = pm_init();
  bool cuda = st == PM_OK && pm_backend_kind() == PM_BACKEND_CUDA;
  printf("usage: %s\n\n", is_copy ? copy_usage : ov_usage);
  printf("defaults below are for the backend that starts here: %s%s\n\n",
         st == PM_OK ? pm_backend_name() : "none",
         st == PM_OK ? "" : " (it did not start; host defaults shown)");
  if (is_copy) {
    const char *names[64];
    int n = bc_case_names(names, 64);
    printf("cases (--cases picks rows by these names; default all):\n");
    size_t col = 0;
    for (int i = 0; i < n; i++) {
      size_t len = strlen(names[i]);
      if (col && col + 2 + len > 90) {
        printf(",\n");
        col = 0;
      } else if (col) {
        printf(", ");
        col += 2;
      }
      if (!col) {
        printf("  ");
        col = 2;
      }
      printf("%s", names[i]);
      col += len;
    }
    printf("\n");
    printf(
        "  zerocopy_mapped and managed_prefetch measure GPU features: on the host backend the\n"
        "  first is skipped and the second runs for its bytes only (GB/s and ratio \"n/a\",\n"
        "  \"applicable\": false in JSON)\n\n");
    printf("options:\n");
    printf(
        "  --sizes LIST   copy sizes, K/M/G suffixes (default %s; --bytes and --size are other\n"
        "                 names for it)\n",
        cuda ? "4K,64K,1M,8M,64M,256M,1G" : "4K,64K,1M,8M,64M");
    printf(
        "  --devices LIST|all  the several-device rows instead: each device's copy at once\n"
        "                 (with --sizes, --repeat and --json)\n");
    printf("  --cases LIST   only these rows, comma-separated (default: all)\n");
    printf("  --repeat N     timed runs per case, the median is reported (default 5)\n");
    printf(
        "  batch rows: %d x 64 KiB pieces; mover and contention rows at the largest size\n"
        "  when it is 8 MiB or more\n",
        cuda ? 4096 : 1024);
  } else {
    printf(
        "cases: serial_one_stream, pinned_two_streams, pageable_plain_two_streams,\n"
        "  pageable_pinmem_two_streams: a copy and a busy kernel as long as the pinned copy\n\n"
        "options:\n");
    printf(
        "  --sizes LIST   bytes copied, the cases run once per size (default %s; --bytes and\n"
        "                 --size are other names for it)\n",
        cuda ? "256M" : "64M");
    printf("  --repeat N     runs per case, the median is reported (default 5)\n");
  }
  printf(
      "  --json         one JSON object per line: bench, case, bytes, seconds, gbps, verified\n"
      "                 (true/false), verify_method (full, sampled, checksum or none), ...\n"
      "  --quiet        no progress on stderr (shown only when stderr is a terminal)\n"
      "An option with a value may be given once; --json and --quiet more than once.\n");
}

/* 0 ok, else the exit code. */
static int parse_args(const char *cmd, int argc, char **argv, bopts_t *o) {
  bool is_copy = strcmp(cmd, "copy") == 0;
  /* --devices is bench copy's other mode (pm_cli_bench_copy), listed for the did-you-mean. */
  static const char *const copy_valued[] = {"--sizes", "--repeat", "--cases", "--devices", NULL};
  static const char *const ov_valued[] = {"--sizes", "--repeat", NULL};
  static const char *const flags[] = {"--json", "--quiet", "--help", NULL};
  cli_usage_context(is_copy ? "bench copy" : "bench overlap", is_copy ? copy_usage : ov_usage);
  memset(o, 0, sizeof *o);
  cli_opts_t op;
  cli_opts_init(&op, is_copy ? "bench copy" : "bench overlap", argc, argv,
                is_copy ? copy_valued : ov_valued, flags);
  const char *val;
  int got;
  while ((got = cli_opts_next(&op, &val)) == 1) {
    if (strcmp(op.name, "--json") == 0) o->json = true;
    if (strcmp(op.name, "--quiet") == 0) o->quiet = true;
    if (strcmp(op.name, "--help") == 0) {
      print_help(is_copy);
      exit(0);
    }
    if (!val) continue;
    bool repeat = strcmp(op.name, "--repeat") == 0, cases = strcmp(op.name, "--cases") == 0;
    if (cases && cli_list_empty_item(val))
      return cli_usage_fail("--cases: item %d of '%s' is empty", cli_list_empty_item(val), val);
    if (repeat) {
      long long v = 0;
      if (cli_opt_int("--repeat", val, 1, 10000, &v)) return CLI_EXIT_USAGE;
      o->repeat = (int)v;
    } else if (cases) {
      if (strlen(val) + 3 > sizeof o->cases)
        return cli_usage_fail("--cases: the list must be under %zu characters",
                              sizeof o->cases - 2);
      snprintf(o->cases, sizeof o->cases, ",%s,", val);
      /* Every name must be a row of this benchmark: a typo would otherwise run nothing. */
      const char *names[65];
      int n = bc_case_names(names, 64);
      names[n] = NULL;
      char *copy = cli_xstrdup(val), *save = NULL;
      for (char *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        bool known = false;
        for (int k = 0; k < n && !known; k++) known = strcmp(t, names[k]) == 0;
        if (known) continue;
        const char *near = cli_suggest(t, names);
        int rc = near ? cli_usage_fail("--cases: unknown case '%s' (did you mean '%s'?)", t, near)
                      : cli_usage_fail("--cases: unknown case '%s' (--help lists the cases)", t);
        free(copy);
        return rc;
      }
      free(copy);
    } else if (strcmp(op.name, "--sizes") == 0) {
      int rc = cli_parse_sizes("--sizes", val, o->sizes, 32, &o->nsizes);
      if (rc) return rc;
    } else {
      return cli_usage_fail("%s is not an option of bench %s", op.name, cmd);
    }
  }
  return got;
}

/* ---- the byte pattern and its checks ----------------------------------------------------------
 */

/* Byte k of the pattern is byte k % 8 (little-endian) of pat_word(k / 8): any range of any
 * buffer can be checked against its absolute offset without a reference copy. */
static inline uint64_t pat_word(uint64_t i) {
  /* splitmix64's value number i from PAT_SEED (pm__mix64 adds one step itself). */
  return pm__mix64((i - 1) * 0x9E3779B97F4A7C15ull + PAT_SEED);
}

static inline unsigned char pat_byte(uint64_t k) {
  return (unsigned char)(pat_word(k / 8) >> (8 * (k % 8)));
}

#define PAT_PIECE (16 * MIB)

typedef struct pat_job {
  char *p;
  const char *cp;
  size_t n;
  uint64_t at;       /* pattern offset of p[0] */
  atomic_ullong bad; /* first bad offset + 1, or 0 */
} pat_job_t;

static void pat_fill_piece(void *vctx, size_t i) {
  pat_job_t *j = vctx;
  size_t lo = i * PAT_PIECE, hi = PM__MIN(j->n, lo + PAT_PIECE);
  for (size_t k = lo; k < hi;) {
    uint64_t abs = j->at + k;
    if (abs % 8 == 0 && k + 8 <= hi) {
      uint64_t w = pat_word(abs / 8);
      memcpy(j->p + k, &w, 8);
      k += 8;
    } else {
      j->p[k] = (char)pat_byte(abs);
      k++;
    }
  }
}

static void pat_fill(void *p, size_t n, uint64_t at) {
  pat_job_t j = {.p = p, .n = n, .at = at};
  atomic_init(&j.bad, 0);
  pm__parallel_for(pm__cpu_count(), (n + PAT_PIECE - 1) / PAT_PIECE, pat_fill_piece, &j);
}

/* First offset in [lo, hi) of cp that differs from the pattern, or SIZE_MAX. */
static size_t pat_check_span(const char *cp, size_t lo, size_t hi, uint64_t at) {
  for (size_t k = lo; k < hi;) {
    uint64_t abs = at + k;
    if (abs % 8 == 0 && k + 8 <= hi) {
      uint64_t w;
      memcpy(&w, cp + k, 8);
      if (w != pat_word(abs / 8)) {
        for (size_t b = 0; b < 8; b++)
          if ((unsigned char)cp[k + b] != pat_byte(abs + b)) return k + b;
      }
      k += 8;
    } else {
      if ((unsigned char)cp[k] != pat_byte(abs)) return k;
      k++;
    }
  }
  return SIZE_MAX;
}

static void pat_check_piece(void *vctx, size_t i) {
  pat_job_t *j = vctx;
  size_t lo = i * PAT_PIECE, hi = PM__MIN(j->n, lo + PAT_PIECE);
  size_t at = pat_check_span(j->cp, lo, hi, j->at);
  if (at != SIZE_MAX) {
    unsigned long long want = 0, v = (unsigned long long)at + 1;
    while (!atomic_compare_exchange_weak(&j->bad, &want, v))
      if (want && want <= v) break;
  }
}

/* Check n bytes at cp against the pattern from offset `at`: all of them up to FULL_VERIFY_MAX,
 * else a sample. Returns "full" / "sampled", or NULL (and prints where) on a mismatch. */
const char *bc_pat_verify(const char *what, const void *cp, size_t n, uint64_t at) {
  pat_job_t j = {.cp = cp, .n = n, .at = at};
  atomic_init(&j.bad, 0);
  const char *method;
  if (n <= FULL_VERIFY_MAX) {
    pm__parallel_for(pm__cpu_count(), (n + PAT_PIECE - 1) / PAT_PIECE, pat_check_piece, &j);
    method = "full";
  } else {
    size_t edge = 64 * KIB;
    size_t bad = pat_check_span(cp, 0, edge, at);
    if (bad == SIZE_MAX) bad = pat_check_span(cp, n - edge, n, at);
    uint64_t x = 0x2545F4914F6CDD1Dull ^ n;
    for (int w = 0; w < 4096 && bad == SIZE_MAX; w++) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      size_t lo = (size_t)(x % (n - 4 * KIB));
      bad = pat_check_span(cp, lo, lo + 4 * KIB, at);
    }
    if (bad != SIZE_MAX) atomic_store(&j.bad, (unsigned long long)bad + 1);
    method = "sampled";
  }
  unsigned long long b = atomic_load(&j.bad);
  if (b) {
    size_t k = (size_t)(b - 1);
    fprintf(stderr, "pinmem: VERIFY FAILED: %s: byte %zu of %zu is 0x%02x, expected 0x%02x\n", what,
            k, n, ((const unsigned char *)cp)[k], pat_byte(at + k));
    return NULL;
  }
  return method;
}

/* ---- shared state -----------------------------------------------------------------------------
 */

const result_t *bc_find_result(const bench_t *b, const char *name, const char *dir, size_t bytes) {
  for (int i = 0; i < b->nres; i++)
    if (!strcmp(b->res[i].name, name) && !strcmp(b->res[i].dir, dir) && b->res[i].bytes == bytes)
      return &b->res[i];
  return NULL;
}

void bc_add_result(bench_t *b, const char *name, const char *dir, size_t bytes, double gbps,
                   bool verified) {
  if (b->nres == (int)(sizeof b->res / sizeof b->res[0])) return;
  result_t *r = &b->res[b->nres++];
  snprintf(r->name, sizeof r->name, "%s", name);
  snprintf(r->dir, sizeof r->dir, "%s", dir);
  r->bytes = bytes;
  r->gbps = gbps;
  r->verified = verified;
}

void bc_sync_all(bench_t *b) {
  cli_check(pm_stream_synchronize(b->s1));
  cli_check(pm_stream_synchronize(b->s2));
}

static void *pinned(size_t n, unsigned flags) {
  void *p;
  cli_check(pm_host_alloc(NULL, n, flags, &p));
  return p;
}

static void *pageable(size_t n) {
  char *p = cli_xmalloc(n);
  memset(p, 0, n); /* fault the pages in now, not inside a timed run */
  return p;
}

static void *device(size_t n) {
  void *p;
  cli_check(pm_device_alloc(n, &p));
  return p;
}

void bc_bench_setup(bench_t *b, size_t cap, bool copy_bench) {
  b->cap = cap;
  cli_check(pm_stream_create(&b->s1));
  cli_check(pm_stream_create(&b->s2));
  cli_check(pm_event_create(PM_EVENT_TIMING, &b->e0));
  cli_check(pm_event_create(PM_EVENT_TIMING, &b->e1));
  cli_check(pm_event_create(PM_EVENT_DEFAULT, &b->ex));
  b->hsrc = pageable(cap);
  b->psrc = pinned(cap, PM_HOST_DEFAULT);
  b->vbuf = pinned(cap, PM_HOST_DEFAULT);
  b->d1 = device(cap);
  pat_fill(b->hsrc, cap, 0);
  pat_fill(b->psrc, cap, 0);
  if (!copy_bench) return;
  b->hdst = pageable(cap);
  b->pdst = pinned(cap, PM_HOST_DEFAULT);
  b->wsrc = pinned(cap, PM_HOST_WRITE_COMBINED);
  b->d2 = device(cap);
  b->man = NULL;
  pat_fill(b->wsrc, cap, 0);
  cli_check(pm_memcpy(b->d2, b->psrc, cap, PM_COPY_H2D));
  if (pm_managed_alloc(cap, (void **)&b->man) == PM_OK)
    pat_fill(b->man, cap, 0);
  else
    b->man = NULL;
#if defined(PINMEM_HAVE_CUDA)
  b->have_checksum = b->cuda;
#else
  b->have_checksum = b->cuda && pm__launch_checksum != NULL;
#endif
  if (b->have_checksum) {
    b->msrc = pinned(cap, PM_HOST_MAPPED);
    pat_fill(b->msrc, cap, 0);
    cli_check(pm_host_device_pointer(b->msrc, &b->msrc_dev));
    b->dres = device(sizeof(uint64_t));
  }
}

void bc_bench_teardown(bench_t *b) {
  bc_sync_all(b);
  free(b->hsrc);
  free(b->hdst);
  pm_host_free(b->psrc);
  pm_host_free(b->pdst);
  pm_host_free(b->wsrc);
  pm_host_free(b->vbuf);
  pm_host_free(b->msrc);
  pm_device_free(b->d1);
  pm_device_free(b->d2);
  pm_device_free(b->dres);
  if (b->man) pm_managed_free(b->man);
  pm_event_destroy(b->e0);
  pm_event_destroy(b->e1);
  pm_event_destroy(b->ex);
  pm_stream_destroy(b->s1);
  pm_stream_destroy(b->s2);
}

/* ---- pieces of the cases that several rows share ------------------------------------------------
 */

void bc_h2d_plain(bench_t *b, size_t n, const void *src) {
  cli_check(pm_memcpy_async(b->d1, src, n, PM_COPY_H2D, b->s1));
}

void bc_clear_host(char *p, size_t n) {
  memset(p, 0, n);
}

void bc_prep_d1(bench_t *b, size_t n) {
  cli_check(pm_device_memset_async(b->d1, 0, n, b->s1));
}

const char *bc_v_d1(bench_t *b, size_t n, const char *what) {
  cli_check(pm_memcpy(b->vbuf, b->d1, n, PM_COPY_D2H));
  return bc_pat_verify(what, b->vbuf, n, 0);
}

/* The end of a timed run begun with e0 recorded on s1: with two streams, s2's work joins s1
 * first; then e1 on s1, and the seconds between the two events once everything finished. */
double bc_end_timing(bench_t *b, bool two_streams) {
  if (two_streams) {
    cli_check(pm_event_record(b->ex, b->s2));
    cli_check(pm_stream_wait_event(b->s1, b->ex));
  }
  cli_check(pm_event_record(b->e1, b->s1));
  cli_check(pm_event_synchronize(b->e1));
  bc_sync_all(b);
  double s;
  cli_check(pm_event_elapsed(b->e0, b->e1, &s));
  return s;
}

/* ---- output -------------------------------------------------------------------------------------
 */

static void fmt_gbps(double v, char *buf, size_t len) {
  if (isfinite(v))
    snprintf(buf, len, "%.2f", v);
  else
    snprintf(buf, len, "-");
}

void bc_print_header(void) {
  printf(ROW_FMT, "dir", "size", "case", "GB/s", "ratio", "path", "verified");
}

/* One row of the text table; `size` is the size column's label, a NAN ratio prints "-". A case
 * that is not applicable on this backend prints "n/a" for its speed and ratio. */
void bc_text_row(const char *dir, const char *size, const char *name, double gbps, double ratio,
                 const char *path, bool ok, const char *method, bool applicable) {
  char g[32], ra[32];
  cli_progress_clear();
  fmt_gbps(gbps, g, sizeof g);
  if (!applicable) {
    snprintf(g, sizeof g, "n/a");
    snprintf(ra, sizeof ra, "n/a");
  } else if (isfinite(ratio))
    snprintf(ra, sizeof ra, "%.2fx", ratio);
  else
    snprintf(ra, sizeof ra, "-");
  printf(ROW_FMT, dir, size, name, g, ra, path, ok ? method : "NO (FAILED)");
  fflush(stdout);
}

bool bc_wanted(const bench_t *b, const char *name) {
  if (!b->o.cases[0]) return true;
  char key[64];
  snprintf(key, sizeof key, ",%s,", name);
  return strstr(b->o.cases, key) != NULL;
}

/* The option's current value (keyword options), for the record of a run. */
const char *bc_opt_value(const char *name, char *buf, size_t len) {
  pm_option_info_t oi;
  snprintf(buf, len, "%s", pm_option_find(name, &oi) == PM_OK ? oi.value : "?");
  return buf;
}

/* The copy engine's configuration as it stands, in every row, so a result file says what it
 * measured (rows that force a layout or a batch mode say so in their case name). */
static void copy_cfg_json(cli_json_t *j) {
  pm__copy_cfg_t cfg;
  pm__copy_cfg(&cfg);
  char v[sizeof((pm_option_info_t *)0)->value];
  cli_json_uint(j, "copy_chunk", cfg.chunk);
  cli_json_int(j, "copy_slots", cfg.slots);
  cli_json_int(j, "copy_threads", cfg.threads);
  cli_json_uint(j, "copy_stage_min", cfg.stage_min);
  cli_json_str(j, "copy_bounce", bc_opt_value("copy_bounce", v, sizeof v));
  cli_json_str(j, "copy_memcpy", bc_opt_value("copy_memcpy", v, sizeof v));
  cli_json_str(j, "copy_batch", bc_opt_value("copy_batch", v, sizeof v));
  cli_json_uint(j, "copy_piece", cfg.piece);
  cli_json_int(j, "copy_piece_slots", cfg.piece_slots);
}

/* The keys every bench copy row starts with: `verified` is true when no check of the row's bytes
 * failed, `verify_method` says which check ran ("full", "sampled", "checksum", or "none" for a
 * row that delivers nothing to check), `applicable` is false for a case that measures a GPU
 * feature the host backend only imitates (its bytes are still checked; its speed means
 * nothing). */
void bc_copy_row_json(cli_json_t *j, const char *name, const char *dir, size_t bytes,
                      double seconds, double gbps, bool ok, const char *method, double ratio,
                      const char *baseline, bool applicable) {
  cli_json_row(j, "copy", name, bytes, seconds, gbps);
  cli_json_str(j, "dir", dir);
  cli_json_bool(j, "verified", ok);
  cli_json_str(j, "verify_method", method && method[0] ? method : "none");
  cli_json_bool(j, "applicable", applicable);
  cli_json_double(j, "ratio_vs_plain", ratio);
  cli_json_str(j, "baseline", baseline);
  copy_cfg_json(j);
}

/* TARGET lines go with the table on stdout, or to stderr with --json (stdout stays JSON lines),
 * so the targets are in every run's output. */
void bc_target(const bench_t *b, const char *what, bool measured, bool met, const char *fig) {
  cli_target(b->o.json ? stderr : stdout, what, measured, b->cuda, met, fig);
}

/* Shared start of both benchmarks: parse the options, start pinmem, fill the defaults. Returns
 * 0 with *out set, or the exit code (usage errors, out of memory). */
int bc_bench_begin(const char *name, int argc, char **argv, bench_t **out) {
  bench_t *b = calloc(1, sizeof *b);
  if (!b) {
    fprintf(stderr, "pinmem: out of memory\n");
    return CLI_EXIT_FAILURE;
  }
  int rc = parse_args(name, argc, argv, &b->o);
  if (rc) {
    free(b);
    return rc;
  }
  cli_check(pm_init());
  b->cuda = pm_backend_kind() == PM_BACKEND_CUDA;
  if (!b->o.repeat) b->o.repeat = 5;
  cli_progress_init(b->o.quiet);
  *out = b;
  return 0;
}
