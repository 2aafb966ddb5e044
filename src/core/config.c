/*
 * DESIGN: the option table. One row per option (name, environment variable, default as text,
 * doc, parser, value type), so `pinmem info`, docs/options.md and the lookups cannot disagree.
 * A static assert ties the table to pm__opt_t, so a new option cannot lack its row.
 *
 * A value comes from, in order: pm_option_set (explicit), PINMEM_<NAME>, the default, and is
 * the table's alone: the defaults, the ranges (the parsers) and the "auto" thread counts live
 * here, and the users of an option take its value as it comes. The first lookup parses the value
 * and caches it; later lookups are one atomic load (the copy path reads its options on every
 * copy). pm_option_set empties the option's entry, pm__opt_reload every entry (tests that
 * setenv), and so does a fork child; the environment is therefore read at the first lookup
 * after such a change, and a program that sets PINMEM_<NAME> sets it before pm_init.
 * An unparsable environment value never stops the program: the default is used and the reason is
 * kept in the value text that pm_option_get shows. A bad explicit value is refused at
 * pm_option_set with PM_ERR_CONFIG, so an explicit value in the table always parses;
 * pm_option_set(name, NULL) drops it again (tests and tools use that to restore the default).
 * "auto" values: budget's lookup returns 0 (the pool resolves it: half of RAM, capped at the
 * memlock limit on the host backend); pin_threads, copy_threads and loader_workers return the
 * resolved count, min(auto_max, usable CPUs), computed when the entry is filled.
 *
 * Threads: one mutex guards the explicit values and fills and empties the cache entries, so a
 * fill cannot store a value that a concurrent pm_option_set replaced; the fast path reads the
 * entry's ready flag (acquire) and value without it. It is a leaf lock (nothing but getenv and
 * the CPU count is called while holding it).
 */
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "internal.h"

#define PM__OPT_TEXT_MAX 128 /* pm_option_info_t.value */

typedef union pm__optval {
  long i;
  size_t sz;
  double d;
} pm__optval_t;

/* Parse `text` (already trimmed). On failure write a short reason into why and return false. */
typedef bool (*pm__opt_parse_fn)(const char *text, pm__optval_t *out, char *why, size_t whylen);

/* How a parsed value is stored, so the typed lookups need no per-option cases. */
typedef enum { PM__T_INT, PM__T_SIZE, PM__T_DOUBLE } pm__opt_type_t;

typedef struct pm__opt_def {
  const char *name;
  const char *env;
  const char *def;
  const char *doc;
  pm__opt_parse_fn parse;
  pm__opt_type_t type;
  int auto_max; /* thread counts: 0 means auto = min(auto_max, usable CPUs); 0 = no auto */
} pm__opt_def_t;

/* ---- parsers --------------------------------------------------------------------------- */

/* Keyword options: the words each takes, with the value stored, in the order the error message
 * lists them; the first word of a value is its canonical spelling. */
typedef struct pm__keyword {
  const char *word;
  long value;
} pm__keyword_t;

static const pm__keyword_t kw_backend[] = {
    {"auto", PM_BACKEND_NONE}, {"cuda", PM_BACKEND_CUDA}, {"host", PM_BACKEND_HOST}, {NULL, 0}};
/* (backend's "auto" is PM_BACKEND_NONE, whose name is "none": its words are its own) */
static const pm__keyword_t kw_policy[] = {PM_EXHAUST_POLICY_MAP(PM__KEYWORD_ROW){NULL, 0}};
static const pm__keyword_t kw_bounce[] = {PM__COPY_BOUNCE_MAP(PM__KEYWORD_ROW){NULL, 0}};
static const pm__keyword_t kw_memcpy[] = {PM__COPY_MEMCPY_MAP(PM__KEYWORD_ROW){NULL, 0}};
static const pm__keyword_t kw_batch[] = {PM__COPY_BATCH_MAP(PM__KEYWORD_ROW){NULL, 0}};

static bool parse_keyword(const pm__keyword_t *kw, const char *t, pm__optval_t *out, char *why,
                          size_t n) {
  for (const pm__keyword_t *k = kw; k->word; k++) {
    if (!strcasecmp(t, k->word)) {
      out->i = k->value;
      return true;
    }
  }
  /* "not a, b or c" */
  size_t used = (size_t)snprintf(why, n, "not ");
  for (const pm__keyword_t *k = kw; k->word && used < n; k++) {
    const char *sep = k == kw ? "" : k[1].word ? ", " : " or ";
    used += (size_t)snprintf(why + used, n - used, "%s%s", sep, k->word);
  }
  return false;
}

static const char *keyword_text(const pm__keyword_t *kw, long value) {
  for (const pm__keyword_t *k = kw; k->word; k++)
    if (k->value == value) return k->word;
  return kw[0].word;
}

/* A table row's parser for a keyword option: one line per option. */
#define PARSE_KEYWORDS(name, kw)                                            \
  static bool name(const char *t, pm__optval_t *out, char *why, size_t n) { \
    return parse_keyword(kw, t, out, why, n);                               \
  }
PARSE_KEYWORDS(parse_backend, kw_backend)
PARSE_KEYWORDS(parse_policy, kw_policy)
PARSE_KEYWORDS(parse_bounce, kw_bounce)
PARSE_KEYWORDS(parse_memcpy, kw_memcpy)
PARSE_KEYWORDS(parse_batch, kw_batch)

static bool parse_long_range(const char *t, long lo, long hi, pm__optval_t *out, char *why,
                             size_t n) {
  char *end;
  errno = 0;
  long v = strtol(t, &end, 10);
  if (end == t || *end != '\0') {
    snprintf(why, n, "not an integer");
    return false;
  }
  if (errno == ERANGE || v < lo || v > hi) {
    snprintf(why, n, "out of range %ld..%ld", lo, hi);
    return false;
  }
  out->i = v;
  return true;
}

/* A table row's parser for an integer option in [lo, hi]. */
#define PARSE_RANGE(name, lo, hi)                                           \
  static bool name(const char *t, pm__optval_t *out, char *why, size_t n) { \
    return parse_long_range(t, lo, hi, out, why, n);                        \
  }
PARSE_RANGE(parse_device, 0, 1023)
PARSE_RANGE(parse_threads, 0, 1024)

static bool parse_bool01(const char *t, pm__optval_t *out, char *why, size_t n) {
  if (!strcmp(t, "1") || !strcasecmp(t, "yes") || !strcasecmp(t, "on") || !strcasecmp(t, "true"))
    out->i = 1;
  else if (!strcmp(t, "0") || !strcasecmp(t, "no") || !strcasecmp(t, "off") ||
           !strcasecmp(t, "false"))
    out->i = 0;
  else {
    snprintf(why, n, "not 0 or 1");
    return false;
  }
  return true;
}

static bool parse_seconds(const char *t, pm__optval_t *out, char *why, size_t n) {
  /* Plain decimal only: strtod would also take "inf", "nan" and hex floats. */
  for (const char *p = t; *p; p++) {
    if (!isdigit((unsigned char)*p) && *p != '.' && *p != 'e' && *p != 'E' && *p != '+' &&
        *p != '-') {
      snprintf(why, n, "not a number of seconds");
      return false;
    }
  }
  char *end;
  errno = 0;
  double v = strtod(t, &end);
  if (end == t || *end != '\0' || errno == ERANGE || !isfinite(v)) {
    snprintf(why, n, "not a number of seconds");
    return false;
  }
  if (v < 0 || v > 1e9) {
    snprintf(why, n, "out of range 0..1e9 seconds");
    return false;
  }
  out->d = v;
  return true;
}

static bool size_reason(const char *t, size_t *v, char *why, size_t n) {
  char inner[64];
  if (pm__size_parse(t, v, inner, sizeof inner)) return true;
  snprintf(why, n, "not a size: %s", inner);
  return false;
}

/* A size above 0; `or_what` names what else the option takes, for the message. */
static bool parse_size_min1(const char *t, pm__optval_t *out, char *why, size_t n,
                            const char *or_what) {
  size_t v;
  if (!size_reason(t, &v, why, n)) return false;
  if (v == 0) {
    snprintf(why, n, "must be more than 0%s", or_what);
    return false;
  }
  out->sz = v;
  return true;
}

static bool parse_budget(const char *t, pm__optval_t *out, char *why, size_t n) {
  if (!strcasecmp(t, "auto")) {
    out->sz = 0;
    return true;
  }
  return parse_size_min1(t, out, why, n, " (or auto)");
}

static bool parse_size_or_auto(const char *t, pm__optval_t *out, char *why, size_t n) {
  if (!strcasecmp(t, "auto")) {
    out->sz = PM__BLOCKS_CUTOFF_AUTO;
    return true;
  }
  size_t v;
  if (!size_reason(t, &v, why, n)) return false;
  if (v == PM__BLOCKS_CUTOFF_AUTO) {
    snprintf(why, n, "too large (or auto)");
    return false;
  }
  out->sz = v;
  return true;
}

static bool parse_size_pos(const char *t, pm__optval_t *out, char *why, size_t n) {
  return parse_size_min1(t, out, why, n, "");
}

static bool parse_size_any(const char *t, pm__optval_t *out, char *why, size_t n) {
  size_t v;
  if (!size_reason(t, &v, why, n)) return false;
  out->sz = v;
  return true;
}

/* Chunk and piece sizes: at most 1 TiB (as pm_file_options_t.chunk), so the sums and roundings
 * that cut a transfer into units (bytes + chunk - 1, a ramp's units, a slot's alignment) cannot
 * wrap; a value near 2^64 made them wrap to a plan that moved nothing or ran past its buffers. */
#define PM__CHUNK_MAX ((size_t)1 << 40)

static bool chunk_range(size_t v, size_t min, pm__optval_t *out, char *why, size_t n) {
  if (v < min || v > PM__CHUNK_MAX) {
    snprintf(why, n, "out of range %zu..1T", min);
    return false;
  }
  out->sz = v;
  return true;
}

static bool parse_chunk(const char *t, pm__optval_t *out, char *why, size_t n) {
  size_t v;
  return size_reason(t, &v, why, n) && chunk_range(v, 1, out, why, n);
}

static bool parse_chunk_or_0(const char *t, pm__optval_t *out, char *why, size_t n) {
  size_t v;
  return size_reason(t, &v, why, n) && chunk_range(v, 0, out, why, n);
}

/* ---- the table --------------------------------------------------------------------------- */

PARSE_RANGE(parse_slots, 1, PM__MAX_SLOTS)
PARSE_RANGE(parse_slots_or_0, 0, PM__MAX_SLOTS)
/* The loader's and the copy engine's own limits, so the option refuses what the argument does. */
PARSE_RANGE(parse_loader_workers, 0, PM__LOADER_MAX_WORKERS)
PARSE_RANGE(parse_copy_threads, 0, PM__COPY_MAX_THREADS)
PARSE_RANGE(parse_host_devices, 1, 16)
/* A claim's indices and reply fit one socket message well within the smallest send buffer
 * (4096 x 8 bytes), and the process depth keeps loader threads x workers within the loader's. */
PARSE_RANGE(parse_process_depth, 1, 8)
PARSE_RANGE(parse_process_claim, 1, 4096)

static bool parse_numa(const char *t, pm__optval_t *out, char *why, size_t n) {
  if (!strcasecmp(t, "auto")) {
    out->i = PM__NUMA_AUTO;
    return true;
  }
  if (!strcasecmp(t, "off")) {
    out->i = PM__NUMA_OFF;
    return true;
  }
  if (parse_long_range(t, 0, PM__NUMA_MAX_NODES - 1, out, why, n)) return true;
  snprintf(why, n, "not auto, off or a node number 0..%d", PM__NUMA_MAX_NODES - 1);
  return false;
}

/* Rows in pm__opt_t order; the static assert below catches an enum value without a row. */
static const pm__opt_def_t opt_table[] = {
    [PM__OPT_BACKEND] = {"backend", "PINMEM_BACKEND", "auto",
                         "auto|cuda|host: auto takes cuda when a device is usable, else host. "
                         "Read at pm_init.",
                         parse_backend, PM__T_INT, 0},
    [PM__OPT_DEVICE] = {"device", "PINMEM_DEVICE", "0",
                        "device index made current by pm_init, only when given (unset: each "
                        "thread keeps its device)",
                        parse_device, PM__T_INT, 0},
    [PM__OPT_BUDGET] = {"budget", "PINMEM_BUDGET", "auto",
                        "hard cap on pinned bytes a pool holds (registrations included, by their "
                        "pages): a size or auto = 50% of physical RAM, and never above "
                        "RLIMIT_MEMLOCK on the host backend (auto is resolved when the pool is "
                        "created)",
                        parse_budget, PM__T_SIZE, 0},
    [PM__OPT_BUDGET_POLICY] = {"budget_policy", "PINMEM_BUDGET_POLICY", "fail",
                               "when the budget is exhausted after trimming the cache: fail "
                               "(PM_ERR_BUDGET at once) or wait (up to budget_timeout for frees)",
                               parse_policy, PM__T_INT, 0},
    [PM__OPT_BUDGET_TIMEOUT] = {"budget_timeout", "PINMEM_BUDGET_TIMEOUT", "10",
                                "seconds budget_policy=wait waits before PM_ERR_BUDGET",
                                parse_seconds, PM__T_DOUBLE, 0},
    [PM__OPT_PIN_THREADS] = {"pin_threads", "PINMEM_PIN_THREADS", "0",
                             "threads that first-touch newly pinned blocks; 0 = auto = "
                             "min(16, usable CPUs)",
                             parse_threads, PM__T_INT, 16},
    [PM__OPT_FAST_PIN_MIN] = {"fast_pin_min", "PINMEM_FAST_PIN_MIN", "4M",
                              "blocks at least this large are pinned by mmap + parallel first "
                              "touch + register instead of the backend's pinned allocator",
                              parse_size_pos, PM__T_SIZE, 0},
    [PM__OPT_HUGE_PAGES] = {"huge_pages", "PINMEM_HUGE_PAGES", "1",
                            "0|1: ask for transparent huge pages on fast-pinned blocks",
                            parse_bool01, PM__T_INT, 0},
    [PM__OPT_HOST_DEVICE_MEMORY] = {"host_device_memory", "PINMEM_HOST_DEVICE_MEMORY", "4G",
                                    "device memory the host backend simulates (0 = unlimited)",
                                    parse_size_any, PM__T_SIZE, 0},
    [PM__OPT_COPY_CHUNK] = {"copy_chunk", "PINMEM_COPY_CHUNK", "4M",
                            "chunk size of staged copies of pageable memory", parse_chunk,
                            PM__T_SIZE, 0},
    [PM__OPT_COPY_SLOTS] = {"copy_slots", "PINMEM_COPY_SLOTS", "32",
                            "pinned bounce buffers in the staging ring (1..4096)", parse_slots,
                            PM__T_INT, 0},
    [PM__OPT_COPY_THREADS] = {"copy_threads", "PINMEM_COPY_THREADS", "0",
                              "threads that memcpy chunks of staged copies (0..256); 0 = auto = "
                              "min(12, usable CPUs)",
                              parse_copy_threads, PM__T_INT, 12},
    [PM__OPT_COPY_STAGE_MIN] = {"copy_stage_min", "PINMEM_COPY_STAGE_MIN", "8M",
                                "pageable copies smaller than this use the plain backend copy "
                                "instead of staging",
                                parse_size_any, PM__T_SIZE, 0},
    [PM__OPT_LOADER_WORKERS] = {"loader_workers", "PINMEM_LOADER_WORKERS", "0",
                                "threads that read samples into a loader's batch slots (0..256); "
                                "0 = auto = min(16, usable CPUs)",
                                parse_loader_workers, PM__T_INT, 16},
    [PM__OPT_LOADER_PREFETCH] = {"loader_prefetch", "PINMEM_LOADER_PREFETCH", "4",
                                 "batch slots of a loader (1..4096): batches read and copied "
                                 "ahead of the consumer; each holds one batch in pinned and in "
                                 "device memory",
                                 parse_slots, PM__T_INT, 0},
    [PM__OPT_COPY_BOUNCE] = {"copy_bounce", "PINMEM_COPY_BOUNCE", "auto",
                             "bounce memory of staged copies: whole (one pool block the size of "
                             "the copy; the call never waits for the stream), ring (copy_slots "
                             "chunk buffers reused in turn; the call waits for the stream's "
                             "earlier work, and a D2H copy is complete when it returns) or auto "
                             "(the ring when the stream is idle)",
                             parse_bounce, PM__T_INT, 0},
    [PM__OPT_COPY_MEMCPY] = {"copy_memcpy", "PINMEM_COPY_MEMCPY", "auto",
                             "how staging threads copy to and from bounce memory: libc (memcpy), "
                             "movsb (x86-64 rep movsb), stream (x86-64 AVX2 non-temporal "
                             "stores) or auto (movsb into the ring of an H2D copy, where the "
                             "DMA reads the bytes from the cache; stream elsewhere); without "
                             "the CPU feature, libc",
                             parse_memcpy, PM__T_INT, 0},
    [PM__OPT_COPY_BATCH] = {"copy_batch", "PINMEM_COPY_BATCH", "auto",
                            "how a batch moves its pieces between pinned (or managed) and device "
                            "memory: dma (cudaMemcpyBatchAsync, else a copy per piece), kernel "
                            "(one kernel reads and writes the pieces where they lie, where the "
                            "device can address pinned memory) or auto (the kernel for 64 pieces "
                            "or more of at most 1 MiB on average)",
                            parse_batch, PM__T_INT, 0},
    [PM__OPT_COPY_RAMP] = {"copy_ramp", "PINMEM_COPY_RAMP", "1",
                           "0|1: start a staged H2D copy with units growing from chunk/threads to "
                           "chunk, so its first DMA starts after a fraction of a chunk's copy",
                           parse_bool01, PM__T_INT, 0},
    [PM__OPT_COPY_PIECE] = {"copy_piece", "PINMEM_COPY_PIECE", "256K",
                            "0 = off, or a size below copy_chunk: a staged H2D copy through the "
                            "ring has all threads fill each slot in pieces of this size (the "
                            "slot's last piece queues its DMA), so a few slots kept in the cache "
                            "suffice; docs/performance.md has the measured setting",
                            parse_chunk_or_0, PM__T_SIZE, 0},
    [PM__OPT_COPY_PIECE_SLOTS] = {"copy_piece_slots", "PINMEM_COPY_PIECE_SLOTS", "8",
                                  "ring slots of a staged H2D copy filled in pieces (copy_piece), "
                                  "0..4096; 0 = copy_slots",
                                  parse_slots_or_0, PM__T_INT, 0},
    [PM__OPT_LOADER_PIECE] = {"loader_piece", "PINMEM_LOADER_PIECE", "4M",
                              "0 = off (one copy per batch once the slot is full), or a size: a "
                              "loader's batch slot goes to the device in parts of this size, each "
                              "queued as soon as its rows are written, so the DMA reads them while "
                              "they are still in the cache (at most 1024 parts a slot)",
                              parse_chunk_or_0, PM__T_SIZE, 0},
    [PM__OPT_NUMA] = {"numa", "PINMEM_NUMA", "auto",
                      "NUMA node of newly pinned pool memory: auto (the current device's node; "
                      "nothing on a single-node machine), off (the kernel's default policy) or "
                      "a node number",
                      parse_numa, PM__T_INT, 0},
    [PM__OPT_NUMA_THREADS] = {"numa_threads", "PINMEM_NUMA_THREADS", "1",
                              "0|1: pinmem's threads (pinning, staging, loader) run on the CPUs of "
                              "the device's NUMA node",
                              parse_bool01, PM__T_INT, 0},
    [PM__OPT_HOST_DEVICES] = {"host_devices", "PINMEM_HOST_DEVICES", "1",
                              "devices the host backend simulates (1..16). Read at pm_init.",
                              parse_host_devices, PM__T_INT, 0},
    /* 2M, in a ring of 24 slots (two a thread, pm__file_slots): hot 3 GiB loads timed right
     * after other work, as a program loads a checkpoint, ran at a median of 47.9, 46.4 and 48.1
     * GB/s on three H200 machines in 2 MiB x 24 slots, against 50.0, 43.3 and 47.0 in 4 MiB x
     * 24 and 46.8, 36.1 and 40.3 in the 8 MiB x 14 used before
     * (bench/results/nvidia-h200-2026-12-04r-hot-slots.jsonl, ...-04s-..., ...-04w-...).
     * Smaller reads gain more, their units spread over more threads: 32 MiB pieces read one
     * call each (safe_open's get_tensor) ran at 22.1 and 24.0 GB/s in 2 MiB units against
     * 18.5 and 19.2 in 4 MiB (...-04v-hot-pieces.jsonl, ...-04w-hot-pieces.jsonl). Larger
     * slots lose more: 37.2 GB/s with 16 MiB back to back
     * (bench/results/nvidia-h200-2026-12-03f-file-chunk-sweep.jsonl). */
    [PM__OPT_FILE_CHUNK] = {"file_chunk", "PINMEM_FILE_CHUNK", "2M",
                            "bounce slot of file reads through the page cache "
                            "(pm_file_read_async, read_file, load_file) that do not set their "
                            "own chunk, and of other reads and writes where file_direct_chunk "
                            "or file_write_chunk is 0",
                            parse_chunk, PM__T_SIZE, 0},
    /* 1M: 3 GiB written from device memory (12 threads, O_DIRECT into a reserved range) on the
     * virtual disks of three H200 machines ran at a median of 2.37-2.66 GB/s with 1 MiB units
     * against 2.08-2.26 with 8 MiB, and from pinned memory in place 2.38 against 2.19
     * (bench/results/nvidia-h200-2026-12-04f-write-sources.jsonl, ...-04g-..., ...-04h-...). */
    [PM__OPT_FILE_WRITE_CHUNK] = {"file_write_chunk", "PINMEM_FILE_WRITE_CHUNK", "1M",
                                  "unit (and bounce slot) of file writes (pm_file_write_async, "
                                  "write_file, save_file) that do not set their own chunk; "
                                  "0 = file_chunk",
                                  parse_chunk_or_0, PM__T_SIZE, 0},
    /* 1M: cold 3 GiB reads through O_DIRECT into device memory on the virtual disks of two
     * H200 machines ran at a median of 2.14 and 2.69 GB/s in 1 MiB slots against 1.91 and
     * 2.22 in 8 MiB, with the default threads
     * (bench/results/nvidia-h200-2026-12-04k-cold-reads.txt, ...-04l-cold-reads.jsonl).
     * Page-cache reads keep file_chunk: they need a larger slot. */
    [PM__OPT_FILE_DIRECT_CHUNK] = {"file_direct_chunk", "PINMEM_FILE_DIRECT_CHUNK", "1M",
                                   "unit (and bounce slot) of file reads through O_DIRECT (io "
                                   "direct, or auto choosing it) that do not set their own "
                                   "chunk; 0 = file_chunk",
                                   parse_chunk_or_0, PM__T_SIZE, 0},
    [PM__OPT_FILE_THREADS] = {"file_threads", "PINMEM_FILE_THREADS", "0",
                              "I/O threads of file reads and writes that do not set their own "
                              "(0..256); 0 = copy_threads",
                              parse_copy_threads, PM__T_INT, 0},
    [PM__OPT_FILE_SLOTS] = {"file_slots", "PINMEM_FILE_SLOTS", "0",
                            "bounce slots of a file read or write into or from device memory "
                            "(0..4096); 0 = the call's threads + 2, and for reads through the "
                            "page cache up to 2 a thread, at most 96 MiB",
                            parse_slots_or_0, PM__T_INT, 0},
    [PM__OPT_FILE_PART] = {"file_part", "PINMEM_FILE_PART", "0",
                           "0 = off (a file read's slot goes to the device in one DMA once it is "
                           "full), or a size: the slot's DMA is queued in parts of this size, each "
                           "as soon as its bytes are read",
                           parse_chunk_or_0, PM__T_SIZE, 0},
    [PM__OPT_BLOCKS_KERNEL_MAX] = {"blocks_kernel_max", "PINMEM_BLOCKS_KERNEL_MAX", "auto",
                                   "block store swaps (pm_blocks_swap_out/in): pieces of at most "
                                   "this many bytes go by the gather/scatter kernel, larger ones by "
                                   "batched DMA; 0 = always DMA; auto = measured by a short "
                                   "calibration on first use on each device",
                                   parse_size_or_auto, PM__T_SIZE, 0},
    [PM__OPT_BLOCKS_CHUNK] = {"blocks_chunk", "PINMEM_BLOCKS_CHUNK", "1G",
                              "bytes a block store pins per registration (rounded to whole "
                              "blocks): the arena becomes usable chunk by chunk, and no single "
                              "registration grows with the arena",
                              parse_chunk, PM__T_SIZE, 0},
    [PM__OPT_LOADER_PROCESS_DEPTH] = {"process_depth", "PINMEM_PROCESS_DEPTH", "2",
                                      "Python loader: loader threads per worker process (1..8), "
                                      "so each process has its next claim of rows queued while "
                                      "it works on one. Read when pinmem is imported.",
                                      parse_process_depth, PM__T_INT, 0},
    [PM__OPT_LOADER_PROCESS_CLAIM] = {"process_claim", "PINMEM_PROCESS_CLAIM", "8",
                                      "Python loader: rows per claim (one message and one reply) "
                                      "sent to a worker process (1..4096; at most a batch). Read "
                                      "when pinmem is imported.",
                                      parse_process_claim, PM__T_INT, 0},
};
_Static_assert(sizeof opt_table / sizeof opt_table[0] == PM__OPT_COUNT,
               "every pm__opt_t needs a row in opt_table");

static pthread_mutex_t opt_lock = PTHREAD_MUTEX_INITIALIZER;
static char opt_explicit[PM__OPT_COUNT][PM__OPT_TEXT_MAX];
static bool opt_has_explicit[PM__OPT_COUNT];

/* ---- resolution ---------------------------------------------------------------------------- */

typedef struct pm__opt_resolved {
  pm__optval_t value;
  pm_option_source_t source;
  char text[PM__OPT_TEXT_MAX]; /* value in force (with the reason when an env value was ignored) */
} pm__opt_resolved_t;

/* The cache: one entry per option, filled by the first lookup and emptied by pm_option_set,
 * pm__opt_reload and the fork child. `bits` holds the value in force (the pm__optval_t's bytes,
 * "auto" thread counts already resolved) for the lock-free fast path; `r` the text and source
 * that pm_option_get shows. Both are written under opt_lock only, so a lookup that fills the
 * entry cannot store a value that a concurrent pm_option_set has already replaced. */
typedef struct pm__opt_cache {
  _Atomic int ready;     /* 1: bits and r hold the value in force */
  _Atomic uint64_t bits; /* the resolved value (read without the lock) */
  pm__opt_resolved_t r;  /* guarded by opt_lock */
} pm__opt_cache_t;
_Static_assert(sizeof(pm__optval_t) == sizeof(uint64_t), "an option value fits the cache word");

static pm__opt_cache_t opt_cache[PM__OPT_COUNT];

/* Copy `src` into dst without leading/trailing white space. */
static void trim_copy(char *dst, size_t len, const char *src) {
  while (*src && isspace((unsigned char)*src)) src++;
  size_t n = strlen(src);
  while (n && isspace((unsigned char)src[n - 1])) n--;
  if (n >= len) n = len - 1;
  memcpy(dst, src, n);
  dst[n] = '\0';
}

/* Enum-like options show their canonical spelling whatever case was given. */
static void canonical_text(pm__opt_t opt, const pm__optval_t *v, char *text, size_t len) {
  if (opt == PM__OPT_BACKEND)
    snprintf(text, len, "%s", keyword_text(kw_backend, v->i));
  else if (opt == PM__OPT_BUDGET_POLICY)
    snprintf(text, len, "%s", keyword_text(kw_policy, v->i));
  else if (opt == PM__OPT_HUGE_PAGES || opt == PM__OPT_COPY_RAMP)
    snprintf(text, len, "%ld", v->i);
  else if (opt == PM__OPT_COPY_BOUNCE)
    snprintf(text, len, "%s", keyword_text(kw_bounce, v->i));
  else if (opt == PM__OPT_COPY_MEMCPY)
    snprintf(text, len, "%s", keyword_text(kw_memcpy, v->i));
  else if (opt == PM__OPT_COPY_BATCH)
    snprintf(text, len, "%s", keyword_text(kw_batch, v->i));
}

/* Called with opt_lock held. */
static void opt_fill(pm__opt_t opt);

/* ---- rules between options ------------------------------------------------------------------ */

/* copy_piece cuts a ring slot of copy_chunk bytes into pieces, so a piece is below the chunk
 * (0: no pieces). A larger one used to be taken and quietly meant "no pieces", so a mistyped
 * size turned the H2D layout off unseen. The rule is checked where a value comes in, whichever
 * of the two comes last: pm_option_set of either refuses a pair that breaks it, and a
 * PINMEM_COPY_PIECE that breaks it is ignored with the reason, as any bad environment value.
 * A pair can still break it where neither is set with a value: the default piece with a small
 * chunk, or copy_chunk's value dropped (pm_option_set(name, NULL)); pm__copy_cfg then stages
 * without pieces, as documented. */

/* The copy_chunk in force, as bytes and as its text. Called with opt_lock held. */
static size_t chunk_in_force_locked(char *text, size_t len) {
  opt_fill(PM__OPT_COPY_CHUNK);
  const pm__opt_resolved_t *c = &opt_cache[PM__OPT_COPY_CHUNK].r;
  snprintf(text, len, "%s",
           c->source == PM_OPTION_DEFAULT ? opt_table[PM__OPT_COPY_CHUNK].def : c->text);
  return c->value.sz;
}

/* A copy_piece of `piece` bytes against the chunk in force; false with the reason otherwise.
 * Called with opt_lock held. */
static bool piece_fits_locked(size_t piece, char *why, size_t n) {
  char chunk_text[PM__OPT_TEXT_MAX];
  size_t chunk = chunk_in_force_locked(chunk_text, sizeof chunk_text);
  if (piece == 0 || piece < chunk) return true;
  snprintf(why, n, "not below copy_chunk %.24s", chunk_text);
  return false;
}

/* pm_option_set's check of the rule: true when `v` (the parsed value of opt) keeps it, else
 * false with the message in msg (set as the error once the lock is dropped: the lock is a leaf).
 * Called with opt_lock held. */
static bool cross_check_locked(pm__opt_t opt, const char *text, const pm__optval_t *v, char *msg,
                               size_t n) {
  char why[96];
  if (opt == PM__OPT_COPY_PIECE && !piece_fits_locked(v->sz, why, sizeof why)) {
    snprintf(msg, n,
             "pm_option_set(copy_piece, '%.64s'): %s; a piece must be smaller than copy_chunk (or "
             "0, no pieces): raise copy_chunk first",
             text, why);
    return false;
  }
  if (opt == PM__OPT_COPY_CHUNK && opt_has_explicit[PM__OPT_COPY_PIECE]) {
    pm__optval_t piece;
    const char *ptext = opt_explicit[PM__OPT_COPY_PIECE];
    if (opt_table[PM__OPT_COPY_PIECE].parse(ptext, &piece, why, sizeof why) && piece.sz &&
        piece.sz >= v->sz) {
      snprintf(msg, n,
               "pm_option_set(copy_chunk, '%.64s'): not above copy_piece %.24s (set with "
               "pm_option_set); a piece must be smaller than copy_chunk: lower copy_piece (or set "
               "it to 0) first",
               text, ptext);
      return false;
    }
  }
  return true;
}

/* Invalidate opt's cache entry and those whose value depends on it. Called with opt_lock held. */
static void opt_invalidate(int opt);
static void opt_changed_locked(int opt) {
  opt_invalidate(opt);
  /* A PINMEM_COPY_PIECE ignored against the old chunk may fit the new one, and the reverse. */
  if (opt == PM__OPT_COPY_CHUNK) opt_invalidate(PM__OPT_COPY_PIECE);
}

static void opt_resolve(pm__opt_t opt, pm__opt_resolved_t *r) {
  const pm__opt_def_t *d = &opt_table[opt];
  char buf[PM__OPT_TEXT_MAX];
  char why[96];

  if (opt_has_explicit[opt] && d->parse(opt_explicit[opt], &r->value, why, sizeof why)) {
    r->source = PM_OPTION_SET;
    snprintf(r->text, sizeof r->text, "%s", opt_explicit[opt]);
    canonical_text(opt, &r->value, r->text, sizeof r->text);
    return;
  }
  /* (an explicit value was validated when set, so the branch above always returns) */

  const char *env = getenv(d->env);
  if (env) {
    trim_copy(buf, sizeof buf, env);
    if (d->parse(buf, &r->value, why, sizeof why) &&
        (opt != PM__OPT_COPY_PIECE || piece_fits_locked(r->value.sz, why, sizeof why))) {
      r->source = PM_OPTION_ENV;
      snprintf(r->text, sizeof r->text, "%s", buf);
      canonical_text(opt, &r->value, r->text, sizeof r->text);
      return;
    }
  }

  bool ok = d->parse(d->def, &r->value, why, sizeof why);
  (void)ok; /* the defaults are constants that parse; test_config checks every row */
  r->source = PM_OPTION_DEFAULT;
  if (env) {
    /* Bounded pieces so the note always fits the 128-byte value field. */
    snprintf(r->text, sizeof r->text, "%.8s (%.25s='%.24s%s' ignored: %.50s)", d->def, d->env, buf,
             strlen(buf) > 24 ? "..." : "", why);
  } else {
    snprintf(r->text, sizeof r->text, "%s", d->def);
  }
}

/* Fill opt's cache entry if it is empty. Called with opt_lock held. */
static void opt_fill(pm__opt_t opt) {
  pm__opt_cache_t *c = &opt_cache[opt];
  if (atomic_load_explicit(&c->ready, memory_order_relaxed)) return;
  opt_resolve(opt, &c->r);
  pm__optval_t v = c->r.value;
  if (opt_table[opt].auto_max && v.i == 0) v.i = PM__MIN(opt_table[opt].auto_max, pm__cpu_count());
  uint64_t bits;
  memcpy(&bits, &v, sizeof bits);
  atomic_store_explicit(&c->bits, bits, memory_order_relaxed);
  atomic_store_explicit(&c->ready, 1, memory_order_release);
}

/* Called with opt_lock held. */
static void opt_invalidate(int opt) {
  atomic_store_explicit(&opt_cache[opt].ready, 0, memory_order_release);
}

/* The value in force: an atomic load once the entry is filled (the copy path reads options on
 * every copy), the lock and the parse only on the first lookup after a change. */
static pm__optval_t opt_value(pm__opt_t opt) {
  pm__opt_cache_t *c = &opt_cache[opt];
  uint64_t bits;
  if (atomic_load_explicit(&c->ready, memory_order_acquire)) {
    bits = atomic_load_explicit(&c->bits, memory_order_relaxed);
  } else {
    pthread_mutex_lock(&opt_lock);
    opt_fill(opt);
    bits = atomic_load_explicit(&c->bits, memory_order_relaxed);
    pthread_mutex_unlock(&opt_lock);
  }
  pm__optval_t v;
  memcpy(&v, &bits, sizeof v);
  return v;
}

/* The text and source in force, for pm_option_get and pm__opt_text. */
static void opt_resolved(pm__opt_t opt, pm__opt_resolved_t *out) {
  pthread_mutex_lock(&opt_lock);
  opt_fill(opt);
  *out = opt_cache[opt].r;
  pthread_mutex_unlock(&opt_lock);
}

void pm__opt_reload(void) {
  pthread_mutex_lock(&opt_lock);
  for (int i = 0; i < PM__OPT_COUNT; i++) opt_invalidate(i);
  pthread_mutex_unlock(&opt_lock);
}

size_t pm__opt_size(pm__opt_t opt) {
  if ((unsigned)opt >= PM__OPT_COUNT) return 0;
  pm__optval_t v = opt_value(opt);
  switch (opt_table[opt].type) {
    case PM__T_SIZE:
      return v.sz;
    case PM__T_DOUBLE:
      return v.d < 0 ? 0 : (size_t)v.d;
    case PM__T_INT:
      break;
  }
  return v.i < 0 ? 0 : (size_t)v.i;
}

long pm__opt_int(pm__opt_t opt) {
  if ((unsigned)opt >= PM__OPT_COUNT) return 0;
  pm__optval_t v = opt_value(opt);
  switch (opt_table[opt].type) {
    case PM__T_SIZE:
      return v.sz > (size_t)LONG_MAX ? LONG_MAX : (long)v.sz;
    case PM__T_DOUBLE:
      return (long)v.d;
    case PM__T_INT:
      break;
  }
  return v.i;
}

double pm__opt_double(pm__opt_t opt) {
  if ((unsigned)opt >= PM__OPT_COUNT) return 0;
  pm__optval_t v = opt_value(opt);
  switch (opt_table[opt].type) {
    case PM__T_SIZE:
      return (double)v.sz;
    case PM__T_DOUBLE:
      return v.d;
    case PM__T_INT:
      break;
  }
  return (double)v.i;
}

void pm__opt_text(pm__opt_t opt, char *buf, size_t len) {
  if (!buf || !len) return;
  if ((unsigned)opt >= PM__OPT_COUNT) {
    buf[0] = '\0';
    return;
  }
  pm__opt_resolved_t r;
  opt_resolved(opt, &r);
  if (r.source == PM_OPTION_DEFAULT)
    snprintf(buf, len, "%s", opt_table[opt].def); /* without the "ignored" note */
  else
    snprintf(buf, len, "%s", r.text);
}

void pm__opt_ignored(pm__opt_t opt, char *buf, size_t len) {
  if (!buf || !len) return;
  buf[0] = '\0';
  if ((unsigned)opt >= PM__OPT_COUNT) return;
  pm__opt_resolved_t r;
  opt_resolved(opt, &r);
  /* An ignored environment value is the part in parentheses of the default's text (resolve). */
  const char *open = strchr(r.text, '('), *close = strrchr(r.text, ')');
  if (r.source == PM_OPTION_DEFAULT && open && close && close > open)
    snprintf(buf, len, "%.*s", (int)(close - open - 1), open + 1);
}

/* ---- public ---------------------------------------------------------------------------- */

int pm_option_count(void) {
  return PM__OPT_COUNT;
}

static void fill_info(pm__opt_t opt, pm_option_info_t *info) {
  pm__opt_resolved_t r;
  opt_resolved(opt, &r);
  info->name = opt_table[opt].name;
  info->env = opt_table[opt].env;
  info->default_value = opt_table[opt].def;
  info->doc = opt_table[opt].doc;
  snprintf(info->value, sizeof info->value, "%s", r.text);
  info->source = r.source;
}

pm_status_t pm_option_get(int index, pm_option_info_t *info_out) {
  if (!info_out) return pm__set_error(PM_ERR_INVALID, "pm_option_get: info_out is NULL");
  if (index < 0 || index >= PM__OPT_COUNT)
    return pm__set_error(PM_ERR_INVALID, "pm_option_get: index %d out of range 0..%d", index,
                         PM__OPT_COUNT - 1);
  fill_info((pm__opt_t)index, info_out);
  return PM_OK;
}

static int find_opt(const char *name) {
  for (int i = 0; i < PM__OPT_COUNT; i++)
    if (!strcasecmp(name, opt_table[i].name)) return i;
  return -1;
}

static pm_status_t unknown_option(const char *fn, const char *name) {
  /* Room for every name: a list cut short hid the options at the end of the table. */
  char known[768];
  size_t off = 0;
  known[0] = '\0';
  for (int i = 0; i < PM__OPT_COUNT && off < sizeof known; i++)
    off +=
        (size_t)snprintf(known + off, sizeof known - off, "%s%s", i ? ", " : "", opt_table[i].name);
  return pm__set_error(PM_ERR_CONFIG, "%s: unknown option '%.64s' (options: %s)", fn, name, known);
}

pm_status_t pm_option_find(const char *name, pm_option_info_t *info_out) {
  if (!name || !info_out)
    return pm__set_error(PM_ERR_INVALID, "pm_option_find: %s is NULL", !name ? "name" : "info_out");
  int i = find_opt(name);
  if (i < 0) return unknown_option("pm_option_find", name);
  fill_info((pm__opt_t)i, info_out);
  return PM_OK;
}

/* value NULL removes the explicit value (the environment or the default applies again). */
pm_status_t pm_option_set(const char *name, const char *value) {
  if (!name) return pm__set_error(PM_ERR_INVALID, "pm_option_set: name is NULL");
  int i = find_opt(name);
  if (i < 0) return unknown_option("pm_option_set", name);
  if (!value) {
    pthread_mutex_lock(&opt_lock);
    opt_has_explicit[i] = false;
    opt_changed_locked(i);
    pthread_mutex_unlock(&opt_lock);
    return PM_OK;
  }
  if (strlen(value) >= PM__OPT_TEXT_MAX)
    return pm__set_error(PM_ERR_CONFIG, "pm_option_set(%s): value longer than %d characters",
                         opt_table[i].name, PM__OPT_TEXT_MAX - 1);
  char buf[PM__OPT_TEXT_MAX];
  char why[96];
  pm__optval_t v;
  trim_copy(buf, sizeof buf, value);
  if (!opt_table[i].parse(buf, &v, why, sizeof why))
    return pm__set_error(PM_ERR_CONFIG, "pm_option_set(%s, '%.64s'): %s", opt_table[i].name, value,
                         why);
  pthread_mutex_lock(&opt_lock);
  char msg[320];
  /* Under the lock: two calls setting copy_piece and copy_chunk at once see each other. */
  bool ok = cross_check_locked((pm__opt_t)i, value, &v, msg, sizeof msg);
  if (ok) {
    memcpy(opt_explicit[i], buf, sizeof buf);
    opt_has_explicit[i] = true;
    opt_changed_locked(i);
  }
  pthread_mutex_unlock(&opt_lock);
  return ok ? PM_OK : pm__set_error(PM_ERR_CONFIG, "%s", msg);
}

/* ---- sizes ------------------------------------------------------------------------------- */

PM__PRINTF(3, 4) static bool size_fail(char *why, size_t n, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, n, fmt, ap);
  va_end(ap);
  return false;
}

/* The reasons are short and do not repeat the text: they also end up in
 * pm_option_info_t.value (128 bytes). */
bool pm__size_parse(const char *text, size_t *bytes_out, char *why, size_t n) {
  const char *p = text;
  while (isspace((unsigned char)*p)) p++;
  if (*p == '-') return size_fail(why, n, "negative");
  if (*p == '+') p++;
  if (!isdigit((unsigned char)*p) && !(*p == '.' && isdigit((unsigned char)p[1])))
    return size_fail(why, n, "not a number");

  /* Integers only, so that "1.25M" is exactly 1310720 and huge sizes keep every bit. */
  uint64_t whole = 0;
  bool overflow = false;
  for (; isdigit((unsigned char)*p); p++) {
    unsigned dgt = (unsigned)(*p - '0');
    if (whole > (UINT64_MAX - dgt) / 10)
      overflow = true;
    else
      whole = whole * 10 + dgt;
  }
  uint64_t frac_num = 0, frac_den = 1; /* the fraction is frac_num / frac_den, < 1 */
  if (*p == '.') {
    p++;
    for (; isdigit((unsigned char)*p); p++) {
      if (frac_den >= 100000000000000000ull) continue; /* 18 digits are plenty */
      frac_num = frac_num * 10 + (uint64_t)(*p - '0');
      frac_den *= 10;
    }
  }
  while (isspace((unsigned char)*p)) p++;

  unsigned shift = 0;
  switch (toupper((unsigned char)*p)) {
    case 'K':
      shift = 10;
      break;
    case 'M':
      shift = 20;
      break;
    case 'G':
      shift = 30;
      break;
    case 'T':
      shift = 40;
      break;
    default:
      break;
  }
  if (shift) {
    p++;
    if (toupper((unsigned char)*p) == 'I' && toupper((unsigned char)p[1]) == 'B')
      p += 2;
    else if (toupper((unsigned char)*p) == 'B')
      p++;
  } else if (toupper((unsigned char)*p) == 'B') {
    p++;
  }
  while (isspace((unsigned char)*p)) p++;
  if (*p != '\0') return size_fail(why, n, "unexpected '%.12s'", p);
  if (frac_num && !shift) return size_fail(why, n, "not a whole number of bytes");
  if (overflow || whole > (UINT64_MAX >> shift)) return size_fail(why, n, "too large");
  uint64_t bytes = whole << shift;
  /* floor(frac * 2^shift) by binary long division; 2 * rem < 2 * 10^18 fits in 64 bits. */
  uint64_t extra = 0, rem = frac_num;
  for (unsigned i = 0; i < shift; i++) {
    rem *= 2;
    extra *= 2;
    if (rem >= frac_den) {
      rem -= frac_den;
      extra++;
    }
  }
  if (bytes > UINT64_MAX - extra || bytes + extra > (uint64_t)SIZE_MAX)
    return size_fail(why, n, "too large");
  *bytes_out = (size_t)(bytes + extra);
  return true;
}

pm_status_t pm_parse_size(const char *text, size_t *bytes_out) {
  if (!text || !bytes_out)
    return pm__set_error(PM_ERR_INVALID, "pm_parse_size: %s is NULL", !text ? "text" : "bytes_out");
  char why[96];
  size_t v;
  if (!pm__size_parse(text, &v, why, sizeof why))
    return pm__set_error(PM_ERR_CONFIG,
                         "pm_parse_size('%.64s'): %s (want e.g. " PM__SIZE_EXAMPLES ")", text, why);
  *bytes_out = v;
  return PM_OK;
}

/* fork.c: the explicit values carry over to a child; the lock is fresh and the cache empty (the
 * child reads its environment and CPU set again at its first lookup). */
void pm__config_atfork(pm__fork_phase_t phase) {
  if (phase == PM__FORK_PREPARE) {
    pthread_mutex_lock(&opt_lock);
  } else if (phase == PM__FORK_PARENT) {
    pthread_mutex_unlock(&opt_lock);
  } else {
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    opt_lock = fresh;
    for (int i = 0; i < PM__OPT_COUNT; i++) opt_invalidate(i);
  }
}
