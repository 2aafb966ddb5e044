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
 *   load_hot_auto, load_cold_auto, save_auto
 *                               io=auto (what load_file / save_file use), hot, cold and saved;
 *                               each row says how many of its bytes went through O_DIRECT
 *   load_hot_mmap               the other way to read the page cache: mmap the file and copy
 *                               the mapping (pageable memory) with pm_memcpy_async, so the copy
 *                               engine's threads memcpy the cached pages into its pinned ring
 *                               (faulting them in) and DMA them; mmap and munmap timed too. A
 *                               comparison row: pm_file_read_async does not use it
 *
 * Sweeps: --chunk, --threads, --slots and --part take comma-separated lists; every pinmem case
 * (load_*, save_*) runs once per combination (save cases ignore --part, which only reads use),
 * one row each; the plain and disk rows run once. The TARGET lines take each target's best row.
 * Cold: fdatasync, posix_fadvise(DONTNEED) on the file, and "1" into /proc/sys/vm/drop_caches
 * where the process may (root); each row says which ("cold_method").
 *
 * Method: a warm-up run, then --repeat timed runs, the median reported; wall-clock time from the
 * call until the fence (or the stream) completed. The warm-up run of every load is verified
 * against the file's pattern (a full compare through a D2H copy), of every save by reading the
 * file back (the timed runs repeat the same code path). Speed
 * targets (TARGET lines) apply to the cuda backend; on the host backend the runs prove
 * correctness only, so the default size is 64 MiB there (1 GiB on cuda).
 */
#include "bench_file.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "internal.h" /* pm__file_note: whether O_DIRECT was refused */

#define MIB ((size_t)1 << 20)
#define PLAIN_CHUNK (16 * MIB)
#define DIRECT_ALIGN 4096

/* pinmem's targets (cuda backend), issue "files": hot load >= 40 GB/s; cold load and save
 * >= 0.9x the disk's own rate measured in the same run. */
#define T_HOT_GBPS 40.0
#define T_DISK_RATIO 0.9

enum { MAX_LIST = 16 };

typedef struct fopts {
  bool json, quiet, help;
  size_t bytes; /* the size of this run, one of sizes[] */
  size_t sizes[MAX_LIST];
  int nsizes;
  const char *dir;
  int repeat;
  /* The sweep: 0 in a list = the default (options file_chunk, file_direct_chunk or
   * file_write_chunk, file_threads, file_slots, file_part). */
  size_t chunk[MAX_LIST], part[MAX_LIST];
  int threads[MAX_LIST], slots[MAX_LIST];
  int nchunk, nthreads, nslots, npart;
  const char *cases;
} fopts_t;

/* One point of the sweep. */
typedef struct combo {
  size_t chunk, part;
  int threads, slots;
} combo_t;

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
  combo_t cur;
} fbench_t;

static const char *file_usage =
    "pinmem [--json] bench file [--quiet] [--sizes LIST] [--dir DIR] [--repeat N]\n"
    "    [--chunk SIZES] [--threads NS] [--slots NS] [--part SIZES] [--cases LIST]";

static void print_help(void) {
  printf(
      "usage: pinmem bench file [--json] [--quiet] [--sizes LIST] [--dir DIR] [--repeat N]\n"
      "                         [--chunk SIZES] [--threads NS] [--slots NS] [--part SIZES]\n"
      "                         [--cases LIST]\n"
      "  file <-> device through pinmem beside a plain pread + copy loop and the disk's own\n"
      "  O_DIRECT rate, page cache hot and cold, in one run.\n"
      "  --sizes LIST    file sizes, each a run of its own (default 1G on cuda, 64M on the host\n"
      "                  backend; --bytes and --size are other names for it)\n"
      "  --dir DIR       where the test files go (default $TMPDIR, else /var/tmp); removed after\n"
      "  --repeat N      timed runs per case, the median is reported (default 3)\n"
      "  The next four take comma-separated lists (0 = the option's default); the pinmem\n"
      "  cases run once per combination, e.g. --chunk 4M,8M,16M,32M --threads 4,8,12,16:\n"
      "  --chunk SIZES   pinmem's bounce slot (pm_file_options_t.chunk; default: option\n"
      "                  file_chunk for loads through the page cache, file_direct_chunk\n"
      "                  for loads through O_DIRECT, file_write_chunk for saves)\n"
      "  --threads NS    pinmem's I/O threads (pm_file_options_t.threads; default: option\n"
      "                  file_threads, else copy_threads)\n"
      "  --slots NS      bounce slots in flight (option file_slots; default threads + 2,\n"
      "                  for loads through the page cache up to 2 a thread, <= 96 MiB)\n"
      "  --part SIZES    loads: a slot's DMA in parts of this size, each queued once read\n"
      "                  (option file_part; 0 = one DMA per slot)\n"
      "  --cases LIST    only these cases, comma separated, of: load_hot_buffered,\n"
      "                  load_direct, load_cold_buffered, plain_load_hot, plain_load_cold,\n"
      "                  disk_read_direct, save_buffered, save_direct, plain_save,\n"
      "                  disk_write_direct, load_hot_auto, load_cold_auto, save_auto,\n"
      "                  load_hot_mmap (mmap + pm_memcpy_async of the mapping)\n"
      "  --json          one JSON object per row on stdout (TARGET lines go to stderr)\n"
      "  --quiet         no progress line on stderr\n"
      "  Cold runs: fdatasync + posix_fadvise(DONTNEED), and /proc/sys/vm/drop_caches when\n"
      "  writable; each row says which. TARGET: hot load >= %.0f GB/s; cold load and save >=\n"
      "  %.1fx the disk's own rate (cuda backend).\n",
      T_HOT_GBPS, T_DISK_RATIO);
}

static int parse_args(int argc, char **argv, fopts_t *o) {
  cli_usage_context("bench file", file_usage);
  memset(o, 0, sizeof *o);
  static const char *const valued[] = {"--sizes", "--dir",  "--repeat", "--chunk", "--threads",
                                       "--slots", "--part", "--cases",  NULL};
  static const char *const flags[] = {"--json", "--quiet", "--help", NULL};
  cli_opts_t op;
  cli_opts_init(&op, "bench file", argc, argv, valued, flags);
  const char *v;
  int got;
  while ((got = cli_opts_next(&op, &v)) == 1) {
    const char *name = op.name;
    if (!strcmp(name, "--json")) o->json = true;
    if (!strcmp(name, "--quiet")) o->quiet = true;
    if (!strcmp(name, "--help")) o->help = true;
    if (!v) continue;
    if (!strcmp(name, "--sizes")) {
      int rc = cli_parse_sizes("--sizes", v, o->sizes, MAX_LIST, &o->nsizes);
      if (rc) return rc;
    } else if (!strcmp(name, "--chunk") || !strcmp(name, "--part")) {
      bool chunk = !strcmp(name, "--chunk");
      if (cli_list_empty_item(v))
        return cli_usage_fail("%s: item %d of '%s' is empty", name, cli_list_empty_item(v), v);
      size_t *list = chunk ? o->chunk : o->part;
      int *n = chunk ? &o->nchunk : &o->npart;
      char buf[64];
      *n = 0;
      for (const char *p = v; *p;) {
        const char *c = strchr(p, ',');
        size_t len = c ? (size_t)(c - p) : strlen(p);
        snprintf(buf, sizeof buf, "%.*s", (int)(len < 63 ? len : 63), p);
        size_t sz;
        char why[160];
        if (*n >= MAX_LIST)
          return cli_usage_fail("%s: at most %d values, in '%s'", name, MAX_LIST, v);
        if (!cli_parse_size(buf, &sz, why, sizeof why))
          return cli_usage_fail("%s: '%s' is not a size: %s", name, buf, why);
        if (sz && sz < 4096)
          return cli_usage_fail("%s: sizes must be 0 (the default) or >= 4K, not '%s'", name, buf);
        list[(*n)++] = sz;
        if (!c) break;
        p = c + 1;
      }
    } else if (!strcmp(name, "--threads") || !strcmp(name, "--slots")) {
      bool thr = !strcmp(name, "--threads");
      if (cli_list_empty_item(v))
        return cli_usage_fail("%s: item %d of '%s' is empty", name, cli_list_empty_item(v), v);
      int *list = thr ? o->threads : o->slots;
      int *n = thr ? &o->nthreads : &o->nslots;
      *n = 0;
      for (const char *p = v; *p;) {
        char *end;
        errno = 0;
        long k = strtol(p, &end, 10);
        if (*n >= MAX_LIST)
          return cli_usage_fail("%s: at most %d values, in '%s'", name, MAX_LIST, v);
        if (errno || end == p || (*end && *end != ',') || k < 0 || k > (thr ? 256 : 4096))
          return cli_usage_fail("%s: counts must be whole numbers from 0 to %d, in '%s'", name,
                                thr ? 256 : 4096, v);
        list[(*n)++] = (int)k;
        if (!*end) break;
        p = end + 1;
      }
    } else if (!strcmp(name, "--dir")) {
      /* "" fell through to $TMPDIR: the files went where the command line did not say. */
      if (!v[0]) return cli_usage_fail("--dir needs a folder, not ''");
      o->dir = v;
    } else if (!strcmp(name, "--cases")) {
      if (cli_list_empty_item(v))
        return cli_usage_fail("--cases: item %d of '%s' is empty", cli_list_empty_item(v), v);
      o->cases = v;
    } else if (!strcmp(name, "--repeat")) {
      long long n = 0;
      if (cli_opt_int("--repeat", v, 1, 1000, &n)) return CLI_EXIT_USAGE;
      o->repeat = (int)n;
    }
  }
  return got;
}

static const char *const k_cases[] = {"load_hot_buffered", "load_direct",     "load_cold_buffered",
                                      "plain_load_hot",    "plain_load_cold", "disk_read_direct",
                                      "save_buffered",     "save_direct",     "plain_save",
                                      "disk_write_direct", "load_hot_auto",   "load_cold_auto",
                                      "save_auto",         "load_hot_mmap"};
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
  size_t i = 0;
  for (; i < n && (pos + i) % 8; i++) {
    uint64_t at = pos + i, w = (at / 8 + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    p[i] = (unsigned char)(w >> (8 * (at % 8)));
  }
  /* Whole words: their bytes little-endian, as the loops around write them one by one (a
   * compiler makes this one store; it keeps setting up and verifying 4 GiB files cheap). */
  for (; i + 8 <= n; i += 8) {
    uint64_t w = ((pos + i) / 8 + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    unsigned char le[8];
    for (int k = 0; k < 8; k++) le[k] = (unsigned char)(w >> (8 * k));
    memcpy(p + i, le, 8);
  }
  for (; i < n; i++) {
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

/* The combination's options that are not pm_file_options_t fields, where the command line
 * gave them (else PINMEM_FILE_SLOTS / PINMEM_FILE_PART or the defaults stay in force). */
static void set_combo_options(const fopts_t *o, const combo_t *k) {
  char v[32];
  if (o->nslots) {
    snprintf(v, sizeof v, "%d", k->slots);
    cli_check(pm_option_set("file_slots", v));
  }
  if (o->npart) {
    snprintf(v, sizeof v, "%zu", k->part);
    cli_check(pm_option_set("file_part", v));
  }
}

/* What a combination runs with, each 0 (the default) resolved as file.c resolves it, for the
 * rows: chunk rounded up to 4 KiB (a load's by whether it went through O_DIRECT), slots as
 * pm__file_slots gives them, part 0 when not below chunk. */
static combo_t combo_resolved(const combo_t *k, bool save, bool direct) {
  combo_t r;
  size_t chunk = k->chunk ? k->chunk : pm__file_chunk(save, direct);
  r.chunk = (chunk + 4095) / 4096 * 4096;
  r.threads = k->threads ? k->threads : (int)pm__opt_int(PM__OPT_FILE_THREADS);
  if (!r.threads) r.threads = (int)pm__opt_int(PM__OPT_COPY_THREADS);
  r.slots = pm__file_slots(r.chunk, r.threads, save, direct);
  r.part = save ? 0 : (pm__opt_size(PM__OPT_FILE_PART) + 4095) / 4096 * 4096;
  if (r.part >= r.chunk) r.part = 0;
  return r;
}

/* pinmem's own read of the test file into device memory (save: its write from device memory
 * into the output file, fdatasync'd), with the sweep's combination in force. */
static void pm_transfer(fbench_t *b, pm_file_io_t io, bool save) {
  pm_file_options_t o;
  pm_file_options_init(&o);
  o.io = io;
  o.chunk = b->cur.chunk;
  o.threads = b->cur.threads;
  o.fsync = save;
  pm_fence_t f;
  cli_check(save ? pm_file_write_async(b->out_fd, 0, b->o.bytes, b->dev, b->s, &o, &f)
                 : pm_file_read_async(b->fd, 0, b->o.bytes, b->dev, b->s, &o, &f));
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

static void mmap_load(fbench_t *b) {
  void *m = mmap(NULL, b->o.bytes, PROT_READ, MAP_SHARED, b->fd, 0);
  if (m == MAP_FAILED) fail_errno("mmap", b->path);
  cli_check(pm_memcpy_async(b->dev, m, b->o.bytes, PM_COPY_H2D, b->s));
  cli_check(pm_stream_synchronize(b->s));
  munmap(m, b->o.bytes);
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

enum {
  C_LOAD_HOT,
  C_LOAD_DIRECT,
  C_LOAD_COLD,
  C_PLAIN_HOT,
  C_PLAIN_COLD,
  C_DISK_READ,
  C_SAVE_BUFFERED,
  C_SAVE_DIRECT,
  C_PLAIN_SAVE,
  C_DISK_WRITE,
  C_LOAD_HOT_AUTO,
  C_LOAD_COLD_AUTO,
  C_SAVE_AUTO,
  C_LOAD_HOT_MMAP
};

static bool is_disk(int c) {
  return c == C_DISK_READ || c == C_DISK_WRITE;
}

/* The cases that run pinmem (and so once per combination of the sweep). */
static bool is_pm(int c) {
  return c != C_PLAIN_HOT && c != C_PLAIN_COLD && c != C_PLAIN_SAVE && c != C_LOAD_HOT_MMAP &&
         !is_disk(c);
}

static bool is_save(int c) {
  return c == C_SAVE_BUFFERED || c == C_SAVE_DIRECT || c == C_PLAIN_SAVE || c == C_DISK_WRITE ||
         c == C_SAVE_AUTO;
}

typedef struct result {
  bool ran;
  double seconds;
  bool verified;
  double direct_share; /* of the bytes the pinmem call moved, the part through O_DIRECT */
  bool refused;        /* pm__file_note: O_DIRECT refused, buffered used */
} result_t;

/* One case: warm-up, then the timed runs. The warm-up run is verified in full (the data of
 * the timed runs is the same code path again; checking each would make a sweep of 4 GiB runs
 * slow). */
static result_t run_case(fbench_t *b, int c) {
  result_t r = {true, NAN, true, NAN, false};
  const char *name = k_cases[c];
  bool cold = strstr(name, "cold") != NULL;
  bool load = strstr(name, "load") != NULL;
  bool save = is_save(c);
  double *t = cli_xmalloc(sizeof(double) * (size_t)b->o.repeat);
  pm_file_stats_t s0, s1;
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
    cli_check(pm_file_get_stats(&s0));
    double t0 = now();
    switch (c) {
      case C_LOAD_HOT:
      case C_LOAD_COLD:
        pm_transfer(b, PM_FILE_IO_BUFFERED, false);
        break;
      case C_LOAD_DIRECT:
        pm_transfer(b, PM_FILE_IO_DIRECT, false);
        break;
      case C_LOAD_HOT_AUTO:
      case C_LOAD_COLD_AUTO:
        pm_transfer(b, PM_FILE_IO_AUTO, false);
        break;
      case C_PLAIN_HOT:
      case C_PLAIN_COLD:
        plain_load(b);
        break;
      case C_LOAD_HOT_MMAP:
        mmap_load(b);
        break;
      case C_DISK_READ:
        disk_read(b);
        break;
      case C_SAVE_BUFFERED:
        pm_transfer(b, PM_FILE_IO_BUFFERED, true);
        break;
      case C_SAVE_DIRECT:
        pm_transfer(b, PM_FILE_IO_DIRECT, true);
        break;
      case C_SAVE_AUTO:
        pm_transfer(b, PM_FILE_IO_AUTO, true);
        break;
      case C_PLAIN_SAVE:
        plain_save(b);
        break;
      case C_DISK_WRITE:
        disk_write(b);
        break;
    }
    double s = now() - t0;
    cli_check(pm_file_get_stats(&s1));
    if (is_pm(c)) {
      uint64_t d = save ? s1.write_direct - s0.write_direct : s1.read_direct - s0.read_direct;
      uint64_t bu =
          save ? s1.write_buffered - s0.write_buffered : s1.read_buffered - s0.read_buffered;
      r.direct_share = d + bu ? (double)d / (double)(d + bu) : NAN;
      r.refused = pm__file_note()[0] != '\0';
    }
    if (run >= 0) t[run] = s;
    if (run < 0 && load && !verify_dev(b, SEED_FILE)) r.verified = false;
    if (run < 0 && save && c != C_DISK_WRITE && !verify_file(b, b->out_fd, SEED_SAVE))
      r.verified = false;
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
  cli_target(b->o.json ? stderr : stdout, what, measured, b->cuda, met, fig);
}

/* The best (fastest verified) row of each case over the sweep, with its combination. */
typedef struct best {
  result_t r;
  combo_t k;
} best_t;

static double gbps_of(const fbench_t *b, const best_t *x) {
  return x->r.ran && x->r.verified ? (double)b->o.bytes / x->r.seconds / 1e9 : NAN;
}

/* "best of" several cases: the fastest, or NaN when none ran. */
static double best_of(const fbench_t *b, const best_t *best, const int *cases, int n, char *which,
                      size_t wlen) {
  double v = NAN;
  for (int i = 0; i < n; i++) {
    double g = gbps_of(b, &best[cases[i]]);
    if (!isnan(g) && (isnan(v) || g > v)) {
      v = g;
      const combo_t *k = &best[cases[i]].k;
      snprintf(which, wlen, "%s chunk %zu threads %d slots %d part %zu", k_cases[cases[i]],
               k->chunk, k->threads, k->slots, k->part);
    }
  }
  return v;
}

/* A TARGET line: the best of three cases against the disk's own rate (case `disk`). */
static void disk_target(const fbench_t *b, const best_t *best, const int cases[3], int disk,
                        const char *what) {
  char fig[256], which[160] = "";
  double rate = gbps_of(b, &best[disk]);
  double v = best_of(b, best, cases, 3, which, sizeof which);
  snprintf(fig, sizeof fig, "%.2f GB/s = %.2fx the disk's %.2f GB/s (%s)", v, v / rate, rate,
           which);
  target(b, what, !isnan(v) && !isnan(rate), v >= T_DISK_RATIO * rate, fig);
}

static void print_row(fbench_t *b, int c, const result_t *r) {
  double gbps = (double)b->o.bytes / r->seconds / 1e9;
  const char *cache = strstr(k_cases[c], "cold") ? b->cold_method
                      : c == C_LOAD_DIRECT || c == C_SAVE_DIRECT || is_disk(c)
                          ? "bypassed (O_DIRECT)"
                      : is_save(c) ? "written + fdatasync"
                                   : "hot";
  if ((c == C_LOAD_DIRECT || c == C_SAVE_DIRECT) && r->refused) cache = "refused: buffered";
  bool pm = is_pm(c);
  if (b->o.json) {
    cli_json_t j;
    cli_json_row(&j, "file", k_cases[c], b->o.bytes, r->seconds, gbps);
    if (is_disk(c))
      cli_json_null(&j, "verified"); /* the disk alone: no data to check */
    else
      cli_json_bool(&j, "verified", r->verified);
    cli_json_str(&j, "verify_method", is_disk(c) ? "none" : "full");
    cli_json_str(&j, "cache", cache);
    combo_t k = combo_resolved(&b->cur, is_save(c), r->direct_share > 0);
    if (pm) {
      /* The combination in force (defaults resolved), and what io did. */
      cli_json_uint(&j, "chunk", k.chunk);
      cli_json_int(&j, "threads", k.threads);
      cli_json_int(&j, "slots", k.slots);
      cli_json_uint(&j, "part", k.part);
      cli_json_double(&j, "direct_share", r->direct_share);
      cli_json_bool(&j, "direct_refused", r->refused);
    }
    cli_json_str(&j, "timing", "wall");
    cli_json_int(&j, "runs", b->o.repeat);
    cli_json_str(&j, "backend", pm_backend_name());
    cli_json_str(&j, "dir", b->o.dir);
    cli_json_end(&j);
  } else {
    cli_progress_clear();
    combo_t k = combo_resolved(&b->cur, is_save(c), r->direct_share > 0);
    char combo[96] = "";
    if (pm)
      snprintf(combo, sizeof combo, "%zu/%d/%d/%zu %.0f%%", k.chunk, k.threads, k.slots, k.part,
               100.0 * r->direct_share);
    printf("%-18s  %-30s %9.4f  %8.2f  %-20s  %s\n", k_cases[c], combo, r->seconds, gbps, cache,
           is_disk(c)    ? "n/a (the disk alone)"
           : r->verified ? "full"
                         : "NO (FAILED)");
  }
  fflush(stdout); /* each row out at once: a sweep stopped by a time limit keeps its rows */
}

static int file_at(const fopts_t *opts);

int pm_cli_bench_file(int argc, char **argv) {
  fbench_t *b = calloc(1, sizeof *b);
  if (!b) return CLI_EXIT_FAILURE;
  int rc = parse_args(argc, argv, &b->o);
  if (rc || b->o.help) {
    if (!rc) print_help();
    free(b);
    return rc;
  }
  fopts_t opts = b->o;
  free(b);
  cli_check(pm_init());
  if (!opts.nsizes) {
    opts.sizes[0] = pm_backend_kind() == PM_BACKEND_CUDA ? 1024 * MIB : 64 * MIB;
    opts.nsizes = 1;
  }
  for (int i = 0; i < opts.nsizes; i++) {
    if (i && !opts.json) printf("\n");
    opts.bytes = opts.sizes[i];
    rc = file_at(&opts);
    if (rc) return rc;
  }
  return 0;
}

/* One file size (o->bytes): every case and combination, then the TARGET lines. */
static int file_at(const fopts_t *opts) {
  fbench_t *b = calloc(1, sizeof *b);
  if (!b) return CLI_EXIT_FAILURE;
  b->o = *opts;
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
        const char *names[NCASES + 1];
        for (int k = 0; k < NCASES; k++) names[k] = k_cases[k];
        names[NCASES] = NULL;
        return cli_unknown("case", one, names);
      }
      if (!c) break;
      p = c + 1;
    }
  }
  fopts_t *o = &b->o;
  /* An empty list is the one default point. */
  if (!o->nchunk) o->nchunk = 1;
  if (!o->nthreads) o->nthreads = 1;
  if (!o->nslots) o->nslots = 1;
  if (!o->npart) o->npart = 1;
  int ncombo = o->nchunk * o->nthreads * o->nslots * o->npart;
  cli_progress_init(o->quiet);
  cli_check(pm_init());
  b->cuda = pm_backend_kind() == PM_BACKEND_CUDA;
  if (!o->repeat) o->repeat = 3;
  b->cold_method = "fadvise";
  for (int c = 0; c < NCASES; c++)
    if (case_on(o, k_cases[c])) b->steps += !is_pm(c) ? 1 : is_save(c) ? ncombo / o->npart : ncombo;
  setup(b);

  char sz[32];
  cli_fmt_bytes(o->bytes, sz, sizeof sz);
  if (!o->json) {
    printf("pinmem bench file: backend %s, a file of %s in %s, median of %d runs\n",
           pm_backend_name(), sz, b->path, o->repeat);
    cli_host_note(false, "these figures");
    printf("\n%-18s  %-30s %9s  %8s  %-20s  %s\n", "case", "chunk/threads/slots/part direct",
           "seconds", "GB/s", "cache", "verified");
  }
  best_t best[NCASES];
  memset(best, 0, sizeof best);
  for (int c = 0; c < NCASES; c++) {
    if (!case_on(o, k_cases[c])) continue;
    int nk = is_pm(c) ? ncombo : 1;
    for (int i = 0; i < nk; i++) {
      int ip = i % o->npart, is = i / o->npart % o->nslots,
          it = i / (o->npart * o->nslots) % o->nthreads,
          ic = i / (o->npart * o->nslots * o->nthreads);
      if (is_save(c) && ip) continue; /* part: reads only */
      combo_t k = {o->chunk[ic], o->part[ip], o->threads[it], o->slots[is]};
      b->cur = k;
      set_combo_options(o, &k);
      result_t r = run_case(b, c);
      print_row(b, c, &r);
      if (r.verified && (!best[c].r.ran || r.seconds < best[c].r.seconds)) {
        best[c].r = r;
        best[c].k = combo_resolved(&k, is_save(c), r.direct_share > 0);
      }
      if (!r.verified) best[c].r.ran = true; /* a failed row is never "best" but still ran */
    }
  }
  cli_progress_clear();
  if (o->json) cli_host_note(true, "these figures");
  FILE *tout = o->json ? stderr : stdout;
  fprintf(tout, "\n");
  char fig[256], which[160] = "";
  const int hot_cases[] = {C_LOAD_HOT, C_LOAD_HOT_AUTO};
  double hot = best_of(b, best, hot_cases, 2, which, sizeof which);
  snprintf(fig, sizeof fig, "%.2f GB/s (%s)", hot, which);
  target(b, "hot load (best of load_hot_buffered, load_hot_auto) >= 40 GB/s", !isnan(hot),
         hot >= T_HOT_GBPS, fig);
  const int cold_cases[] = {C_LOAD_COLD, C_LOAD_DIRECT, C_LOAD_COLD_AUTO};
  disk_target(b, best, cold_cases, C_DISK_READ,
              "cold load (best of load_cold_buffered, load_direct, load_cold_auto) >= 0.9x "
              "disk_read_direct");
  const int save_cases[] = {C_SAVE_BUFFERED, C_SAVE_DIRECT, C_SAVE_AUTO};
  disk_target(b, best, save_cases, C_DISK_WRITE,
              "save (best of save_buffered, save_direct, save_auto, with fdatasync) >= 0.9x "
              "disk_write_direct");
  teardown(b);
  bool failed = b->failed;
  free(b);
  if (failed) {
    fprintf(stderr, "pinmem: bench file: some cases delivered wrong bytes (VERIFY FAILED above)\n");
    return CLI_EXIT_FAILURE;
  }
  return 0;
}
