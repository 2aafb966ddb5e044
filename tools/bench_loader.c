/*
 * `pinmem bench loader`: what pinmem's data loader delivers to the device in a training loop.
 *
 * Data: with no --data/--tokens, two synthetic files written to a temporary folder (removed at
 * exit): an .npy of 3x224x224 uint8 images (150 KB samples, the target case; 8192 of them on
 * the cuda backend, 512 on the host backend) and a raw uint16 token file (nanoGPT layout). With
 * --data the given .npy file(s), with --tokens FILE --seq-len N a token file. Before the runs
 * the files are read once, so they are in the page cache.
 *
 * The loop (per rank, --world N simulates N ranks with N loaders in one process, taken in turn):
 * pm_loader_next, pm_batch_wait_stream on the rank's consumer stream, a busy kernel of --busy
 * seconds on that stream (the stand-in for the training step), pm_batch_release. With a kernel,
 * each step ends with a synchronisation of the consumer streams, as a training loop's
 * loss.item() does: otherwise the host would run ahead of the device and time spent waiting
 * in pm_loader_next would hide behind queued kernels instead of being the device's idle time.
 * Without a kernel (the throughput cases) the consumer just takes batches and its streams wait
 * for them. The clock starts when every rank has its first batch (pipeline start-up excluded;
 * those batches are not counted) and stops after the final synchronisation. Reported: GB/s
 * delivered (inputs + targets), batches/s, the consumer's stall (time inside pm_loader_next
 * waiting for data, from the loader's stats, start-up excluded) as seconds, per batch and as a
 * share of the run; with a kernel also the device's idle time between the end of one step's
 * kernel and the moment the next batch was on the device (timing events: it includes the
 * host's own step overhead and any copy the stream had to wait for); and the latency of
 * pm_loader_next calls whose batch was ready. Each case runs --repeat times; the median run is
 * reported.
 *
 * Cases: images (or the --data file) with pin_memory on ("pinned": each slot's copy in parts
 * queued as their rows are written, option loader_piece) and the same with one copy of the whole
 * slot once it is full ("pinned_whole", loader_piece 0), their runs taken in turn so the two
 * layouts see the same machine; pin_memory off ("pageable": slots in pageable memory and a plain
 * copy inside pm_loader_next, as DataLoader(pin_memory=False) + .to(device)); "pinned_compute":
 * pinned, with a busy kernel 1.5x the measured device time of one batch copy, so compute is the
 * bottleneck and the loader must hide entirely; tokens (batch 64 x seq_len 1024 by default)
 * pinned with a 5 ms step.
 *
 * The two halves at once (images, pinned, device delivery), as `bench copy` shows them for
 * staging: "images_host" is the loader's reads alone (host delivery: the workers fill pinned
 * slots and nothing copies them); "slot_dma" a plain pinned DMA of one slot's size alone
 * (events, median); "slot_dma_under_reads" the same DMA while a loader with host delivery keeps
 * its workers reading (a consumer thread takes and releases its batches); "reads_under_dma" the
 * rate that loader delivered meanwhile (wall time over the timed DMAs). No layout passes the
 * reads alone; one copy per full slot cannot pass the smaller of the last two (its DMA reads
 * DRAM while the workers read); parts pass it only where the DMA reads them from the cache. The
 * >= 48 GB/s TARGET line gives these ceilings beside the figure.
 *
 * Checks, always: every sample index is delivered the expected number of times per epoch over
 * all ranks (exactly once when the ranks divide the dataset, else at least once, with the
 * padding total), and the first batch of each rank (outside the timed part) is copied back
 * from the device and checked sample by sample against checksums of the source. --verify checks
 * every delivered batch that way (inside the timed loop, so its speed figures are not the
 * loader's). Synthetic images are checked against checksums taken when they were generated;
 * other samples against pm_dataset_read_sample of the same file, and token targets against
 * their inputs shifted by one. A failed check makes "verified" false and the exit status 1.
 *
 * TARGET lines (text mode; on stderr with --json) compare with pinmem's targets; speed
 * targets apply to the cuda backend.
 */
#include "bench_loader.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "internal.h"

#define KB 1000.0
#define IMG_C 3
#define IMG_H 224
#define IMG_W 224
#define IMG_BYTES ((size_t)IMG_C * IMG_H * IMG_W)

/* pinmem's targets. */
#define T_IMG_GBPS 40.0
#define T_IMG_GBPS_LINK 48.0        /* the link's 55.5 GB/s less the gaps a loader may keep */
#define T_TOKEN_STALL_FRACTION 0.01 /* of a step */
#define T_TOKEN_NEXT_US 20.0
#define T_COMPUTE_STALL_FRACTION 0.02 /* of the run */

/* ---- options ---------------------------------------------------------------------------- */

typedef struct lopts {
  bool json, verify, shuffle, help, quiet;
  const char *data;   /* comma list of .npy files */
  const char *tokens; /* token file */
  size_t seq_len;
  int token_bytes;
  size_t batch, token_batch;
  int workers, prefetch, world, repeat;
  uint64_t epochs, samples, windows, seed;
  double busy, token_busy; /* < 0: default */
  int pin;                 /* 1 on, 0 off, 2 both */
  pm_io_mode_t io;
  pm_delivery_t delivery;
} lopts_t;

static const char *usage_text =
    "usage: pinmem bench loader [options]\n"
    "  (no data option)       synthetic 3x224x224 uint8 images (.npy) and a uint16 token file,\n"
    "                         in a temporary folder removed at exit\n"
    "  --data FILE[,FILE..]   .npy file(s) instead (samples along axis 0)\n"
    "  --tokens FILE          a raw token file (nanoGPT train.bin) instead; needs --seq-len\n"
    "  --seq-len N            tokens per sample (default 1024 for the synthetic tokens)\n"
    "  --token-bytes 2|4      uint16 (default) or uint32 tokens\n"
    "  --batch N              samples per batch (default 256 on cuda, 64 on host; tokens: 64)\n"
    "  --workers N            reader threads per loader (default: option loader_workers)\n"
    "  --prefetch N           batch slots per loader (default: option loader_prefetch)\n"
    "  --epochs N             epochs per run (default 5 on cuda, 2 on host)\n"
    "  --samples N            synthetic images (default 8192 on cuda, 512 on host)\n"
    "  --windows N            token windows per epoch (default 200 batches' worth)\n"
    "  --busy SECONDS         busy kernel per batch for images/--data (default 0);\n"
    "                         the pinned_compute case uses 1.5x the measured copy time\n"
    "  --token-busy SECONDS   busy kernel per token batch (default 0.005)\n"
    "  --world N              simulate N ranks (N loaders) in one process (default 1)\n"
    "  --pin on|off|both      pin_memory cases to run (default both)\n"
    "  --io pread|mmap|direct how the files are read (default pread)\n"
    "  --delivery device|host batches in device buffers (default) or host slots only\n"
    "  --no-shuffle           sequential order (default: shuffled)\n"
    "  --seed N               shuffle / window seed (default 1)\n"
    "  --repeat N             runs per case, median reported (default 3 on cuda, 1 on host)\n"
    "  --verify               check every delivered sample (slower: the speed is not the "
    "loader's)\n"
    "  --json                 one JSON object per line: bench, case, bytes, seconds, gbps,\n"
    "                         verified (true/false), verify_method (\"full\" with --verify,\n"
    "                         else \"first_batch+coverage\"), ...\n"
    "  --quiet                no progress on stderr (else one line rewritten on a terminal, a line\n"
    "                         per case on a pipe or a log)\n"
    "cases: images_pinned (copies in parts of loader_piece), images_pinned_whole (one copy\n"
    "  per full slot), images_pageable, images_pinned_compute, and the halves at once:\n"
    "  images_host (reads alone), slot_dma, slot_dma_under_reads, reads_under_dma (images or\n"
    "  --data); tokens_pinned, tokens_pageable (synthetic tokens or --tokens); --pin picks them\n"
    "  (PINMEM_LOADER_PIECE=SIZE sets the parts of images_pinned)\n"
    "An option with a value may be given once; a switch (--json, --verify, ...) more than once.\n"
    "--data and --tokens take regular files (not devices, FIFOs or folders).\n";

static int lusage(const char *fmt, const char *arg) {
  return cli_usage_fail(fmt, arg);
}

static bool parse_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out) {
  char *end;
  errno = 0;
  if (!s[0] || s[0] == '-') return false;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || *end || v < lo || v > hi) return false;
  *out = v;
  return true;
}

static bool parse_secs(const char *s, double *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (errno || end == s || *end || !isfinite(v) || v < 0 || v > 3600) return false;
  *out = v;
  return true;
}

/* 0 when path is a regular file, or cannot be looked at (the dataset's open says why), else the
 * usage exit code with the reason. */
static int check_regular(const char *opt, const char *path) {
  struct stat sb;
  if (stat(path, &sb) != 0 || S_ISREG(sb.st_mode)) return 0;
  const char *kind = S_ISDIR(sb.st_mode)    ? "a folder"
                     : S_ISCHR(sb.st_mode)  ? "a character device"
                     : S_ISBLK(sb.st_mode)  ? "a block device"
                     : S_ISFIFO(sb.st_mode) ? "a FIFO"
                     : S_ISSOCK(sb.st_mode) ? "a socket"
                                            : "not a regular file";
  char msg[600];
  snprintf(msg, sizeof msg, "%s: '%%s' is %s; a dataset must be a regular file", opt, kind);
  return lusage(msg, path);
}

static int parse_args(int argc, char **argv, lopts_t *o) {
  cli_usage_context(
      "bench loader",
      "pinmem bench loader [--json] [--quiet] [--data FILES | --tokens FILE --seq-len N]\n"
      "    [--batch N] [--workers N] [--prefetch N] [--epochs N] [--repeat N] [--pin on|off|both]");
  memset(o, 0, sizeof *o);
  o->shuffle = true;
  o->seed = 1;
  o->busy = o->token_busy = -1;
  o->pin = 2;
  o->token_bytes = 2;
  o->io = PM_IO_PREAD;
  o->delivery = PM_DELIVER_DEVICE;
  static const char *const valued[] = {
      "--data",     "--tokens", "--seq-len",    "--token-bytes", "--batch", "--workers",
      "--prefetch", "--epochs", "--samples",    "--windows",     "--seed",  "--world",
      "--repeat",   "--busy",   "--token-busy", "--pin",         "--io",    "--delivery",
      NULL};
  static const char *const flags[] = {"--json", "--verify", "--no-shuffle",
                                      "--help", "--quiet",  NULL};
  cli_opts_t op;
  cli_opts_init(&op, "bench loader", argc, argv, valued, flags);
  const char *v;
  int got;
  while ((got = cli_opts_next(&op, &v)) == 1) {
    const char *name = op.name;
    if (!strcmp(name, "--json")) o->json = true;
    if (!strcmp(name, "--verify")) o->verify = true;
    if (!strcmp(name, "--no-shuffle")) o->shuffle = false;
    if (!strcmp(name, "--help")) o->help = true;
    if (!strcmp(name, "--quiet")) o->quiet = true;
    if (!v) continue;
    uint64_t u;
    if (!strcmp(name, "--data")) {
      int empty = cli_list_empty_item(v);
      if (empty) {
        char msg[64];
        snprintf(msg, sizeof msg, "--data: item %d of '%%s' is empty", empty);
        return lusage(msg, v);
      }
      o->data = v;
    } else if (!strcmp(name, "--tokens")) {
      o->tokens = v;
    } else if (!strcmp(name, "--seq-len")) {
      if (!parse_u64(v, 1, 1u << 24, &u))
        return lusage("--seq-len must be a whole number from 1 to 16777216, not '%s'", v);
      o->seq_len = (size_t)u;
    } else if (!strcmp(name, "--token-bytes")) {
      if (!parse_u64(v, 2, 4, &u) || u == 3)
        return lusage("--token-bytes must be 2 or 4, not '%s'", v);
      o->token_bytes = (int)u;
    } else if (!strcmp(name, "--batch")) {
      if (!parse_u64(v, 1, 1u << 24, &u))
        return lusage("--batch must be a whole number from 1 to 16777216, not '%s'", v);
      o->batch = o->token_batch = (size_t)u;
    } else if (!strcmp(name, "--workers")) {
      if (!parse_u64(v, 0, 256, &u))
        return lusage("--workers must be a whole number from 0 to 256, not '%s'", v);
      o->workers = (int)u;
    } else if (!strcmp(name, "--prefetch")) {
      if (!parse_u64(v, 0, 4096, &u))
        return lusage("--prefetch must be a whole number from 0 to 4096, not '%s'", v);
      o->prefetch = (int)u;
    } else if (!strcmp(name, "--epochs")) {
      if (!parse_u64(v, 1, 1000000, &u))
        return lusage("--epochs must be a whole number from 1 to 1000000, not '%s'", v);
      o->epochs = u;
    } else if (!strcmp(name, "--samples")) {
      if (!parse_u64(v, 1, (uint64_t)1 << 32, &u))
        return lusage("--samples must be a whole number from 1 to 2^32, not '%s'", v);
      o->samples = u;
    } else if (!strcmp(name, "--windows")) {
      if (!parse_u64(v, 1, (uint64_t)1 << 40, &u))
        return lusage("--windows must be a whole number from 1 to 2^40, not '%s'", v);
      o->windows = u;
    } else if (!strcmp(name, "--seed")) {
      if (!parse_u64(v, 0, UINT64_MAX, &u))
        return lusage("--seed must be a whole number from 0 to 2^64-1, not '%s'", v);
      o->seed = u;
    } else if (!strcmp(name, "--world")) {
      if (!parse_u64(v, 1, 64, &u))
        return lusage("--world must be a whole number from 1 to 64, not '%s'", v);
      o->world = (int)u;
    } else if (!strcmp(name, "--repeat")) {
      if (!parse_u64(v, 1, 1000, &u))
        return lusage("--repeat must be a whole number from 1 to 1000, not '%s'", v);
      o->repeat = (int)u;
    } else if (!strcmp(name, "--busy")) {
      if (!parse_secs(v, &o->busy))
        return lusage("--busy must be seconds from 0 to 3600, not '%s'", v);
    } else if (!strcmp(name, "--token-busy")) {
      if (!parse_secs(v, &o->token_busy))
        return lusage("--token-busy must be seconds from 0 to 3600, not '%s'", v);
    } else if (!strcmp(name, "--pin")) {
      if (!strcmp(v, "on"))
        o->pin = 1;
      else if (!strcmp(v, "off"))
        o->pin = 0;
      else if (!strcmp(v, "both"))
        o->pin = 2;
      else
        return lusage("--pin must be on, off or both, not '%s'", v);
    } else if (!strcmp(name, "--io")) {
      if (!strcmp(v, "pread"))
        o->io = PM_IO_PREAD;
      else if (!strcmp(v, "mmap"))
        o->io = PM_IO_MMAP;
      else if (!strcmp(v, "direct"))
        o->io = PM_IO_DIRECT;
      else
        return lusage("--io must be pread, mmap or direct, not '%s'", v);
    } else if (!strcmp(name, "--delivery")) {
      if (!strcmp(v, "device"))
        o->delivery = PM_DELIVER_DEVICE;
      else if (!strcmp(v, "host"))
        o->delivery = PM_DELIVER_HOST;
      else
        return lusage("--delivery must be device or host, not '%s'", v);
    }
  }
  if (got) return got;
  if (o->data && o->tokens) return lusage("%s", "--data and --tokens exclude each other");
  if (o->tokens && !o->seq_len) return lusage("%s", "--tokens needs --seq-len");
  if (o->seq_len && !o->tokens && o->data)
    return lusage("%s", "--seq-len belongs to --tokens (or the synthetic tokens)");
  /* The files are read once to warm the page cache before any run: a device, a FIFO or a
   * folder would block there or never end (/dev/zero), so only regular files are taken. */
  int rc = 0;
  if (o->tokens) rc = check_regular("--tokens", o->tokens);
  if (!rc && o->data) {
    char *copy = cli_xstrdup(o->data), *save = NULL;
    for (char *t = strtok_r(copy, ",", &save); t && !rc; t = strtok_r(NULL, ",", &save))
      rc = check_regular("--data", t);
    free(copy);
  }
  return rc;
}

/* ---- checksums and synthetic data ------------------------------------------------------- */

static uint64_t hash_bytes(const void *p, size_t n) {
  const unsigned char *b = p;
  uint64_t h = 0x243F6A8885A308D3ull ^ n;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    memcpy(&w, b + i, 8);
    h = (h ^ w) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
  }
  uint64_t w = 0;
  if (i < n) memcpy(&w, b + i, n - i);
  return pm__mix64(h ^ w);
}

static void syn_sample(void *dst, size_t n, uint64_t index) {
  unsigned char *d = dst;
  uint64_t base = pm__mix64(index * 0x100000001B3ull + 0x5151);
  size_t j = 0;
  for (; j + 8 <= n; j += 8) {
    uint64_t w = pm__mix64(base + j);
    memcpy(d + j, &w, 8);
  }
  if (j < n) {
    uint64_t w = pm__mix64(base + j);
    memcpy(d + j, &w, n - j);
  }
}

static char g_tmpdir[512];

static void remove_tmpdir(void) {
  if (!g_tmpdir[0]) return;
  char p[600];
  const char *names[] = {"images.npy", "tokens.bin"};
  for (size_t i = 0; i < 2; i++) {
    snprintf(p, sizeof p, "%s/%s", g_tmpdir, names[i]);
    unlink(p);
  }
  rmdir(g_tmpdir);
  g_tmpdir[0] = '\0';
}

typedef struct gen_job {
  int fd;
  uint64_t n, per_chunk;
  size_t hdr;
  uint64_t *table;
  atomic_int failed;
} gen_job_t;

static void gen_chunk(void *ctx, size_t c) {
  gen_job_t *g = ctx;
  uint64_t first = (uint64_t)c * g->per_chunk, cnt = PM__MIN(g->per_chunk, g->n - first);
  unsigned char *buf = malloc((size_t)cnt * IMG_BYTES);
  if (!buf) {
    atomic_store(&g->failed, ENOMEM);
    return;
  }
  for (uint64_t i = 0; i < cnt; i++) {
    syn_sample(buf + i * IMG_BYTES, IMG_BYTES, first + i);
    g->table[first + i] = hash_bytes(buf + i * IMG_BYTES, IMG_BYTES);
  }
  size_t len = (size_t)cnt * IMG_BYTES, done = 0;
  off_t off = (off_t)(g->hdr + first * IMG_BYTES);
  while (done < len) {
    ssize_t w = pwrite(g->fd, buf + done, len - done, off + (off_t)done);
    if (w <= 0) {
      if (w < 0 && errno == EINTR) continue;
      atomic_store(&g->failed, w < 0 ? errno : EIO);
      break;
    }
    done += (size_t)w;
  }
  free(buf);
}

static int make_tmpdir(void) {
  if (g_tmpdir[0]) return 0;
  const char *t = getenv("TMPDIR");
  snprintf(g_tmpdir, sizeof g_tmpdir, "%s/pinmem-loader.XXXXXX", t && t[0] ? t : "/tmp");
  if (!mkdtemp(g_tmpdir)) {
    fprintf(stderr, "pinmem: mkdtemp(%s): %s\n", g_tmpdir, strerror(errno));
    g_tmpdir[0] = '\0';
    return -1;
  }
  atexit(remove_tmpdir);
  return 0;
}

/* images.npy with n samples; table[i] = checksum of sample i. 0 or -1 (message printed). */
static int gen_images(uint64_t n, char *path, size_t plen, uint64_t *table) {
  if (make_tmpdir()) return -1;
  snprintf(path, plen, "%s/images.npy", g_tmpdir);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    fprintf(stderr, "pinmem: creating %s: %s\n", path, strerror(errno));
    return -1;
  }
  char hdr[128];
  memset(hdr, ' ', sizeof hdr);
  memcpy(hdr, "\x93NUMPY\x01\x00", 8);
  hdr[8] = (char)(sizeof hdr - 10);
  hdr[9] = 0;
  int k = snprintf(hdr + 10, sizeof hdr - 10,
                   "{'descr': '|u1', 'fortran_order': False, 'shape': (%llu, %d, %d, %d), }",
                   (unsigned long long)n, IMG_C, IMG_H, IMG_W);
  hdr[10 + k] = ' ';
  hdr[sizeof hdr - 1] = '\n';
  gen_job_t g = {fd, n, 64, sizeof hdr, table, 0};
  bool ok = pwrite(fd, hdr, sizeof hdr, 0) == (ssize_t)sizeof hdr;
  if (ok) {
    pm__parallel_for(pm__cpu_count(), (size_t)((n + g.per_chunk - 1) / g.per_chunk), gen_chunk, &g);
    ok = atomic_load(&g.failed) == 0;
  }
  int e = ok ? 0 : atomic_load(&g.failed) ? atomic_load(&g.failed) : errno;
  if (close(fd) != 0 && ok) {
    ok = false;
    e = errno;
  }
  if (!ok) {
    fprintf(stderr, "pinmem: writing %s (%.2f GB): %s\n", path, (double)(n * IMG_BYTES) / 1e9,
            strerror(e));
    return -1;
  }
  return 0;
}

static int gen_tokens(uint64_t ntok, int tb, char *path, size_t plen) {
  if (make_tmpdir()) return -1;
  snprintf(path, plen, "%s/tokens.bin", g_tmpdir);
  FILE *f = fopen(path, "wb");
  if (!f) {
    fprintf(stderr, "pinmem: creating %s: %s\n", path, strerror(errno));
    return -1;
  }
  enum { CH = 1 << 16 };
  static unsigned char buf[CH * 4];
  bool ok = true;
  for (uint64_t t = 0; t < ntok && ok; t += CH) {
    uint64_t m = PM__MIN((uint64_t)CH, ntok - t);
    for (uint64_t i = 0; i < m; i++) {
      uint32_t v = (uint32_t)(pm__mix64(t + i) % 50257);
      memcpy(buf + i * (uint64_t)tb, &v, (size_t)tb); /* little endian */
    }
    ok = fwrite(buf, (size_t)tb, (size_t)m, f) == (size_t)m;
  }
  if (fclose(f) != 0) ok = false;
  if (!ok) {
    fprintf(stderr, "pinmem: writing %s: %s\n", path, strerror(errno));
    return -1;
  }
  return 0;
}

/* Read a file once so it is in the page cache. */
static void warm_file(const char *path) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  static char buf[1 << 20];
  while (read(fd, buf, sizeof buf) > 0) {
  }
  close(fd);
}

/* ---- one case ------------------------------------------------------------------------------ */

typedef struct src {
  pm_dataset_t *ds;
  pm_dataset_info_t info;
  const uint64_t *table; /* synthetic images: checksum per sample; else NULL */
  bool tokens;
  char label[256];
} src_t;

typedef struct result {
  char name[48];
  char piece[128]; /* loader_piece in force (pm_option_info_t.value) */
  pm_delivery_t delivery;
  bool pinned;
  double busy;
  int runs;
  double seconds, gbps, batches_per_s;
  uint64_t bytes, batches;
  double stall, stall_per_batch, stall_pct;
  double next_p50, next_p99; /* ready calls, seconds; NAN if none */
  double idle, idle_pct;     /* device idle between steps (cases with a kernel), else NAN */
  uint64_t ready_calls;
  double read_s, copy_s, copy_per_batch;
  size_t device_bytes, host_bytes, slot_bytes;
  int workers, prefetch;
  bool verified;
} result_t;

typedef struct bench {
  lopts_t o;
  bool cuda;
  int world;
  uint64_t epochs;
  int repeat;
  bool verify_failed;
  result_t res[24];
  int nres;
  int run;                /* of the case now running, for the progress line */
  pm_delivery_t delivery; /* of the case now running */
  /* The two halves at once (NAN: not measured). */
  double dma_alone, dma_under_reads, reads_under_dma;
  size_t halves_bytes;
  int halves_runs;
  bool halves_ok;
} bench_t;

/* Progress on a terminal only (cli_progress): the case, the run, batches done of the run's
 * total and the rate so far. */
static void progress(bench_t *B, const char *name, uint64_t done, uint64_t total, double gbps) {
  cli_progress(done, total, "%s: run %d/%d, batches, %.2f GB/s", name, B->run + 1, B->repeat, gbps);
}

/* Check one delivered batch against its source: 0 bad rows, else the count (message printed
 * for the first). The data is read back from the device buffer when there is one. */
static uint64_t check_batch(bench_t *B, src_t *s, const pm_batch_t *b, pm_stream_t stream,
                            unsigned char *vbuf, unsigned char *tmp_in, unsigned char *tmp_tg) {
  const unsigned char *in = b->inputs, *tg = b->targets;
  if (b->event) {
    if (pm_memcpy_async(vbuf, b->inputs, b->inputs_bytes, PM_COPY_D2H, stream) != PM_OK ||
        (b->targets && pm_memcpy_async(vbuf + b->inputs_bytes, b->targets, b->targets_bytes,
                                       PM_COPY_D2H, stream) != PM_OK) ||
        pm_stream_synchronize(stream) != PM_OK)
      cli_fail(PM_ERR_BACKEND);
    in = vbuf;
    tg = b->targets ? vbuf + b->inputs_bytes : NULL;
  }
  size_t sb = s->info.sample_bytes, tb = s->info.target_bytes;
  uint64_t bad = 0;
  for (size_t r = 0; r < b->samples; r++) {
    uint64_t idx = b->indices[r];
    const unsigned char *ri = in + r * sb;
    bool ok;
    if (s->table) {
      ok = hash_bytes(ri, sb) == s->table[idx];
    } else {
      pm_status_t st = pm_dataset_read_sample(s->ds, b->epoch, idx, tmp_in, tmp_tg);
      if (st != PM_OK) cli_fail(st);
      ok = memcmp(ri, tmp_in, sb) == 0;
      if (ok && tb) {
        const unsigned char *rt = tg + r * tb;
        size_t isz = s->info.itemsize;
        ok = memcmp(rt, tmp_tg, tb) == 0 && memcmp(rt, ri + isz, sb - isz) == 0;
      }
    }
    if (!ok && bad++ == 0 && (cli_progress_clear(), true))
      fprintf(stderr,
              "pinmem: VERIFY FAILED: epoch %llu batch %llu row %zu (sample %llu) differs "
              "from its source\n",
              (unsigned long long)b->epoch, (unsigned long long)b->index, r,
              (unsigned long long)idx);
  }
  (void)B;
  return bad;
}

static void run_once(bench_t *B, src_t *s, const char *name, bool pinned, double busy, size_t batch,
                     result_t *r) {
  int W = B->world;
  pm_loader_t *ld[64];
  pm_stream_t st[64];
  pm_batch_t cur;
  pm_status_t rc;
  memset(r, 0, sizeof *r);
  for (int k = 0; k < W; k++) {
    pm_loader_config_t c;
    pm_loader_config_init(&c);
    c.batch_size = batch;
    c.workers = B->o.workers;
    c.prefetch = B->o.prefetch;
    c.shuffle = B->o.shuffle;
    c.seed = B->o.seed;
    c.rank = k;
    c.world_size = W;
    c.pin_memory = pinned;
    c.delivery = B->delivery;
    c.epochs = B->epochs;
    if ((rc = pm_loader_create(s->ds, &c, &ld[k])) != PM_OK) cli_fail(rc);
    if ((rc = pm_stream_create(&st[k])) != PM_OK) cli_fail(rc);
  }
  pm_loader_stats_t s0;
  pm_loader_get_stats(ld[0], &s0);
  uint64_t n = s->info.samples, bpe = s0.batches_per_epoch, total = bpe * B->epochs;
  uint8_t *count = calloc((size_t)(n * B->epochs), 1);
  double *lat = malloc(sizeof(double) * (size_t)(total * (uint64_t)W + 1));
  size_t vbytes = s0.slot_bytes;
  unsigned char *vbuf = NULL;
  if (B->delivery == PM_DELIVER_DEVICE && (rc = pm_host_alloc(NULL, vbytes, 0, (void **)&vbuf)))
    cli_fail(rc);
  unsigned char *tmp_in = malloc(s->info.sample_bytes + 1),
                *tmp_tg = malloc(s->info.target_bytes + 1);
  if (!count || !lat || !tmp_in || !tmp_tg) cli_fail(PM_ERR_NOMEM);
  uint64_t bad = 0, nlat = 0, ready_calls = 0;
  pm_loader_stats_t st0[64];
  pm_event_t ev_ready[64], ev_end[64][2];
  if (busy > 0)
    for (int k = 0; k < W; k++)
      if ((rc = pm_event_create(PM_EVENT_TIMING, &ev_ready[k])) != PM_OK ||
          (rc = pm_event_create(PM_EVENT_TIMING, &ev_end[k][0])) != PM_OK ||
          (rc = pm_event_create(PM_EVENT_TIMING, &ev_end[k][1])) != PM_OK)
        cli_fail(rc);
  double t0 = 0, idle = 0;
  uint64_t counted_bytes = 0, counted_batches = 0;

  for (uint64_t step = 0; step < total; step++) {
    for (int k = 0; k < W; k++) {
      pm_loader_stats_t before;
      pm_loader_get_stats(ld[k], &before);
      double a = pm__now();
      rc = pm_loader_next(ld[k], &cur);
      double dt = pm__now() - a;
      if (rc != PM_OK) cli_fail(rc);
      pm_loader_stats_t after;
      pm_loader_get_stats(ld[k], &after);
      if (step > 0 && after.waits == before.waits) {
        lat[nlat++] = dt;
        ready_calls++;
      }
      for (size_t i = 0; i < cur.samples; i++) {
        uint8_t *c = &count[cur.epoch * n + cur.indices[i]];
        if (*c < 255) (*c)++;
      }
      if ((rc = pm_batch_wait_stream(&cur, st[k])) != PM_OK) cli_fail(rc);
      if (step == 0 || B->o.verify) bad += check_batch(B, s, &cur, st[k], vbuf, tmp_in, tmp_tg);
      if (step > 0) {
        counted_bytes += cur.inputs_bytes + cur.targets_bytes;
        counted_batches++;
      }
      if (busy > 0) {
        if ((rc = pm_event_record(ev_ready[k], st[k])) != PM_OK ||
            (rc = pm_launch_busy(st[k], busy)) != PM_OK ||
            (rc = pm_event_record(ev_end[k][step & 1], st[k])) != PM_OK)
          cli_fail(rc);
      }
      if ((rc = pm_batch_release(&cur, st[k])) != PM_OK) cli_fail(rc);
    }
    if (step == 0) {
      for (int k = 0; k < W; k++) {
        if ((rc = pm_stream_synchronize(st[k])) != PM_OK) cli_fail(rc);
        pm_loader_get_stats(ld[k], &st0[k]);
      }
      t0 = pm__now();
    } else {
      if (busy > 0) {
        for (int k = 0; k < W; k++) {
          double gap = 0;
          if ((rc = pm_stream_synchronize(st[k])) != PM_OK ||
              (rc = pm_event_elapsed(ev_end[k][(step - 1) & 1], ev_ready[k], &gap)) != PM_OK)
            cli_fail(rc);
          if (gap > 0) idle += gap;
        }
      }
      double el = pm__now() - t0;
      progress(B, name, step + 1, total, el > 0 ? (double)counted_bytes / el / 1e9 : 0);
    }
  }
  for (int k = 0; k < W; k++)
    if ((rc = pm_stream_synchronize(st[k])) != PM_OK) cli_fail(rc);
  double secs = pm__now() - t0;
  pm_batch_t extra;
  for (int k = 0; k < W; k++) {
    rc = pm_loader_next(ld[k], &extra);
    if (rc != PM_ERR_STATE) {
      fprintf(stderr, "pinmem: VERIFY FAILED: rank %d delivered more batches than it should\n", k);
      bad++;
      if (rc == PM_OK) pm_batch_release(&extra, st[k]);
    }
  }

  /* Coverage: each epoch over all ranks. */
  uint64_t per_rank = s0.samples_per_epoch, want_total = per_rank * (uint64_t)W;
  for (uint64_t e = 0; e < B->epochs; e++) {
    uint64_t sum = 0, missing = 0, extra_n = 0;
    for (uint64_t i = 0; i < n; i++) {
      uint8_t c = count[e * n + i];
      sum += c;
      missing += c == 0;
      extra_n += c > 1;
    }
    bool exact = want_total == n;
    if (missing || sum != want_total || (exact && extra_n)) {
      fprintf(stderr,
              "pinmem: VERIFY FAILED: epoch %llu: %llu samples never delivered, %llu more "
              "than once, %llu deliveries (expected %llu)\n",
              (unsigned long long)e, (unsigned long long)missing, (unsigned long long)extra_n,
              (unsigned long long)sum, (unsigned long long)want_total);
      bad++;
    }
  }

  snprintf(r->name, sizeof r->name, "%s", name);
  pm_option_info_t oi;
  snprintf(r->piece, sizeof r->piece, "%s",
           pm_option_find("loader_piece", &oi) == PM_OK ? oi.value : "?");
  r->delivery = B->delivery;
  r->pinned = pinned;
  r->busy = busy;
  r->runs = 1;
  r->seconds = secs;
  r->bytes = counted_bytes;
  r->batches = counted_batches;
  /* The first step is the warm-up: a run of one step timed nothing, and its rates are not 0. */
  bool timed = counted_batches > 0 && secs > 0;
  r->gbps = timed ? (double)counted_bytes / secs / 1e9 : NAN;
  r->batches_per_s = timed ? (double)counted_batches / secs : NAN;
  for (int k = 0; k < W; k++) {
    pm_loader_stats_t e;
    pm_loader_get_stats(ld[k], &e);
    r->stall += e.stall_seconds - st0[k].stall_seconds;
    r->read_s += e.read_seconds - st0[k].read_seconds;
    r->copy_s += e.copy_seconds - st0[k].copy_seconds;
    r->device_bytes += e.device_bytes;
    r->host_bytes += e.host_bytes;
    r->slot_bytes = e.slot_bytes;
    r->workers = e.workers;
    r->prefetch = e.prefetch;
  }
  /* The stall is summed over ranks, which take turns on one thread: it is all wall time. */
  r->stall_per_batch = counted_batches ? r->stall / (double)counted_batches : NAN;
  r->stall_pct = secs > 0 ? 100.0 * r->stall / secs : NAN;
  r->copy_per_batch = counted_batches ? r->copy_s / (double)counted_batches : NAN;
  /* Per rank stream, so the share is of W streams' run time. */
  r->idle = busy > 0 ? idle : NAN;
  r->idle_pct = busy > 0 && secs > 0 ? 100.0 * idle / (secs * W) : NAN;
  qsort(lat, nlat, sizeof *lat, cli_cmp_double);
  r->ready_calls = ready_calls;
  r->next_p50 = nlat ? lat[nlat / 2] : NAN;
  r->next_p99 = nlat ? lat[(size_t)((double)(nlat - 1) * 0.99)] : NAN;
  r->verified = bad == 0;
  if (bad) B->verify_failed = true;

  for (int k = 0; k < W; k++) {
    if ((rc = pm_loader_destroy(ld[k])) != PM_OK) cli_fail(rc);
    if ((rc = pm_stream_destroy(st[k])) != PM_OK) cli_fail(rc);
    if (busy > 0) {
      pm_event_destroy(ev_ready[k]);
      pm_event_destroy(ev_end[k][0]);
      pm_event_destroy(ev_end[k][1]);
    }
  }
  if (vbuf) pm_host_free(vbuf);
  free(count);
  free(lat);
  free(tmp_in);
  free(tmp_tg);
}

static int cmp_result_secs(const void *a, const void *b) {
  const result_t *x = a, *y = b;
  return x->seconds < y->seconds ? -1 : x->seconds > y->seconds;
}

/* One case of run_cases: its name, pin_memory, kernel per batch, and loader_piece for its runs
 * (NULL: as the option stands). */
typedef struct case_spec {
  const char *name;
  bool pinned;
  double busy;
  const char *piece;
} case_spec_t;

/* --repeat runs of each case, the cases taken in turn run by run (so a drift of the machine
 * touches them alike); the median run of each is kept. */
static void run_cases(bench_t *B, src_t *s, const case_spec_t *cs, int ncases, size_t batch,
                      const result_t **out) {
  enum { MAXC = 4 };
  static result_t runs[MAXC][64];
  int n = PM__MIN(B->repeat, 64);
  bool all_ok[MAXC];
  for (int k = 0; k < ncases && k < MAXC; k++) all_ok[k] = true;
  for (int i = 0; i < n; i++) {
    B->run = i;
    for (int k = 0; k < ncases && k < MAXC; k++) {
      if (cs[k].piece) cli_check(pm_option_set("loader_piece", cs[k].piece));
      run_once(B, s, cs[k].name, cs[k].pinned, cs[k].busy, batch, &runs[k][i]);
      if (cs[k].piece) cli_check(pm_option_set("loader_piece", NULL));
      all_ok[k] &= runs[k][i].verified;
    }
  }
  for (int k = 0; k < ncases && k < MAXC; k++) {
    qsort(runs[k], (size_t)n, sizeof runs[k][0], cmp_result_secs);
    result_t *r = &B->res[B->nres++];
    *r = runs[k][n / 2];
    r->runs = n;
    r->verified = all_ok[k];
    out[k] = r;
  }
}

static const result_t *run_case(bench_t *B, src_t *s, const char *name, bool pinned, double busy,
                                size_t batch) {
  case_spec_t c = {name, pinned, busy, NULL};
  const result_t *r;
  run_cases(B, s, &c, 1, batch, &r);
  return r;
}

/* ---- the two halves at once ------------------------------------------------------------------ */

#define HALVES_MIN_RUNS 20
#define HALVES_MIN_WINDOW 0.25 /* seconds of DMA under the reads at least, for their rate */
#define HALVES_MAX_RUNS 4000

#define FEED_EPOCHS 8 /* epochs whose coverage the consumer thread counts */

/* A consumer thread that takes the batches of a host-delivery loader as fast as they come,
 * checked as every case's are: the first batch (every batch with --verify) against its source,
 * and the coverage of every epoch it completed. */
typedef struct feed {
  bench_t *B;
  src_t *s;
  pm_loader_t *ld;
  atomic_bool stop;
  atomic_uint_fast64_t bytes, batches;
  uint8_t *count;                      /* [FEED_EPOCHS][samples] deliveries */
  uint64_t epoch_batches[FEED_EPOCHS]; /* batches delivered per epoch */
  uint64_t bad;
  unsigned char *tmp_in, *tmp_tg;
  atomic_bool failed; /* err and msg are set (read them after the join) */
  pm_status_t err;
  char msg[256];
} feed_t;

static void *feed_main(void *arg) {
  feed_t *f = arg;
  uint64_t n = f->s->info.samples;
  while (!atomic_load_explicit(&f->stop, memory_order_relaxed)) {
    pm_batch_t b;
    pm_status_t st = pm_loader_next(f->ld, &b);
    if (st == PM_OK) {
      uint64_t nb = 0;
      for (int k = 0; k < b.nfields; k++) nb += b.fields[k].bytes;
      if (atomic_load_explicit(&f->batches, memory_order_relaxed) == 0 || f->B->o.verify)
        f->bad += check_batch(f->B, f->s, &b, NULL, NULL, f->tmp_in, f->tmp_tg);
      if (b.epoch < FEED_EPOCHS) {
        f->epoch_batches[b.epoch]++;
        for (size_t i = 0; i < b.samples; i++) {
          uint8_t *c = &f->count[b.epoch * n + b.indices[i]];
          if (*c < 255) (*c)++;
        }
      }
      st = pm_batch_release(&b, NULL);
      atomic_fetch_add_explicit(&f->bytes, nb, memory_order_relaxed);
      atomic_fetch_add_explicit(&f->batches, 1, memory_order_relaxed);
    }
    if (st != PM_OK) {
      f->err = st;
      snprintf(f->msg, sizeof f->msg, "%s", pm_last_error());
      atomic_store(&f->failed, true);
      break;
    }
  }
  return NULL;
}

/* Bad epochs among those the consumer thread completed (each sample once, one rank). */
static uint64_t feed_coverage(const feed_t *f, uint64_t bpe, uint64_t per_epoch) {
  uint64_t n = f->s->info.samples, bad = 0;
  for (uint64_t e = 0; e < FEED_EPOCHS && f->epoch_batches[e] == bpe; e++) {
    uint64_t sum = 0, missing = 0;
    for (uint64_t i = 0; i < n; i++) {
      sum += f->count[e * n + i];
      missing += f->count[e * n + i] == 0;
    }
    if (missing || sum != per_epoch) {
      fprintf(stderr,
              "pinmem: VERIFY FAILED: reads_under_dma epoch %llu: %llu samples never delivered, "
              "%llu deliveries (expected %llu)\n",
              (unsigned long long)e, (unsigned long long)missing, (unsigned long long)sum,
              (unsigned long long)per_epoch);
      bad++;
    }
  }
  return bad;
}

/* One plain pinned DMA of n bytes, timed with events on `stream`. */
static double timed_dma(void *dev, const void *src, size_t n, pm_stream_t stream, pm_event_t e0,
                        pm_event_t e1) {
  double sec = NAN;
  cli_check(pm_event_record(e0, stream));
  cli_check(pm_memcpy_async(dev, src, n, PM_COPY_H2D, stream));
  cli_check(pm_event_record(e1, stream));
  cli_check(pm_event_synchronize(e1));
  cli_check(pm_event_elapsed(e0, e1, &sec));
  return sec;
}

/* slot_dma, slot_dma_under_reads, reads_under_dma (see the top of the file). The DMA moves one
 * slot's bytes from a pinned buffer of its own; its bytes are checked on the device after. */
static void run_halves(bench_t *B, src_t *s, size_t batch) {
  pm_loader_config_t c;
  pm_loader_config_init(&c);
  c.batch_size = batch;
  c.workers = B->o.workers;
  c.prefetch = B->o.prefetch;
  c.shuffle = B->o.shuffle;
  c.seed = B->o.seed;
  c.rank = 0;
  c.world_size = 1;
  c.delivery = PM_DELIVER_HOST;
  c.epochs = 0; /* no end: it reads for as long as the DMAs run */
  feed_t *f = cli_xmalloc(sizeof *f);
  memset(f, 0, sizeof *f);
  f->B = B;
  f->s = s;
  f->count = calloc((size_t)(s->info.samples * FEED_EPOCHS), 1);
  f->tmp_in = malloc(s->info.sample_bytes + 1);
  f->tmp_tg = malloc(s->info.target_bytes + 1);
  if (!f->count || !f->tmp_in || !f->tmp_tg) cli_fail(PM_ERR_NOMEM);
  atomic_init(&f->stop, false);
  atomic_init(&f->failed, false);
  atomic_init(&f->bytes, 0);
  atomic_init(&f->batches, 0);
  /* A first loader tells the slot's size; the DMA alone runs before the loader that reads. */
  cli_check(pm_loader_create(s->ds, &c, &f->ld));
  pm_loader_stats_t ls;
  cli_check(pm_loader_get_stats(f->ld, &ls));
  cli_check(pm_loader_destroy(f->ld));
  f->ld = NULL;
  size_t n = ls.slot_bytes;
  unsigned char *src = NULL, *back = cli_xmalloc(n);
  void *dev = NULL;
  pm_stream_t stream;
  pm_event_t e0, e1;
  cli_check(pm_host_alloc(NULL, n, 0, (void **)&src));
  cli_check(pm_device_alloc(n, &dev));
  cli_check(pm_stream_create(&stream));
  cli_check(pm_event_create(PM_EVENT_TIMING, &e0));
  cli_check(pm_event_create(PM_EVENT_TIMING, &e1));
  syn_sample(src, n, 0x5107);
  int cap = PM__MAX(B->repeat, HALVES_MAX_RUNS);
  double *t = cli_xmalloc(sizeof(double) * (size_t)cap);

  /* The DMA alone. */
  cli_progress(0, 0, "slot_dma: %zu bytes alone", n);
  int runs = 0;
  for (int r = -1; r < PM__MAX(B->repeat, HALVES_MIN_RUNS); r++) {
    double sec = timed_dma(dev, src, n, stream, e0, e1);
    if (r >= 0) t[runs++] = sec;
  }
  B->dma_alone = (double)n / cli_median(t, runs) / 1e9;

  /* The DMA while the workers read; the loader's delivery rate meanwhile. */
  cli_check(pm_loader_create(s->ds, &c, &f->ld));
  pthread_t th;
  if (pthread_create(&th, NULL, feed_main, f) != 0) {
    fprintf(stderr, "pinmem: cannot start the consumer thread of slot_dma_under_reads\n");
    B->verify_failed = true;
    B->halves_ok = false;
    goto out;
  }
  /* Time only once the pipeline runs: a slot's worth of batches delivered. */
  double give_up = pm__now() + 30.0;
  while (atomic_load(&f->batches) < (uint64_t)ls.prefetch + 2 && !atomic_load(&f->failed) &&
         pm__now() < give_up)
    sched_yield();
  cli_progress(0, 0, "slot_dma_under_reads and reads_under_dma");
  runs = 0;
  double host_s = 0;
  uint64_t host_bytes = 0;
  for (int r = -1;
       r < cap && (r < PM__MAX(B->repeat, HALVES_MIN_RUNS) || host_s < HALVES_MIN_WINDOW); r++) {
    uint64_t b0 = atomic_load(&f->bytes);
    double w0 = pm__now();
    double sec = timed_dma(dev, src, n, stream, e0, e1);
    double w1 = pm__now();
    uint64_t b1 = atomic_load(&f->bytes);
    if (r < 0) continue;
    t[runs++] = sec;
    host_s += w1 - w0;
    host_bytes += b1 - b0;
  }
  atomic_store(&f->stop, true);
  pthread_join(th, NULL);
  if (f->err) {
    fprintf(stderr, "pinmem: reads_under_dma: the loader failed: %s\n", f->msg);
    B->verify_failed = true;
  }
  B->dma_under_reads = (double)n / cli_median(t, runs) / 1e9;
  B->reads_under_dma = host_s > 0 ? (double)host_bytes / host_s / 1e9 : NAN;
  B->halves_runs = runs;
  B->halves_bytes = n;
  /* The DMA's bytes arrived; the loader's batches were right. */
  memset(back, 0, n);
  cli_check(pm_memcpy(back, dev, n, PM_COPY_D2H));
  bool dma_ok = memcmp(back, src, n) == 0;
  if (!dma_ok)
    fprintf(stderr,
            "pinmem: VERIFY FAILED: slot_dma: the device holds other bytes than were "
            "sent\n");
  if (host_bytes == 0)
    fprintf(stderr,
            "pinmem: VERIFY FAILED: reads_under_dma: the loader delivered nothing in "
            "%.3f s of DMA\n",
            host_s);
  f->bad += feed_coverage(f, ls.batches_per_epoch, ls.samples_per_epoch);
  B->halves_ok = dma_ok && !f->err && host_bytes > 0 && f->bad == 0;
  if (!B->halves_ok) B->verify_failed = true;
out:
  cli_check(pm_loader_destroy(f->ld));
  pm_event_destroy(e0);
  pm_event_destroy(e1);
  pm_stream_destroy(stream);
  pm_device_free(dev);
  pm_host_free(src);
  free(back);
  free(t);
  free(f->count);
  free(f->tmp_in);
  free(f->tmp_tg);
  free(f);
}

static void emit_halves_json(const bench_t *B, const src_t *s, const result_t *reads,
                             size_t batch) {
  static const char *names[] = {"slot_dma", "slot_dma_under_reads", "reads_under_dma"};
  double g[3] = {B->dma_alone, B->dma_under_reads, B->reads_under_dma};
  for (int i = 0; i < 3; i++) {
    cli_json_t j;
    double sec = g[i] > 0 ? (double)B->halves_bytes / g[i] / 1e9 : NAN;
    cli_json_row(&j, "loader", names[i], B->halves_bytes, sec, g[i]);
    /* The DMA's bytes are read back from the device; the loader that reads meanwhile is
     * checked as every case's (its first batch, or all with --verify, and its coverage). */
    cli_json_bool(&j, "verified", B->halves_ok);
    cli_json_str(&j, "backend", pm_backend_name());
    cli_json_str(&j, "verify_method", B->o.verify ? "full" : "first_batch+coverage");
    cli_json_str(&j, "dma_verify", "device bytes read back");
    cli_json_str(&j, "dataset", s->label);
    cli_json_uint(&j, "samples", s->info.samples);
    cli_json_uint(&j, "sample_bytes", s->info.sample_bytes + s->info.target_bytes);
    cli_json_uint(&j, "batch", batch);
    cli_json_str(&j, "path", i < 2 ? "plain pinned h2d" : "loader, host delivery");
    cli_json_str(&j, "load", i == 0 ? "none" : i == 1 ? "loader reads" : "dma h2d");
    cli_json_str(&j, "timing", i < 2 ? "events" : "wall");
    cli_json_int(&j, "runs", i == 0 ? PM__MAX(B->repeat, HALVES_MIN_RUNS) : B->halves_runs);
    cli_json_int(&j, "workers", reads ? reads->workers : 0);
    /* against the half alone: the DMA alone, the reads alone (images_host) */
    double base = i == 1 ? B->dma_alone : i == 2 && reads ? reads->gbps : NAN;
    cli_json_double(&j, "ratio", i ? g[i] / base : NAN);
    cli_json_end(&j);
  }
}

static void print_halves(const bench_t *B, const result_t *reads) {
  printf("\n  the two halves at once (one slot: %zu bytes; images_host: the reads alone)\n",
         B->halves_bytes);
  cli_table_t t;
  cli_table_init(&t, 5);
  cli_table_row(&t, "case", "GB/s", "vs alone", "runs", "verified");
  static const char *names[] = {"slot_dma", "slot_dma_under_reads", "reads_under_dma"};
  double g[3] = {B->dma_alone, B->dma_under_reads, B->reads_under_dma};
  for (int i = 0; i < 3; i++) {
    char gb[32], ratio[32], runs[16];
    snprintf(gb, sizeof gb, "%.2f", g[i]);
    double base = i == 1 ? B->dma_alone : i == 2 && reads ? reads->gbps : NAN;
    if (i && isfinite(base) && base > 0)
      snprintf(ratio, sizeof ratio, "%.2fx", g[i] / base);
    else
      snprintf(ratio, sizeof ratio, "-");
    snprintf(runs, sizeof runs, "%d",
             i == 0 ? PM__MAX(B->repeat, HALVES_MIN_RUNS) : B->halves_runs);
    cli_table_row(&t, names[i], gb, ratio, runs, B->halves_ok ? "yes" : "NO");
  }
  cli_table_print(&t, 2);
}

/* ---- output ------------------------------------------------------------------------------- */

static void emit_json(const bench_t *B, const src_t *s, const result_t *r, size_t batch) {
  cli_json_t j;
  cli_json_row(&j, "loader", r->name, r->bytes, r->seconds, r->gbps);
  cli_json_bool(&j, "verified", r->verified);
  cli_json_str(&j, "backend", pm_backend_name());
  cli_json_str(&j, "verify_method", B->o.verify ? "full" : "first_batch+coverage");
  cli_json_str(&j, "dataset", s->label);
  cli_json_uint(&j, "samples", s->info.samples);
  cli_json_uint(&j, "sample_bytes", s->info.sample_bytes + s->info.target_bytes);
  cli_json_uint(&j, "batch", batch);
  cli_json_bool(&j, "pin_memory", r->pinned);
  cli_json_bool(&j, "shuffle", B->o.shuffle);
  cli_json_str(&j, "delivery", pm__delivery_name(r->delivery));
  cli_json_str(&j, "io", pm__io_mode_name(s->info.io));
  cli_json_int(&j, "world", B->world);
  cli_json_int(&j, "workers", r->workers);
  cli_json_int(&j, "prefetch", r->prefetch);
  if (r->pinned && r->delivery == PM_DELIVER_DEVICE) cli_json_str(&j, "loader_piece", r->piece);
  cli_json_uint(&j, "epochs", B->epochs);
  cli_json_uint(&j, "batches", r->batches);
  cli_json_double(&j, "batches_per_s", r->batches_per_s);
  cli_json_double(&j, "busy_seconds", r->busy);
  cli_json_double(&j, "stall_seconds", r->stall);
  cli_json_double(&j, "stall_per_batch_seconds", r->stall_per_batch);
  cli_json_double(&j, "stall_pct", r->stall_pct);
  cli_json_double(&j, "device_idle_seconds", r->idle);
  cli_json_double(&j, "device_idle_pct", r->idle_pct);
  cli_json_double(&j, "next_ready_p50_seconds", r->next_p50);
  cli_json_double(&j, "next_ready_p99_seconds", r->next_p99);
  cli_json_uint(&j, "next_ready_calls", r->ready_calls);
  cli_json_double(&j, "read_seconds", r->read_s);
  cli_json_double(&j, "copy_seconds", r->copy_s);
  cli_json_uint(&j, "device_bytes", r->device_bytes);
  cli_json_uint(&j, "host_bytes", r->host_bytes);
  cli_json_int(&j, "runs", r->runs);
  cli_json_end(&j);
}

static void fmt_us(double s, char *buf, size_t n) {
  if (isfinite(s))
    snprintf(buf, n, "%.1f us", s * 1e6);
  else
    snprintf(buf, n, "-");
}

static void print_table(const bench_t *B) {
  cli_table_t t;
  cli_table_init(&t, 10);
  cli_table_row(&t, "case", "GB/s", "batches/s", "stall", "stall/batch", "device idle",
                "next (ready) p50", "busy/batch", "runs", "verified");
  for (int i = 0; i < B->nres; i++) {
    const result_t *r = &B->res[i];
    char g[32], bps[32], st[32], spb[32], idle[32], p50[32], busy[32], runs[16];
    snprintf(g, sizeof g, "-");
    snprintf(bps, sizeof bps, "-");
    if (isfinite(r->gbps)) snprintf(g, sizeof g, "%.2f", r->gbps);
    if (isfinite(r->batches_per_s)) snprintf(bps, sizeof bps, "%.1f", r->batches_per_s);
    snprintf(st, sizeof st, "%.2f%%", r->stall_pct);
    fmt_us(r->stall_per_batch, spb, sizeof spb);
    if (isfinite(r->idle_pct))
      snprintf(idle, sizeof idle, "%.2f%%", r->idle_pct);
    else
      snprintf(idle, sizeof idle, "-");
    fmt_us(r->next_p50, p50, sizeof p50);
    snprintf(busy, sizeof busy, "%.2f ms", r->busy * 1e3);
    snprintf(runs, sizeof runs, "%d", r->runs);
    cli_table_row(&t, r->name, g, bps, st, spb, idle, p50, busy, runs, r->verified ? "yes" : "NO");
  }
  cli_table_print(&t, 2);
}

static const result_t *find(const bench_t *B, const char *name) {
  for (int i = 0; i < B->nres; i++)
    if (!strcmp(B->res[i].name, name)) return &B->res[i];
  return NULL;
}

static void target(const bench_t *B, const char *what, const result_t *r, bool met, const char *fig,
                   bool speed) {
  cli_target(B->o.json ? stderr : stdout, what, r != NULL, !speed || B->cuda,
             met && r && r->verified, fig);
}

static void print_targets(const bench_t *B, const src_t *img, size_t batch) {
  FILE *out = B->o.json ? stderr : stdout;
  fprintf(out, "\n");
  char fig[256];
  const result_t *r = find(B, "images_pinned");
  bool issue_case = img && img->info.sample_bytes == IMG_BYTES && batch == 256 && B->o.shuffle &&
                    B->o.delivery == PM_DELIVER_DEVICE;
  if (r && !issue_case) r = NULL;
  snprintf(fig, sizeof fig, "%.1f GB/s", r ? r->gbps : NAN);
  target(B, "150 KB images, batch 256, shuffled, page cache: >= 40 GB/s to the device", r,
         r && r->gbps >= T_IMG_GBPS, fig, true);
  {
    /* The same case against the link, with what bounds it. No layout passes the loader's reads
     * alone (images_host); one copy per full slot cannot pass the smaller of the two halves
     * measured at once (a slot's DMA under the workers' reads, the reads under that DMA), whose
     * DMA reads DRAM; parts pass that only where the DMA reads them from the cache, as the copy
     * engine's staging passes dma_under_h2h. */
    const result_t *w = find(B, "images_pinned_whole"), *h = find(B, "images_host");
    char big[640], bound[400] = "";
    if (B->halves_bytes) {
      bool by_reads = !(B->reads_under_dma >= B->dma_under_reads);
      snprintf(bound, sizeof bound,
               "; the reads alone %.1f; at once a slot's DMA %.1f (alone %.1f) and the reads "
               "%.1f: one copy per full slot cannot pass %.1f (the %s)",
               h ? h->gbps : NAN, B->dma_under_reads, B->dma_alone, B->reads_under_dma,
               by_reads ? B->reads_under_dma : B->dma_under_reads, by_reads ? "reads" : "DMA");
    }
    snprintf(big, sizeof big, "%.1f GB/s (one copy per full slot: %.1f)%s", r ? r->gbps : NAN,
             w && issue_case ? w->gbps : NAN, bound);
    target(B, "150 KB images, batch 256, shuffled, page cache: >= 48 GB/s to the device", r,
           r && r->gbps >= T_IMG_GBPS_LINK, big, true);
  }
  fprintf(out,
          "TARGET >= 10x the best torch DataLoader configuration: measured by "
          "bench/compare_torch.py\n");
  r = find(B, "tokens_pinned");
  if (r && r->busy > 0) {
    double frac = r->stall_per_batch / r->busy;
    snprintf(fig, sizeof fig,
             "stall %.3f%% of a %.1f ms step (device idle %.3f%%), next() p50 %.1f us (p99 %.1f "
             "us)",
             100 * frac, r->busy * 1e3, r->idle_pct, r->next_p50 * 1e6, r->next_p99 * 1e6);
    target(B, "token windows: stall < 1% of the step and pm_loader_next < 20 us when ready", r,
           frac < T_TOKEN_STALL_FRACTION && r->next_p50 < T_TOKEN_NEXT_US * 1e-6, fig, true);
  } else {
    target(B, "token windows: stall < 1% of the step and pm_loader_next < 20 us when ready", NULL,
           false, "", true);
  }
  r = find(B, "images_pinned_compute");
  snprintf(fig, sizeof fig,
           "stall %.3f%% of the run (device idle %.3f%%; kernel %.2f ms per batch)",
           r ? r->stall_pct : NAN, r ? r->idle_pct : NAN, r ? r->busy * 1e3 : NAN);
  target(B, "kernel longer than the copy: total stall < 2% of the run", r,
         r && r->stall_pct < 100 * T_COMPUTE_STALL_FRACTION, fig, true);
  if (B->o.verify) {
    bool all = true;
    for (int i = 0; i < B->nres; i++) all &= B->res[i].verified;
    snprintf(fig, sizeof fig, "%llu epochs, %s, %d rank%s x %d workers, every sample checked",
             (unsigned long long)B->epochs, B->o.shuffle ? "shuffled" : "sequential", B->world,
             B->world == 1 ? "" : "s", B->nres ? B->res[0].workers : 0);
    bool config =
        B->epochs >= 3 && B->world >= 2 && B->o.shuffle && B->nres && B->res[0].workers >= 2;
    if (config)
      target(B, "--verify: 3 epochs, shuffle, 2 ranks x 2 workers", &B->res[0], all, fig, false);
    else
      fprintf(out,
              "TARGET --verify: 3 epochs, shuffle, 2 ranks x 2 workers: not measured in this run "
              "(ran %s: %s)\n",
              fig, all ? "verified" : "FAILED");
  }
}

/* ---- main ----------------------------------------------------------------------------------- */

static void open_src(bench_t *B, src_t *s, const char *kind, const char *path, size_t seq_len,
                     uint64_t windows) {
  memset(s, 0, sizeof *s);
  pm_status_t rc;
  if (!strcmp(kind, "npy")) {
    /* Every file of the list is kept, however many (the dataset takes any number). */
    char *copy = cli_xstrdup(path), *save = NULL;
    size_t cap = 1;
    for (const char *p = path; *p; p++) cap += *p == ',';
    const char **paths = cli_xmalloc(cap * sizeof *paths);
    size_t np = 0;
    for (char *t = strtok_r(copy, ",", &save); t && np < cap; t = strtok_r(NULL, ",", &save))
      paths[np++] = t;
    for (size_t i = 0; i < np; i++) {
      cli_progress(i, np, "reading %s once (page cache)", paths[i]);
      warm_file(paths[i]);
    }
    pm_npy_options_t o;
    pm_npy_options_init(&o);
    o.io = B->o.io;
    rc = pm_dataset_open_npy(paths, np, &o, &s->ds);
    free(paths);
    free(copy);
  } else {
    cli_progress(0, 0, "reading %s once (page cache)", path);
    warm_file(path);
    pm_tokens_options_t o;
    pm_tokens_options_init(&o);
    o.seq_len = seq_len;
    o.token_bytes = B->o.token_bytes;
    o.random = 1;
    o.seed = B->o.seed;
    o.windows = windows;
    o.io = B->o.io;
    rc = pm_dataset_open_tokens(path, &o, &s->ds);
    s->tokens = true;
  }
  if (rc != PM_OK) cli_fail(rc);
  pm_dataset_get_info(s->ds, &s->info);
  snprintf(s->label, sizeof s->label, "%s", path);
  if (s->info.note[0]) {
    cli_progress_clear();
    fprintf(stderr, "pinmem: note: %s\n", s->info.note);
  }
}

int pm_cli_bench_loader(int argc, char **argv) {
  bench_t B;
  memset(&B, 0, sizeof B);
  int rc = parse_args(argc, argv, &B.o);
  if (rc) return rc;
  if (B.o.help) {
    printf("%s", usage_text);
    pm_status_t hs = pm_init();
    bool cuda = hs == PM_OK && pm_backend_kind() == PM_BACKEND_CUDA;
    printf(
        "defaults on the backend that starts here (%s): batch %d, epochs %d, samples %d, "
        "repeat %d\n",
        hs == PM_OK ? pm_backend_name() : "none; host shown", cuda ? 256 : 64, cuda ? 5 : 2,
        cuda ? 8192 : 512, cuda ? 3 : 1);
    return 0;
  }
  pm_status_t st = pm_init();
  if (st != PM_OK) cli_fail(st);
  B.cuda = pm_backend_kind() == PM_BACKEND_CUDA;
  cli_progress_init(B.o.quiet);
  B.world = B.o.world ? B.o.world : 1;
  B.epochs = B.o.epochs ? B.o.epochs : B.cuda ? 5 : 2;
  B.repeat = B.o.repeat ? B.o.repeat : B.cuda ? 3 : 1;
  size_t batch = B.o.batch ? B.o.batch : B.cuda ? 256 : 64;
  size_t tbatch = B.o.token_batch ? B.o.token_batch : 64;
  double busy = B.o.busy >= 0 ? B.o.busy : 0;
  double tbusy = B.o.token_busy >= 0 ? B.o.token_busy : 0.005;
  bool synthetic = !B.o.data && !B.o.tokens;
  bool run_images = synthetic || B.o.data;
  bool run_tokens = synthetic || B.o.tokens;
  bool device = B.o.delivery == PM_DELIVER_DEVICE;

  src_t img, tok;
  uint64_t *table = NULL;
  if (run_images) {
    char path[600];
    if (synthetic) {
      uint64_t n = B.o.samples ? B.o.samples : B.cuda ? 8192 : 512;
      table = malloc(sizeof(uint64_t) * (size_t)n);
      if (!table) cli_fail(PM_ERR_NOMEM);
      cli_progress(0, 0, "generating %llu synthetic 3x224x224 uint8 images (%.2f GB)",
                   (unsigned long long)n, (double)(n * IMG_BYTES) / 1e9);
      if (gen_images(n, path, sizeof path, table)) return CLI_EXIT_FAILURE;
      open_src(&B, &img, "npy", path, 0, 0);
      img.table = table;
      snprintf(img.label, sizeof img.label, "synthetic 3x224x224 uint8 x %llu",
               (unsigned long long)n);
    } else {
      open_src(&B, &img, "npy", B.o.data, 0, 0);
    }
  }
  if (run_tokens) {
    size_t L = B.o.seq_len ? B.o.seq_len : 1024;
    uint64_t windows = B.o.windows ? B.o.windows : (uint64_t)tbatch * (B.cuda ? 200 : 20) * B.world;
    if (synthetic) {
      char path[600];
      uint64_t ntok = B.cuda ? (uint64_t)64 << 20 : (uint64_t)4 << 20;
      cli_progress(0, 0, "generating %llu synthetic tokens", (unsigned long long)ntok);
      if (gen_tokens(ntok, B.o.token_bytes, path, sizeof path)) return CLI_EXIT_FAILURE;
      open_src(&B, &tok, "tokens", path, L, windows);
      snprintf(tok.label, sizeof tok.label, "synthetic uint%d tokens x %llu, seq_len %zu",
               8 * B.o.token_bytes, (unsigned long long)ntok, L);
    } else {
      open_src(&B, &tok, "tokens", B.o.tokens, L, windows);
    }
  }

  if (!B.o.json) {
    cli_progress_clear();
    printf(
        "pinmem bench loader: backend %s, %d rank%s, %llu epoch%s per run, %d run%s per case, "
        "%s, %s delivery\n",
        pm_backend_name(), B.world, B.world == 1 ? "" : "s", (unsigned long long)B.epochs,
        B.epochs == 1 ? "" : "s", B.repeat, B.repeat == 1 ? "" : "s",
        B.o.shuffle ? "shuffled" : "sequential", device ? "device" : "host");
    if (run_images)
      printf("  images: %s, %llu samples of %zu bytes, batch %zu\n", img.label,
             (unsigned long long)img.info.samples, img.info.sample_bytes, batch);
    if (run_images && device && B.o.pin != 0) {
      pm_option_info_t oi;
      printf(
          "  images_pinned copies a slot in parts of %s bytes (loader_piece), "
          "images_pinned_whole in one copy once the slot is full\n",
          pm_option_find("loader_piece", &oi) == PM_OK ? oi.value : "?");
    }
    if (run_tokens)
      printf("  tokens: %s, %llu windows per epoch, batch %zu\n", tok.label,
             (unsigned long long)tok.info.samples, tbatch);
    cli_host_note(false, "these figures");
  }

  B.delivery = B.o.delivery;
  B.dma_alone = B.dma_under_reads = B.reads_under_dma = NAN;
  const result_t *reads = NULL;
  if (run_images) {
    const result_t *pinned = NULL;
    if (B.o.pin != 0 && device) {
      /* The two layouts of the copy, run by run in turn. */
      case_spec_t cs[2] = {{"images_pinned", true, busy, NULL},
                           {"images_pinned_whole", true, busy, "0"}};
      const result_t *rr[2];
      run_cases(&B, &img, cs, 2, batch, rr);
      pinned = rr[0];
      if (B.o.json) emit_json(&B, &img, rr[0], batch);
      if (B.o.json) emit_json(&B, &img, rr[1], batch);
    } else if (B.o.pin != 0) {
      pinned = run_case(&B, &img, "images_pinned", true, busy, batch);
      if (B.o.json) emit_json(&B, &img, pinned, batch);
    }
    if (B.o.pin != 1) {
      const result_t *r = run_case(&B, &img, "images_pageable", false, busy, batch);
      if (B.o.json) emit_json(&B, &img, r, batch);
    }
    if (pinned && device) {
      /* The kernel outlasts the batch's copy: 1.5x its measured device time (at least 1 ms). */
      double copy = pinned->copy_per_batch;
      if (!(copy > 0)) copy = (double)pinned->bytes / (double)PM__MAX(pinned->batches, 1) / 10e9;
      double kb = PM__MAX(1.5 * copy, 1e-3);
      const result_t *r = run_case(&B, &img, "images_pinned_compute", true, kb, batch);
      if (B.o.json) emit_json(&B, &img, r, batch);
      /* The two halves at once: the reads alone, then a slot's DMA and the reads together. */
      B.delivery = PM_DELIVER_HOST;
      reads = run_case(&B, &img, "images_host", true, 0, batch);
      B.delivery = B.o.delivery;
      if (B.o.json) emit_json(&B, &img, reads, batch);
      run_halves(&B, &img, batch);
      if (B.o.json) emit_halves_json(&B, &img, reads, batch);
    }
  }
  if (run_tokens) {
    if (B.o.pin != 0) {
      const result_t *r = run_case(&B, &tok, "tokens_pinned", true, tbusy, tbatch);
      if (B.o.json) emit_json(&B, &tok, r, tbatch);
    }
    if (B.o.pin == 0 || (B.o.tokens && B.o.pin == 2)) {
      const result_t *r = run_case(&B, &tok, "tokens_pageable", false, tbusy, tbatch);
      if (B.o.json) emit_json(&B, &tok, r, tbatch);
    }
  }
  cli_progress_clear();
  if (!B.o.json) print_table(&B);
  if (!B.o.json && B.halves_bytes) print_halves(&B, reads);
  if (B.o.json) cli_host_note(true, "these figures");
  print_targets(&B, run_images ? &img : NULL, batch);

  if (run_images) pm_dataset_destroy(img.ds);
  if (run_tokens) pm_dataset_destroy(tok.ds);
  free(table);
  if (B.verify_failed) {
    fprintf(stderr,
            "pinmem: the loader delivered wrong or missing data (see VERIFY FAILED above)\n");
    return CLI_EXIT_FAILURE;
  }
  return 0;
}
