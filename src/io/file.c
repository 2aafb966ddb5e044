/*
 * DESIGN: file ranges read into, and written from, device or host memory (pm_file_read_async,
 * pm_file_write_async, and lists of ranges: pm_file_readv_async, pm_file_writev_async), on the
 * copy engine's pieces: bounce slots are pool blocks (the pool's budget holds; ordinary memory
 * where other buffers hold a budget that could hold a slot, or where a call of host memory alone
 * meets a budget that cannot: ring_create), DMAs are the
 * backend's memcpy_async with one event per slot, threads come from pm__parallel_for and
 * completion is a copy fence (fence.c).
 *
 * Every call moves a list of ranges (the one-range calls a list of one): sorted by file offset
 * (frange_t; ranges of 0 bytes left out, overlaps refused), then grouped into segments, runs of
 * ranges back to back in the file (fseg_t), each a stream of units numbered after the previous
 * segment's. A unit inside one range of host memory that O_DIRECT reaches in place moves in
 * place; any other unit (device memory, host memory not aligned as the file is, a unit holding
 * bytes of two ranges) goes through a slot, read once and split into its ranges' memory, or
 * gathered from them and written once (pieces()).
 *
 * A segment [start, end) is cut into units on a grid of `chunk` bytes (options
 * file_chunk, 2 MiB, for reads through the page cache; file_direct_chunk, 1 MiB, for reads
 * through O_DIRECT; file_write_chunk, 1 MiB, for writes) that starts at its start
 * rounded down to 4 KiB, so every unit but the first starts 4 KiB-aligned and every unit but
 * the last ends so. Threads (option file_threads, else copy_threads) claim the call's units
 * from an atomic counter in ascending order. A write past the end of the file reserves the span
 * of its ranges first (reserve()): a full disk is an error before a byte is written, and the
 * threads' direct writes do not wait for each other. A list read checks the file's size first:
 * a truncated file is an error before a byte is read. An io=auto read that would go direct
 * marks its span first (reader_mark()), so that processes reading the same bytes at the same
 * moment read them through the page cache, which they share.
 *
 * Ring (any unit that does not move in place; a unit that does still takes its slot's turn and
 * passes it on at once): unit i uses slot i % slots in turn (option file_slots, else threads + 2, and for reads through the page cache
 * up to two a thread while they hold at most 96 MiB: pm__file_slots), as copy_stage.c's ring, so unit i waits only for unit i - slots, claimed
 * earlier by a running thread: no deadlock. Inside a slot the unit's bytes sit at the same
 * offset modulo 4 KiB as in the file, so the aligned middle can go through O_DIRECT. Read:
 * wait for the slot's last DMA (its event), pread into the slot, queue the H2D DMA and record
 * the event (option file_part: pread and queue the DMA part by part, so the DMA starts before
 * the slot is full and reads bytes still in the CPU cache); the call returns once every read is done and every DMA queued; the fence's event
 * follows the last DMA. Write: queue the D2H DMA (behind the stream's earlier work), wait for
 * its event, pwrite the slot; the call returns once everything is in the file.
 * In place (host memory): after a stream synchronize (the stream's earlier work may still use
 * the memory), threads pread / pwrite the units in place; the call returns with the bytes
 * moved and a completed fence.
 *
 * I/O: every system call goes through xfer(): EINTR is retried, a short transfer continued, the
 * head and tail of a piece that are not 4 KiB-aligned (in the file and in memory) use the
 * caller's fd and the middle the O_DIRECT fd (a second open of /proc/self/fd/N, so the caller's
 * fd, its offset and flags, never change). A filesystem that refuses O_DIRECT (EINVAL at the
 * open or at a transfer) turns the call buffered, with a note (pm__file_note).
 * Writes through O_DIRECT keep each segment's unaligned head and tail (at most 4 KiB each, only
 * in its first and last unit) and write them buffered after every direct middle, so the page the
 * kernel merges an edge into already holds the middle's new bytes (see write_edges).
 * io=auto, for ranges of at least FILE_AUTO_MIN (64 MiB; smaller ones are buffered): writes go
 * direct (a checkpoint written once should not evict the page cache, and the disk is fastest
 * with several large direct writes in flight); reads go direct when most of the range is not in
 * the page cache, from mincore on a read-only mapping of the range sampled in 64 windows
 * (resident_fraction), else buffered (a copy from the cache beats any disk); where residency
 * cannot be probed, direct when the range is larger than MemAvailable. pm_file_get_stats counts
 * the bytes each way, so tests and benchmarks see what auto chose.
 * Fault injection: ops file_read / file_write (fault.c) before each call.
 *
 * Errors: the first failing unit's status and detail are kept (workers have their own
 * pm_last_error); later units are skipped but the ring's turns still advance, so nothing waits
 * forever; slots go back to the pool gated by the stream (a DMA may still run). A failed call
 * gives no fence and runs no callback.
 *
 * Lock order: the ring's mutex is a leaf: no backend, pool or system call while it is held.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "copy_internal.h"

#define FILE_ALIGN 4096u
#define FILE_AUTO_MIN ((size_t)64 << 20) /* smaller ranges never go direct under io=auto */
/* The ring of a read through the page cache holds up to this much (pm__file_slots): the slots
 * a thread copies into are then still in the CPU caches when their DMA reads them, also on a
 * machine whose caches were just used for something else. Read 3 GiB hot right after other
 * work, on three H200 machines (medians): 2 MiB slots x 24 at 47.9, 46.4 and 48.1 GB/s,
 * 4 MiB x 24 at 50.0, 43.3 and 47.0, 8 MiB x 14 (112 MiB) at 46.8, 36.1 and 40.3, 8 MiB x 24
 * (192 MiB) at 42.0, 35.2 and 37.1, 2 MiB x 48 at 48.9, 36.9 and 46.8
 * (bench/results/nvidia-h200-2026-12-04r-hot-slots.jsonl, ...-04s-..., ...-04w-...). */
#define FILE_READ_RING ((size_t)96 << 20)

static _Thread_local char g_note[256];
static _Thread_local bool g_injected; /* the errno xfer_fd returned last was injected */
static _Thread_local bool g_wrote;    /* pm__file_wrote() */

/* pm_file_get_stats: bytes moved [write][direct], and calls whose O_DIRECT was refused. */
static _Atomic uint64_t g_bytes[2][2];
static _Atomic uint64_t g_refused;

atomic_size_t pm__file_auto_min;

const char *pm__file_note(void) {
  return g_note;
}

bool pm__file_wrote(void) {
  return g_wrote;
}

size_t pm__file_chunk(bool write, bool direct) {
  size_t w = write    ? pm__opt_size(PM__OPT_FILE_WRITE_CHUNK)
             : direct ? pm__opt_size(PM__OPT_FILE_DIRECT_CHUNK)
                      : 0;
  return w ? w : pm__opt_size(PM__OPT_FILE_CHUNK);
}

int pm__file_slots(size_t chunk, int threads, bool write, bool direct) {
  int set = (int)pm__opt_int(PM__OPT_FILE_SLOTS);
  if (set) return set;
  int slots = threads + 2;
  if (!write && !direct && chunk) {
    /* Up to two slots a thread: more, even of smaller units, lost again (2 MiB x 48 against
     * 2 MiB x 24 in the same measurements). */
    size_t ring = PM__MIN(pm__div_up(FILE_READ_RING, chunk), (size_t)2 * (size_t)threads);
    if (ring > (size_t)slots) slots = (int)ring;
  }
  return slots;
}

pm_status_t pm_file_get_stats(pm_file_stats_t *out) {
  if (!out) return pm__set_error(PM_ERR_INVALID, "pm_file_get_stats: out is NULL");
  memset(out, 0, sizeof *out);
  out->read_direct = atomic_load(&g_bytes[0][1]);
  out->read_buffered = atomic_load(&g_bytes[0][0]);
  out->write_direct = atomic_load(&g_bytes[1][1]);
  out->write_buffered = atomic_load(&g_bytes[1][0]);
  out->direct_refused = atomic_load(&g_refused);
  return PM_OK;
}

void pm_file_options_init(pm_file_options_t *options) {
  if (!options) return;
  memset(options, 0, sizeof *options);
  options->io = PM_FILE_IO_AUTO;
}

/* ---- one call's state ----------------------------------------------------------------------- */

typedef struct first_error {
  atomic_int status;
  char msg[512];
} first_error_t;

/* One range of a call, in the file's order. */
typedef struct frange {
  uint64_t off; /* file offset of mem[0] */
  size_t bytes;
  char *mem;
  size_t idx;  /* its place in the caller's list (messages) */
  bool device; /* mem is reached by DMA (device or managed memory) */
  bool ring;   /* its bytes go through the bounce slots */
} frange_t;

/* Ranges that follow each other in the file without a gap: one stream of units. */
typedef struct fseg {
  size_t r0, nr;       /* its ranges: rng[r0 .. r0 + nr) */
  uint64_t start, end; /* [start, end) of the file */
  uint64_t grid;       /* start rounded down to FILE_ALIGN: unit j starts at grid + j * chunk */
  size_t unit0;        /* the call's number of its first unit */
  /* Writes with O_DIRECT: the segment's unaligned head and tail, written buffered after every
   * direct middle (see write_edges()). [0] head, [1] tail; len 0 = none. */
  struct {
    char buf[FILE_ALIGN];
    uint64_t pos;
    size_t len;
  } edge[2];
} fseg_t;

typedef struct fio {
  const char *fn;
  bool write;
  int fd;             /* the caller's */
  int bfd;                   /* buffered transfers: fd, or bfd_own where fd has O_DIRECT */
  int bfd_own;               /* fd's file without O_DIRECT (open_buffered()), or -1 */
  int dfd;            /* O_DIRECT, or -1 */
  atomic_bool refuse; /* a direct transfer got EINVAL: buffered from now on */
  bool watch;         /* an auto read whose dfd holds its reader mark (reader_mark()): */
  _Atomic int64_t next_look; /* looks for other readers, not before this time (ns) */
  atomic_bool shared; /* one is there: buffered from now on, to share the page cache */
  uint64_t off;       /* the hull of the ranges: from the first one's offset ... */
  size_t bytes;       /* ... to the last one's end */
  frange_t *rng;      /* the ranges of at least one byte, by file offset */
  size_t nrng;
  fseg_t *seg;
  size_t nseg;
  frange_t one_rng; /* pm_file_read_async / pm_file_write_async: rng and seg point here */
  fseg_t one_seg;
  bool device; /* some range's memory is reached by DMA */
  bool ring;   /* some range goes through the slots */
  pm_stream_t stream;
  pm_pool_t *pool;
  size_t chunk;
  bool cached; /* a read through the page cache (its ring's size: pm__file_slots) */
  size_t part; /* reads into device memory: the slot's DMA in parts of this size; 0 = whole */
  size_t nunits;
  atomic_size_t next;
  /* ring */
  int nslots;
  char **slot; /* pool blocks of chunk + FILE_ALIGN bytes (heap: ordinary memory) */
  bool heap;   /* the slots are ordinary memory: the pool's budget was spent (ring_create) */
  char **aslot; /* the same, aligned up to FILE_ALIGN */
  pm_event_t *ev;
  bool *dma;    /* the slot's last unit queued a DMA that reads it (ev follows it) */
  long long *gen; /* the last unit that used the slot */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  first_error_t err;
  /* Writes asked for CRCs (options->crc32): unit k's piece of range i (c->rng order) has its
   * CRC at crc_part[crc_base[i] + k - first unit of i]; joined in crc_finish(). NULL: none. */
  uint32_t *crc_part;
  size_t *crc_base;
} fio_t;

static void err_set(fio_t *c, pm_status_t st) {
  int expected = PM_OK;
  if (atomic_compare_exchange_strong(&c->err.status, &expected, (int)st))
    snprintf(c->err.msg, sizeof c->err.msg, "%s", pm_last_error());
}

static bool err_any(fio_t *c) {
  return atomic_load_explicit(&c->err.status, memory_order_relaxed) != PM_OK;
}

/* Unit k: its segment and its bytes [*start, *start + *len) of the file. */
static fseg_t *unit_range(const fio_t *c, size_t k, uint64_t *start, size_t *len) {
  size_t lo = 0, hi = c->nseg; /* the last segment whose unit0 <= k */
  while (hi - lo > 1) {
    size_t mid = lo + (hi - lo) / 2;
    if (c->seg[mid].unit0 <= k) lo = mid;
    else hi = mid;
  }
  fseg_t *g = &c->seg[lo];
  uint64_t s = g->grid + (uint64_t)(k - g->unit0) * c->chunk, e = s + c->chunk;
  if (s < g->start) s = g->start;
  if (e > g->end) e = g->end;
  *start = s;
  *len = (size_t)(e - s);
  return g;
}

/* The first range of segment g that ends after file offset at. */
static size_t first_piece(const fio_t *c, const fseg_t *g, uint64_t at) {
  size_t lo = g->r0, hi = g->r0 + g->nr; /* ranges of a segment are sorted and back to back */
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (c->rng[mid].off + c->rng[mid].bytes <= at) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/* ---- system calls --------------------------------------------------------------------------- */

static pm_status_t io_error(fio_t *c, int e, size_t len, uint64_t pos) {
  if (e == ENODATA) {
    struct stat sb;
    long long size = fstat(c->fd, &sb) == 0 ? (long long)sb.st_size : -1;
    return pm__set_error(PM_ERR_IO,
                         "%s: fd %d ends at byte %lld (its size), before the range [%llu, %llu) "
                         "does (read of %zu bytes at offset %llu hit the end)",
                         c->fn, c->fd, size, (unsigned long long)c->off,
                         (unsigned long long)(c->off + c->bytes), len, (unsigned long long)pos);
  }
  return pm__set_error(PM_ERR_IO, "%s: %s(fd %d, %zu bytes at offset %llu): %s%s", c->fn,
                       c->write ? "pwrite" : "pread", c->fd, len, (unsigned long long)pos,
                       strerror(e),
                       g_injected ? " (injected fault: PINMEM_FAULT or pm__fault_set)" : "");
}

/* Move len bytes between buf and the file at pos through one fd: EINTR retried, short
 * transfers continued. 0 or an errno (ENODATA: the file ended first; EINVAL from the direct fd
 * makes the caller go buffered). */
static int xfer_fd(fio_t *c, int fd, char *buf, size_t len, uint64_t pos) {
  pm__fault_op_t op = c->write ? PM__FAULT_FILE_WRITE : PM__FAULT_FILE_READ;
  size_t done = 0;
  g_injected = false;
  while (done < len) {
    size_t n = len - done;
    int fe = pm__fault_file(op, &n);
    if (fe == EINTR) continue; /* as a signal would: try again */
    if (fe) {
      g_injected = true;
      return fe;
    }
    if (fd == c->dfd && (n % FILE_ALIGN)) { /* a short direct transfer stays aligned */
      n = n / FILE_ALIGN * FILE_ALIGN;
      if (!n) n = len - done;
    }
    ssize_t r = c->write ? pwrite(fd, buf + done, n, (off_t)(pos + done))
                         : pread(fd, buf + done, n, (off_t)(pos + done));
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (r == 0) return c->write ? EIO : ENODATA;
    atomic_fetch_add_explicit(&g_bytes[c->write][fd == c->dfd], (uint64_t)r,
                              memory_order_relaxed);
    done += (size_t)r;
    /* A direct transfer that stopped off the alignment (the end of the file) goes on buffered. */
    if (fd == c->dfd && done < len && ((pos + done) % FILE_ALIGN)) fd = c->bfd;
  }
  return 0;
}

static bool other_reader(int fd, uint64_t off, size_t bytes); /* (reader_mark, below) */

/* A direct read looks for other readers at most this often: a lock query is a system call
 * (on a network filesystem, a round trip), and a reader that comes 20 ms late shares the rest. */
#define READER_LOOK_NS 20000000LL

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* True for the one thread whose turn it is to look. */
static bool look_due(fio_t *c) {
  int64_t now = now_ns(), next = atomic_load_explicit(&c->next_look, memory_order_relaxed);
  return now >= next && atomic_compare_exchange_strong(&c->next_look, &next, now + READER_LOOK_NS);
}

/* Move one piece of segment g: the 4 KiB-aligned middle through O_DIRECT when buf and pos agree
 * modulo 4 KiB, the edges (and everything else) through the caller's fd (c->bfd). */
static pm_status_t xfer(fio_t *c, fseg_t *g, char *buf, size_t len, uint64_t pos) {
  size_t head = 0, mid = 0;
  bool direct = c->dfd >= 0 && !atomic_load_explicit(&c->refuse, memory_order_relaxed) &&
                !atomic_load_explicit(&c->shared, memory_order_relaxed) &&
                ((uintptr_t)buf % FILE_ALIGN) == (pos % FILE_ALIGN);
  if (direct && c->watch && look_due(c) && other_reader(c->dfd, c->off, c->bytes)) {
    atomic_store(&c->shared, true);
    direct = false;
  }
  if (direct) {
    head = (size_t)((FILE_ALIGN - pos % FILE_ALIGN) % FILE_ALIGN);
    if (head > len) head = len;
    mid = (len - head) / FILE_ALIGN * FILE_ALIGN;
  }
  size_t tail = len - head - mid;
  if (c->write && direct) {
    /* Only the segment's first piece has a head and only its last a tail (every other piece
     * starts and ends on the 4 KiB grid): kept, and written after the direct middles. */
    if (head) {
      memcpy(g->edge[0].buf, buf, head);
      g->edge[0].pos = pos;
      g->edge[0].len = head;
      head = 0;
      buf += g->edge[0].len;
      pos += g->edge[0].len;
      len -= g->edge[0].len;
    }
    if (tail) {
      memcpy(g->edge[1].buf, buf + mid, tail);
      g->edge[1].pos = pos + mid;
      g->edge[1].len = tail;
      len -= tail;
      tail = 0;
    }
  }
  int e = head ? xfer_fd(c, c->bfd, buf, head, pos) : 0;
  if (e) return io_error(c, e, head, pos);
  if (mid) {
    e = xfer_fd(c, c->dfd, buf + head, mid, pos + head);
    if (e == EINVAL) { /* the filesystem took the open but refuses the transfer */
      atomic_store(&c->refuse, true);
      e = xfer_fd(c, c->bfd, buf + head, mid, pos + head);
    }
    if (e) return io_error(c, e, mid, pos + head);
  }
  e = tail ? xfer_fd(c, c->bfd, buf + head + mid, tail, pos + head + mid) : 0;
  return e ? io_error(c, e, tail, pos + head + mid) : PM_OK;
}

/* ---- ring of pinned slots ------------------------------------------------------------------- */

static void free_after_stream(pm_pool_t *pool, void *p, pm_stream_t stream) {
  if (pm__pool_record_stream(pool, p, stream) != PM_OK &&
      pm__cb_stream_synchronize(stream) != PM_OK) {
    (void)pm__pool_quarantine(pool, p);
    return;
  }
  (void)pm__pool_free(pool, p);
}

static void ring_destroy(fio_t *c, bool dmas_may_run) {
  for (int s = 0; s < c->nslots; s++) {
    if (c->slot && c->slot[s]) {
      if (c->heap) /* a DMA to or from pageable memory is done when its call returns */
        free(c->slot[s]);
      else if (dmas_may_run)
        free_after_stream(c->pool, c->slot[s], c->stream);
      else
        (void)pm__pool_free(c->pool, c->slot[s]);
    }
    if (c->ev && c->ev[s]) pm__copy_reap_event(c->ev[s]);
  }
  free(c->slot);
  free(c->aslot);
  free(c->ev);
  free(c->gen);
  free(c->dma);
  c->slot = c->aslot = NULL;
  c->ev = NULL;
  c->gen = NULL;
  c->dma = NULL;
  c->nslots = 0;
  c->heap = false;
}

/* A bounce slot of ordinary memory (ring_create, where the budget is held elsewhere, or
 * cannot hold a slot of a host-memory call). */
static pm_status_t heap_slot(size_t bytes, void **p) {
  if (posix_memalign(p, FILE_ALIGN, bytes) == 0) return PM_OK;
  *p = NULL;
  return pm__set_error(PM_ERR_NOMEM, "posix_memalign of %zu bytes failed", bytes);
}

static pm_status_t ring_create(fio_t *c, int want) {
  size_t sbytes = c->chunk + FILE_ALIGN;
  if ((size_t)want > c->nunits) want = (int)c->nunits;
  pm_pool_stats_t stats;
  if (pm_pool_get_stats(c->pool, &stats) == PM_OK && stats.budget) {
    size_t fit = stats.budget / pm__size_class(sbytes);
    if (fit == 0 && c->device)
      return pm__set_error(PM_ERR_BUDGET,
                           "%s: the pool budget (%zu bytes) cannot hold one %zu-byte bounce slot; "
                           "lower options->chunk or raise the budget",
                           c->fn, stats.budget, sbytes);
    if (fit == 0) {
      /* Host memory only: a slot is scratch for memcpy, which needs no pinning, and a budget
       * this small should not fail a transfer the page cache or O_DIRECT can do. */
      c->heap = true;
      snprintf(g_note, sizeof g_note,
               "%s: the pool budget (%zu bytes) cannot hold one %zu-byte bounce slot: %d slots "
               "of pageable memory",
               c->fn, stats.budget, sbytes, want);
    } else if ((size_t)want > fit) {
      want = (int)fit;
    }
  }
  c->slot = calloc((size_t)want, sizeof *c->slot);
  c->aslot = calloc((size_t)want, sizeof *c->aslot);
  c->ev = calloc((size_t)want, sizeof *c->ev);
  c->gen = calloc((size_t)want, sizeof *c->gen);
  c->dma = calloc((size_t)want, sizeof *c->dma);
  if (!c->slot || !c->aslot || !c->ev || !c->gen || !c->dma) {
    ring_destroy(c, false);
    return pm__set_error(PM_ERR_NOMEM, "%s: malloc of a %d-slot ring failed", c->fn, want);
  }
  int got = 0;
  for (; got < want; got++) {
    void *p = NULL;
    pm_status_t st = c->heap ? heap_slot(sbytes, &p)
                             : pm_host_alloc(c->pool, sbytes, PM_HOST_DEFAULT, &p);
    if (st == PM_ERR_BUDGET && got > 0) break; /* fewer slots: slower, still correct */
    if (st == PM_ERR_BUDGET) {
      /* The budget holds a slot, but other buffers hold the budget now (a checkpoint's kept
       * snapshot): the slots are ordinary memory, which the budget does not count. A memcpy
       * needs no pinned memory; a DMA from or to pageable memory is staged by the driver,
       * slower and done when its call returns. Still correct; the note says so. */
      c->heap = true;
      snprintf(g_note, sizeof g_note,
               "%s: the pool's budget is spent: %d bounce slots of %zu bytes in pageable "
               "memory", c->fn, want, sbytes);
      st = heap_slot(sbytes, &p);
    }
    if (st != PM_OK) {
      char msg[512];
      snprintf(msg, sizeof msg, "%s", pm_last_error());
      c->nslots = got;
      ring_destroy(c, false);
      return pm__set_error(st, "%s: bounce slot %d of %zu bytes: %s", c->fn, got, sbytes, msg);
    }
    c->slot[got] = p;
    c->aslot[got] = (char *)pm__align_up((uintptr_t)p, FILE_ALIGN);
  }
  c->nslots = got;
  for (int s = 0; s < got; s++) {
    c->gen[s] = (long long)s - got;
    if (!c->device) continue; /* host memory: plain memcpy, no DMA to wait for */
    pm_status_t st = pm__cb_event_create(PM_EVENT_DEFAULT, &c->ev[s]);
    if (st != PM_OK) {
      char msg[512];
      snprintf(msg, sizeof msg, "%s", pm_last_error());
      ring_destroy(c, false);
      return pm__set_error(st, "%s: event for a bounce slot: %s", c->fn, msg);
    }
  }
  return PM_OK;
}

/* Moves the pieces of the file's [at, to) between slot bytes p (which hold the file's byte at)
 * and the ranges' memory: host memory by memcpy, device memory by a DMA on the stream (queued;
 * *dma set). */
static pm_status_t pieces(fio_t *c, const fseg_t *g, char *p, uint64_t at, uint64_t to,
                          bool *dma) {
  for (size_t i = first_piece(c, g, at); i < g->r0 + g->nr && c->rng[i].off < to; i++) {
    const frange_t *r = &c->rng[i];
    uint64_t s = at > r->off ? at : r->off, e = r->off + r->bytes < to ? r->off + r->bytes : to;
    size_t n = (size_t)(e - s);
    char *m = r->mem + (s - r->off), *q = p + (s - at);
    if (!r->device) {
      if (c->write) memcpy(q, m, n);
      else memcpy(m, q, n);
      continue;
    }
    pm_status_t st = c->write ? pm__cb_memcpy_async(q, m, n, PM_COPY_D2H, c->stream)
                              : pm__cb_memcpy_async(m, q, n, PM_COPY_H2D, c->stream);
    if (st != PM_OK)
      return pm__wrap_error(st, "%s: %s DMA of %zu bytes (ranges[%zu])", c->fn,
                            c->write ? "D2H" : "H2D", n, r->idx);
    *dma = true;
  }
  return PM_OK;
}

/* The first and the last unit of range r of segment g (units of a segment lie on its grid). */
static size_t first_unit(const fio_t *c, const fseg_t *g, const frange_t *r) {
  return g->unit0 + (size_t)((r->off - g->grid) / c->chunk);
}

static size_t last_unit(const fio_t *c, const fseg_t *g, const frange_t *r) {
  return g->unit0 + (size_t)((r->off + r->bytes - 1 - g->grid) / c->chunk);
}

/* Unit k's pieces' CRCs (options->crc32): p holds the file's bytes [pos, pos + len), the ones
 * written (the slot after its DMA, or the range's own memory where it is written in place). */
static void crc_unit(fio_t *c, const fseg_t *g, size_t k, const char *p, uint64_t pos,
                     size_t len) {
  uint64_t to = pos + len;
  for (size_t i = first_piece(c, g, pos); i < g->r0 + g->nr && c->rng[i].off < to; i++) {
    const frange_t *r = &c->rng[i];
    uint64_t s = pos > r->off ? pos : r->off, e = r->off + r->bytes < to ? r->off + r->bytes : to;
    c->crc_part[c->crc_base[i] + (k - first_unit(c, g, r))] =
        pm__crc32(0, p + (s - pos), (size_t)(e - s));
  }
}

/* Unit k through slot s: read, then its pieces out; or its pieces in, then write. */
static pm_status_t ring_step(fio_t *c, fseg_t *g, size_t k, int s) {
  uint64_t pos;
  size_t len;
  (void)unit_range(c, k, &pos, &len);
  char *p = c->aslot[s] + pos % FILE_ALIGN; /* the file's alignment, for O_DIRECT */
  pm_status_t st = PM_OK;
  bool dma = false;
  if (!c->write) {
    /* The slot's previous unit's DMA still reads it. */
    if (c->dma[s]) st = pm__copy_wait_event(c->ev[s], 50);
    c->dma[s] = false;
    if (st != PM_OK) return st;
    /* Parts (option file_part): each part's DMA is queued as soon as its pread is done, so the
     * DMA starts earlier and reads bytes still warm in the CPU cache. Part ends lie on the
     * grid's multiples of part (4 KiB-aligned), so every part but the segment's first and last
     * stays whole for O_DIRECT. */
    uint64_t end = pos + len;
    for (uint64_t at = pos; at < end;) {
      uint64_t to = end;
      if (c->part) {
        to = g->grid + ((at - g->grid) / c->part + 1) * c->part;
        if (to > end) to = end;
      }
      st = xfer(c, g, p + (at - pos), (size_t)(to - at), at);
      if (st == PM_OK) st = pieces(c, g, p + (at - pos), at, to, &dma);
      if (st != PM_OK) break;
      at = to;
    }
    if (dma) { /* also after a failure: the DMAs queued so far read the slot */
      pm_status_t ev = pm__cb_event_record(c->ev[s], c->stream);
      if (ev != PM_OK) return pm__wrap_error(ev, "%s: event after an H2D DMA", c->fn);
      c->dma[s] = true;
    }
    return st;
  }
  st = pieces(c, g, p, pos, pos + len, &dma);
  if (dma) {
    pm_status_t ev = pm__cb_event_record(c->ev[s], c->stream);
    if (ev == PM_OK) ev = pm__copy_wait_event(c->ev[s], 50);
    if (ev != PM_OK) return pm__wrap_error(ev, "%s: D2H DMA of %zu bytes", c->fn, len);
  }
  if (st == PM_OK && c->crc_part) crc_unit(c, g, k, p, pos, len);
  return st == PM_OK ? xfer(c, g, p, len, pos) : st;
}

/* The range unit k lies in, when it lies in one and that one's memory is reached in place. */
static const frange_t *in_place(const fio_t *c, const fseg_t *g, uint64_t pos, size_t len) {
  size_t i = first_piece(c, g, pos);
  const frange_t *r = &c->rng[i];
  return !r->ring && r->off <= pos && r->off + r->bytes >= pos + len ? r : NULL;
}

/* The threads' loop: units claimed in ascending order. With a ring, unit k takes slot
 * k % nslots once the unit nslots earlier has left it (a unit read in place takes its turn too,
 * and leaves the slot at once), so unit k waits only for a unit claimed earlier by a running
 * thread: no deadlock. */
static void unit_task(void *vctx, size_t task) {
  fio_t *c = vctx;
  (void)task;
  for (;;) {
    size_t k = atomic_fetch_add_explicit(&c->next, 1, memory_order_relaxed);
    if (k >= c->nunits) return;
    uint64_t pos;
    size_t len;
    fseg_t *g = unit_range(c, k, &pos, &len);
    const frange_t *r = in_place(c, g, pos, len);
    int s = c->nslots ? (int)(k % (size_t)c->nslots) : -1;
    if (s >= 0) {
      pthread_mutex_lock(&c->mu);
      while (c->gen[s] != (long long)k - c->nslots) pthread_cond_wait(&c->cv, &c->mu);
      if (r) { /* in place: the slot's turn passes on at once */
        c->gen[s] = (long long)k;
        pthread_cond_broadcast(&c->cv);
      }
      pthread_mutex_unlock(&c->mu);
    }
    if (!err_any(c)) {
      if (r && c->crc_part) crc_unit(c, g, k, r->mem + (pos - r->off), pos, len);
      pm_status_t st = r ? xfer(c, g, r->mem + (pos - r->off), len, pos) : ring_step(c, g, k, s);
      if (st != PM_OK) err_set(c, st);
    }
    if (s >= 0 && !r) {
      pthread_mutex_lock(&c->mu);
      c->gen[s] = (long long)k;
      pthread_cond_broadcast(&c->cv);
      pthread_mutex_unlock(&c->mu);
    }
  }
}

/* ---- set-up --------------------------------------------------------------------------------- */

/* MemAvailable of /proc/meminfo in bytes, or 0 when unknown. */
static uint64_t mem_available(void) {
  FILE *f = fopen("/proc/meminfo", "re");
  if (!f) return 0;
  char line[128];
  unsigned long long kb = 0;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) break;
  fclose(f);
  return (uint64_t)kb * 1024;
}

/* Fraction of the pages of the range that are in the page cache, from mincore on a read-only
 * mapping of the range (made once; mapping pages it never touches costs no I/O) sampled in
 * PROBE_WINDOWS windows of PROBE_PAGES pages spread evenly over it: a few thousand page lookups
 * whatever the size, where mincore over every page of a 4 GiB range (a million lookups) would
 * cost a noticeable part of a hot load. Only the part of the range inside the file is probed.
 * -1 when unknown (not a regular file, nothing of the range in the file, mmap or mincore
 * refused). */
enum { PROBE_WINDOWS = 64, PROBE_PAGES = 64 };

static double resident_fraction(int fd, uint64_t off, size_t bytes) {
  struct stat sb;
  if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size <= 0) return -1;
  uint64_t end = off + bytes;
  if (end > (uint64_t)sb.st_size) end = (uint64_t)sb.st_size;
  long pgl = sysconf(_SC_PAGESIZE);
  uint64_t pg = pgl > 0 ? (uint64_t)pgl : FILE_ALIGN;
  uint64_t first = off / pg * pg;
  if (end <= off || end - first > (uint64_t)SIZE_MAX) return -1;
  size_t maplen = (size_t)(end - first);
  void *map = mmap(NULL, maplen, PROT_READ, MAP_SHARED, fd, (off_t)first);
  if (map == MAP_FAILED) return -1;
  uint64_t pages = (maplen + pg - 1) / pg, in = 0, seen = 0;
  uint64_t win = PROBE_PAGES, stride = pages > win ? (pages - win) / (PROBE_WINDOWS - 1) : 0;
  unsigned char vec[PROBE_PAGES];
  bool ok = true;
  for (uint64_t w = 0; w < PROBE_WINDOWS && ok; w++) {
    uint64_t p0 = w * stride, np = pages - p0 < win ? pages - p0 : win;
    size_t len = (size_t)(np * pg);
    if (p0 * pg + len > maplen) len = maplen - (size_t)(p0 * pg);
    ok = mincore((char *)map + p0 * pg, len, vec) == 0;
    for (uint64_t k = 0; ok && k < np; k++) in += vec[k] & 1;
    seen += np;
    if (!stride) break; /* the whole range fit one window */
  }
  munmap(map, maplen);
  return ok && seen ? (double)in / (double)seen : -1;
}

/* io=auto: O_DIRECT or not, for a range of at least FILE_AUTO_MIN bytes. Writes: direct (a
 * checkpoint written once should not evict the page cache, and the disk is fastest with several
 * large direct writes in flight). Reads: direct when most of the range is not in the page cache
 * (the disk at queue depth beats readahead), buffered when most of it is (a copy from the cache
 * beats the disk); where residency is unknown, direct when the range is larger than
 * MemAvailable (it would evict the cache and still not fit). */
static bool auto_direct(fio_t *c) {
  if (c->write) return true;
  double resident = resident_fraction(c->fd, c->off, c->bytes);
  if (resident >= 0) return resident < 0.5;
  uint64_t avail = mem_available();
  return avail && (uint64_t)c->bytes > avail;
}

/* Processes that read one file at the same moment (the ranks of a node loading one checkpoint)
 * share the page cache when they read it buffered; an O_DIRECT read leaves nothing there, so
 * each of them would read the whole file from the disk (on a 2-core machine, four processes
 * reading 1 GiB cold at once: 1.53-2.10 s direct against 0.62-1.07 s buffered,
 * bench/results/debian12-2core-2026-12-04a-shared-reads.jsonl). Only auto's
 * cold reads, which would go direct, take part. Each marks the range it reads with an OFD read
 * lock on the same range moved up by PM__FILE_READER_MARKS (2^62: past any data, so it locks
 * nothing a program uses; it goes with the descriptor when the call ends), then asks whether
 * another descriptor holds a mark that overlaps it (an OFD lock: l_pid -1). If one does, this
 * read goes buffered; if none does yet, the read goes direct and asks again before its pieces
 * (every 20 ms at most), going buffered for the rest once another reader of its bytes has come
 * (it is ahead of them: its reads then fill the page cache they read from). Readers of
 * disjoint ranges (threads splitting one file) would share nothing, and do not see each
 * other. Marking first, then asking, means two readers that start together both see the
 * other. A filesystem without locks, a range that reaches 2^62, or a program's own lock there
 * leaves the read as auto chose it. */
static bool other_reader(int fd, uint64_t off, size_t bytes) {
  struct flock probe = {.l_type = F_WRLCK, .l_whence = SEEK_SET,
                        .l_start = (off_t)(PM__FILE_READER_MARKS + off), .l_len = (off_t)bytes};
  return fcntl(fd, F_OFD_GETLK, &probe) == 0 && probe.l_type == F_RDLCK && probe.l_pid == -1;
}

/* -1: no mark (no locks here); 0: marked, no other reader; 1: marked, another reader. */
static int reader_mark(int dfd, uint64_t off, size_t bytes) {
  if (off >= PM__FILE_READER_MARKS || bytes > PM__FILE_READER_MARKS - off) return -1;
  struct flock mark = {.l_type = F_RDLCK, .l_whence = SEEK_SET,
                       .l_start = (off_t)(PM__FILE_READER_MARKS + off), .l_len = (off_t)bytes};
  if (fcntl(dfd, F_OFD_SETLK, &mark) != 0) return -1;
  return other_reader(dfd, off, bytes) ? 1 : 0;
}

static void fio_close(fio_t *c) {
  if (c->dfd >= 0) close(c->dfd); /* and with it the reader mark */
  c->dfd = -1;
  if (c->bfd_own >= 0) close(c->bfd_own);
  c->bfd_own = -1;
  if (c->rng != &c->one_rng) free(c->rng);
  if (c->seg != &c->one_seg) free(c->seg);
  c->rng = NULL;
  c->seg = NULL;
  free(c->crc_part);
  free(c->crc_base);
  c->crc_part = NULL;
  c->crc_base = NULL;
}

/* A caller's fd opened with O_DIRECT refuses what buffered transfers are for: any offset, length
 * and memory address (EINVAL), the unaligned edges of a direct call included. Those go through
 * a second fd of the file without it, opened as open_direct() opens its own (the caller's fd and
 * its flags are never changed: F_SETFL would change them for every holder of its open file).
 * Where that open fails the caller's fd serves, as before. */
static void open_buffered(fio_t *c, int flags) {
  if (!(flags & O_DIRECT)) return;
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", c->fd);
  int bfd = open(path, (flags & O_ACCMODE) | O_CLOEXEC);
  if (bfd >= 0) c->bfd = c->bfd_own = bfd;
}

/* The O_DIRECT fd for c->fd, or -1 with a note when the filesystem refuses it. */
static pm_status_t open_direct(fio_t *c, int flags) {
  if (atomic_load(&pm__io_refuse_direct)) {
    snprintf(g_note, sizeof g_note, "O_DIRECT refused for fd %d (test hook): buffered I/O is used",
             c->fd);
    atomic_fetch_add(&g_refused, 1);
    return PM_OK;
  }
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", c->fd);
  /* The caller's access mode, never more; never O_TRUNC, O_CREAT or O_APPEND. */
  int dfd = open(path, (flags & O_ACCMODE) | O_DIRECT | O_CLOEXEC);
  if (dfd >= 0) {
    c->dfd = dfd;
    return PM_OK;
  }
  int e = errno;
  if (e == EINVAL || e == EOPNOTSUPP) {
    snprintf(g_note, sizeof g_note,
             "O_DIRECT refused by the filesystem of fd %d (open: %s): buffered I/O is used", c->fd,
             strerror(e));
    atomic_fetch_add(&g_refused, 1);
    return PM_OK;
  }
  return pm__set_error(PM_ERR_IO, "%s: open(%s, O_DIRECT): %s", c->fn, path, strerror(e));
}

static pm_status_t read_options(const pm_file_options_t *options, const char *fn,
                                pm_file_options_t *out) {
  if (!options) {
    pm_file_options_init(out);
    return PM_OK;
  }
  if ((unsigned)options->io > PM_FILE_IO_DIRECT)
    return pm__set_error(PM_ERR_INVALID, "%s: options->io %d is not a pm_file_io_t", fn,
                         (int)options->io);
  if (options->threads < 0 || options->threads > 256) /* option file_threads' range */
    return pm__set_error(PM_ERR_INVALID, "%s: options->threads %d is not in 0..256", fn,
                         options->threads);
  if (options->chunk > ((size_t)1 << 40))
    return pm__set_error(PM_ERR_INVALID, "%s: options->chunk %zu is larger than 1 TiB", fn,
                         options->chunk);
  *out = *options;
  return PM_OK;
}

static void copy_opts(const pm_file_options_t *o, pm_copy_options_t *co) {
  pm_copy_options_init(co);
  co->callback = o->callback;
  co->callback_arg = o->callback_arg;
}

static int by_offset(const void *x, const void *y) {
  const frange_t *a = x, *b = y;
  if (a->off != b->off) return a->off < b->off ? -1 : 1;
  return a->idx < b->idx ? -1 : a->idx > b->idx;
}

static int by_address(const void *x, const void *y) {
  const frange_t *a = *(const frange_t *const *)x, *b = *(const frange_t *const *)y;
  if (a->mem != b->mem) return (uintptr_t)a->mem < (uintptr_t)b->mem ? -1 : 1;
  return 0;
}

/* The name of range i in messages: dst / src for the one-range calls, ranges[i] otherwise. */
static const char *range_name(bool multi, bool write, size_t i, char *buf, size_t cap) {
  if (!multi) return write ? "src" : "dst";
  snprintf(buf, cap, "ranges[%zu].mem", i);
  return buf;
}

/* The ranges checked one by one, then sorted by file offset into c->rng (those of 0 bytes left
 * out) and checked against each other: no two overlap in the file, and for reads no two
 * destinations overlap in memory. */
static pm_status_t take_ranges(fio_t *c, const pm_file_range_t *ranges, size_t count, bool multi,
                               const pm__backend_t *b) {
  const char *fn = c->fn;
  char name[48];
  size_t n = 0;
  if (count && !ranges) return pm__set_error(PM_ERR_INVALID, "%s: ranges is NULL", fn);
  for (size_t i = 0; i < count; i++) {
    const pm_file_range_t *r = &ranges[i];
    const char *what = range_name(multi, c->write, i, name, sizeof name);
    if (!r->mem && (r->bytes || !multi)) return pm__set_error(PM_ERR_INVALID, "%s: %s is NULL", fn, what);
    if (r->offset > (uint64_t)INT64_MAX || (uint64_t)r->bytes > (uint64_t)INT64_MAX - r->offset)
      return pm__set_error(PM_ERR_INVALID,
                           "%s: %s%soffset %llu + %zu bytes is past the largest file offset", fn,
                           multi ? what : "", multi ? ": " : "", (unsigned long long)r->offset,
                           r->bytes);
    if ((uintptr_t)r->mem > UINTPTR_MAX - r->bytes)
      return pm__set_error(PM_ERR_INVALID, "%s: %s: %zu bytes from %p wraps the address space",
                           fn, what, r->bytes, r->mem);
    n += r->bytes != 0;
  }
  if (!n) return PM_OK;
  if (n == 1) {
    c->rng = &c->one_rng;
  } else {
    c->rng = n <= SIZE_MAX / sizeof *c->rng ? malloc(n * sizeof *c->rng) : NULL;
    if (!c->rng) return pm__set_error(PM_ERR_NOMEM, "%s: malloc for %zu ranges failed", fn, n);
  }
  for (size_t i = 0; i < count; i++) {
    const pm_file_range_t *r = &ranges[i];
    if (!r->bytes) continue;
    frange_t *f = &c->rng[c->nrng++];
    *f = (frange_t){.off = r->offset, .bytes = r->bytes, .mem = r->mem, .idx = i};
    pm__mem_t kind;
    uintptr_t base;
    size_t size;
    const char *what = range_name(multi, c->write, i, name, sizeof name);
    pm_status_t st = pm__classify(b, r->mem, r->bytes, what, &kind, &base, &size);
    if (st != PM_OK) return pm__wrap_error(st, "%s", fn);
    f->device = kind == PM__MEM_DEVICE || kind == PM__MEM_MANAGED;
    c->device |= f->device;
  }
  qsort(c->rng, c->nrng, sizeof *c->rng, by_offset);
  for (size_t i = 1; i < c->nrng; i++) {
    const frange_t *p = &c->rng[i - 1], *q = &c->rng[i];
    if (q->off < p->off + p->bytes)
      return pm__set_error(PM_ERR_INVALID,
                           "%s: ranges[%zu] (bytes [%llu, %llu) of the file) and ranges[%zu] "
                           "([%llu, %llu)) overlap in the file",
                           fn, p->idx, (unsigned long long)p->off,
                           (unsigned long long)(p->off + p->bytes), q->idx,
                           (unsigned long long)q->off, (unsigned long long)(q->off + q->bytes));
  }
  if (!c->write && c->nrng > 1) { /* two reads into one byte: which one lands is undefined */
    const frange_t **by = malloc(c->nrng * sizeof *by);
    if (!by) return pm__set_error(PM_ERR_NOMEM, "%s: malloc for %zu ranges failed", fn, n);
    for (size_t i = 0; i < c->nrng; i++) by[i] = &c->rng[i];
    qsort(by, c->nrng, sizeof *by, by_address);
    pm_status_t st = PM_OK;
    for (size_t i = 1; i < c->nrng && st == PM_OK; i++)
      if ((uintptr_t)by[i]->mem < (uintptr_t)by[i - 1]->mem + by[i - 1]->bytes)
        st = pm__set_error(PM_ERR_INVALID,
                           "%s: the destinations of ranges[%zu] (%zu bytes at %p) and "
                           "ranges[%zu] (%zu bytes at %p) overlap in memory",
                           fn, by[i - 1]->idx, by[i - 1]->bytes, (void *)by[i - 1]->mem,
                           by[i]->idx, by[i]->bytes, (void *)by[i]->mem);
    free(by);
    if (st != PM_OK) return st;
  }
  c->off = c->rng[0].off;
  c->bytes = (size_t)(c->rng[c->nrng - 1].off + c->rng[c->nrng - 1].bytes - c->off);
  return PM_OK;
}

/* Segments: runs of ranges back to back in the file, each cut into units on its own grid. */
static pm_status_t make_segments(fio_t *c) {
  size_t n = 1;
  for (size_t i = 1; i < c->nrng; i++)
    n += c->rng[i].off != c->rng[i - 1].off + c->rng[i - 1].bytes;
  c->seg = n == 1 ? &c->one_seg : calloc(n, sizeof *c->seg);
  if (!c->seg) return pm__set_error(PM_ERR_NOMEM, "%s: malloc for %zu segments failed", c->fn, n);
  for (size_t i = 0; i < c->nrng; i++) {
    const frange_t *r = &c->rng[i];
    fseg_t *g = c->nseg ? &c->seg[c->nseg - 1] : NULL;
    if (g && g->end == r->off) {
      g->nr++;
      g->end += r->bytes;
      continue;
    }
    g = &c->seg[c->nseg++];
    memset(g, 0, sizeof *g);
    g->r0 = i;
    g->nr = 1;
    g->start = r->off;
    g->end = r->off + r->bytes;
  }
  for (size_t j = 0; j < c->nseg; j++) {
    fseg_t *g = &c->seg[j];
    g->grid = g->start / FILE_ALIGN * FILE_ALIGN;
    g->unit0 = c->nunits;
    c->nunits += pm__div_up((size_t)(g->end - g->grid), c->chunk);
  }
  return PM_OK;
}

/* A read whose ranges run past the end of a regular file fails before it reads a byte. */
static pm_status_t check_size(fio_t *c) {
  struct stat sb;
  if (c->write || fstat(c->fd, &sb) != 0 || !S_ISREG(sb.st_mode)) return PM_OK;
  uint64_t size = (uint64_t)sb.st_size;
  for (size_t i = 0; i < c->nrng; i++) {
    const frange_t *r = &c->rng[i];
    if (r->off + r->bytes > size)
      return pm__set_error(PM_ERR_IO,
                           "%s: fd %d ends at byte %llu (its size), before ranges[%zu] "
                           "(bytes [%llu, %llu) of the file) does: the file is shorter than the "
                           "ranges say (truncated?); nothing was read",
                           c->fn, c->fd, (unsigned long long)size, r->idx,
                           (unsigned long long)r->off, (unsigned long long)(r->off + r->bytes));
  }
  return PM_OK;
}

/* The CRCs of the units' pieces, range by range (fio_t.crc_part). */
static pm_status_t crc_parts(fio_t *c) {
  c->crc_base = malloc(c->nrng * sizeof *c->crc_base);
  size_t n = 0;
  for (size_t j = 0; j < c->nseg && c->crc_base; j++) {
    const fseg_t *g = &c->seg[j];
    for (size_t i = g->r0; i < g->r0 + g->nr; i++) {
      const frange_t *r = &c->rng[i];
      c->crc_base[i] = n;
      n += last_unit(c, g, r) - first_unit(c, g, r) + 1;
    }
  }
  c->crc_part = c->crc_base ? calloc(n, sizeof *c->crc_part) : NULL;
  if (!c->crc_part)
    return pm__set_error(PM_ERR_NOMEM, "%s: malloc for the CRCs of %zu pieces failed", c->fn, n);
  return PM_OK;
}

/* Each range's CRC from its pieces', joined in file order, into out[its place in the caller's
 * list]; out[i] = 0 for ranges of 0 bytes. */
static void crc_finish(const fio_t *c, uint32_t *out, size_t count) {
  for (size_t i = 0; i < count; i++) out[i] = 0;
  for (size_t j = 0; j < c->nseg; j++) {
    const fseg_t *g = &c->seg[j];
    for (size_t i = g->r0; i < g->r0 + g->nr; i++) {
      const frange_t *r = &c->rng[i];
      const uint32_t *part = &c->crc_part[c->crc_base[i]];
      uint64_t end = r->off + r->bytes;
      size_t k0 = first_unit(c, g, r), k1 = last_unit(c, g, r);
      uint32_t crc = part[0];
      for (size_t k = k0 + 1; k <= k1; k++) { /* units after the first start inside r */
        uint64_t pos;
        size_t len;
        (void)unit_range(c, k, &pos, &len);
        crc = pm__crc32_combine(crc, part[k - k0], (pos + len < end ? pos + len : end) - pos);
      }
      out[r->idx] = crc;
    }
  }
}

/* Validate, classify and open: everything that can fail before the first byte moves. On
 * failure the caller still calls fio_close. multi: the list calls (messages name ranges[i],
 * and a read checks the file's size first). */
static pm_status_t prepare(fio_t *c, const char *fn, bool write, int fd,
                           const pm_file_range_t *ranges, size_t count, bool multi,
                           pm_stream_t stream, const pm_file_options_t *o, bool *empty) {
  memset(c, 0, sizeof *c);
  c->fn = fn;
  c->write = write;
  c->fd = fd;
  c->bfd = fd;
  c->bfd_own = -1;
  c->dfd = -1;
  c->stream = stream;
  g_note[0] = '\0';
  *empty = false;
  if (fd < 0) return pm__set_error(PM_ERR_INVALID, "%s: fd %d is negative", fn, fd);
  if (!multi && !ranges[0].mem)
    return pm__set_error(PM_ERR_INVALID, "%s: %s is NULL", fn, write ? "src" : "dst");
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0) return pm__set_error(PM_ERR_INVALID, "%s: fd %d: %s", fn, fd, strerror(errno));
  int acc = flags & O_ACCMODE;
  if (write ? acc == O_RDONLY : acc == O_WRONLY)
    return pm__set_error(PM_ERR_INVALID, "%s: fd %d is not open for %s", fn, fd,
                         write ? "writing" : "reading");
  if (write && (flags & O_APPEND))
    return pm__set_error(PM_ERR_INVALID,
                         "%s: fd %d has O_APPEND, so Linux pwrite would ignore the offset", fn, fd);
  if (o->crc32 && !write)
    return pm__set_error(PM_ERR_INVALID, "%s: options->crc32 is for writes", fn);
  if (o->crc32) {
    pm_status_t zs = pm__crc32_ready();
    if (zs != PM_OK) return pm__wrap_error(zs, "%s: options->crc32", fn);
  }
  PM__BACKEND_OR_RETURN(b);
  pm_status_t st = take_ranges(c, ranges, count, multi, b);
  if (st != PM_OK) return st;
  if (!c->nrng) {
    *empty = true;
    return PM_OK;
  }
  open_buffered(c, flags);
  if (multi) {
    st = check_size(c);
    if (st != PM_OK) return st;
  }

  atomic_init(&c->next, 0);
  atomic_init(&c->refuse, false);
  atomic_init(&c->shared, false);
  atomic_init(&c->err.status, PM_OK);

  size_t total = 0;
  for (size_t i = 0; i < c->nrng; i++) total += c->rng[i].bytes;
  bool direct = o->io == PM_FILE_IO_DIRECT;
  size_t auto_min = atomic_load(&pm__file_auto_min);
  bool by_auto = o->io == PM_FILE_IO_AUTO && total >= (auto_min ? auto_min : FILE_AUTO_MIN);
  if (by_auto) direct = auto_direct(c);
  if (direct) {
    st = open_direct(c, flags);
    if (st != PM_OK) return st;
    int mark = by_auto && !write && c->dfd >= 0 ? reader_mark(c->dfd, c->off, c->bytes) : -1;
    if (mark == 1) { /* buffered throughout; dfd stays open, holding the mark for later readers */
      atomic_store(&c->shared, true);
      snprintf(g_note, sizeof g_note,
               "another reader of fd %d's file is reading it: buffered I/O, to share the page "
               "cache with it", fd);
    } else if (mark == 0) {
      c->watch = true;
      atomic_init(&c->next_look, now_ns() + READER_LOOK_NS);
    }
  }
  /* The unit, once the read is known to go direct or through the page cache (a direct read
   * that turns buffered midway keeps its unit). */
  bool by_dfd = c->dfd >= 0 && !atomic_load(&c->shared);
  size_t chunk = o->chunk ? o->chunk : pm__file_chunk(write, by_dfd);
  c->chunk = pm__align_up(chunk, FILE_ALIGN);
  c->cached = !write && !by_dfd;
  c->part = write ? 0 : pm__align_up(pm__opt_size(PM__OPT_FILE_PART), FILE_ALIGN);
  if (c->part >= c->chunk) c->part = 0;
  st = make_segments(c);
  if (st != PM_OK) return st;
  if (o->crc32) {
    st = crc_parts(c);
    if (st != PM_OK) return st;
  }
  /* Host memory O_DIRECT cannot reach in place (not aligned as the file is) goes through the
   * slots; device memory always does; so do the units that hold bytes of two ranges. */
  for (size_t i = 0; i < c->nrng; i++) {
    frange_t *r = &c->rng[i];
    r->ring = r->device || (by_dfd && ((uintptr_t)r->mem % FILE_ALIGN) != r->off % FILE_ALIGN);
    c->ring |= r->ring;
  }
  for (size_t j = 0; j < c->nseg && !c->ring; j++) c->ring = c->seg[j].nr > 1;
  if (c->ring) {
    st = o->pool ? PM_OK : pm_pool_default(&c->pool);
    if (o->pool) c->pool = o->pool;
    if (st != PM_OK) return pm__wrap_error(st, "%s: default pool for bounce slots", fn);
  }
  return PM_OK;
}

static int threads_for(const pm_file_options_t *o) {
  int t = o->threads ? o->threads : (int)pm__opt_int(PM__OPT_FILE_THREADS);
  if (!t) t = (int)pm__opt_int(PM__OPT_COPY_THREADS);
  return t < 1 ? 1 : t;
}

/* The deferred head and tail of a direct write, through the caller's fd (c->bfd). They go last
 * because the kernel merges a partial-page buffered write with the page's bytes on disk: once
 * every direct middle is there, the merged page holds the new bytes whatever the page (or folio)
 * size, where an edge written first could leave a cached page that a direct write of the same
 * page must flush and invalidate (the kernel does, but only page-cache pages that are not
 * busy). With 4 KiB pages the edges' pages and the middles' pages are distinct anyway. */
static pm_status_t write_edges(fio_t *c) {
  for (size_t j = 0; j < c->nseg; j++)
    for (int i = 0; i < 2; i++) {
      fseg_t *g = &c->seg[j];
      if (!g->edge[i].len) continue;
      int e = xfer_fd(c, c->bfd, g->edge[i].buf, g->edge[i].len, g->edge[i].pos);
      if (e) return io_error(c, e, g->edge[i].len, g->edge[i].pos);
    }
  return PM_OK;
}

/* A write whose range ends past the end of a regular file reserves the range first
 * (fallocate, which also sets the size), buffered or direct:
 * - A full disk (or quota, or file size limit) is reported here, before a byte is written, and
 *   leaves the file as long as it was.
 * - Direct writes are then overwrites inside the file, which ext4 and XFS run side by side
 *   under a shared inode lock; a direct write that extends the file, or fills a hole, takes the
 *   lock exclusively, so the threads would wait for each other, one write at a time. A 3 GiB
 *   save (its header, then its data past the end) wrote at 1.74 GB/s in 1 MiB units on an H200
 *   machine's virtual disk where the same writes into a reserved file ran at 2.46
 *   (bench/results/nvidia-h200-2026-12-04g-write-sources.jsonl), and at 2.44 once it reserved
 *   (...-04h-write-sources.jsonl).
 * Where the filesystem cannot reserve (EOPNOTSUPP, ...), the write goes on as it would have.
 * After a later failure the file keeps the new size, the part not written reading as zeros: a
 * failed write leaves its range undefined in any case. */
static pm_status_t reserve(fio_t *c) {
  struct stat sb;
  if (fstat(c->fd, &sb) != 0 || !S_ISREG(sb.st_mode) || c->off + c->bytes <= (uint64_t)sb.st_size)
    return PM_OK;
  int e;
  bool injected = false;
  for (;;) {
    size_t len = c->bytes;
    int fe = pm__fault_file(PM__FAULT_FILE_RESERVE, &len);
    if (fe == EINTR) continue; /* as a signal would: try again */
    if (fe) {
      /* As a filesystem that fills up midway: a part reserved, then the error. */
      if (c->bytes / 2) (void)fallocate(c->fd, 0, (off_t)c->off, (off_t)(c->bytes / 2));
      e = fe;
      injected = true;
      break;
    }
    e = fallocate(c->fd, 0, (off_t)c->off, (off_t)c->bytes) == 0 ? 0 : errno;
    if (e != EINTR) break;
  }
  if (e == 0 || (e != ENOSPC && e != EDQUOT && e != EFBIG)) return PM_OK;
  /* A failed fallocate keeps what it reserved before it failed (ext4 keeps the blocks it got
   * and sets the size to their end): give back what lies past the old end, so that the file
   * is as long as it was and a full disk is no fuller for the attempt. */
  struct stat now;
  if (fstat(c->fd, &now) == 0 && now.st_size > sb.st_size) {
    int r;
    do r = ftruncate(c->fd, sb.st_size);
    while (r != 0 && errno == EINTR);
  }
  return pm__set_error(PM_ERR_IO, "%s: fallocate(fd %d, %zu bytes at offset %llu): %s%s", c->fn,
                       c->fd, c->bytes, (unsigned long long)c->off, strerror(e),
                       injected ? " (injected fault: PINMEM_FAULT or pm__fault_set)" : "");
}

/* Move every range (in place and through the ring). */
static pm_status_t run(fio_t *c, const pm_file_options_t *o) {
  int threads = threads_for(o);
  int tasks = (int)PM__MIN((size_t)threads, c->nunits);
  pm_status_t st;
  if (c->write) {
    st = reserve(c);
    if (st != PM_OK) return st;
  }
  bool host = false;
  for (size_t i = 0; i < c->nrng && !host; i++) host = !c->rng[i].device;
  if (host) {
    /* Host memory: the stream's earlier work may still read or write it. */
    st = pm__cb_stream_synchronize(c->stream);
    if (st != PM_OK) return pm__wrap_error(st, "%s: waiting for the stream's earlier work", c->fn);
  }
  if (!c->ring) {
    g_wrote = c->write;
    pm__parallel_for(tasks, (size_t)tasks, unit_task, c);
  } else {
    st = ring_create(c, pm__file_slots(c->chunk, threads, c->write, !c->cached));
    if (st != PM_OK) return st;
    g_wrote = c->write; /* from here a failure may leave part of the bytes in the file */
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    tasks = PM__MIN(tasks, c->nslots);
    pm__parallel_for(tasks, (size_t)tasks, unit_task, c);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    ring_destroy(c, c->device);
  }
  if (atomic_load(&c->shared) && !g_note[0])
    snprintf(g_note, sizeof g_note,
             "another reader of fd %d's file came: the rest buffered, to share the page cache",
             c->fd);
  if (atomic_load(&c->refuse) && !g_note[0]) {
    snprintf(g_note, sizeof g_note,
             "O_DIRECT transfers refused (EINVAL) by the filesystem of fd %d: buffered I/O is used",
             c->fd);
    atomic_fetch_add(&g_refused, 1);
  }
  st = (pm_status_t)atomic_load(&c->err.status);
  if (st != PM_OK) return pm__set_error(st, "%s", c->err.msg);
  if (c->write) {
    st = write_edges(c);
    if (st != PM_OK) return st;
  }
  if (c->write && o->fsync) {
    int r;
    do r = fdatasync(c->fd);
    while (r != 0 && errno == EINTR);
    if (r != 0)
      return pm__set_error(PM_ERR_IO, "%s: fdatasync(fd %d): %s", c->fn, c->fd, strerror(errno));
  }
  return PM_OK;
}

/* What every call does first: the options checked (and their copy-engine form), the call's
 * state prepared. On failure nothing is left open. */
static pm_status_t begin(fio_t *c, const char *fn, bool write, int fd,
                         const pm_file_range_t *ranges, size_t count, bool multi,
                         pm_stream_t stream, const pm_file_options_t *options,
                         pm_file_options_t *o, pm_copy_options_t *co, bool *empty) {
  memset(c, 0, sizeof *c);
  c->dfd = c->bfd_own = -1;
  pm_status_t st = read_options(options, fn, o);
  if (st != PM_OK) return st;
  copy_opts(o, co);
  st = prepare(c, fn, write, fd, ranges, count, multi, stream, o, empty);
  if (st != PM_OK) fio_close(c);
  return st;
}

/* A call that failed after queueing DMAs (device memory) gives no fence, so nothing would tell
 * its caller when they end: a read's H2D DMAs could still write into dst after the error came
 * back, into memory the caller may already have handed to someone else (a caching allocator's
 * block), and a write's D2H DMAs still read src. The failed call waits for its stream, its
 * first error kept (the wait's own failure, a device error, is in the detail of neither). */
static void settle(pm_stream_t stream, pm_status_t st) {
  char msg[512];
  snprintf(msg, sizeof msg, "%s", pm_last_error());
  (void)pm__cb_stream_synchronize(stream);
  pm__set_error(st, "%s", msg);
}

static pm_status_t read_ranges(const char *fn, int fd, const pm_file_range_t *ranges,
                               size_t count, bool multi, pm_stream_t stream,
                               const pm_file_options_t *options, pm_fence_t *fence_out) {
  pm_file_options_t o;
  pm_copy_options_t co;
  fio_t c;
  bool empty;
  pm_status_t st =
      begin(&c, fn, false, fd, ranges, count, multi, stream, options, &o, &co, &empty);
  if (st != PM_OK) return st;
  if (empty || !c.device) {
    if (!empty) st = run(&c, &o);
    fio_close(&c);
    return st == PM_OK ? pm__fence_submit_empty(&co, fence_out) : st;
  }

  /* Device memory: the fence's event follows the last DMA. Made first, so a failure to make it
   * has no side effect. */
  pm_fence_t f = NULL;
  if (fence_out || co.callback) {
    st = pm__fence_new(PM_PATH_STAGED, true, &co, &f);
    if (st == PM_OK && fence_out) {
      st = pm__fence_live_add(f);
      if (st != PM_OK) pm__fence_free(f);
    }
    if (st != PM_OK) {
      fio_close(&c);
      return st;
    }
  }
  st = run(&c, &o);
  fio_close(&c);
  if (st != PM_OK) settle(stream, st);
  if (st == PM_OK && f) {
    f->host = f->cb != NULL;
    atomic_init(&f->refs, (fence_out ? 1 : 0) + (f->host ? 1 : 0));
    st = pm__cb_event_record(f->event, stream);
    if (st == PM_OK && f->cb) st = pm__cb_launch_host_func(stream, pm__fence_notify, f);
    if (st != PM_OK) st = pm__wrap_error(st, "%s: fence", fn);
  }
  if (st != PM_OK) {
    if (f) {
      char msg[512];
      snprintf(msg, sizeof msg, "%s", pm_last_error());
      if (fence_out) pm__fence_live_remove(f);
      pm__fence_free(f);
      pm__set_error(st, "%s", msg);
    }
    return st;
  }
  if (fence_out) *fence_out = f;
  return PM_OK;
}

static pm_status_t write_ranges(const char *fn, int fd, const pm_file_range_t *ranges,
                                size_t count, bool multi, pm_stream_t stream,
                                const pm_file_options_t *options, pm_fence_t *fence_out) {
  pm_file_options_t o;
  pm_copy_options_t co;
  fio_t c;
  bool empty;
  g_wrote = false;
  pm_status_t st = begin(&c, fn, true, fd, ranges, count, multi, stream, options, &o, &co, &empty);
  if (st != PM_OK) return st;
  if (!empty) st = run(&c, &o);
  if (st == PM_OK && o.crc32) crc_finish(&c, o.crc32, count);
  fio_close(&c);
  if (st != PM_OK) {
    if (c.device) settle(stream, st);
    return st;
  }
  /* Every byte is in the file: the fence is complete (the callback still runs once). */
  return pm__fence_submit_empty(&co, fence_out);
}

pm_status_t pm_file_read_async(int fd, uint64_t offset, size_t bytes, void *dst,
                               pm_stream_t stream, const pm_file_options_t *options,
                               pm_fence_t *fence_out) {
  pm_file_range_t r = {.offset = offset, .bytes = bytes, .mem = dst};
  return read_ranges("pm_file_read_async", fd, &r, 1, false, stream, options, fence_out);
}

pm_status_t pm_file_write_async(int fd, uint64_t offset, size_t bytes, const void *src,
                                pm_stream_t stream, const pm_file_options_t *options,
                                pm_fence_t *fence_out) {
  pm_file_range_t r = {.offset = offset, .bytes = bytes, .mem = (void *)(uintptr_t)src};
  return write_ranges("pm_file_write_async", fd, &r, 1, false, stream, options, fence_out);
}

pm_status_t pm_file_readv_async(int fd, const pm_file_range_t *ranges, size_t count,
                                pm_stream_t stream, const pm_file_options_t *options,
                                pm_fence_t *fence_out) {
  return read_ranges("pm_file_readv_async", fd, ranges, count, true, stream, options, fence_out);
}

pm_status_t pm_file_writev_async(int fd, const pm_file_range_t *ranges, size_t count,
                                 pm_stream_t stream, const pm_file_options_t *options,
                                 pm_fence_t *fence_out) {
  return write_ranges("pm_file_writev_async", fd, ranges, count, true, stream, options,
                      fence_out);
}
