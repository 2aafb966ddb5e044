/*
 * DESIGN: staging of pageable host memory through pinned bounce memory (PM_PATH_STAGED).
 *
 * The CUDA driver stages a pageable copy through one small pinned buffer with one thread, so it
 * runs at a fraction of the link. Here a copy (or a batch of pieces, packed back to back) is cut
 * into units of at most copy_chunk bytes and several threads move the units through pinned
 * bounce memory while the DMA engine drains the units already staged.
 *
 * Bounce memory, by copy_bounce. The ring (ring; auto, the default, on an idle stream): up to
 * copy_slots chunk-sized blocks that stay in the caches and overlap a D2H copy's DMA with its
 * copy-out. The whole block (whole; auto behind queued work): one pool block as large as the
 * copy. The pool caches it, so repeated copies pin nothing, and its reuse is gated by the stream
 * (pm__pool_record_stream), so the call never waits for the stream. When the budget refuses the
 * whole block the ring is used instead. A ring slot is reused only after the event of its last
 * DMA completed (never a wait after every chunk). The ring makes the call wait for the stream
 * (see "What each path blocks on" in copy.c). The bytes move by copy_memcpy's mover (memcpy.c).
 *
 * Work distribution: pm__parallel_for starts `threads` tasks (the caller is one); each task
 * claims units from an atomic counter, so units are claimed in ascending order. That order is
 * what makes the ring deadlock-free: unit i waits only for unit i - slots, which was claimed
 * earlier by a task that is running it.
 *
 * H2D: claim a unit, memcpy it into bounce memory, queue its DMA at once. The DMAs of one copy
 * may be queued in any order (they write disjoint bytes); all are queued before the call
 * returns, so the stream's order with earlier and later work is kept. With copy_ramp the first
 * `threads` units grow from chunk / threads to chunk (ramp_units), so the DMA engine starts
 * after a fraction of one chunk's copy instead of idling until the first whole chunk is in.
 * With copy_piece (one-segment copies through the ring) all threads fill each slot in pieces
 * instead, and the slot's last piece queues its DMA (stage_h2d_slab): a ring of a few slots
 * then keeps up, small enough to stay in the cache. Its slots go to groups from a free queue,
 * so a stalled thread holds up one slot, not the ring.
 * D2H (whole bounce): the caller queues every DMA device -> bounce, with a host function after
 * each group of units (at most 32 groups) that counts the group as landed, and returns a job;
 * a completion thread copies units out to the destination with several threads as their
 * groups land (pm__stage_d2h_finish), while copy.c's gate holds the stream behind the DMAs
 * until the copy-out is done (the gate also signals the last group). The copy-out makes no
 * backend call at all: under CUDA a call such as cudaEventQuery can wait behind another
 * thread's synchronizing call (cudaFree), which waits for the gate, which waits for the
 * copy-out: a deadlock seen on the H200 with events here. D2H ring: the copy runs to the end
 * inside the call, with events (no gate waits for it).
 *
 * Invariant: bounce memory is returned to the pool only once no queued DMA can still touch it
 * (stream-recorded free, or after its events or group signals completed); when neither a record
 * nor a wait is possible, the pool quarantines it (never reused). Errors: the first
 * failing step's status and detail are kept (worker threads have their own pm_last_error);
 * later units are skipped but the ring's bookkeeping still advances, so nothing waits forever.
 *
 * Lock order: each ring's mutex (slot generations) and each D2H job's mutex (groups landed)
 * are leaves: no backend, pool or memcpy call is made while one is held.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "copy_internal.h"

#define PM__D2H_MAX_GROUPS 32
#define PM__BOUNCE_ALIGN 64 /* pieces of a packed batch start on their own cache line */

typedef struct unit {
  char *host;
  char *dev;
  size_t bytes;
  size_t boff;    /* offset in the whole-copy bounce block */
  uint32_t group; /* D2H: the group whose landing signal covers this unit */
} unit_t;

/* First error of a parallel step, with the detail text of the thread that hit it. */
typedef struct first_error {
  atomic_int status;
  char msg[512];
} first_error_t;

static void first_error_set(first_error_t *e, pm_status_t st) {
  int expected = PM_OK;
  if (atomic_compare_exchange_strong(&e->status, &expected, (int)st))
    snprintf(e->msg, sizeof e->msg, "%s", pm_last_error());
}

static bool first_error_any(first_error_t *e) {
  return atomic_load_explicit(&e->status, memory_order_relaxed) != PM_OK;
}

/* Re-raise a worker's error on the calling thread (after the parallel step joined). */
static pm_status_t first_error_raise(first_error_t *e) {
  pm_status_t st = (pm_status_t)atomic_load(&e->status);
  if (st != PM_OK) pm__set_error(st, "%s", e->msg);
  return st;
}

/* The sizes of the first units of an H2D copy: `ramp` units growing from chunk / ramp to chunk
 * (multiples of 4 KiB), or 0 when the first segment is too small to be worth it.
 *
 * Why: the threads claim the first units together and copy at the same rate, so with equal
 * units none is ready before all are, and the DMA engine idles for one whole chunk's copy time
 * (about 1 ms for 4 MiB at 16 threads on the H200 machine, some 5% of a 1 GiB copy). Growing
 * first units finish one after another from chunk / ramp on, so the DMA starts almost at once,
 * and the threads stay staggered afterwards. */
static size_t ramp_len(size_t chunk, size_t ramp, size_t k) {
  size_t len = chunk / ramp * (k + 1) & ~(size_t)4095;
  return len ? len : PM__MIN(chunk, (size_t)4096);
}

static size_t ramp_units(const pm__stage_req_t *req, bool ramp) {
  size_t chunk = req->cfg.chunk, r = (size_t)req->cfg.threads;
  if (!ramp || !req->cfg.ramp || r < 2 || req->nsegs == 0 || chunk < r * 4096) return 0;
  size_t sum = 0;
  for (size_t k = 0; k < r; k++) sum += ramp_len(chunk, r, k);
  return req->segs[0].bytes >= 2 * sum + 4 * chunk ? r : 0;
}

/* Cut the segments into units of at most `chunk` bytes, packed into one bounce layout (the first
 * segment starting with the ramp of ramp_units when `ramp`). */
static pm_status_t plan_units(const pm__stage_req_t *req, bool ramp, unit_t **units_out,
                              size_t *n_out, size_t *total_out) {
  size_t chunk = req->cfg.chunk, n = 0, r = ramp_units(req, ramp);
  for (size_t s = 0; s < req->nsegs; s++) n += pm__div_up(req->segs[s].bytes, chunk);
  n += r; /* the ramp cuts its bytes into at most r more units */
  if (n == 0) return pm__set_error(PM_ERR_INTERNAL, "staging: empty plan");
  unit_t *u = malloc(n * sizeof *u);
  if (!u) return pm__set_error(PM_ERR_NOMEM, "staging: malloc of %zu units failed", n);
  size_t k = 0, off = 0;
  for (size_t s = 0; s < req->nsegs; s++) {
    const pm__stage_seg_t *seg = &req->segs[s];
    if (seg->bytes == 0) continue;
    off = pm__align_up(off, PM__BOUNCE_ALIGN);
    size_t len;
    for (size_t done = 0; done < seg->bytes; done += len) {
      len = PM__MIN(chunk, seg->bytes - done);
      if (s == 0 && k < r) len = ramp_len(chunk, r, k);
      u[k].host = seg->host + done;
      u[k].dev = seg->dev + done;
      u[k].bytes = len;
      u[k].boff = off + done;
      u[k].group = 0;
      k++;
    }
    off += seg->bytes;
  }
  *units_out = u;
  *n_out = k;
  *total_out = off;
  return PM_OK;
}

/* One bounce block for the whole copy. PM_ERR_BUDGET (detail kept) means: use the ring. */
static pm_status_t whole_bounce(const pm__stage_req_t *req, size_t total, char **bounce_out) {
  pm_pool_stats_t stats;
  /* A block larger than the whole budget can never come: skip the attempt (and, with the wait
   * policy, its timeout). */
  if (pm_pool_get_stats(req->pool, &stats) == PM_OK && stats.budget &&
      pm__size_class(total) > stats.budget)
    return pm__set_error(PM_ERR_BUDGET, "staging: a %zu-byte bounce block exceeds the budget (%zu)",
                         total, stats.budget);
  void *p = NULL;
  pm_status_t st = pm_host_alloc(req->pool, total, PM_HOST_DEFAULT, &p);
  if (st != PM_OK) return st;
  *bounce_out = p;
  return PM_OK;
}

/* Return bounce memory whose DMAs were queued on `stream` and may still be running. The pool
 * gates its reuse on the stream; without that record (no memory left for it) the stream is
 * waited for, when `may_wait`; failing that too, the pool quarantines the block: never handed
 * out again, released when the pool is destroyed, after a device synchronize. */
static void free_after_stream(pm_pool_t *pool, void *p, pm_stream_t stream, bool may_wait) {
  if (pm__pool_record_stream(pool, p, stream) != PM_OK &&
      (!may_wait || pm__cb_stream_synchronize(stream) != PM_OK)) {
    (void)pm__pool_quarantine(pool, p);
    return;
  }
  (void)pm__pool_free(pool, p);
}

/* ---- ring of chunk-sized bounce slots ------------------------------------------------------ */

typedef struct ring {
  pm_pool_t *pool; /* the bounce slots' pool */
  int n;
  char **slot;
  pm_event_t *ev;
  long long *gen; /* the last unit that used the slot (initially slot - n) */
  pthread_mutex_t mu;
  pthread_cond_t cv;
} ring_t;

static void ring_destroy(ring_t *r, pm_stream_t stream, bool dmas_may_run) {
  for (int s = 0; s < r->n; s++) {
    if (r->slot && r->slot[s]) {
      if (dmas_may_run)
        free_after_stream(r->pool, r->slot[s], stream, true);
      else
        (void)pm__pool_free(r->pool, r->slot[s]);
    }
    if (r->ev && r->ev[s]) pm__copy_reap_event(r->ev[s]);
  }
  free(r->slot);
  free(r->ev);
  free(r->gen);
  pthread_mutex_destroy(&r->mu);
  pthread_cond_destroy(&r->cv);
}

static pm_status_t ring_create(const pm__stage_req_t *req, int slots, size_t nunits, ring_t *r) {
  /* A slot holds one unit (or one slab group): at most a chunk, and no more than the largest
   * segment, so a small copy under a small budget needs no slot of a whole copy_chunk. */
  size_t largest = 0;
  for (size_t s = 0; s < req->nsegs; s++) largest = PM__MAX(largest, req->segs[s].bytes);
  size_t chunk = PM__MIN(req->cfg.chunk, pm__align_up(PM__MAX(largest, (size_t)1), 4096));
  size_t want = PM__MIN((size_t)slots, nunits);
  pm_pool_stats_t stats;
  if (pm_pool_get_stats(req->pool, &stats) == PM_OK && stats.budget) {
    size_t fit = stats.budget / pm__size_class(chunk);
    if (fit == 0)
      return pm__set_error(PM_ERR_BUDGET,
                           "staging: the pool budget (%zu bytes) cannot hold one %zu-byte bounce "
                           "slot; lower copy_chunk or raise the budget",
                           stats.budget, chunk);
    want = PM__MIN(want, fit);
  }
  memset(r, 0, sizeof *r);
  r->pool = req->pool;
  pthread_mutex_init(&r->mu, NULL);
  pthread_cond_init(&r->cv, NULL);
  r->slot = calloc(want, sizeof *r->slot);
  r->ev = calloc(want, sizeof *r->ev);
  r->gen = calloc(want, sizeof *r->gen);
  if (!r->slot || !r->ev || !r->gen) {
    ring_destroy(r, NULL, false);
    return pm__set_error(PM_ERR_NOMEM, "staging: malloc of a %zu-slot ring failed", want);
  }
  size_t got = 0;
  for (; got < want; got++) {
    void *p = NULL;
    pm_status_t st = pm_host_alloc(req->pool, chunk, PM_HOST_DEFAULT, &p);
    if (st == PM_ERR_BUDGET && got > 0) break; /* fewer slots: slower, still correct */
    if (st != PM_OK) {
      r->n = (int)got;
      char msg[512];
      snprintf(msg, sizeof msg, "%s", pm_last_error());
      ring_destroy(r, NULL, false);
      return pm__set_error(st, "staging: bounce slot %zu of %zu bytes: %s", got, chunk, msg);
    }
    r->slot[got] = p;
  }
  r->n = (int)got;
  for (int s = 0; s < r->n; s++) {
    pm_status_t st = pm__cb_event_create(PM_EVENT_DEFAULT, &r->ev[s]);
    if (st != PM_OK) {
      char msg[512];
      snprintf(msg, sizeof msg, "%s", pm_last_error());
      ring_destroy(r, NULL, false);
      return pm__set_error(st, "staging: event for ring slot: %s", msg);
    }
    r->gen[s] = (long long)s - r->n;
  }
  return PM_OK;
}

static void ring_wait_turn(ring_t *r, int s, long long unit) {
  pthread_mutex_lock(&r->mu);
  while (r->gen[s] != unit - r->n) pthread_cond_wait(&r->cv, &r->mu);
  pthread_mutex_unlock(&r->mu);
}

static void ring_done_turn(ring_t *r, int s, long long unit) {
  pthread_mutex_lock(&r->mu);
  r->gen[s] = unit;
  pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->mu);
}

/* ---- H2D ------------------------------------------------------------------------------------ */

/* One parallel staging step (H2D whole or ring, D2H ring): its units, the next to claim, where
 * the bytes go, and the first error. */
typedef struct stage_ctx {
  const unit_t *u;
  size_t n;
  atomic_size_t next;
  char *bounce; /* H2D whole-copy mode */
  ring_t *ring; /* ring mode */
  pm_stream_t stream;
  int mover;
  first_error_t err;
} stage_ctx_t;

static void stage_ctx_init(stage_ctx_t *c, const pm__stage_req_t *req, const unit_t *u, size_t n) {
  memset(c, 0, sizeof *c);
  c->u = u;
  c->n = n;
  atomic_init(&c->next, 0);
  atomic_init(&c->err.status, PM_OK);
  c->stream = req->stream;
}

static void h2d_whole_task(void *vctx, size_t task) {
  stage_ctx_t *c = vctx;
  (void)task;
  for (;;) {
    size_t i = atomic_fetch_add_explicit(&c->next, 1, memory_order_relaxed);
    if (i >= c->n) return;
    if (first_error_any(&c->err)) continue;
    const unit_t *u = &c->u[i];
    pm__memcpy_mode(c->bounce + u->boff, u->host, u->bytes, c->mover);
    pm_status_t st =
        pm__cb_memcpy_async(u->dev, c->bounce + u->boff, u->bytes, PM_COPY_H2D, c->stream);
    if (st != PM_OK) first_error_set(&c->err, st);
  }
}

/* Unit i goes to slot i % n in turn (ring_wait_turn), so the ring's units run in claim order;
 * `step` moves one unit through its slot. After an error the turns still advance. */
static void ring_run(stage_ctx_t *c, pm_status_t (*step)(stage_ctx_t *c, size_t i, int s)) {
  ring_t *r = c->ring;
  for (;;) {
    size_t i = atomic_fetch_add_explicit(&c->next, 1, memory_order_relaxed);
    if (i >= c->n) return;
    int s = (int)(i % (size_t)r->n);
    ring_wait_turn(r, s, (long long)i);
    if (!first_error_any(&c->err)) {
      pm_status_t st = step(c, i, s);
      if (st != PM_OK) first_error_set(&c->err, st);
    }
    ring_done_turn(r, s, (long long)i);
  }
}

static pm_status_t h2d_ring_step(stage_ctx_t *c, size_t i, int s) {
  ring_t *r = c->ring;
  pm_status_t st = PM_OK;
  if (i >= (size_t)r->n) st = pm__copy_wait_event(r->ev[s], 50); /* the slot's last DMA */
  if (st == PM_OK) {
    const unit_t *u = &c->u[i];
    pm__memcpy_mode(r->slot[s], u->host, u->bytes, c->mover);
    st = pm__cb_memcpy_async(u->dev, r->slot[s], u->bytes, PM_COPY_H2D, c->stream);
    if (st == PM_OK) st = pm__cb_event_record(r->ev[s], c->stream);
  }
  return st;
}

static void h2d_ring_task(void *vctx, size_t task) {
  (void)task;
  ring_run(vctx, h2d_ring_step);
}

/* ---- H2D through slots filled in pieces (copy_piece) ---------------------------------------- */

/* Group g of the copy is bytes [g * chunk, (g + 1) * chunk) of its one segment. Its pieces are
 * units g * per .. g * per + per - 1 of one counter that all threads claim from, so a group
 * fills at the threads' combined rate; the thread that finishes a group's last piece queues the
 * group's DMA, records the slot's event and returns the slot to the free queue. The ring stays
 * small enough for the cache, so the DMA engine reads the bytes from there instead of a second
 * pass through DRAM (with a cache-keeping mover: copy_memcpy movsb or auto).
 *
 * Slots are handed to groups in group order from a FIFO of free slots, not by g % n: a thread
 * that stalls inside a piece (descheduled, or on a slow vCPU) then holds up only its own
 * group's slot and DMA, while the other groups go on through the remaining slots. With a fixed
 * slot per group the whole ring stopped at its next wrap behind such a thread (measured on the
 * H200 machine: single processes fell from 50 to 24-31 GB/s).
 *
 * The thread that takes a slot for its group waits for the slot's last DMA (its event) before
 * publishing it, so no piece writes under a running DMA. Deadlock-free: a piece waits only for
 * its group's slot; slots are handed out in group order, the groups that hold slots have all
 * their pieces claimed by threads that are copying (they wait for nothing), so slots keep
 * coming back. */
void (*pm__stage_piece_hook)(size_t group, size_t piece);

typedef struct slab_ctx {
  const pm__stage_seg_t *seg;
  pm_stream_t stream;
  ring_t *ring;
  size_t chunk, piece, per, units, groups;
  atomic_size_t next;
  atomic_size_t *filled; /* per slot: pieces of its current group finished */
  int mover;
  first_error_t err;
  /* Under ring->mu: */
  int *gslot;        /* per group: its slot, -1 none yet, -2 being handed over */
  size_t assign;     /* the lowest group without a slot */
  int *freeq;        /* FIFO of free slots (ring->n entries) */
  int fhead, fcount; /* its head and length */
  bool *recorded;    /* the slot's event was recorded (a DMA may still read the slot) */
} slab_ctx_t;

/* The slot of group g, taking one from the free queue when it is g's turn. */
static int slab_slot(slab_ctx_t *c, size_t g) {
  ring_t *r = c->ring;
  pthread_mutex_lock(&r->mu);
  for (;;) {
    int s = c->gslot[g];
    if (s >= 0) break;
    if (s == -1 && c->assign == g && c->fcount > 0) {
      s = c->freeq[c->fhead];
      c->fhead = (c->fhead + 1) % r->n;
      c->fcount--;
      c->gslot[g] = -2;
      c->assign++;
      bool wait = c->recorded[s];
      pthread_mutex_unlock(&r->mu);
      /* The slot's last DMA must be done before any piece of g writes into it. */
      pm_status_t st = wait ? pm__copy_wait_event(r->ev[s], 50) : PM_OK;
      if (st != PM_OK) first_error_set(&c->err, st);
      pthread_mutex_lock(&r->mu);
      c->gslot[g] = s;
      pthread_cond_broadcast(&r->cv); /* g's other pieces, and group g + 1 */
      break;
    }
    pthread_cond_wait(&r->cv, &r->mu);
  }
  int s = c->gslot[g];
  pthread_mutex_unlock(&r->mu);
  return s;
}

static void slab_release(slab_ctx_t *c, int s, bool recorded) {
  ring_t *r = c->ring;
  pthread_mutex_lock(&r->mu);
  if (recorded) c->recorded[s] = true;
  c->freeq[(c->fhead + c->fcount) % r->n] = s;
  c->fcount++;
  pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->mu);
}

static void h2d_slab_task(void *vctx, size_t task) {
  slab_ctx_t *c = vctx;
  ring_t *r = c->ring;
  (void)task;
  for (;;) {
    size_t i = atomic_fetch_add_explicit(&c->next, 1, memory_order_relaxed);
    if (i >= c->units) return;
    size_t g = i / c->per, p = i % c->per;
    size_t goff = g * c->chunk, glen = PM__MIN(c->chunk, c->seg->bytes - goff);
    size_t pieces = pm__div_up(glen, c->piece);
    if (p >= pieces) continue; /* the last group is short; its missing pieces are no-ops */
    int s = slab_slot(c, g);
    if (!first_error_any(&c->err)) {
      size_t poff = p * c->piece;
      pm__memcpy_mode(r->slot[s] + poff, c->seg->host + goff + poff,
                      PM__MIN(c->piece, glen - poff), c->mover);
    }
    if (pm__stage_piece_hook) pm__stage_piece_hook(g, p);
    /* Every piece is counted, failed or not, so the group always completes and its slot comes
     * back: nothing waits forever after an error. */
    if (atomic_fetch_add(&c->filled[s], 1) + 1 == pieces) {
      atomic_store(&c->filled[s], 0); /* before the slot is freed: its next group counts afresh */
      bool recorded = false;
      if (!first_error_any(&c->err)) {
        pm_status_t st = pm__cb_memcpy_async(c->seg->dev + goff, r->slot[s], glen, PM_COPY_H2D,
                                         c->stream);
        if (st == PM_OK) st = pm__cb_event_record(r->ev[s], c->stream);
        if (st == PM_OK)
          recorded = true;
        else
          first_error_set(&c->err, st);
      }
      slab_release(c, s, recorded);
    }
  }
}

/* cfg.piece is 0 or below the chunk (pm__copy_cfg). */
static bool slab_eligible(const pm__stage_req_t *req) {
  return req->cfg.piece && req->nsegs == 1 && req->segs[0].bytes > 0;
}

static atomic_ulong g_slab_count;

unsigned long pm__stage_slab_count(void) {
  return atomic_load(&g_slab_count);
}

static pm_status_t stage_h2d_slab(const pm__stage_req_t *req) {
  atomic_fetch_add(&g_slab_count, 1);
  slab_ctx_t c;
  memset(&c, 0, sizeof c);
  c.seg = &req->segs[0];
  c.stream = req->stream;
  c.chunk = req->cfg.chunk;
  c.piece = req->cfg.piece;
  c.per = pm__div_up(c.chunk, c.piece);
  c.groups = pm__div_up(c.seg->bytes, c.chunk);
  c.units = c.groups * c.per;
  atomic_init(&c.next, 0);
  atomic_init(&c.err.status, PM_OK);
  c.mover = pm__memcpy_for(req->cfg.mover, true);
  ring_t ring;
  pm_status_t st = ring_create(req, req->cfg.piece_slots, c.groups, &ring);
  if (st != PM_OK) return st;
  c.ring = &ring;
  c.filled = malloc((size_t)ring.n * sizeof *c.filled);
  c.gslot = malloc(c.groups * sizeof *c.gslot);
  c.freeq = malloc((size_t)ring.n * sizeof *c.freeq);
  c.recorded = calloc((size_t)ring.n, sizeof *c.recorded);
  if (!c.filled || !c.gslot || !c.freeq || !c.recorded) {
    st = pm__set_error(PM_ERR_NOMEM, "staging: malloc of the slab state (%zu groups) failed",
                       c.groups);
  } else {
    for (int s = 0; s < ring.n; s++) {
      atomic_init(&c.filled[s], 0);
      c.freeq[s] = s;
    }
    c.fcount = ring.n;
    for (size_t g = 0; g < c.groups; g++) c.gslot[g] = -1;
    int tasks = (int)PM__MIN((size_t)req->cfg.threads, c.units);
    pm__parallel_for(tasks, (size_t)tasks, h2d_slab_task, &c);
    st = first_error_raise(&c.err);
  }
  ring_destroy(&ring, req->stream, true);
  free(c.filled);
  free(c.gslot);
  free(c.freeq);
  free(c.recorded);
  return st;
}

pm_status_t pm__stage_h2d(const pm__stage_req_t *req, bool *ring_out) {
  unit_t *u = NULL;
  size_t n = 0, total = 0;
  pm_status_t st = plan_units(req, true, &u, &n, &total);
  if (st != PM_OK) return st;

  stage_ctx_t c;
  stage_ctx_init(&c, req, u, n);
  int tasks = (int)PM__MIN((size_t)req->cfg.threads, n);

  char *bounce = NULL;
  /* The ring reuses a few chunk buffers, which stay hot in the TLB and caches, but a slot can
   * only be refilled after its DMA ran, which waits behind the stream's earlier work; a
   * whole-copy block never waits. copy_bounce picks; auto takes the ring on an idle stream. */
  bool ring_first =
      req->cfg.bounce == PM__BOUNCE_RING ||
      (req->cfg.bounce == PM__BOUNCE_AUTO && pm__cb_stream_query(req->stream) == PM_OK);
  if (ring_first)
    st = PM_ERR_BUDGET;
  else
    st = whole_bounce(req, total, &bounce);
  if (st == PM_OK) {
    c.bounce = bounce;
    c.mover = pm__memcpy_for(req->cfg.mover, false);
    pm__parallel_for(tasks, (size_t)tasks, h2d_whole_task, &c);
    st = first_error_raise(&c.err);
    free_after_stream(req->pool, bounce, req->stream, true);
    if (ring_out) *ring_out = false;
  } else if (st == PM_ERR_BUDGET && slab_eligible(req)) {
    st = stage_h2d_slab(req);
    if (ring_out) *ring_out = true;
  } else if (st == PM_ERR_BUDGET) {
    ring_t ring;
    st = ring_create(req, req->cfg.slots, n, &ring);
    if (st == PM_OK) {
      c.ring = &ring;
      c.mover = pm__memcpy_for(req->cfg.mover, true);
      pm__parallel_for(tasks, (size_t)tasks, h2d_ring_task, &c);
      st = first_error_raise(&c.err);
      ring_destroy(&ring, req->stream, true);
      if (ring_out) *ring_out = true;
    }
  }
  free(u);
  return st;
}

/* ---- D2H ------------------------------------------------------------------------------------ */

struct pm__d2h_job {
  pm_pool_t *pool; /* the bounce block's pool */
  unit_t *u;
  size_t n;
  char *bounce;
  int threads;
  int mover;
  pm_stream_t stream;
  atomic_bool discard; /* skip the copy-out still to do (the DMAs' completion is unknown) */
  uint32_t ngroups;
  /* Groups whose DMAs completed, counted by host functions on the stream (no backend call is
   * needed to learn it, see the design note). */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint32_t groups_done; /* under mu */
  atomic_size_t next;
  /* One reference for the owner (finish or abort) and one for each queued group host function,
   * so the job outlives every host function that touches it even when an abort cannot wait for
   * the stream (its synchronize failed). */
  atomic_uint refs;
};

void pm__stage_d2h_discard(pm__d2h_job_t *job) {
  atomic_store(&job->discard, true);
}

static void d2h_job_free(pm__d2h_job_t *job) {
  if (atomic_fetch_sub_explicit(&job->refs, 1, memory_order_acq_rel) != 1) return;
  pthread_mutex_destroy(&job->mu);
  pthread_cond_destroy(&job->cv);
  free(job->u);
  free(job);
}

static void groups_done_set(pm__d2h_job_t *job, uint32_t done) {
  pthread_mutex_lock(&job->mu);
  if (done > job->groups_done) job->groups_done = done;
  pthread_cond_broadcast(&job->cv);
  pthread_mutex_unlock(&job->mu);
}

/* Host function behind each group but the last: those DMAs are complete. */
static void group_done_fn(void *arg) {
  pm__d2h_job_t *job = arg;
  pthread_mutex_lock(&job->mu);
  job->groups_done++;
  pthread_cond_broadcast(&job->cv);
  pthread_mutex_unlock(&job->mu);
  d2h_job_free(job); /* this host function's reference */
}

void pm__stage_d2h_dmas_done(pm__d2h_job_t *job) {
  groups_done_set(job, job->ngroups);
}

static void wait_group(pm__d2h_job_t *job, uint32_t g) {
  pthread_mutex_lock(&job->mu);
  while (job->groups_done <= g) pthread_cond_wait(&job->cv, &job->mu);
  pthread_mutex_unlock(&job->mu);
}

/* The slot's turn came once unit i - n was copied out of it. */
static pm_status_t d2h_ring_step(stage_ctx_t *c, size_t i, int s) {
  ring_t *r = c->ring;
  const unit_t *u = &c->u[i];
  pm_status_t st = pm__cb_memcpy_async(r->slot[s], u->dev, u->bytes, PM_COPY_D2H, c->stream);
  if (st == PM_OK) st = pm__cb_event_record(r->ev[s], c->stream);
  if (st == PM_OK) st = pm__copy_wait_event(r->ev[s], 50);
  if (st == PM_OK) pm__memcpy_mode(u->host, r->slot[s], u->bytes, c->mover);
  return st;
}

static void d2h_ring_task(void *vctx, size_t task) {
  (void)task;
  ring_run(vctx, d2h_ring_step);
}

static pm_status_t d2h_ring(const pm__stage_req_t *req, unit_t *u, size_t n) {
  ring_t ring;
  pm_status_t st = ring_create(req, req->cfg.slots, n, &ring);
  if (st != PM_OK) return st;
  stage_ctx_t c;
  stage_ctx_init(&c, req, u, n);
  c.ring = &ring;
  c.mover = pm__memcpy_for(req->cfg.mover, false); /* D2H: the destination is not read back soon */
  int tasks = (int)PM__MIN((size_t)req->cfg.threads, n);
  pm__parallel_for(tasks, (size_t)tasks, d2h_ring_task, &c);
  st = first_error_raise(&c.err);
  /* On success every DMA was waited for; after a failure some may still be queued. */
  ring_destroy(&ring, req->stream, st != PM_OK);
  return st;
}

pm_status_t pm__stage_d2h_submit(const pm__stage_req_t *req, pm__d2h_job_t **job_out) {
  unit_t *u = NULL;
  size_t n = 0, total = 0;
  pm_status_t st = plan_units(req, false, &u, &n, &total);
  if (st != PM_OK) return st;

  /* copy_bounce=ring (or auto on an idle stream) takes the ring at once: a few chunk buffers
   * that stay in the caches, at the price of a call that returns only once dst holds the bytes.
   * Otherwise the ring is the fallback when the budget refuses a whole-copy block. */
  char *bounce = NULL;
  bool ring_first =
      req->cfg.bounce == PM__BOUNCE_RING ||
      (req->cfg.bounce == PM__BOUNCE_AUTO && pm__cb_stream_query(req->stream) == PM_OK);
  st = ring_first ? PM_ERR_BUDGET : whole_bounce(req, total, &bounce);
  if (st == PM_ERR_BUDGET) {
    st = d2h_ring(req, u, n);
    free(u);
    if (st == PM_OK) *job_out = NULL;
    return st;
  }
  if (st != PM_OK) {
    free(u);
    return st;
  }

  pm__d2h_job_t *job = calloc(1, sizeof *job);
  if (!job) {
    free(u);
    (void)pm__pool_free(req->pool, bounce);
    return pm__set_error(PM_ERR_NOMEM, "staging: malloc of a D2H job failed");
  }
  job->u = u;
  job->n = n;
  job->bounce = bounce;
  job->pool = req->pool;
  job->threads = req->cfg.threads;
  job->stream = req->stream;
  job->mover = pm__memcpy_for(req->cfg.mover, false);
  atomic_init(&job->discard, false);
  pthread_mutex_init(&job->mu, NULL);
  pthread_cond_init(&job->cv, NULL);
  atomic_init(&job->next, 0);
  atomic_init(&job->refs, 1);

  /* Units are grouped, one signal per group: at most PM__D2H_MAX_GROUPS per copy, because each
   * host function briefly stalls the stream. */
  size_t gbytes = PM__MAX(req->cfg.chunk, (total + PM__D2H_MAX_GROUPS - 1) / PM__D2H_MAX_GROUPS);
  uint32_t g = 0;
  for (size_t i = 0; i < n; i++) {
    if (i > 0 && u[i].boff / gbytes != u[i - 1].boff / gbytes) g++;
    u[i].group = g;
  }
  job->ngroups = g + 1;

  for (size_t i = 0; i < n; i++) {
    st = pm__cb_memcpy_async(bounce + u[i].boff, u[i].dev, u[i].bytes, PM_COPY_D2H, req->stream);
    /* The last group is signalled by the caller's gate (pm__stage_d2h_dmas_done). */
    if (st == PM_OK && i + 1 < n && u[i + 1].group != u[i].group) {
      atomic_fetch_add_explicit(&job->refs, 1, memory_order_relaxed);
      st = pm__cb_launch_host_func(req->stream, group_done_fn, job);
      if (st != PM_OK) atomic_fetch_sub_explicit(&job->refs, 1, memory_order_relaxed);
    }
    if (st != PM_OK) {
      pm__stage_d2h_abort(job, req->stream);
      return st;
    }
  }
  *job_out = job;
  return PM_OK;
}

void pm__stage_d2h_abort(pm__d2h_job_t *job, pm_stream_t stream) {
  char msg[512];
  snprintf(msg, sizeof msg, "%s", pm_last_error());
  /* Queued DMAs write into the bounce block and queued host functions touch the job: let the
   * stream pass them all before anything is freed. */
  /* If that synchronize fails, the pool keeps the bounce block out of use until the stream
   * passed it (or for good), and the references keep the job alive for its host functions. */
  if (pm__cb_stream_synchronize(stream) == PM_OK)
    (void)pm__pool_free(job->pool, job->bounce);
  else
    free_after_stream(job->pool, job->bounce, stream, false);
  d2h_job_free(job);
  pm__set_error(PM_ERR_INTERNAL, "%s", msg); /* restore the detail; the caller keeps its status */
}

static void d2h_out_task(void *vctx, size_t task) {
  pm__d2h_job_t *job = vctx;
  (void)task;
  for (;;) {
    size_t i = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed);
    if (i >= job->n) return;
    const unit_t *u = &job->u[i];
    wait_group(job, u->group);
    if (atomic_load_explicit(&job->discard, memory_order_relaxed)) return;
    pm__memcpy_mode(u->host, job->bounce + u->boff, u->bytes, job->mover);
  }
}

pm_status_t pm__stage_d2h_finish(pm__d2h_job_t *job, char *msg, size_t msg_len) {
  /* No backend call in here: a stream gate may be waiting for this work, and a backend call
   * could wait behind a synchronizing call (cudaFree) that waits for the gate. Progress comes
   * from the host functions behind each group and from the gate. */
  (void)msg;
  (void)msg_len;
  /* Wait for the first group alone, so the copy-out threads are not all parked on a stream that
   * still runs earlier work; later groups follow at link speed. */
  wait_group(job, 0);
  if (!atomic_load(&job->discard)) {
    int tasks = (int)PM__MIN((size_t)job->threads, job->n);
    pm__parallel_for(tasks, (size_t)tasks, d2h_out_task, job);
  }
  /* Every DMA into the bounce block is over before it goes back to the pool (and every host
   * function that touches the job has run). */
  wait_group(job, job->ngroups - 1);
  /* Discarded: the stream could not be waited for, so DMAs may still write into the block; the
   * pool keeps it out of use until the stream passed them, or for good (no backend call here). */
  if (atomic_load(&job->discard))
    free_after_stream(job->pool, job->bounce, job->stream, false);
  else
    (void)pm__pool_free(job->pool, job->bounce);
  d2h_job_free(job);
  return PM_OK;
}
