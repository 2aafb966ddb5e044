/*
 * `pinmem bench file`: file <-> device through pinmem (pm_file_read_async / pm_file_write_async)
 * beside a plain loop and the disk's own rate, in one run.
 *
 * Cases (all on one file of --bytes in --dir, written first):
 *   load_hot_buffered           file -> device, page cache hot
 *   load_direct                 file -> device through O_DIRECT (the page cache bypassed)
 *   load_cold_buffered          file -> device after the file left the page cache
 *   plain_load_{hot,cold}       the plain loop: pread 16 MiB into one pinned buffer, then
 *                               pm_memcpy_async and a stream synchronize, chunk after chunk
 *   disk_read_direct            the disk's own rate: O_DIRECT preads of 16 MiB into one aligned
 *                               buffer (dd iflag=direct bs=16M), nothing else
 *   save_{buffered,direct}      device -> file with fdatasync (pm_file_write_async, fsync = 1)
 *   plain_save                  pm_memcpy D2H of 16 MiB into one pinned buffer, pwrite, chunk
 *                               after chunk, then fdatasync
 *   disk_write_direct           O_DIRECT pwrites of 16 MiB from one aligned buffer + fdatasync
 * Cold: fdatasync, posix_fadvise(DONTNEED) on the file, and "1" into /proc/sys/vm/drop_caches
 * where the process may (root); each row says which ("cold_method").
 *
 * Method: a warm-up run, then --repeat timed runs, the median reported; wall-clock time from the
 * call until the fence (or the stream) completed. Every load is verified against the file's
 * pattern (a full compare through a D2H copy), every save by reading the file back. Speed
 * targets (TARGET lines) apply to the cuda backend; on the host backend the runs prove
 * correctness only, so the default size is 64 MiB there (1 GiB on cuda).
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "bench_file.h"
#include "cli.h"
#include "internal.h" /* pm__file_note: whether O_DIRECT was refused */

#define MIB ((size_t)1 << 20)
#define PLAIN_CHUNK (16 * MIB)
#define DIRECT_ALIGN 4096

/* pinmem's targets (cuda backend), issue "files": hot load >= 40 GB/s; cold load and save
 * >= 0.9x the disk's own rate measured in the same run. */
#define T_HOT_GBPS 40.0
#define T_DISK_RATIO 0.9

typedef struct fopts {
  bool json, quiet, help;
  size_t bytes;
  const char *dir;
  int repeat;
  size_t chunk;
  int threads;
  const char *cases;
} fopts_t;

typedef struct fbench {
  fopts_t o;
  bool cuda;
  char path[1024];
  char out_path[1024];
  int fd, out_fd;
  void *dev;
  void *pinned;  /* PLAIN_CHUNK */
  void *aligned; /* PLAIN_CHUNK, DIRECT_ALIGN-aligned */
  unsigned char *check;
  pm_stream_t s;
  const char *cold_method;
  bool failed;
  int steps, steps_done;
} fbench_t;

static int fusage(const char *fmt, const char *arg) {
  fprintf(stderr, "pinmem: bench file: ");
  fprintf(stderr, fmt, arg);
  fprintf(stderr,
          "\nusage: pinmem [--json] bench file [--quiet] [--bytes SIZE] [--dir DIR] [--repeat N]\n"
          "         [--chunk SIZE] [--threads N] [--cases LIST]   (--help lists them all)\n");
  return CLI_EXIT_USAGE;
}

static void print_help(void) {
  printf(
      "pinmem bench file [--json] [--quiet] [--bytes SIZE] [--dir DIR] [--repeat N]\n"
      "                  [--chunk SIZE] [--threads N] [--cases LIST]\n"
      "  file <-> device through pinmem beside a plain pread + copy loop and the disk's own\n"
      "  O_DIRECT rate, page cache hot and cold, in one run.\n"
      "  --bytes SIZE    file size (default 1G on cuda, 64M on the host backend)\n"
      "  --dir DIR       where the test files go (default $TMPDIR, else /var/tmp); removed after\n"
      "  --repeat N      timed runs per case, the median is reported (default 3)\n"
      "  --chunk SIZE    pinmem's bounce slot (default 16M: pm_file_options_t.chunk)\n"
      "  --threads N     pinmem's I/O threads (default: option copy_threads)\n"
      "  --cases LIST    only these cases, comma separated, of: load_hot_buffered,\n"
      "                  load_direct, load_cold_buffered, plain_load_hot, plain_load_cold,\n"
      "                  disk_read_direct, save_buffered, save_direct, plain_save,\n"
      "                  disk_write_direct\n"
      "  --json          one JSON object per case on stdout (TARGET lines go to stderr)\n"
      "  --quiet         no progress line on stderr\n"
      "  Cold runs: fdatasync + posix_fadvise(DONTNEED), and /proc/sys/vm/drop_caches when\n"
      "  writable; each row says which. TARGET: hot load >= %.0f GB/s; cold load and save >=\n"
      "  %.1fx the disk's own rate (cuda backend).\n",
      T_HOT_GBPS, T_DISK_RATIO);
}

static int parse_args(int argc, char **argv, fopts_t *o) {
  memset(o, 0, sizeof *o);
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--json")) {
      o->json = true;
      continue;
    }
    if (!strcmp(a, "--quiet")) {
      o->quiet = true;
      continue;
    }
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      o->help = true;
      continue;
    }
    if (strncmp(a, "--", 2) != 0) return fusage("unexpected argument '%s'", a);
    const char *eq = strchr(a, '=');
    char name[32];
    size_t nl = eq ? (size_t)(eq - a) : strlen(a);
    if (nl >= sizeof name) return fusage("unknown option '%s'", a);
    memcpy(name, a, nl);
    name[nl] = '\0';
    const char *v;
    if (eq) {
      v = eq + 1;
    } else {
      if (i + 1 >= argc) return fusage("%s needs a value", a);
      v = argv[++i];
    }
    if (!strcmp(name, "--bytes")) {
      if (pm_parse_size(v, &o->bytes) != PM_OK || o->bytes == 0)
        return fusage("--bytes: bad size '%s'", v);
    } else if (!strcmp(name, "--chunk")) {
      if (pm_parse_size(v, &o->chunk) != PM_OK || o->chunk < 4096)
        return fusage("--chunk: bad size '%s' (at least 4K)", v);
    } else if (!strcmp(name, "--dir")) {
      o->dir = v;
    } else if (!strcmp(name, "--cases")) {
      if (cli_list_empty_item(v)) return fusage("--cases: an empty item in '%s'", v);
      o->cases = v;
    } else if (!strcmp(name, "--repeat") || !strcmp(name, "--threads")) {
      char *end;
      errno = 0;
      long n = strtol(v, &end, 10);
      if (errno || *end || !v[0] || n < 1 || n > 1000)
        return fusage(!strcmp(name, "--repeat") ? "--repeat: bad count '%s'"
                                                : "--threads: bad count '%s'",
                      v);
      if (!strcmp(name, "--repeat"))
        o->repeat = (int)n;
      else
        o->threads = (int)n;
    } else {
      return fusage("unknown option '%s'", a);
    }
  }
  return 0;
}

static const char *const k_cases[] = {
    "load_hot_buffered", "load_direct", "load_cold_buffered", "plain_load_hot",
    "plain_load_cold",   "disk_read_direct", "save_buffered",     "save_direct",
    "plain_save",        "disk_write_direct"};
enum { NCASES = sizeof k_cases / sizeof k_cases[0] };

static bool case_on(const fopts_t *o, const char *name) {
  if (!o->cases) return true;
  size_t n = strlen(name);
  for (const char *p = o->cases; *p;) {
    const char *c = strchr(p, ',');
    size_t len = c ? (size_t)(c - p) : strlen(p);
    if (len == n && !strncmp(p, name, n)) return true;
    if (!c) break;
    p = c + 1;
  }
  return false;
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The file's bytes: 8-byte words that depend on their position and the seed. */
static void pattern(unsigned char *p, size_t n, uint64_t pos, uint64_t seed) {
  for (size_t i = 0; i < n; i++) {
    uint64_t at = pos + i, w = (at / 8 + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    p[i] = (unsigned char)(w >> (8 * (at % 8)));
  }
}

static bool io_all(int fd, bool write, void *buf, size_t n, uint64_t off) {
  size_t done = 0;
  while (done < n) {
    ssize_t r = write ? pwrite(fd, (char *)buf + done, n - done, (off_t)(off + done))
                      : pread(fd, (char *)buf + done, n - done, (off_t)(off + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    done += (size_t)r;
  }
  return true;
}

static void fail_errno(const char *what, const char *path) {
  fprintf(stderr, "pinmem: bench file: %s(%s): %s\n", what, path, strerror(errno));
  exit(CLI_EXIT_FAILURE);
}

/* Evict the file from the page cache; say how. */
static void make_cold(fbench_t *b, int fd) {
  if (fdatasync(fd) != 0) fail_errno("fdatasync", b->path);
  (void)posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  int dc = open("/proc/sys/vm/drop_caches", O_WRONLY | O_CLOEXEC);
  if (dc >= 0) {
    sync();
    bool ok = write(dc, "1", 1) == 1;
    close(dc);
    b->cold_method = ok ? "fadvise+drop_caches" : "fadvise";
  } else {
    b->cold_method = "fadvise";
  }
}

/* Device buffer == the file's pattern, compared in PLAIN_CHUNK pieces through `check`. */
static bool verify_dev(fbench_t *b, uint64_t seed) {
  unsigned char *want = cli_xmalloc(PLAIN_CHUNK);
  bool ok = true;
  for (size_t off = 0; off < b->o.bytes && ok; off += PLAIN_CHUNK) {
    size_t n = b->o.bytes - off < PLAIN_CHUNK ? b->o.bytes - off : PLAIN_CHUNK;
    cli_check(pm_memcpy(b->check, (char *)b->dev + off, n, PM_COPY_D2H));
    pattern(want, n, off, seed);
    ok = memcmp(want, b->check, n) == 0;
  }
  free(want);
  return ok;
}

static bool verify_file(fbench_t *b, int fd, uint64_t seed) {
  unsigned char *want = cli_xmalloc(PLAIN_CHUNK);
  bool ok = true;
  for (size_t off = 0; off < b->o.bytes && ok; off += PLAIN_CHUNK) {
    size_t n = b->o.bytes - off < PLAIN_CHUNK ? b->o.bytes - off : PLAIN_CHUNK;
    ok = io_all(fd, false, b->check, n, off);
    pattern(want, n, off, seed);
    ok = ok && memcmp(want, b->check, n) == 0;
  }
  free(want);
  return ok;
}

/* Fill the device buffer with the save pattern (before a save; not timed). */
static void fill_dev(fbench_t *b, uint64_t seed) {
  for (size_t off = 0; off < b->o.bytes; off += PLAIN_CHUNK) {
    size_t n = b->o.bytes - off < PLAIN_CHUNK ? b->o.bytes - off : PLAIN_CHUNK;
    pattern(b->check, n, off, seed);
    cli_check(pm_memcpy((char *)b->dev + off, b->check, n, PM_COPY_H2D));
  }
}

/* ---- the cases ---------------------------------------------------------------------------- */

enum { SEED_FILE = 0x51ull, SEED_SAVE = 0xA7ull };

static void pm_load(fbench_t *b, pm_file_io_t io) {
  pm_file_options_t o;
  pm_file_options_init(&o);
  o.io = io;
  o.chunk = b->o.chunk;
  o.threads = b->o.threads;
  pm_fence_t f;
  cli_check(pm_file_read_async(b->fd, 0, b->o.bytes, b->dev, b->s, &o, &f));
  cli_check(pm_fence_wait(f));
  cli_check(pm_fence_release(f));
}

static void plain_load(fbench_t *b) {
  for (size_t off = 0; off < b->o.bytes; off += PLAIN_CHUNK) {
    size_t n = b->o.bytes - off < PLAIN_CHUNK ? b->o.bytes - off : PLAIN_CHUNK;
    if (!io_all(b->fd, false, b->pinned, n, off)) fail_errno("pread", b->path);
    cli_check(pm_memcpy_async((char *)b->dev + off, b->pinned, n, PM_COPY_H2D, b->s));
    cli_check(pm_stream_synchronize(b->s));
  }
}

static void disk_read(fbench_t *b) {
  int dfd = open(b->path, O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (dfd < 0) fail_errno("open O_DIRECT", b->path);
  size_t whole = b->o.bytes / DIRECT_ALIGN * DIRECT_ALIGN;
  for (size_t off = 0; off < whole; off += PLAIN_CHUNK) {
    size_t n = whole - off < PLAIN_CHUNK ? whole - off : PLAIN_CHUNK;
    if (!io_all(dfd, false, b->aligned, n, off)) fail_errno("pread O_DIRECT", b->path);
  }
  close(dfd);
}

static void pm_save(fbench_t *b, pm_file_io_t io) {
  pm_file_options_t o;
  pm_file_options_init(&o);
  o.io = io;
  o.chunk = b->o.chunk;
  o.threads = b->o.threads;
  o.fsync = 1;
  pm_fence_t f;
  cli_check(pm_file_write_async(b->out_fd, 0, b->o.bytes, b->dev, b->s, &o, &f));
  cli_check(pm_fence_wait(f));
  cli_check(pm_fence_release(f));
}

static void plain_save(fbench_t *b) {
  for (size_t off = 0; off < b->o.bytes; off += PLAIN_CHUNK) {
    size_t n = b->o.bytes - off < PLAIN_CHUNK ? b->o.bytes - off : PLAIN_CHUNK;
    cli_check(pm_memcpy(b->pinned, (char *)b->dev + off, n, PM_COPY_D2H));
    if (!io_all(b->out_fd, true, b->pinned, n, off)) fail_errno("pwrite", b->out_path);
  }
  if (fdatasync(b->out_fd) != 0) fail_errno("fdatasync", b->out_path);
}

static void disk_write(fbench_t *b) {
  int dfd = open(b->out_path, O_WRONLY | O_DIRECT | O_CLOEXEC);
  if (dfd < 0) fail_errno("open O_DIRECT", b->out_path);
  size_t whole = b->o.bytes / DIRECT_ALIGN * DIRECT_ALIGN;
  for (size_t off = 0; off < whole; off += PLAIN_CHUNK) {
    size_t n = whole - off < PLAIN_CHUNK ? whole - off : PLAIN_CHUNK;
    if (!io_all(dfd, true, b->aligned, n, off)) fail_errno("pwrite O_DIRECT", b->out_path);
  }
  if (fdatasync(dfd) != 0) fail_errno("fdatasync", b->out_path);
  close(dfd);
}

typedef struct result {
  bool ran;
  double seconds;
  bool verified;
} result_t;

/* One case: warm-up, then the timed runs. */
static result_t run_case(fbench_t *b, int c) {
  result_t r = {true, NAN, true};
  const char *name = k_cases[c];
  bool cold = strstr(name, "cold") != NULL;
  bool load = strstr(name, "load") != NULL;
  bool save = !load && strcmp(name, "disk_read_direct") != 0;
  double *t = cli_xmalloc(sizeof(double) * (size_t)b->o.repeat);
  for (int run = -1; run < b->o.repeat; run++) {
    cli_progress((unsigned long long)b->steps_done, (unsigned long long)b->steps, "%s, %s", name,
                 run < 0 ? "warm-up" : "timed run");
    if (load) cli_check(pm_device_memset_async(b->dev, 0, b->o.bytes, b->s));
    if (save) {
      /* The device holds the save pattern; the output file starts empty each run. */
      if (run < 0) fill_dev(b, SEED_SAVE);
      if (ftruncate(b->out_fd, 0) != 0) fail_errno("ftruncate", b->out_path);
    }
    cli_check(pm_stream_synchronize(b->s));
    if (cold) make_cold(b, b->fd);
    double t0 = now();
    switch (c) {
      case 0: pm_load(b, PM_FILE_IO_BUFFERED); break;
      case 1: pm_load(b, PM_FILE_IO_DIRECT); break;
      case 2: pm_load(b, PM_FILE_IO_BUFFERED); break;
      case 3: plain_load(b); break;
      case 4: plain_load(b); break;
      case 5: disk_read(b); break;
      case 6: pm_save(b, PM_FILE_IO_BUFFERED); break;
      case 7: pm_save(b, PM_FILE_IO_DIRECT); break;
      case 8: plain_save(b); break;
      case 9: disk_write(b); break;
    }
    double s = now() - t0;
    if (run >= 0) t[run] = s;
    if (load && !verify_dev(b, SEED_FILE)) r.verified = false;
    if (save && c != 9 && !verify_file(b, b->out_fd, SEED_SAVE)) r.verified = false;
  }
  b->steps_done++;
  r.seconds = cli_median(t, b->o.repeat);
  free(t);
  if (!r.verified) {
    cli_progress_clear();
    fprintf(stderr, "pinmem: bench file: VERIFY FAILED: %s\n", name);
    b->failed = true;
  }
  return r;
}

static void setup(fbench_t *b) {
  const char *dir = b->o.dir;
  if (!dir) dir = getenv("TMPDIR");
  if (!dir || !dir[0]) dir = "/var/tmp";
  b->o.dir = dir;
  snprintf(b->path, sizeof b->path, "%s/pinmem-bench-file.XXXXXX", dir);
  b->fd = mkstemp(b->path);
  if (b->fd < 0) fail_errno("mkstemp", b->path);
  snprintf(b->out_path, sizeof b->out_path, "%s/pinmem-bench-file-out.XXXXXX", dir);
  b->out_fd = mkstemp(b->out_path);
  if (b->out_fd < 0) fail_errno("mkstemp", b->out_path);
  cli_check(pm_stream_create(&b->s));
  cli_check(pm_device_alloc(b->o.bytes, &b->dev));
  cli_check(pm_host_alloc(NULL, PLAIN_CHUNK, PM_HOST_DEFAULT, &b->pinned));
  if (posix_memalign(&b->aligned, DIRECT_ALIGN, PLAIN_CHUNK) != 0) {
    fprintf(stderr, "pinmem: bench file: out of memory\n");
    exit(CLI_EXIT_FAILURE);
  }
  pattern(b->aligned, PLAIN_CHUNK, 0, SEED_SAVE);
  b->check = cli_xmalloc(PLAIN_CHUNK);
  /* The input file, written with plain pwrite and synced. */
  for (size_t off = 0; off < b->o.bytes; off += PLAIN_CHUNK) {
    size_t n = b->o.bytes - off < PLAIN_CHUNK ? b->o.bytes - off : PLAIN_CHUNK;
    pattern(b->check, n, off, SEED_FILE);
    if (!io_all(b->fd, true, b->check, n, off)) fail_errno("pwrite", b->path);
  }
  if (fdatasync(b->fd) != 0) fail_errno("fdatasync", b->path);
}

static void teardown(fbench_t *b) {
  close(b->fd);
  close(b->out_fd);
  unlink(b->path);
  unlink(b->out_path);
  cli_check(pm_device_free(b->dev));
  cli_check(pm_host_free(b->pinned));
  free(b->aligned);
  free(b->check);
  cli_check(pm_stream_destroy(b->s));
}

static void target(const fbench_t *b, const char *what, bool measured, bool met, const char *fig) {
  FILE *out = b->o.json ? stderr : stdout;
  if (!measured)
    fprintf(out, "TARGET %s: not measured in this run\n", what);
  else if (!b->cuda)
    fprintf(out, "TARGET %s: %s  (speed targets apply to the cuda backend only)\n", what, fig);
  else
    fprintf(out, "TARGET %s: %s  %s\n", what, fig, met ? "PASS" : "MISS");
}

int pm_cli_bench_file(int argc, char **argv) {
  fbench_t *b = calloc(1, sizeof *b);
  if (!b) return CLI_EXIT_FAILURE;
  int rc = parse_args(argc, argv, &b->o);
  if (rc || b->o.help) {
    if (!rc) print_help();
    free(b);
    return rc;
  }
  if (b->o.cases) {
    for (const char *p = b->o.cases; *p;) {
      const char *c = strchr(p, ',');
      size_t len = c ? (size_t)(c - p) : strlen(p);
      bool known = false;
      for (int k = 0; k < NCASES; k++)
        known = known || (strlen(k_cases[k]) == len && !strncmp(p, k_cases[k], len));
      if (!known) {
        char one[64];
        snprintf(one, sizeof one, "%.*s", (int)(len < 60 ? len : 60), p);
        free(b);
        return fusage("--cases: unknown case '%s'", one);
      }
      if (!c) break;
      p = c + 1;
    }
  }
  cli_progress_init(b->o.quiet);
  cli_check(pm_init());
  b->cuda = pm_backend_kind() == PM_BACKEND_CUDA;
  if (!b->o.bytes) b->o.bytes = b->cuda ? 1024 * MIB : 64 * MIB;
  if (!b->o.repeat) b->o.repeat = 3;
  b->cold_method = "fadvise";
  for (int c = 0; c < NCASES; c++) b->steps += case_on(&b->o, k_cases[c]);
  setup(b);

  char sz[32];
  cli_fmt_bytes(b->o.bytes, sz, sizeof sz);
  if (!b->o.json) {
    printf("pinmem bench file: backend %s, a file of %s in %s, median of %d runs\n",
           pm_backend_name(), sz, b->path, b->o.repeat);
    cli_host_note(false, "these figures");
    printf("\n%-20s  %10s  %9s  %-20s  %s\n", "case", "seconds", "GB/s", "cache", "verified");
  }
  result_t res[NCASES];
  memset(res, 0, sizeof res);
  for (int c = 0; c < NCASES; c++) {
    if (!case_on(&b->o, k_cases[c])) continue;
    res[c] = run_case(b, c);
    double gbps = (double)b->o.bytes / res[c].seconds / 1e9;
    const char *cache = strstr(k_cases[c], "cold") ? b->cold_method
                        : strstr(k_cases[c], "direct") || c == 9 ? "bypassed (O_DIRECT)"
                        : c >= 6                                ? "written + fdatasync"
                                                                : "hot";
    if (c == 1 || c == 7) cache = pm__file_note()[0] ? "refused: buffered" : "bypassed (O_DIRECT)";
    if (b->o.json) {
      cli_json_t j;
      cli_json_row(&j, "file", k_cases[c], b->o.bytes, res[c].seconds, gbps);
      if (c == 5 || c == 9)
        cli_json_null(&j, "verified"); /* the disk alone: no data to check */
      else
        cli_json_bool(&j, "verified", res[c].verified);
      cli_json_str(&j, "verify_method", c == 5 || c == 9 ? "none" : "full");
      cli_json_str(&j, "cache", cache);
      cli_json_str(&j, "timing", "wall");
      cli_json_int(&j, "runs", b->o.repeat);
      cli_json_str(&j, "backend", pm_backend_name());
      cli_json_str(&j, "dir", b->o.dir);
      cli_json_end(&j);
    } else {
      cli_progress_clear();
      printf("%-20s  %10.4f  %9.2f  %-20s  %s\n", k_cases[c], res[c].seconds, gbps, cache,
             c == 5 || c == 9 ? "n/a (the disk alone)" : res[c].verified ? "full" : "NO (FAILED)");
    }
  }
  cli_progress_clear();
  if (b->o.json) cli_host_note(true, "these figures");
  fprintf(b->o.json ? stderr : stdout, "\n");
  char fig[128];
  double gb = (double)b->o.bytes / 1e9;
  double hot = res[0].ran ? gb / res[0].seconds : NAN;
  snprintf(fig, sizeof fig, "%.2f GB/s", hot);
  target(b, "hot load (load_hot_buffered) >= 40 GB/s", res[0].ran && res[0].verified,
         hot >= T_HOT_GBPS, fig);
  double disk_r = res[5].ran ? gb / res[5].seconds : NAN;
  double cold = NAN;
  if (res[2].ran) cold = gb / res[2].seconds;
  if (res[1].ran && (isnan(cold) || gb / res[1].seconds > cold)) cold = gb / res[1].seconds;
  snprintf(fig, sizeof fig, "%.2f GB/s = %.2fx the disk's %.2f GB/s", cold, cold / disk_r, disk_r);
  target(b, "cold load (best of load_cold_buffered, load_direct) >= 0.9x disk_read_direct",
         !isnan(cold) && res[5].ran, cold >= T_DISK_RATIO * disk_r, fig);
  double disk_w = res[9].ran ? gb / res[9].seconds : NAN;
  double save = NAN;
  if (res[6].ran) save = gb / res[6].seconds;
  if (res[7].ran && (isnan(save) || gb / res[7].seconds > save)) save = gb / res[7].seconds;
  snprintf(fig, sizeof fig, "%.2f GB/s = %.2fx the disk's %.2f GB/s", save, save / disk_w, disk_w);
  target(b, "save (best of save_buffered, save_direct, with fdatasync) >= 0.9x disk_write_direct",
         !isnan(save) && res[9].ran, save >= T_DISK_RATIO * disk_w, fig);
  teardown(b);
  bool failed = b->failed;
  free(b);
  if (failed) {
    fprintf(stderr, "pinmem: bench file: some cases delivered wrong bytes (VERIFY FAILED above)\n");
    return CLI_EXIT_FAILURE;
  }
  return 0;
}
