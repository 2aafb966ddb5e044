/*
 * DESIGN: the KV-cache block store (pm_blocks_*): a pinned host arena of N equal blocks, a free
 * list of block ids, and swaps that move many blocks between paged device KV tensors and the
 * arena in one call.
 *
 * The arena is a list of chunks, each its own mapping pinned by pm__fast_pin_node (mmap, huge
 * pages, NUMA binding to the device's node, parallel first touch, one registration), each a whole
 * number of blocks, so no registration grows with the arena (a single cudaHostRegister of
 * 512 GiB fails) and no block straddles two. The whole arena is charged to the pool's budget at
 * create, exactly (each chunk rounded to the page), so a store that cannot fit fails at once.
 * Chunk 0 is pinned in pm_blocks_create; the others by one background thread, in order, so the
 * blocks of chunks [0, chunks_ready) are usable and the free list hands out low ids first.
 * Chunk 0 is at most BLK__FIRST_BYTES (and at most a chunk): the create call returns after
 * pinning that much, whatever the chunk size and the arena.
 * A call that names a block of a chunk not pinned yet waits for it (ready_cv).
 *
 * A swap builds one piece per (block, region): the region's bytes of device block d <-> their
 * place in host block h. Pieces up to the cut-off go to the backend's gather/scatter kernel
 * (launch_batch_copy, cut into 64 KiB tiles as the copy engine does), larger ones to one
 * memcpy_batch_async (cudaMemcpyBatchAsync), else one memcpy_async each. The cut-off is option
 * blocks_kernel_max, or measured once per device (calibrate()): kernel against DMA on a few
 * piece sizes, the largest size at which the kernel wins. A piece that continues the previous
 * one on both sides, within one region and one host chunk, extends it (one copy, not two).
 * A swap runs with the store's device current (and puts the caller's back): its kernel, event
 * and calibration belong to that device whatever device the calling thread is on, and memory
 * of another device is refused before anything is queued.
 *
 * Freeing a block a swap still uses. A caller may free host blocks while a swap_in still reads
 * them or a swap_out still writes them (it has queued the swap and moved on, as the caching
 * host allocators of PyTorch and of pinmem's pool allow with record_stream). Such a block must
 * not go to another request until that swap completed, or the new owner's swap_out and the old
 * swap_in race on the same host memory. So every swap that names blocks gets a sequence number
 * (seq, from 1) and a record: its event, recorded on its stream after its copies, and the host
 * ids it names. inflight[id] counts the records not known ended that name block id (a swap_in
 * may name one twice), last_swap[id] is the seq of the last. Per block, not in seq order: two
 * swaps on different streams may name one block (two swap_ins reading it), and the later one
 * completing says nothing of the earlier, while a swap on another stream that never named the
 * block says nothing of it at all; a block is idle exactly when inflight[id] is 0.
 * A freed block that is idle goes on the free stack; one that is not goes on the waiting list
 * (doubly linked by link[] and prev[], oldest free first). When a record ends, each id it named
 * counts one record less, and a waiting block at 0 moves to the free stack: O(ids of the
 * record). alloc takes from the free stack: O(count), no scan. Only when it holds too few but
 * waiting blocks would make up the count, alloc learns what completed (below) and then waits
 * for a record that names the longest-waiting block (its last swap, else, where that one
 * completed and an earlier swap on another stream still runs, the oldest such record: a scan
 * of the ring, on this path only), event_synchronize outside the lock, until enough are idle.
 * Waiting, not PM_ERR_NOMEM: a vLLM-style scheduler counts its free host blocks itself (a freed
 * block is free to it), decides to swap out on that count, and treats a failed allocation
 * after the check as a bug. Refusing blocks it freed would turn a scheduling decision into a
 * crash or a retry loop on the scheduling thread; the swaps waited for were queued before the
 * free and name the blocks, so the wait is bounded by work already queued that the caller
 * itself must see through, and happens only when idle blocks run out. PM_ERR_NOMEM stays for
 * count > idle + waiting blocks. free_blocks of the stats counts idle blocks only (what alloc
 * takes without waiting); pm_blocks_get_free gives idle, waiting and quarantined from one
 * reading.
 * Completion is learnt by event_query at the end of each swap, at a free of a block still
 * named, at the stats and at alloc's wait (so records do not pile up): per stream, a queue of
 * its records in seq order, and of each queue the head and the records behind it while they
 * completed (a stream runs its work in order, so the first one not complete ends that queue's
 * look; only a record's own event marks it complete). A record leaves the ring once every
 * earlier one ended, so the ring holds the records from the oldest one still running on.
 * A swap whose completion cannot be learnt (no event could be recorded and its stream could
 * not be synchronized, or its event fails) is broken: it ends, so the records after it still
 * leave, but the blocks it named are quarantined: a waiting one at once, an allocated one
 * (tainted) when freed. The device may still read or write them and nothing will say when it
 * stops, so they are never handed out again while the store lives (destroy synchronizes the
 * device before unpinning). Its event is kept until then too (ev_dead). alloc that only the
 * quarantined blocks would satisfy fails with the device's status, naming the swap.
 *
 * Invariants: chunk_base[c] is written before chunks_ready passes c (release/acquire); a block
 * id below usable is on the free stack exactly when state[id] is ST_FREE, on the waiting list
 * exactly when ST_WAITING (then inflight[id] > 0); a queue's head record never ended (ended ones
 * leave at once), so swap_base never passes a record still on a queue; everything is validated
 * before anything is queued. Locks: blocks->lock
 * (free lists, records, pin status, ready_cv, swap_cv) is a leaf: no backend call is made under
 * it. poll_lock is taken before it, by the one thread that queries or waits on swap events
 * (alloc's wait; the polls of a swap, a free and the stats only when it is free): only that
 * thread ends a queued record, so an event is not recycled while it is queried. The per-device
 * cut-off is measured by the first thread that claims it (an atomic state); other threads take
 * DMA until it is known, so no lock is held around device work. The calibration's 2 MiB of
 * pinned memory is the backend's, outside any pool's budget; it and the 2 MiB of device memory
 * are freed when the store whose call measured is destroyed, not in that call (a free
 * synchronizes the device).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define BLK__TILE ((size_t)64 << 10)   /* kernel piece, as copy_batch.c's PM__BATCH_TILE */
#define BLK__BATCH ((size_t)1 << 16)   /* pieces handed to the backend per call */
#define BLK__MAX_DEVICES 64
/* Chunk 0's size: what pm_blocks_create pins before it returns. At pinmem's cold pinning rate
 * (about 0.05 s/GiB) 64 MiB is a few milliseconds, so a store's first blocks are usable at
 * once, while the later chunks keep registrations few. */
#define BLK__FIRST_BYTES ((size_t)64 << 20)
atomic_size_t pm__blocks_first_bytes = BLK__FIRST_BYTES;
#define BLK__CAL_BYTES ((size_t)2 << 20) /* bytes each calibration size moves per direction */
#define BLK__CAL_REPS 3                  /* runs per size and path; the best counts, first warms */

#define BLK__NONE UINT64_MAX /* end of an id list */

/* A swap's record (see DESIGN). Queueing: its copies are being queued (no event yet); queued:
 * its event is recorded; done: it completed (event back in the cache); broken: its completion
 * cannot be learnt. ids: the host ids it names (a swap_in may repeat one), until it ended; next:
 * the next record of its stream's queue (0: none). */
enum { SW_QUEUEING, SW_QUEUED, SW_DONE, SW_BROKEN };
typedef struct blk_swap {
  pm_event_t event;
  pm_stream_t stream;
  uint64_t next;
  uint64_t *ids;
  size_t n;
  int phase;
} blk_swap_t;

/* The records of one stream not known ended, in seq order: head first (0: none). */
typedef struct blk_queue {
  pm_stream_t stream;
  uint64_t head, tail;
} blk_queue_t;

/* A block's state (state[id]): the low bits one of ST_*, ST_TAINT besides on an allocated block
 * that a broken swap named (freed, it is quarantined, not reused). */
enum { ST_FREE, ST_ALLOC, ST_SEEN, ST_WAITING, ST_QUAR };
#define ST_TAINT 0x80u
static unsigned st_base(uint8_t state) {
  return state & 0x7fu;
}

struct pm_blocks_s {
  const pm__backend_t *b;
  pm_pool_t *pool;
  size_t block_bytes;
  uint64_t num_blocks;
  uint64_t chunk_blocks, nchunks; /* blocks of each chunk after the first, chunks */
  uint64_t first_blocks;           /* blocks of chunk 0 */
  size_t charged; /* under lock once the pinner runs (a failed pinning gives the rest back) */
  int device, node, threads;
  bool huge;
  char **chunk_base;          /* [nchunks]: set before chunks_ready passes the index */
  _Atomic uint64_t chunks_ready;
  atomic_bool stop;
  pthread_t pinner;
  bool has_pinner;
  double t_create;
  _Atomic double first_ready_s, all_ready_s;

  pthread_mutex_t lock; /* leaf: the free list, pin_status, ready_cv */
  pthread_cond_t ready_cv;
  pm_status_t pin_status; /* a chunk that could not be pinned stops the pinning */
  char pin_error[512];
  uint64_t *free_stack; /* top at [nfree - 1]: the lowest ids on top */
  uint64_t nfree;
  uint64_t usable; /* ids below it can be pinned: num_blocks, or where the pinning failed */
  uint8_t *state;  /* ST_* (and ST_TAINT) */

  /* Swaps and freed blocks they still use (DESIGN), under lock. */
  pthread_mutex_t poll_lock; /* before lock: the thread that queries or waits on swap events */
  pthread_cond_t swap_cv;    /* a record left queueing */
  uint64_t *inflight;        /* [num_blocks]: names of the block by records not ended */
  uint64_t *last_swap;       /* [num_blocks]: seq of the last swap that named the block, 0: none */
  uint64_t *link, *prev;     /* [num_blocks]: the waiting list, freed blocks with inflight > 0 */
  uint64_t wait_head, wait_tail, nwaiting; /* oldest free first */
  uint64_t nquar;                          /* freed blocks a broken swap named: never reused */
  pm_status_t broken_status;               /* the last broken swap's, and its seq (0: none) */
  uint64_t broken_seq;
  blk_swap_t *swaps; /* records of seqs [swap_base, swap_next), at seq % swaps_cap */
  uint64_t swaps_cap, swap_base, swap_next;
  blk_queue_t *queues; /* one per stream with records not ended */
  size_t nqueues, queues_cap;
  pm_event_t *ev_cache; /* events of done records, for the next swaps */
  pm_event_t *ev_dead;  /* events of broken records, destroyed at close; capacity ev_cap too */
  size_t nev, ndead, ev_cap, ev_live; /* cached; dead; capacity (>= ev_live); in existence */

  _Atomic uint64_t swaps_out, swaps_in, blocks_out, blocks_in, bytes_out, bytes_in;
  _Atomic uint64_t pieces_kernel, pieces_dma, transfers;
  /* The calibration's buffers when this store's call measured the cut-off (calibrate):
   * released by store_free, after destroy synchronized the device. */
  char *cal_host, *cal_dev;
};

/* ---- the per-device cut-off ----------------------------------------------------------------- */

/* Per device: 0 not measured, 1 being measured by one thread, 2 measured (cal_value valid). */
enum { CAL_NONE, CAL_RUNNING, CAL_DONE };
static atomic_int cal_state[BLK__MAX_DEVICES];
static _Atomic size_t cal_value[BLK__MAX_DEVICES];

static bool kernel_usable(const pm__backend_t *b) {
  return b->launch_batch_copy && b->kernel_host_access && b->kernel_host_access() != 0;
}

/* Queue pieces by the kernel: each cut into tiles of at most BLK__TILE bytes. */
static pm_status_t queue_kernel(const pm__backend_t *b, void *const *dsts, const void *const *srcs,
                                const size_t *sizes, size_t n, pm_stream_t stream,
                                pm__copy_desc_t *scratch, size_t scratch_cap) {
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    for (size_t off = 0; off < sizes[i]; off += BLK__TILE) {
      if (k == scratch_cap) {
        pm_status_t st = b->launch_batch_copy(scratch, k, stream);
        if (st != PM_OK) return st;
        k = 0;
      }
      scratch[k].src = (const char *)srcs[i] + off;
      scratch[k].dst = (char *)dsts[i] + off;
      scratch[k].bytes = (uint64_t)PM__MIN(BLK__TILE, sizes[i] - off);
      k++;
    }
  }
  return k ? b->launch_batch_copy(scratch, k, stream) : PM_OK;
}

/* Queue pieces by DMA: one batch call where the backend has it, else a copy each. */
static pm_status_t queue_dma(const pm__backend_t *b, void *const *dsts, const void *const *srcs,
                             const size_t *sizes, size_t n, pm_copy_kind_t kind,
                             pm_stream_t stream) {
  if (n == 0) return PM_OK;
  if (b->memcpy_batch_async && n > 1) return b->memcpy_batch_async(dsts, srcs, sizes, n, stream);
  for (size_t i = 0; i < n; i++) {
    pm_status_t st = b->memcpy_async(dsts[i], srcs[i], sizes[i], kind, stream);
    if (st != PM_OK) return st;
  }
  return PM_OK;
}

/* Seconds the pieces of `size` bytes take, both directions, by one path: the best of the runs
 * after the first. < 0 on a backend failure (the calibration then keeps DMA). */
static double cal_time(const pm__backend_t *b, char *host, char *dev, size_t size, bool kernel,
                       pm_stream_t s, pm_event_t e0, pm_event_t e1, void **dsts,
                       const void **srcs, size_t *sizes, pm__copy_desc_t *desc, size_t cap) {
  size_t n = BLK__CAL_BYTES / size;
  double best = -1;
  for (int rep = 0; rep < BLK__CAL_REPS; rep++) {
    if (b->event_record(e0, s) != PM_OK) return -1;
    for (int dir = 0; dir < 2; dir++) {
      /* Pieces in a scattered order (a stride prime to n), as random block ids are. */
      size_t step = n > 7 ? 7 : 1;
      for (size_t i = 0; i < n; i++) {
        size_t j = (i * step) % n;
        dsts[i] = dir ? host + j * size : dev + i * size;
        srcs[i] = dir ? dev + i * size : host + j * size;
        sizes[i] = size;
      }
      pm_status_t st =
          kernel ? queue_kernel(b, dsts, srcs, sizes, n, s, desc, cap)
                 : queue_dma(b, dsts, srcs, sizes, n, dir ? PM_COPY_D2H : PM_COPY_H2D, s);
      if (st != PM_OK) return -1;
    }
    double t;
    if (b->event_record(e1, s) != PM_OK || b->event_synchronize(e1) != PM_OK ||
        b->event_elapsed(e0, e1, &t) != PM_OK)
      return -1;
    if (rep > 0 && (best < 0 || t < best)) best = t;
  }
  return best;
}

/* The largest of a few piece sizes at which the kernel beats DMA on the current device; 0 when
 * it never does (or something failed: DMA is always correct). No lock is held. */
/* Measure the cut-off. Its pinned and device buffers are not freed here but handed to the store
 * whose call measured (*host_keep, *dev_keep): freeing device or pinned memory synchronizes the
 * whole device (cudaFree, cudaFreeHost; the host backend models cudaFree), so the first swap of
 * a device would wait for every stream's work, the compute stream's and the caller's own
 * included: a stall, and a hang when a stream waits on the calling thread (a host function). */
static size_t calibrate(const pm__backend_t *b, char **host_keep, char **dev_keep) {
  static const size_t sizes_try[] = {4u << 10, 16u << 10, 64u << 10, 256u << 10, 1u << 20};
  if (!kernel_usable(b)) return 0;
  size_t cut = 0, n_max = BLK__CAL_BYTES / sizes_try[0], cap = BLK__CAL_BYTES / BLK__TILE + n_max;
  char *host = NULL, *dev = NULL;
  pm_stream_t s = NULL;
  pm_event_t e0 = NULL, e1 = NULL;
  void **dsts = malloc(n_max * sizeof *dsts);
  const void **srcs = malloc(n_max * sizeof *srcs);
  size_t *szs = malloc(n_max * sizeof *szs);
  pm__copy_desc_t *desc = malloc(cap * sizeof *desc);
  if (!dsts || !srcs || !szs || !desc) goto done;
  if (b->host_alloc(BLK__CAL_BYTES, PM_HOST_PORTABLE | PM_HOST_MAPPED, (void **)&host) != PM_OK)
    goto done;
  if (b->device_alloc(BLK__CAL_BYTES, (void **)&dev) != PM_OK) goto done;
  if (b->stream_create(&s) != PM_OK) goto done;
  if (b->event_create(PM_EVENT_TIMING, &e0) != PM_OK) goto done;
  if (b->event_create(PM_EVENT_TIMING, &e1) != PM_OK) goto done;
  memset(host, 0x5a, BLK__CAL_BYTES);
  for (size_t i = 0; i < sizeof sizes_try / sizeof sizes_try[0]; i++) {
    double tk = cal_time(b, host, dev, sizes_try[i], true, s, e0, e1, (void **)dsts, srcs, szs,
                         desc, cap);
    double td = cal_time(b, host, dev, sizes_try[i], false, s, e0, e1, (void **)dsts, srcs, szs,
                         desc, cap);
    if (tk < 0 || td < 0) break;
    if (tk < td) cut = sizes_try[i];
  }
done:
  if (s) (void)b->stream_synchronize(s);
  if (e1) (void)b->event_destroy(e1);
  if (e0) (void)b->event_destroy(e0);
  if (s) (void)b->stream_destroy(s);
  *host_keep = host;
  *dev_keep = dev;
  free(dsts);
  free(srcs);
  free(szs);
  free(desc);
  pm__clear_error(); /* a failed calibration is not the swap's error */
  return cut;
}

/* The cut-off in force: the option, or device dev's calibration (then *calibrated, when asked
 * for, is true). dev is the current device (enter_device); s, the store of the call, keeps the
 * buffers of a calibration the call runs. */
static size_t kernel_max(pm_blocks_t *s, int dev, bool *calibrated) {
  const pm__backend_t *b = s->b;
  size_t opt = pm__opt_size(PM__OPT_BLOCKS_KERNEL_MAX);
  if (calibrated) *calibrated = opt == PM__BLOCKS_CUTOFF_AUTO;
  if (opt != PM__BLOCKS_CUTOFF_AUTO) return kernel_usable(b) ? opt : 0;
  if (dev < 0 || dev >= BLK__MAX_DEVICES) dev = 0;
  int state = atomic_load_explicit(&cal_state[dev], memory_order_acquire);
  if (state == CAL_NONE) {
    int expect = CAL_NONE;
    if (atomic_compare_exchange_strong(&cal_state[dev], &expect, CAL_RUNNING)) {
      atomic_store_explicit(&cal_value[dev], calibrate(b, &s->cal_host, &s->cal_dev),
                            memory_order_relaxed);
      atomic_store_explicit(&cal_state[dev], CAL_DONE, memory_order_release);
      state = CAL_DONE;
    } else {
      state = expect;
    }
  }
  /* While another thread measures, calls take DMA: correct at every size, and nobody waits on
   * a lock (nor, in a child forked mid-measurement, forever). */
  if (state != CAL_DONE) return 0;
  return atomic_load_explicit(&cal_value[dev], memory_order_relaxed);
}

/* Make the store's device current; *prev gets the caller's where it changed (its device, or
 * PM__DEVICE_NONE for a thread that had none; else PM__DEVICE_KEEP), for leave_device. The
 * backend's status, its detail unwrapped. */
static pm_status_t switch_device(const pm_blocks_t *s, int *prev) {
  *prev = PM__DEVICE_KEEP;
  int cur = -1;
  pm_status_t st = pm__device_binding(s->b, &cur);
  if (st == PM_OK && cur != s->device) {
    st = s->b->set_device(s->device);
    if (st == PM_OK) *prev = cur;
  }
  return st;
}

/* switch_device for a call, a failure named by the call. */
static pm_status_t enter_device(const pm_blocks_t *s, int *prev, const char *fn) {
  pm_status_t st = switch_device(s, prev);
  if (st != PM_OK)
    return pm__wrap_error(st, "%s: making the store's device %d current", fn, s->device);
  return PM_OK;
}

static void leave_device(const pm_blocks_t *s, int prev) {
  pm__device_put_back(s->b, prev);
}

/* ---- swap records and the reuse of freed blocks ---------------------------------------------- */

static blk_swap_t *rec_at(const pm_blocks_t *s, uint64_t seq) {
  return &s->swaps[seq & (s->swaps_cap - 1)];
}

static bool rec_ended(const blk_swap_t *r) {
  return r->phase == SW_DONE || r->phase == SW_BROKEN;
}

/* The waiting list: freed blocks that swaps not ended still name, oldest free first. */
static void wait_push(pm_blocks_t *s, uint64_t id) {
  s->link[id] = BLK__NONE;
  s->prev[id] = s->wait_tail;
  if (s->wait_tail == BLK__NONE)
    s->wait_head = id;
  else
    s->link[s->wait_tail] = id;
  s->wait_tail = id;
  s->nwaiting++;
}

static void wait_unlink(pm_blocks_t *s, uint64_t id) {
  if (s->prev[id] == BLK__NONE)
    s->wait_head = s->link[id];
  else
    s->link[s->prev[id]] = s->link[id];
  if (s->link[id] == BLK__NONE)
    s->wait_tail = s->prev[id];
  else
    s->prev[s->link[id]] = s->prev[id];
  s->nwaiting--;
}

static size_t queue_find(const pm_blocks_t *s, pm_stream_t stream) {
  size_t i = 0;
  while (i < s->nqueues && s->queues[i].stream != stream) i++;
  return i;
}

/* Record seq ended: completed (st PM_OK) or broken (st, its completion cannot be known). Each
 * block it named has one name less; a freed block that no record names any more is idle (the
 * free stack), one a broken record named is quarantined, an allocated one tainted (quarantined
 * when freed): the device may still read or write it, and nothing will say when it stops. The
 * record leaves its stream's queue (with the ended records behind it) and, once every record
 * before it ended, the ring: records stay bounded by the swaps still running. */
static void end_record_locked(pm_blocks_t *s, uint64_t seq, pm_status_t st) {
  blk_swap_t *r = rec_at(s, seq);
  for (size_t i = 0; i < r->n; i++) {
    uint64_t id = r->ids[i];
    s->inflight[id]--;
    unsigned base = st_base(s->state[id]);
    if (st != PM_OK) {
      if (base == ST_WAITING) {
        wait_unlink(s, id);
        s->state[id] = ST_QUAR;
        s->nquar++;
      } else if (base == ST_ALLOC) {
        s->state[id] |= ST_TAINT;
      }
    } else if (base == ST_WAITING && s->inflight[id] == 0) {
      wait_unlink(s, id);
      s->state[id] = ST_FREE;
      s->free_stack[s->nfree++] = id;
    }
  }
  free(r->ids);
  r->ids = NULL;
  r->n = 0;
  /* Both arrays have room: ev_cap >= ev_live >= nev + ndead + the events of live records. */
  if (r->event && st == PM_OK) s->ev_cache[s->nev++] = r->event;
  if (r->event && st != PM_OK) s->ev_dead[s->ndead++] = r->event;
  r->event = NULL;
  r->phase = st == PM_OK ? SW_DONE : SW_BROKEN;
  if (st != PM_OK) {
    s->broken_status = st;
    s->broken_seq = seq;
  }
  size_t qi = queue_find(s, r->stream);
  if (qi < s->nqueues) {
    blk_queue_t *q = &s->queues[qi];
    while (q->head && rec_ended(rec_at(s, q->head))) q->head = rec_at(s, q->head)->next;
    if (!q->head) s->queues[qi] = s->queues[--s->nqueues];
  }
  /* A record still on a queue has a record not ended ahead of it (a queue's head never ended),
   * at or after swap_base: the base never passes a queued record. */
  while (s->swap_base < s->swap_next && rec_ended(rec_at(s, s->swap_base))) s->swap_base++;
  pthread_cond_broadcast(&s->swap_cv);
}

/* Give a swap of `count` host blocks on `stream` its seq: check again, under the lock, that they
 * are allocated (a free on another thread since check_ids is refused before anything is
 * queued), count the swap in each block's names and put its record on its stream's queue. Room
 * for the record, its queue and its event is made here, so end_swap cannot fail for want of
 * memory. */
static pm_status_t begin_swap(pm_blocks_t *s, const uint64_t *host_ids, size_t count,
                              pm_stream_t stream, const char *fn, uint64_t *seq_out) {
  uint64_t *ids = malloc(count * sizeof *ids);
  if (!ids) return pm__set_error(PM_ERR_NOMEM, "%s: out of memory for the swap's record", fn);
  memcpy(ids, host_ids, count * sizeof *ids);
  pthread_mutex_lock(&s->lock);
  for (size_t i = 0; i < count; i++) {
    if (st_base(s->state[host_ids[i]]) != ST_ALLOC) {
      pthread_mutex_unlock(&s->lock);
      free(ids);
      return pm__set_error(PM_ERR_INVALID,
                           "%s: host_ids[%zu] = %llu is not allocated (pm_blocks_alloc)", fn, i,
                           (unsigned long long)host_ids[i]);
    }
  }
  bool room = true;
  if (s->swap_next - s->swap_base == s->swaps_cap) {
    uint64_t cap = s->swaps_cap ? 2 * s->swaps_cap : 16;
    blk_swap_t *n = malloc((size_t)cap * sizeof *n);
    if (n) {
      for (uint64_t q = s->swap_base; q < s->swap_next; q++) n[q & (cap - 1)] = *rec_at(s, q);
      free(s->swaps);
      s->swaps = n;
      s->swaps_cap = cap;
    }
    room = n != NULL;
  }
  if (room && s->ev_cap < s->ev_live + 1) { /* every event fits: end_record never grows them */
    size_t cap = PM__MAX((size_t)16, 2 * s->ev_cap);
    pm_event_t *c = realloc(s->ev_cache, cap * sizeof *c);
    if (c) s->ev_cache = c;
    pm_event_t *d = c ? realloc(s->ev_dead, cap * sizeof *d) : NULL;
    if (d) {
      s->ev_dead = d;
      s->ev_cap = cap;
    }
    room = d != NULL;
  }
  size_t qi = queue_find(s, stream);
  if (room && qi == s->nqueues && s->nqueues == s->queues_cap) {
    size_t cap = PM__MAX((size_t)4, 2 * s->queues_cap);
    blk_queue_t *n = realloc(s->queues, cap * sizeof *n);
    if (n) {
      s->queues = n;
      s->queues_cap = cap;
    }
    room = n != NULL;
  }
  if (!room) {
    pthread_mutex_unlock(&s->lock);
    free(ids);
    return pm__set_error(PM_ERR_NOMEM, "%s: out of memory for the swap's record", fn);
  }
  s->ev_live++; /* the event end_swap may make */
  uint64_t seq = s->swap_next++;
  *rec_at(s, seq) = (blk_swap_t){NULL, stream, 0, ids, count, SW_QUEUEING};
  for (size_t i = 0; i < count; i++) {
    s->inflight[host_ids[i]]++;
    s->last_swap[host_ids[i]] = seq;
  }
  if (qi == s->nqueues) s->queues[s->nqueues++] = (blk_queue_t){stream, 0, 0};
  blk_queue_t *q = &s->queues[qi];
  if (q->head)
    rec_at(s, q->tail)->next = seq;
  else
    q->head = seq;
  q->tail = seq;
  pthread_mutex_unlock(&s->lock);
  *seq_out = seq;
  return PM_OK;
}

/* Learn which records completed, without waiting: the head of each stream's queue, and the
 * records behind it while they completed (a stream runs its work in order, so the first record
 * not complete ends the look at that stream; only a record's own event says it completed).
 * Called with poll_lock held; takes lock. */
static void poll_swaps(pm_blocks_t *s) {
  /* The queries run on the store's device, as every call of the store's does (the callers of
   * the stats, of free and of alloc may be on another one), made current at the first. A poll
   * that cannot make it current learns nothing, which is no error of the call it serves. */
  int prev = PM__DEVICE_KEEP;
  bool on_device = false;
  pthread_mutex_lock(&s->lock);
  size_t i = 0;
  while (i < s->nqueues) {
    uint64_t seq = s->queues[i].head;
    blk_swap_t *r = rec_at(s, seq);
    if (r->phase != SW_QUEUED) {
      i++;
      continue;
    }
    pm_event_t ev = r->event;
    pthread_mutex_unlock(&s->lock);
    if (!on_device && !(on_device = switch_device(s, &prev) == PM_OK)) {
      pthread_mutex_lock(&s->lock);
      break;
    }
    pm_status_t q = s->b->event_query(ev);
    pthread_mutex_lock(&s->lock);
    /* Still queued: only the poll_lock holder ends a queued record. Entry i is looked at again
     * (its next record, or the queue moved there when this one emptied). */
    if (q == PM_NOT_READY)
      i++;
    else
      end_record_locked(s, seq, q);
  }
  pthread_mutex_unlock(&s->lock);
  leave_device(s, prev);
}

/* What completed, learnt without waiting, unless another thread is at it (alloc's wait): the
 * counts then show what the store knows. */
static void learn_completed(pm_blocks_t *s) {
  if (pthread_mutex_trylock(&s->poll_lock) == 0) {
    poll_swaps(s);
    pthread_mutex_unlock(&s->poll_lock);
  }
}

/* Give record seq its event, recorded on `stream` after the swap's copies (those queued, all
 * or some). Without an event, the stream is synchronized instead; when that fails too the
 * record is broken and the device's status returned. begin_swap counted one event for the swap
 * in ev_live: kept when an event is made, given back otherwise. */
static pm_status_t end_swap(pm_blocks_t *s, uint64_t seq, pm_stream_t stream, const char *fn) {
  const pm__backend_t *b = s->b;
  pm_status_t st = PM_OK;
  pm_event_t ev = NULL;
  size_t gone = 1; /* events of ev_live that do not exist after this call */
  pthread_mutex_lock(&s->lock);
  if (s->nev) ev = s->ev_cache[--s->nev];
  pthread_mutex_unlock(&s->lock);
  if (!ev) {
    st = b->event_create(PM_EVENT_DEFAULT, &ev);
    if (st == PM_OK)
      gone = 0;
    else
      ev = NULL;
  }
  if (st == PM_OK) st = b->event_record(ev, stream);
  if (st != PM_OK) {
    if (ev && b->event_destroy(ev) == PM_OK) gone++;
    ev = NULL;
    st = b->stream_synchronize(stream);
    if (st != PM_OK)
      st = pm__wrap_error(st,
                          "%s: the swap's completion cannot be tracked (no event, and its "
                          "stream could not be synchronized)",
                          fn);
    else
      pm__clear_error();
  }
  pthread_mutex_lock(&s->lock);
  s->ev_live -= gone;
  if (ev) {
    blk_swap_t *r = rec_at(s, seq);
    r->event = ev;
    r->phase = SW_QUEUED;
    pthread_cond_broadcast(&s->swap_cv);
  } else {
    end_record_locked(s, seq, st);
  }
  pthread_mutex_unlock(&s->lock);
  learn_completed(s);
  return st;
}

/* ---- pinning -------------------------------------------------------------------------------- */

/* The first block of chunk c, and the chunk holding block id. */
static uint64_t chunk_start(const pm_blocks_t *s, uint64_t c) {
  return c == 0 ? 0 : s->first_blocks + (c - 1) * s->chunk_blocks;
}

static uint64_t chunk_of(const pm_blocks_t *s, uint64_t id) {
  return id < s->first_blocks ? 0 : 1 + (id - s->first_blocks) / s->chunk_blocks;
}

static size_t chunk_len(const pm_blocks_t *s, uint64_t c) {
  uint64_t start = chunk_start(s, c);
  uint64_t n = PM__MIN(c == 0 ? s->first_blocks : s->chunk_blocks, s->num_blocks - start);
  return (size_t)n * s->block_bytes;
}

static pm_status_t pin_chunk(pm_blocks_t *s, uint64_t c) {
  bool bound;
  void *p = NULL;
  pm_status_t st =
      pm__fast_pin_node(s->b, chunk_len(s, c), PM_REGISTER_PORTABLE | PM_REGISTER_MAPPED,
                        s->threads, s->huge, s->node, &bound, &p);
  if (st != PM_OK) return pm__wrap_error(st, "block store: pinning chunk %llu of %llu",
                                         (unsigned long long)c, (unsigned long long)s->nchunks);
  s->chunk_base[c] = p;
  return PM_OK;
}

static void mark_ready(pm_blocks_t *s, uint64_t c) {
  double t = pm__now() - s->t_create;
  if (c == 0) atomic_store(&s->first_ready_s, t);
  if (c + 1 == s->nchunks) atomic_store(&s->all_ready_s, t);
  pthread_mutex_lock(&s->lock);
  atomic_store_explicit(&s->chunks_ready, c + 1, memory_order_release);
  pthread_cond_broadcast(&s->ready_cv);
  pthread_mutex_unlock(&s->lock);
}

static void *pinner_main(void *arg) {
  pm_blocks_t *s = arg;
  pm__thread_enter(s->device);
  for (uint64_t c = 1; c < s->nchunks; c++) {
    if (atomic_load(&s->stop)) break;
    pm_status_t st = pin_chunk(s, c);
    if (st != PM_OK) {
      /* The blocks of chunks c.. will never be usable: they leave the free list (alloc hands
       * out only blocks a swap can use), freed ones do not come back to it, and their bytes go
       * back to the budget. Chunks 1..c-1 are full chunks. */
      size_t page = pm__page_size();
      size_t kept = pm__align_up(chunk_len(s, 0), page) +
                    (size_t)(c - 1) * pm__align_up(chunk_len(s, 1), page);
      uint64_t limit = chunk_start(s, c), n = 0;
      char why[sizeof s->pin_error];
      snprintf(why, sizeof why, "%s", pm_last_error());
      /* The charge goes back before waiters hear of the failure (the pool's lock is not taken
       * under the store's, a leaf): whoever sees the error sees the budget it left. */
      pthread_mutex_lock(&s->lock);
      size_t back = s->charged > kept ? s->charged - kept : 0;
      s->charged -= back;
      pthread_mutex_unlock(&s->lock);
      if (back) pm__pool_uncharge(s->pool, back);
      pthread_mutex_lock(&s->lock);
      s->pin_status = st;
      memcpy(s->pin_error, why, sizeof why);
      for (uint64_t i = 0; i < s->nfree; i++)
        if (s->free_stack[i] < limit) s->free_stack[n++] = s->free_stack[i];
      s->nfree = n;
      for (uint64_t id = s->wait_head, next; id != BLK__NONE; id = next) {
        next = s->link[id];
        if (id < limit) continue;
        wait_unlink(s, id);
        s->state[id] = ST_FREE; /* on no list: its swaps' end leaves it there */
      }
      s->usable = limit;
      pthread_cond_broadcast(&s->ready_cv);
      pthread_mutex_unlock(&s->lock);
      break;
    }
    mark_ready(s, c);
  }
  return NULL;
}

/* Wait until chunk c is pinned; the pinning error if it never will be. */
static pm_status_t wait_chunk(pm_blocks_t *s, uint64_t c, const char *fn) {
  if (atomic_load_explicit(&s->chunks_ready, memory_order_acquire) > c) return PM_OK;
  pthread_mutex_lock(&s->lock);
  while (atomic_load_explicit(&s->chunks_ready, memory_order_acquire) <= c &&
         s->pin_status == PM_OK)
    pthread_cond_wait(&s->ready_cv, &s->lock);
  pm_status_t st = PM_OK;
  if (atomic_load_explicit(&s->chunks_ready, memory_order_acquire) <= c)
    st = pm__set_error(s->pin_status,
                       "%s: blocks from %llu on are not pinned: the background pinning failed: %s",
                       fn, (unsigned long long)chunk_start(s, atomic_load(&s->chunks_ready)),
                       s->pin_error);
  pthread_mutex_unlock(&s->lock);
  return st;
}

static char *block_addr(const pm_blocks_t *s, uint64_t id) {
  uint64_t c = chunk_of(s, id);
  return s->chunk_base[c] + (size_t)(id - chunk_start(s, c)) * s->block_bytes;
}

/* ---- create / destroy ----------------------------------------------------------------------- */

void pm_blocks_config_init(pm_blocks_config_t *config) {
  if (!config) return;
  memset(config, 0, sizeof *config);
  config->device = -1;
  config->background = 1;
}

/* What the arena charges the pool's budget: each chunk page-rounded (chunk 0, the full chunks
 * after it, the last partial one), without a loop over chunks (a tiny chunk_bytes makes one
 * chunk a block); SIZE_MAX where it overflows, which every budget refuses. */
static size_t arena_charge(const pm_blocks_t *s) {
  size_t page = pm__page_size();
  uint64_t rest = s->num_blocks - s->first_blocks;
  uint64_t full = rest / s->chunk_blocks, tail = rest % s->chunk_blocks;
  size_t full_len = pm__align_up((size_t)s->chunk_blocks * s->block_bytes, page);
  size_t charge = pm__align_up(chunk_len(s, 0), page);
  if (full && full_len > (SIZE_MAX - charge) / full) return SIZE_MAX;
  charge += (size_t)full * full_len;
  size_t tail_len = tail ? pm__align_up((size_t)tail * s->block_bytes, page) : 0;
  return tail_len > SIZE_MAX - charge ? SIZE_MAX : charge + tail_len;
}

static void store_free(pm_blocks_t *s) {
  for (uint64_t c = 0; c < s->nchunks && s->chunk_base; c++)
    if (s->chunk_base[c]) (void)pm__fast_unpin(s->b, s->chunk_base[c], chunk_len(s, c));
  if (s->charged) pm__pool_uncharge(s->pool, s->charged);
  /* The device's work is over (destroy synchronized it): every record's event is done. */
  for (uint64_t q = s->swap_base; q < s->swap_next; q++) {
    if (rec_at(s, q)->event) (void)s->b->event_destroy(rec_at(s, q)->event);
    free(rec_at(s, q)->ids);
  }
  for (size_t i = 0; i < s->nev; i++) (void)s->b->event_destroy(s->ev_cache[i]);
  for (size_t i = 0; i < s->ndead; i++) (void)s->b->event_destroy(s->ev_dead[i]);
  if (s->cal_dev) (void)s->b->device_free(s->cal_dev);
  if (s->cal_host) (void)s->b->host_free(s->cal_host, BLK__CAL_BYTES);
  pthread_cond_destroy(&s->swap_cv);
  pthread_mutex_destroy(&s->poll_lock);
  pthread_cond_destroy(&s->ready_cv);
  pthread_mutex_destroy(&s->lock);
  free(s->chunk_base);
  free(s->free_stack);
  free(s->state);
  free(s->inflight);
  free(s->last_swap);
  free(s->link);
  free(s->prev);
  free(s->swaps);
  free(s->queues);
  free(s->ev_cache);
  free(s->ev_dead);
  free(s);
}

pm_status_t pm_blocks_create(const pm_blocks_config_t *config, pm_blocks_t **blocks_out) {
  static const char fn[] = "pm_blocks_create";
  if (!config || !blocks_out)
    return pm__set_error(PM_ERR_INVALID, "%s: config and blocks_out are required", fn);
  PM__BACKEND_OR_RETURN(b);
  pm_blocks_config_t c = *config;
  if (c.block_bytes == 0) return pm__set_error(PM_ERR_INVALID, "%s: block_bytes is 0", fn);
  if (c.num_blocks == 0) return pm__set_error(PM_ERR_INVALID, "%s: num_blocks is 0", fn);
  if (c.num_blocks > SIZE_MAX / c.block_bytes / 2 || c.num_blocks > (uint64_t)SIZE_MAX / 16)
    return pm__set_error(PM_ERR_INVALID, "%s: %llu blocks of %zu bytes is too large", fn,
                         (unsigned long long)c.num_blocks, c.block_bytes);
  if (c.pin_threads < 0 || c.pin_threads > 1024)
    return pm__set_error(PM_ERR_INVALID, "%s: pin_threads %d is not in 0..1024", fn,
                         c.pin_threads);
  if (c.background != 0 && c.background != 1)
    return pm__set_error(PM_ERR_INVALID, "%s: background is %d, not 0 or 1", fn, c.background);
  int ndev = 0, cur = 0;
  pm_status_t st = b->device_count(&ndev);
  if (st == PM_OK) st = b->get_device(&cur);
  if (st != PM_OK) return pm__wrap_error(st, "%s", fn);
  if (c.device < -1 || c.device >= ndev)
    return pm__set_error(PM_ERR_INVALID, "%s: device %d is not -1 or a device 0..%d", fn,
                         c.device, ndev - 1);
  pm_pool_t *pool = c.pool;
  if (pool) {
    st = pm__handle_check(pool, PM__HANDLE_POOL, fn);
  } else {
    st = pm_pool_default(&pool);
  }
  if (st != PM_OK) return st;

  pm_blocks_t *s = calloc(1, sizeof *s);
  if (!s) return pm__set_error(PM_ERR_NOMEM, "%s: out of memory", fn);
  s->b = b;
  s->pool = pool;
  s->block_bytes = c.block_bytes;
  s->num_blocks = c.num_blocks;
  s->device = c.device >= 0 ? c.device : cur;
  size_t chunk = c.chunk_bytes ? c.chunk_bytes : pm__opt_size(PM__OPT_BLOCKS_CHUNK);
  s->chunk_blocks = PM__MAX((uint64_t)1, (uint64_t)(chunk / c.block_bytes));
  s->chunk_blocks = PM__MIN(s->chunk_blocks, s->num_blocks);
  s->first_blocks = PM__MIN(s->chunk_blocks,
                            PM__MAX((uint64_t)1, (uint64_t)(atomic_load(&pm__blocks_first_bytes) /
                                                            c.block_bytes)));
  s->nchunks = 1 + (s->num_blocks - s->first_blocks + s->chunk_blocks - 1) / s->chunk_blocks;
  s->threads = c.pin_threads ? c.pin_threads : (int)pm__opt_int(PM__OPT_PIN_THREADS);
  s->huge = pm__opt_int(PM__OPT_HUGE_PAGES) != 0;
  s->node = pm__numa_node_for(s->device);
  pthread_mutex_init(&s->lock, NULL);
  pthread_cond_init(&s->ready_cv, NULL);
  pthread_mutex_init(&s->poll_lock, NULL);
  pthread_cond_init(&s->swap_cv, NULL);
  s->swap_base = s->swap_next = 1; /* last_swap 0: no swap, idle from the start */
  s->wait_head = s->wait_tail = BLK__NONE;
  /* The budget first: a store far past it is refused before its bookkeeping (41 bytes a
   * block) is made, at once and without the memory. */
  size_t charge = arena_charge(s);
  st = pm__pool_charge_for(pool, charge, "block store arena");
  if (st != PM_OK) {
    store_free(s);
    return pm__wrap_error(st, "%s: %llu blocks of %zu bytes", fn,
                          (unsigned long long)c.num_blocks, c.block_bytes);
  }
  s->charged = charge;
  s->chunk_base = calloc((size_t)s->nchunks, sizeof *s->chunk_base);
  s->free_stack = malloc((size_t)s->num_blocks * sizeof *s->free_stack);
  s->state = calloc((size_t)s->num_blocks, 1);
  s->inflight = calloc((size_t)s->num_blocks, sizeof *s->inflight);
  s->last_swap = calloc((size_t)s->num_blocks, sizeof *s->last_swap);
  s->link = malloc((size_t)s->num_blocks * sizeof *s->link);
  s->prev = malloc((size_t)s->num_blocks * sizeof *s->prev);
  if (!s->chunk_base || !s->free_stack || !s->state || !s->inflight || !s->last_swap || !s->link ||
      !s->prev) {
    store_free(s);
    return pm__set_error(PM_ERR_NOMEM, "%s: out of memory for %llu blocks' bookkeeping", fn,
                         (unsigned long long)c.num_blocks);
  }
  for (uint64_t i = 0; i < s->num_blocks; i++) s->free_stack[i] = s->num_blocks - 1 - i;
  s->nfree = s->num_blocks;
  s->usable = s->num_blocks;
  s->t_create = pm__now();
  /* The arena is pinned (and, on a failure, released) with the store's device current, as the
   * pinner thread pins the later chunks and as every other call of the store runs: a caller on
   * another device does not get the registrations made in its device's context. */
  int prev;
  st = enter_device(s, &prev, fn);
  if (st != PM_OK) {
    store_free(s);
    return st;
  }
  for (uint64_t k = 0; k < (c.background ? 1 : s->nchunks) && st == PM_OK; k++) {
    st = pin_chunk(s, k);
    if (st == PM_OK) mark_ready(s, k);
  }
  if (st == PM_OK && c.background && s->nchunks > 1) {
    if (pthread_create(&s->pinner, NULL, pinner_main, s) != 0)
      st = pm__set_error(PM_ERR_NOMEM, "%s: cannot start the pinning thread", fn);
    else
      s->has_pinner = true;
  } else if (st != PM_OK) {
    st = pm__wrap_error(st, "%s", fn);
  }
  if (st == PM_OK) st = pm__handle_add(s, PM__HANDLE_BLOCKS);
  if (st != PM_OK) {
    atomic_store(&s->stop, true);
    if (s->has_pinner) pthread_join(s->pinner, NULL);
    store_free(s);
  }
  pm__device_put_back(b, prev); /* (s may be gone) */
  if (st != PM_OK) return st;
  *blocks_out = s;
  return PM_OK;
}

pm_status_t pm_blocks_destroy(pm_blocks_t *s) {
  static const char fn[] = "pm_blocks_destroy";
  if (pm__handle_foreign(s, PM__HANDLE_BLOCKS)) {
    (void)pm__handle_remove(s, PM__HANDLE_BLOCKS);
    return PM_OK;
  }
  pm_status_t st = pm__handle_check(s, PM__HANDLE_BLOCKS, fn);
  if (st != PM_OK) return st;
  (void)pm__handle_remove(s, PM__HANDLE_BLOCKS);
  atomic_store(&s->stop, true);
  if (s->has_pinner) pthread_join(s->pinner, NULL);
  /* Swaps queued on any stream may still read or write the arena: the device's work finishes
   * before the memory is unpinned. */
  int prev;
  pm_status_t sync = enter_device(s, &prev, fn);
  if (sync == PM_OK) sync = s->b->device_synchronize();
  if (sync != PM_OK) {
    leave_device(s, prev);
    /* Unpinning memory the device may still use would be worse than keeping it. */
    return pm__wrap_error(sync, "%s: the device could not be synchronized; the arena is kept", fn);
  }
  /* The arena's unpinning, the events and the calibration's buffers go on the store's device
   * too (the caller's may be another, or none yet). */
  const pm__backend_t *b = s->b;
  store_free(s);
  pm__device_put_back(b, prev);
  return PM_OK;
}

/* ---- the free list -------------------------------------------------------------------------- */

/* A record not ended that names waiting block id, for alloc to wait on: its last swap, else (it
 * completed while an earlier swap on another stream still uses the block) the oldest such
 * record. The scan runs only in that case, over the records still in the ring. 0: none (a
 * block on the waiting list has one). */
static uint64_t rec_naming(const pm_blocks_t *s, uint64_t id) {
  uint64_t last = s->last_swap[id];
  if (last >= s->swap_base && !rec_ended(rec_at(s, last))) return last;
  for (uint64_t q = s->swap_base; q < last; q++) {
    const blk_swap_t *r = rec_at(s, q);
    for (size_t i = 0; i < r->n && !rec_ended(r); i++)
      if (r->ids[i] == id) return q;
  }
  return 0;
}

/* Wait until count blocks are idle, or until fewer than count are free or waiting (another
 * thread took them, or a broken swap quarantined them): first learn what completed without
 * waiting, then wait for the swaps of the longest-waiting freed block, one at a time. Only the
 * swaps that name freed blocks are waited for: an unrelated swap on another stream holds
 * nothing back. Called with lock held, and returns with it held; takes poll_lock meanwhile.
 * Not PM_OK (the error set) where it could not wait: the store's device could not be made
 * current; alloc then fails with that, not as an arena too small. */
static pm_status_t wait_idle_locked(pm_blocks_t *s, size_t count) {
  pm_status_t st = PM_OK;
  pthread_mutex_unlock(&s->lock);
  pthread_mutex_lock(&s->poll_lock);
  poll_swaps(s);
  pthread_mutex_lock(&s->lock);
  int prev = PM__DEVICE_KEEP;
  bool on_device = false; /* the waits too run on the store's device (poll_swaps) */
  while (count > s->nfree && count <= s->nfree + s->nwaiting) {
    uint64_t seq = rec_naming(s, s->wait_head);
    if (!seq) { /* cannot be (the block would not wait); never spin */
      st = pm__set_error(PM_ERR_INTERNAL, "pm_blocks_alloc: freed block %llu waits for no swap",
                         (unsigned long long)s->wait_head);
      break;
    }
    blk_swap_t *r = rec_at(s, seq);
    if (r->phase == SW_QUEUEING) {
      pthread_cond_wait(&s->swap_cv, &s->lock);
    } else {
      pm_event_t ev = r->event;
      pthread_mutex_unlock(&s->lock);
      if (!on_device) {
        st = enter_device(s, &prev, "pm_blocks_alloc: waiting for the swaps of freed blocks");
        on_device = st == PM_OK;
      }
      if (!on_device) {
        pthread_mutex_lock(&s->lock);
        break;
      }
      pm_status_t w = s->b->event_synchronize(ev);
      pthread_mutex_lock(&s->lock);
      end_record_locked(s, seq, w);
    }
  }
  pthread_mutex_unlock(&s->poll_lock);
  if (prev != PM__DEVICE_KEEP) { /* lock is a leaf: no backend call under it */
    pthread_mutex_unlock(&s->lock);
    leave_device(s, prev);
    pthread_mutex_lock(&s->lock);
  }
  return st;
}

pm_status_t pm_blocks_alloc(pm_blocks_t *s, size_t count, uint64_t *ids_out) {
  static const char fn[] = "pm_blocks_alloc";
  pm_status_t st = pm__handle_check(s, PM__HANDLE_BLOCKS, fn);
  if (st != PM_OK) return st;
  if (count == 0) return PM_OK;
  if (!ids_out) return pm__set_error(PM_ERR_INVALID, "%s: ids_out is NULL", fn);
  pthread_mutex_lock(&s->lock);
  /* Idle blocks first; freed blocks whose swaps still run only when those do not suffice. */
  pm_status_t wst = PM_OK;
  if (count > s->nfree && count <= s->nfree + s->nwaiting) wst = wait_idle_locked(s, count);
  if (count > s->nfree && wst != PM_OK) {
    pthread_mutex_unlock(&s->lock);
    return wst;
  }
  if (count > s->nfree) {
    uint64_t nfree = s->nfree + s->nwaiting, usable = s->usable, nquar = s->nquar;
    uint64_t bseq = s->broken_seq;
    pm_status_t bst = s->broken_status;
    char why[600] = "";
    if (usable < s->num_blocks)
      snprintf(why, sizeof why, " (blocks from %llu on could not be pinned: %s)",
               (unsigned long long)usable, s->pin_error);
    pthread_mutex_unlock(&s->lock);
    /* Short only for the quarantined blocks: the device's failure is the reason, not the size
     * of the arena. */
    if (nquar && count <= nfree + nquar)
      return pm__set_error(bst,
                           "%s: asked for %zu blocks, %llu are free; %llu freed blocks are kept "
                           "out of use: a swap that named them cannot say whether it completed, "
                           "so its completion cannot be known (swap %llu failed on the device)",
                           fn, count, (unsigned long long)nfree, (unsigned long long)nquar,
                           (unsigned long long)bseq);
    return pm__set_error(PM_ERR_NOMEM,
                         "%s: the arena is exhausted: asked for %zu blocks, %llu of %llu are "
                         "free%s",
                         fn, count, (unsigned long long)nfree, (unsigned long long)s->num_blocks,
                         why);
  }
  for (size_t i = 0; i < count; i++) {
    uint64_t id = s->free_stack[--s->nfree];
    s->state[id] = ST_ALLOC;
    ids_out[i] = id;
  }
  pthread_mutex_unlock(&s->lock);
  return PM_OK;
}

pm_status_t pm_blocks_free(pm_blocks_t *s, const uint64_t *ids, size_t count) {
  static const char fn[] = "pm_blocks_free";
  pm_status_t st = pm__handle_check(s, PM__HANDLE_BLOCKS, fn);
  if (st != PM_OK) return st;
  if (count == 0) return PM_OK;
  if (!ids) return pm__set_error(PM_ERR_INVALID, "%s: ids is NULL", fn);
  /* A block a swap not known ended names: learn which swaps completed first, so a caller that
   * waited for its swaps before freeing finds the blocks idle. */
  pthread_mutex_lock(&s->lock);
  bool busy = false;
  for (size_t j = 0; j < count && !busy; j++) busy = ids[j] < s->num_blocks && s->inflight[ids[j]];
  pthread_mutex_unlock(&s->lock);
  if (busy) learn_completed(s);
  pthread_mutex_lock(&s->lock);
  size_t i = 0;
  for (; i < count; i++) {
    if (ids[i] >= s->num_blocks || st_base(s->state[ids[i]]) != ST_ALLOC) break;
    s->state[ids[i]] = (uint8_t)((s->state[ids[i]] & ST_TAINT) | ST_SEEN); /* a repeat is caught */
  }
  bool ok = i == count;
  for (size_t j = 0; j < i; j++) {
    uint64_t id = ids[j];
    bool taint = s->state[id] & ST_TAINT;
    if (!ok) {
      s->state[id] = (uint8_t)(ST_ALLOC | (taint ? ST_TAINT : 0));
    } else if (id >= s->usable) {
      s->state[id] = ST_FREE; /* never pinned: on no list */
    } else if (taint) { /* a broken swap named it: the device may still use it, unknown when */
      s->state[id] = ST_QUAR;
      s->nquar++;
    } else if (s->inflight[id]) { /* a swap may still read or write it: reusable once ended */
      s->state[id] = ST_WAITING;
      wait_push(s, id);
    } else {
      s->state[id] = ST_FREE;
      s->free_stack[s->nfree++] = id;
    }
  }
  pthread_mutex_unlock(&s->lock);
  if (ok) return PM_OK;
  if (ids[i] >= s->num_blocks)
    return pm__set_error(PM_ERR_INVALID, "%s: ids[%zu] = %llu is not a block (the arena has %llu)",
                         fn, i, (unsigned long long)ids[i], (unsigned long long)s->num_blocks);
  bool repeat = false;
  for (size_t j = 0; j < i && !repeat; j++) repeat = ids[j] == ids[i];
  return pm__set_error(PM_ERR_INVALID, "%s: ids[%zu] = %llu is %s; nothing was freed", fn, i,
                       (unsigned long long)ids[i],
                       repeat ? "named twice" : "not allocated (pm_blocks_alloc)");
}

pm_status_t pm_blocks_ptr(pm_blocks_t *s, uint64_t id, void **ptr_out) {
  static const char fn[] = "pm_blocks_ptr";
  pm_status_t st = pm__handle_check(s, PM__HANDLE_BLOCKS, fn);
  if (st != PM_OK) return st;
  if (!ptr_out) return pm__set_error(PM_ERR_INVALID, "%s: ptr_out is NULL", fn);
  if (id >= s->num_blocks)
    return pm__set_error(PM_ERR_INVALID, "%s: id %llu is not a block (the arena has %llu)", fn,
                         (unsigned long long)id, (unsigned long long)s->num_blocks);
  st = wait_chunk(s, chunk_of(s, id), fn);
  if (st != PM_OK) return st;
  *ptr_out = block_addr(s, id);
  return PM_OK;
}

pm_status_t pm_blocks_wait_ready(pm_blocks_t *s, uint64_t count) {
  static const char fn[] = "pm_blocks_wait_ready";
  pm_status_t st = pm__handle_check(s, PM__HANDLE_BLOCKS, fn);
  if (st != PM_OK) return st;
  if (count == 0 || count > s->num_blocks) count = s->num_blocks;
  return wait_chunk(s, chunk_of(s, count - 1), fn);
}

pm_status_t pm_blocks_get_free(pm_blocks_t *s, uint64_t *idle_out, uint64_t *waiting_out,
                               uint64_t *quarantined_out) {
  static const char fn[] = "pm_blocks_get_free";
  pm_status_t st = pm__handle_check(s, PM__HANDLE_BLOCKS, fn);
  if (st != PM_OK) return st;
  learn_completed(s);
  pthread_mutex_lock(&s->lock); /* one reading: a block is counted once */
  if (idle_out) *idle_out = s->nfree;
  if (waiting_out) *waiting_out = s->nwaiting;
  if (quarantined_out) *quarantined_out = s->nquar;
  pthread_mutex_unlock(&s->lock);
  return PM_OK;
}

pm_status_t pm_blocks_get_stats(pm_blocks_t *s, pm_blocks_stats_t *out) {
  static const char fn[] = "pm_blocks_get_stats";
  pm_status_t st = pm__handle_check(s, PM__HANDLE_BLOCKS, fn);
  if (st != PM_OK) return st;
  if (!out) return pm__set_error(PM_ERR_INVALID, "%s: stats_out is NULL", fn);
  pm_blocks_stats_t r;
  memset(&r, 0, sizeof r);
  r.block_bytes = s->block_bytes;
  r.num_blocks = s->num_blocks;
  learn_completed(s);
  pthread_mutex_lock(&s->lock);
  r.free_blocks = s->nfree;
  r.arena_bytes = s->charged;
  pthread_mutex_unlock(&s->lock);
  r.chunks = s->nchunks;
  r.chunks_ready = atomic_load(&s->chunks_ready);
  r.ready_blocks = PM__MIN(s->num_blocks, chunk_start(s, r.chunks_ready));
  r.chunk_bytes = (size_t)s->chunk_blocks * s->block_bytes;
  r.numa_node = s->node;
  r.first_ready_seconds = atomic_load(&s->first_ready_s);
  r.all_ready_seconds = atomic_load(&s->all_ready_s);
  bool cal;
  int prev;
  st = enter_device(s, &prev, fn);
  if (st != PM_OK) return st;
  r.kernel_max = kernel_max(s, s->device, &cal);
  leave_device(s, prev);
  r.kernel_max_calibrated = cal;
  r.swaps_out = atomic_load(&s->swaps_out);
  r.swaps_in = atomic_load(&s->swaps_in);
  r.blocks_out = atomic_load(&s->blocks_out);
  r.blocks_in = atomic_load(&s->blocks_in);
  r.bytes_out = atomic_load(&s->bytes_out);
  r.bytes_in = atomic_load(&s->bytes_in);
  r.pieces_kernel = atomic_load(&s->pieces_kernel);
  r.pieces_dma = atomic_load(&s->pieces_dma);
  r.transfers = atomic_load(&s->transfers);
  *out = r;
  return PM_OK;
}

/* ---- swaps ---------------------------------------------------------------------------------- */

static pm_status_t check_layout(const pm_blocks_t *s, const pm_kv_layout_t *L, const char *fn) {
  if (!L) return pm__set_error(PM_ERR_INVALID, "%s: layout is NULL", fn);
  if (L->nregions < 1 || L->nregions > PM_KV_MAX_REGIONS || !L->regions)
    return pm__set_error(PM_ERR_INVALID, "%s: layout has %d regions (1..%d, regions not NULL)",
                         fn, L->nregions, PM_KV_MAX_REGIONS);
  if (L->device_blocks == 0)
    return pm__set_error(PM_ERR_INVALID, "%s: layout->device_blocks is 0", fn);
  if (L->device < -1 || (L->device >= 0 && L->device != s->device))
    return pm__set_error(PM_ERR_INVALID,
                         "%s: the KV tensors are on device %d, the store serves device %d", fn,
                         L->device, s->device);
  size_t sum = 0;
  for (int r = 0; r < L->nregions; r++) {
    const pm_kv_region_t *g = &L->regions[r];
    if (!g->base || g->bytes == 0)
      return pm__set_error(PM_ERR_INVALID, "%s: region %d has %s", fn, r,
                           g->base ? "0 bytes" : "a NULL base");
    if (L->device_blocks > 1 && g->block_stride < g->bytes)
      return pm__set_error(PM_ERR_INVALID,
                           "%s: region %d's block_stride %zu is below its bytes %zu (blocks "
                           "would overlap)",
                           fn, r, g->block_stride, g->bytes);
    if (g->bytes > s->block_bytes - PM__MIN(sum, s->block_bytes))
      return pm__set_error(PM_ERR_INVALID,
                           "%s: the layout's regions hold more than a block's %zu bytes (region "
                           "%d ends at %zu)",
                           fn, s->block_bytes, r, sum + g->bytes);
    sum += g->bytes;
    uint64_t span_blocks = L->device_blocks - 1;
    if (g->block_stride && span_blocks > (UINTPTR_MAX - (uintptr_t)g->base - g->bytes) /
                                             g->block_stride)
      return pm__set_error(PM_ERR_INVALID, "%s: region %d runs past the end of the address space",
                           fn, r);
    const char *last = (const char *)g->base + span_blocks * g->block_stride + g->bytes - 1;
    if (s->b->pointer_kind(g->base) != PM__PTR_DEVICE || s->b->pointer_kind(last) != PM__PTR_DEVICE)
      return pm__set_error(PM_ERR_INVALID,
                           "%s: region %d [%p, %p] is not device memory (KV tensors must be on "
                           "the device)",
                           fn, r, g->base, (const void *)last);
    /* Another device's memory would be read by this device's kernel (an illegal address
     * without peer access) or copied through the wrong engine. Managed memory answers -1. */
    int other = pm__backend_other_device(s->b, g->base, last, s->device);
    if (other >= 0)
      return pm__set_error(PM_ERR_INVALID,
                           "%s: region %d [%p, %p] is memory of device %d, the store serves "
                           "device %d",
                           fn, r, g->base, (const void *)last, other, s->device);
  }
  if (sum != s->block_bytes)
    return pm__set_error(PM_ERR_INVALID,
                         "%s: the layout's regions hold %zu bytes of a block, the store's blocks "
                         "are %zu bytes",
                         fn, sum, s->block_bytes);
  return PM_OK;
}

/* Ids in range, host blocks allocated, destination ids distinct. *max_host gets the largest
 * host id. */
static pm_status_t check_ids(pm_blocks_t *s, const pm_kv_layout_t *L, const uint64_t *dev_ids,
                             const uint64_t *host_ids, size_t count, bool out, const char *fn,
                             uint64_t *max_host) {
  uint64_t mh = 0;
  for (size_t i = 0; i < count; i++) {
    if (dev_ids[i] >= L->device_blocks)
      return pm__set_error(PM_ERR_INVALID,
                           "%s: device_ids[%zu] = %llu is not a device block (the KV tensors "
                           "have %llu)",
                           fn, i, (unsigned long long)dev_ids[i],
                           (unsigned long long)L->device_blocks);
    if (host_ids[i] >= s->num_blocks)
      return pm__set_error(PM_ERR_INVALID,
                           "%s: host_ids[%zu] = %llu is not a block (the arena has %llu)", fn, i,
                           (unsigned long long)host_ids[i], (unsigned long long)s->num_blocks);
    mh = PM__MAX(mh, host_ids[i]);
  }
  const uint64_t *dst = out ? host_ids : dev_ids;
  uint64_t range = out ? s->num_blocks : L->device_blocks;
  uint8_t *seen = calloc((size_t)(range + 7) / 8, 1);
  if (!seen) return pm__set_error(PM_ERR_NOMEM, "%s: out of memory", fn);
  pm_status_t st = PM_OK;
  for (size_t i = 0; i < count && st == PM_OK; i++) {
    uint64_t d = dst[i];
    if (seen[d / 8] & (1u << (d % 8))) {
      size_t first = 0;
      while (dst[first] != d) first++;
      st = pm__set_error(PM_ERR_INVALID,
                         "%s: %s[%zu] = %llu is also %s[%zu]: the blocks a swap writes must be "
                         "distinct (overlapping ids in one call)",
                         fn, out ? "host_ids" : "device_ids", i, (unsigned long long)d,
                         out ? "host_ids" : "device_ids", first);
    }
    seen[d / 8] |= (uint8_t)(1u << (d % 8));
  }
  free(seen);
  if (st != PM_OK) return st;
  pthread_mutex_lock(&s->lock);
  size_t bad = count;
  for (size_t i = 0; i < count && bad == count; i++)
    if (st_base(s->state[host_ids[i]]) != ST_ALLOC) bad = i;
  pthread_mutex_unlock(&s->lock);
  if (bad < count)
    return pm__set_error(PM_ERR_INVALID,
                         "%s: host_ids[%zu] = %llu is not allocated (pm_blocks_alloc)", fn, bad,
                         (unsigned long long)host_ids[bad]);
  *max_host = mh;
  return PM_OK;
}

typedef struct blk_lists {
  void **dsts;
  const void **srcs;
  size_t *sizes;
  size_t n;
  pm__copy_desc_t *desc;
  size_t desc_cap;
  int last_region;     /* of the last piece: what a following piece may extend */
  uint64_t last_chunk;
} blk_lists_t;

static pm_status_t swap(pm_blocks_t *s, const pm_kv_layout_t *L, const uint64_t *dev_ids,
                        const uint64_t *host_ids, size_t count, pm_stream_t stream,
                        pm_event_t *event_out, bool out, const char *fn) {
  pm_status_t st = pm__handle_check(s, PM__HANDLE_BLOCKS, fn);
  if (st != PM_OK) return st;
  st = check_layout(s, L, fn);
  if (st != PM_OK) return st;
  if (count && (!dev_ids || !host_ids))
    return pm__set_error(PM_ERR_INVALID, "%s: device_ids and host_ids are required", fn);
  uint64_t max_host = 0;
  if (count) {
    st = check_ids(s, L, dev_ids, host_ids, count, out, fn, &max_host);
    if (st != PM_OK) return st;
    st = wait_chunk(s, chunk_of(s, max_host), fn);
    if (st != PM_OK) return st;
  }
  const pm__backend_t *b = s->b;
  int prev;
  st = enter_device(s, &prev, fn);
  if (st != PM_OK) return st;
  /* Another device's stream would get this device's kernel, copies and event: the driver
   * refuses the launch or the record part way, after earlier pieces were queued. Refused
   * before anything is (NULL is the store's device's default stream, now current). */
  int sdev = pm__backend_stream_other_device(b, stream, s->device);
  if (sdev >= 0) {
    leave_device(s, prev);
    return pm__set_error(PM_ERR_INVALID,
                         "%s: the stream %p is a stream of device %d, the store serves device %d",
                         fn, (void *)stream, sdev, s->device);
  }
  size_t cut = kernel_max(s, s->device, NULL);
  blk_lists_t k = {0}, d = {0};
  uint64_t seq = 0; /* 0: no record (nothing named) */
  /* Lists for at most BLK__BATCH pieces: a larger call goes to the backend in parts. */
  size_t pieces = count * (size_t)L->nregions;
  size_t cap = PM__MAX((size_t)1, PM__MIN(BLK__BATCH, pieces));
  k.dsts = malloc(cap * sizeof *k.dsts);
  k.srcs = malloc(cap * sizeof *k.srcs);
  k.sizes = malloc(cap * sizeof *k.sizes);
  k.desc_cap = cap;
  k.desc = malloc(k.desc_cap * sizeof *k.desc);
  d.dsts = malloc(cap * sizeof *d.dsts);
  d.srcs = malloc(cap * sizeof *d.srcs);
  d.sizes = malloc(cap * sizeof *d.sizes);
  if (!k.dsts || !k.srcs || !k.sizes || !k.desc || !d.dsts || !d.srcs || !d.sizes) {
    st = pm__set_error(PM_ERR_NOMEM, "%s: out of memory for the piece lists", fn);
    goto done;
  }
  /* From here the swap has a seq (its blocks name it): end_swap below ends its record. */
  if (count) {
    st = begin_swap(s, host_ids, count, stream, fn, &seq);
    if (st != PM_OK) goto done;
  }
  uint64_t nk = 0, nd = 0, ntr = 0;
  pm_copy_kind_t kind = out ? PM_COPY_D2H : PM_COPY_H2D;
  for (size_t i = 0; i < count && st == PM_OK; i++) {
    char *host = block_addr(s, host_ids[i]);
    size_t off = 0;
    for (int r = 0; r < L->nregions && st == PM_OK; r++) {
      const pm_kv_region_t *g = &L->regions[r];
      char *dev = (char *)g->base + (size_t)dev_ids[i] * g->block_stride;
      bool small = g->bytes <= cut;
      blk_lists_t *l = small ? &k : &d;
      char *dst = out ? host + off : dev;
      const char *src = out ? dev : host + off;
      off += g->bytes;
      *(small ? &nk : &nd) += 1;
      /* A piece that continues the previous one on both sides (a one-region layout, ids
       * consecutive on both sides, pages without padding) extends it: fewer, larger DMAs and
       * descriptors, the same bytes. Only within one region (one device tensor) and one host
       * chunk (one registration): a DMA never spans two allocations that happen to touch. */
      uint64_t chunk = chunk_of(s, host_ids[i]);
      if (l->n && l->last_region == r && l->last_chunk == chunk &&
          (char *)l->dsts[l->n - 1] + l->sizes[l->n - 1] == dst &&
          (const char *)l->srcs[l->n - 1] + l->sizes[l->n - 1] == src) {
        l->sizes[l->n - 1] += g->bytes;
        continue;
      }
      l->last_region = r;
      l->last_chunk = chunk;
      if (l->n == cap) {
        st = small ? queue_kernel(b, k.dsts, k.srcs, k.sizes, k.n, stream, k.desc, k.desc_cap)
                   : queue_dma(b, d.dsts, d.srcs, d.sizes, d.n, kind, stream);
        l->n = 0;
        if (st != PM_OK) break;
      }
      ntr++;
      l->dsts[l->n] = dst;
      l->srcs[l->n] = src;
      l->sizes[l->n] = g->bytes;
      l->n++;
    }
  }
  if (st == PM_OK && k.n) st = queue_kernel(b, k.dsts, k.srcs, k.sizes, k.n, stream, k.desc,
                                            k.desc_cap);
  if (st == PM_OK && d.n) st = queue_dma(b, d.dsts, d.srcs, d.sizes, d.n, kind, stream);
  if (st != PM_OK)
    st = pm__wrap_error(st, "%s: queueing %zu blocks (what was queued before the failure still "
                            "runs on the stream)", fn, count);
  /* The record's event goes before the caller's: once the caller's completed, so did the
   * record's, and a free after waiting on it finds the blocks idle (no wait in alloc). */
  if (seq) {
    /* A failed swap keeps its own error; a swap that went well reports a failed tracking. */
    char why[512];
    pm_status_t failed = st;
    if (failed != PM_OK) snprintf(why, sizeof why, "%s", pm_last_error());
    pm_status_t e = end_swap(s, seq, stream, fn);
    if (failed != PM_OK)
      pm__set_error(failed, "%s", why);
    else
      st = e;
  }
  if (st != PM_OK) goto done;
  if (event_out) {
    pm_event_t ev = NULL;
    st = b->event_create(PM_EVENT_DEFAULT, &ev);
    if (st == PM_OK) {
      st = b->event_record(ev, stream);
      if (st != PM_OK) (void)b->event_destroy(ev);
    }
    if (st != PM_OK) {
      st = pm__wrap_error(st, "%s: the call's event", fn);
      goto done;
    }
    *event_out = ev;
  }
  atomic_fetch_add(out ? &s->swaps_out : &s->swaps_in, 1);
  atomic_fetch_add(out ? &s->blocks_out : &s->blocks_in, count);
  atomic_fetch_add(out ? &s->bytes_out : &s->bytes_in, (uint64_t)count * s->block_bytes);
  atomic_fetch_add(&s->pieces_kernel, nk);
  atomic_fetch_add(&s->pieces_dma, nd);
  atomic_fetch_add(&s->transfers, ntr);
done:
  leave_device(s, prev);
  free(k.dsts);
  free(k.srcs);
  free(k.sizes);
  free(k.desc);
  free(d.dsts);
  free(d.srcs);
  free(d.sizes);
  return st;
}

pm_status_t pm_blocks_swap_out(pm_blocks_t *blocks, const pm_kv_layout_t *layout,
                               const uint64_t *device_ids, const uint64_t *host_ids, size_t count,
                               pm_stream_t stream, pm_event_t *event_out) {
  return swap(blocks, layout, device_ids, host_ids, count, stream, event_out, true,
              "pm_blocks_swap_out");
}

pm_status_t pm_blocks_swap_in(pm_blocks_t *blocks, const pm_kv_layout_t *layout,
                              const uint64_t *device_ids, const uint64_t *host_ids, size_t count,
                              pm_stream_t stream, pm_event_t *event_out) {
  return swap(blocks, layout, device_ids, host_ids, count, stream, event_out, false,
              "pm_blocks_swap_in");
}
