/* The KV block store (pm_blocks_*) under several threads at once, against a byte model: each
 * thread owns a range of device blocks and the host blocks it allocated, and does random allocs,
 * swap_outs, swap_ins and frees on its own streams, a stream all threads share, and two streams
 * on the same blocks (ordered by stream_wait_event, as a caller must). Host blocks are freed
 * right after a swap that still uses them is queued, some of those swaps held on their stream
 * by a gate (under CUDA by a busy kernel: see do_swap), so other threads' allocs run while freed
 * blocks are still read or written. Every device and host block holds a pattern of a (block,
 * generation) tag: once a thread has waited for a swap, the blocks it wrote must hold exactly
 * the tag the model says, so a block handed to a second owner while the first one's swap still
 * ran shows up as wrong bytes. Besides:
 * - a block named by a swap held by a closed gate is never handed out (checked at each alloc:
 *   such a swap cannot have completed, whatever the timing; host backend);
 * - the fault table makes the store's event_query fail (a swap whose completion cannot be
 *   known: its blocks are quarantined, alloc fails naming it when only they would do, other
 *   blocks keep working)
 *   or event_record fail (the store synchronizes the stream instead);
 * - the store is closed with swaps in flight and blocks freed while they run;
 * - pm_blocks_get_stats' free_blocks, and pm_blocks_get_free's idle, waiting and quarantined
 *   blocks, never count a block a thread owns; at the end the last three add up to the arena.
 * Regions have odd sizes and padded strides; the padding must stay untouched.
 * Verdicts do not depend on timing: every check is of data after waiting for events, or of
 * something that holds whatever the interleaving.
 * Arguments (for longer sweeps): first seed, number of seeds, operations per thread. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "internal.h"

#define MAXT 4        /* threads */
#define DEVB 8        /* device blocks per thread */
#define NREG 3        /* regions */
#define MAXH 48       /* host blocks, at most */
#define MAXP 24       /* pending swaps per thread */
#define MAXK 4        /* blocks per call */
#define MAXGATES 2    /* closed gates per thread */
#define PAD_BYTE 0xA5 /* the regions' padding */

enum { FAULT_NONE, FAULT_QUERY, FAULT_RECORD, FAULT_MODES };

typedef struct world {
  pm_blocks_t *s;
  pm_kv_region_t regions[NREG];
  pm_kv_layout_t layout;
  char *dev[NREG];
  size_t dev_bytes[NREG];
  size_t block_bytes;
  int nthreads;
  uint64_t nhost;
  int fault;
  pm_stream_t shared;
  atomic_int owner[MAXH];       /* -1: not owned by a thread */
  atomic_int gated[MAXH];       /* swaps naming the block held behind a closed gate */
  bool busy_holds;              /* swaps held by busy kernels, not gates (the cuda backend) */
  atomic_int failures;          /* model violations (printed where found) */
  atomic_int broken_allocs;     /* allocs refused for a swap whose completion cannot be known */
  atomic_bool freed_busy[MAXH]; /* freed while a swap named it: its next alloc is a reuse */
  atomic_int reuses;            /* blocks handed out again after such a free */
} world_t;

typedef struct pend {
  pm_event_t ev;
  pm_stream_t stream;
  bool in;
  int n;
  uint64_t dev[MAXK], host[MAXK];
  pm_test_gate_t *gate; /* held behind it; NULL when none */
  bool opened;
} pend_t;

typedef struct thr {
  world_t *w;
  int id;
  uint64_t rng;
  int ops;
  pm_stream_t own[2];
  uint64_t dev_tag[DEVB];  /* what device block i holds once its pending swaps completed */
  int dev_busy[DEVB];      /* pending swaps naming it */
  uint64_t host_tag[MAXH]; /* of owned host blocks; 0: unknown */
  int host_busy[MAXH];     /* pending swaps naming it (owned or not) */
  uint64_t owned[MAXH];
  int nowned;
  pend_t pend[MAXP];
  int npend;
  int ngates;
  bool no_gates; /* the last swaps, left in flight for the close, are not held */
  uint64_t tag_next;
} thr_t;

#define FAIL(t, ...)                                         \
  do {                                                       \
    atomic_fetch_add(&(t)->w->failures, 1);                  \
    fprintf(stderr, "thread %d: ", (t)->id);                 \
    fprintf(stderr, __VA_ARGS__);                            \
    fprintf(stderr, " (last error: %s)\n", pm_last_error()); \
  } while (0)

static uint64_t rnd(thr_t *t, uint64_t n) {
  return pm_test_rand(&t->rng) % n;
}

/* The byte at offset off of region r of a block that holds tag. */
static uint8_t pat(uint64_t tag, int r, size_t off) {
  uint64_t x = tag * 0x9E3779B97F4A7C15ull + (uint64_t)r * 0xBF58476D1CE4E5B9ull + off / 8;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 29;
  return (uint8_t)(x >> (8 * (off % 8)));
}

static size_t reg_max(const world_t *w) {
  size_t m = 0;
  for (int r = 0; r < NREG; r++) m = PM__MAX(m, w->regions[r].bytes);
  return m;
}

static char *dev_at(const world_t *w, int r, uint64_t d) {
  return w->dev[r] + (size_t)d * w->regions[r].block_stride;
}

static uint64_t gdev(const thr_t *t, int i) {
  return (uint64_t)t->id * DEVB + (uint64_t)i;
}

/* Device block i of thread t gets a new tag (no pending swap names it). */
static void dev_fill(thr_t *t, int i) {
  world_t *w = t->w;
  uint64_t tag = ((uint64_t)(t->id + 1) << 40) | t->tag_next++;
  uint8_t *buf = malloc(reg_max(w));
  for (int r = 0; r < NREG; r++) {
    for (size_t o = 0; o < w->regions[r].bytes; o++) buf[o] = pat(tag, r, o);
    if (pm_memcpy(dev_at(w, r, gdev(t, i)), buf, w->regions[r].bytes, PM_COPY_H2D) != PM_OK)
      FAIL(t, "filling device block %d", i);
  }
  free(buf);
  t->dev_tag[i] = tag;
}

static bool dev_holds(thr_t *t, int i, uint64_t tag) {
  world_t *w = t->w;
  uint8_t *buf = malloc(reg_max(w));
  bool ok = true;
  for (int r = 0; r < NREG && ok; r++) {
    if (pm_memcpy(buf, dev_at(w, r, gdev(t, i)), w->regions[r].bytes, PM_COPY_D2H) != PM_OK)
      ok = false;
    for (size_t o = 0; o < w->regions[r].bytes && ok; o++) ok = buf[o] == pat(tag, r, o);
  }
  free(buf);
  return ok;
}

static bool host_holds(world_t *w, uint64_t h, uint64_t tag) {
  uint8_t *p;
  if (pm_blocks_ptr(w->s, h, (void **)&p) != PM_OK) return false;
  size_t off = 0;
  for (int r = 0; r < NREG; r++) {
    for (size_t o = 0; o < w->regions[r].bytes; o++)
      if (p[off + o] != pat(tag, r, o)) return false;
    off += w->regions[r].bytes;
  }
  return true;
}

/* Open a pending swap's gate: the count of closed gates goes down first, so alloc never sees a
 * block whose swap could have run as gated. */
static void open_gate(thr_t *t, pend_t *p) {
  if (!p->gate || p->opened) return;
  p->opened = true;
  for (int j = 0; j < p->n; j++) atomic_fetch_sub(&t->w->gated[p->host[j]], 1);
  pm_test_gate_open(p->gate);
  t->ngates--;
}

/* Before a call that may block (alloc, a wait): nothing of this thread stays held. */
static void open_gates(thr_t *t) {
  for (int i = 0; i < t->npend; i++) open_gate(t, &t->pend[i]);
}

static void verify_quiet(thr_t *t, pend_t *p) {
  for (int j = 0; j < p->n; j++) {
    int i = (int)(p->dev[j] - gdev(t, 0));
    if (p->in && t->dev_busy[i] == 0 && !dev_holds(t, i, t->dev_tag[i]))
      FAIL(t, "device block %llu does not hold what host block %llu was given",
           (unsigned long long)p->dev[j], (unsigned long long)p->host[j]);
    uint64_t h = p->host[j];
    if (!p->in && t->host_busy[h] == 0 && atomic_load(&t->w->owner[h]) == t->id && t->host_tag[h] &&
        !host_holds(t->w, h, t->host_tag[h]))
      FAIL(t, "host block %llu does not hold what was swapped out into it", (unsigned long long)h);
  }
}

/* Wait for pending swap k (its gate opened first) and check what it wrote. */
static void wait_pend(thr_t *t, int k) {
  pend_t p = t->pend[k];
  open_gates(t);
  if (p.ev) {
    /* event_sync faults (fault mode 1) fail a wait now and then: try again. */
    int tries = 0;
    while (pm_event_synchronize(p.ev) != PM_OK && ++tries < 1000) continue;
    if (tries == 1000) FAIL(t, "event_synchronize");
    if (pm_event_destroy(p.ev) != PM_OK) FAIL(t, "event_destroy");
  }
  t->pend[k] = t->pend[--t->npend];
  for (int j = 0; j < p.n; j++) {
    t->dev_busy[p.dev[j] - gdev(t, 0)]--;
    t->host_busy[p.host[j]]--;
  }
  verify_quiet(t, &p);
  if (p.gate) { /* (opened above) the stream passed it: the event came after */
    pm_test_gate_destroy(p.gate);
    free(p.gate);
  }
}

static void wait_all(thr_t *t) {
  while (t->npend) wait_pend(t, 0);
}

/* Queue a swap of n blocks on stream s, after the pending swaps on other streams that name the
 * same blocks (a caller orders its own streams); maybe held behind a gate. */
static void do_swap(thr_t *t, bool in, int n, const int *di, const uint64_t *h, pm_stream_t s) {
  world_t *w = t->w;
  if (t->npend == MAXP) wait_pend(t, 0);
  for (int k = 0; k < t->npend; k++) {
    pend_t *p = &t->pend[k];
    if (p->stream == s || !p->ev) continue;
    /* Only a write orders: two swap_ins may read one host block, two swap_outs one device
     * block, on two streams at once (a free after them waits for both). */
    bool dep = false;
    for (int a = 0; a < p->n && !dep; a++)
      for (int b = 0; b < n && !dep; b++)
        dep = (p->host[a] == h[b] && !(p->in && in)) ||
              (p->dev[a] == gdev(t, di[b]) && (p->in || in));
    if (dep && pm_stream_wait_event(s, p->ev) != PM_OK) FAIL(t, "stream_wait_event");
  }
  pend_t *p = &t->pend[t->npend];
  memset(p, 0, sizeof *p);
  p->stream = s;
  p->in = in;
  p->n = n;
  for (int j = 0; j < n; j++) {
    p->dev[j] = gdev(t, di[j]);
    p->host[j] = h[j];
  }
  if (w->fault != FAULT_RECORD && !t->no_gates && t->ngates < MAXGATES && rnd(t, 4) == 0) {
    if (w->busy_holds) {
      /* Under CUDA a busy kernel holds the stream, not a gate. A host function that waits for
       * a thread of the program stalls the driver's one host-function thread; a thread in a
       * driver call (a pageable copy) can then wait for it while holding a lock that another
       * thread's cuEventCreate waits for, and that thread holds the gate: a deadlock of the
       * test, not of the store. The kernel ends by itself, so no swap is known to be still in
       * flight and the gated check has nothing to check; the byte model still catches a block
       * handed out while a swap used it. */
      if (pm_launch_busy(s, 0.0005 * (double)(1 + rnd(t, 4))) != PM_OK) FAIL(t, "launch busy");
    } else {
      p->gate = malloc(sizeof *p->gate);
      pm_test_gate_init(p->gate);
      for (int j = 0; j < n; j++) atomic_fetch_add(&w->gated[h[j]], 1);
      t->ngates++;
      if (pm_launch_host_func(s, pm_test_gate_wait, p->gate) != PM_OK) FAIL(t, "launch gate");
    }
  }
  pm_status_t st = in ? pm_blocks_swap_in(w->s, &w->layout, p->dev, h, (size_t)n, s, &p->ev)
                      : pm_blocks_swap_out(w->s, &w->layout, p->dev, h, (size_t)n, s, &p->ev);
  if (st != PM_OK) {
    /* Only the caller's own event may fail (event_record faults): the copies were queued. */
    if (w->fault != FAULT_RECORD || !strstr(pm_last_error(), "the call's event"))
      FAIL(t, "swap_%s of %d blocks failed", in ? "in" : "out", n);
    p->ev = NULL;
  }
  for (int j = 0; j < n; j++) {
    t->dev_busy[di[j]]++;
    t->host_busy[h[j]]++;
    if (in)
      t->dev_tag[di[j]] = t->host_tag[h[j]];
    else
      t->host_tag[h[j]] = t->dev_tag[di[j]];
  }
  t->npend++;
  if (!p->ev) { /* no event to wait for: the stream is */
    open_gates(t);
    if (pm_stream_synchronize(s) != PM_OK) FAIL(t, "stream_synchronize");
    wait_pend(t, t->npend - 1);
  }
}

static pm_stream_t pick_stream(thr_t *t) {
  uint64_t r = rnd(t, 10);
  if (r < 4) return t->own[0];
  if (r < 7) return t->own[1];
  return t->w->shared;
}

/* n distinct owned host blocks, known contents only when `known`; fewer if there are not. */
static int pick_owned(thr_t *t, int n, bool known, uint64_t *out) {
  uint64_t cand[MAXH];
  int nc = 0;
  for (int i = 0; i < t->nowned; i++)
    if (!known || t->host_tag[t->owned[i]]) cand[nc++] = t->owned[i];
  int k = 0;
  for (; k < n && nc; k++) {
    int j = (int)rnd(t, (uint64_t)nc);
    out[k] = cand[j];
    cand[j] = cand[--nc];
  }
  return k;
}

static void swap_out_into(thr_t *t, const uint64_t *h, int n) {
  int di[MAXK];
  for (int j = 0; j < n; j++) di[j] = (int)rnd(t, DEVB); /* device ids may repeat going out */
  do_swap(t, false, n, di, h, pick_stream(t));
}

static void op_alloc(thr_t *t) {
  world_t *w = t->w;
  int n = 1 + (int)rnd(t, MAXK);
  if (t->nowned + n > MAXH) return;
  open_gates(t);
  uint64_t ids[MAXK];
  pm_status_t st = pm_blocks_alloc(w->s, (size_t)n, ids);
  if (st == PM_ERR_NOMEM && strstr(pm_last_error(), "the arena is exhausted")) return;
  if (st != PM_OK) {
    if (w->fault == FAULT_QUERY && strstr(pm_last_error(), "completion cannot be known") &&
        strstr(pm_last_error(), "(swap ")) {
      atomic_fetch_add(&w->broken_allocs, 1);
      return;
    }
    FAIL(t, "alloc(%d) failed: %d", n, (int)st);
    return;
  }
  for (int j = 0; j < n; j++) {
    if (ids[j] >= w->nhost) {
      FAIL(t, "alloc gave %llu, not a block", (unsigned long long)ids[j]);
      return;
    }
    int none = -1;
    if (!atomic_compare_exchange_strong(&w->owner[ids[j]], &none, t->id))
      FAIL(t, "alloc gave block %llu, owned by thread %d", (unsigned long long)ids[j], none);
    if (atomic_load(&w->gated[ids[j]]) > 0)
      FAIL(t, "alloc gave block %llu while a swap naming it is held on its stream",
           (unsigned long long)ids[j]);
    if (atomic_exchange(&w->freed_busy[ids[j]], false)) atomic_fetch_add(&w->reuses, 1);
    t->host_tag[ids[j]] = 0;
    t->owned[t->nowned++] = ids[j];
  }
  if (rnd(t, 10) < 7) swap_out_into(t, ids, n); /* the new owner writes them at once */
}

static void op_swap_out(thr_t *t) {
  uint64_t h[MAXK];
  int n = pick_owned(t, 1 + (int)rnd(t, MAXK), false, h);
  if (n) swap_out_into(t, h, n);
}

static void op_swap_in(thr_t *t) {
  uint64_t h[MAXK];
  int n = pick_owned(t, 1 + (int)rnd(t, MAXK), true, h);
  if (!n) return;
  int di[MAXK], perm[DEVB];
  for (int i = 0; i < DEVB; i++) perm[i] = i;
  for (int j = 0; j < n; j++) { /* distinct: a swap_in writes them */
    int k = j + (int)rnd(t, (uint64_t)(DEVB - j));
    int x = perm[j];
    perm[j] = perm[k];
    perm[k] = x;
    di[j] = perm[j];
  }
  do_swap(t, true, n, di, h, pick_stream(t));
}

/* Free owned blocks, most often ones a pending swap still names, without waiting. */
static void op_free(thr_t *t) {
  world_t *w = t->w;
  uint64_t h[MAXK];
  int n = pick_owned(t, 1 + (int)rnd(t, 3), false, h);
  if (!n) return;
  for (int j = 0; j < n; j++) {
    atomic_store(&w->freed_busy[h[j]], t->host_busy[h[j]] > 0);
    atomic_store(&w->owner[h[j]], -1); /* before the free: the next owner may come at once */
    for (int i = 0; i < t->nowned; i++)
      if (t->owned[i] == h[j]) {
        t->owned[i] = t->owned[--t->nowned];
        break;
      }
    t->host_tag[h[j]] = 0;
  }
  if (pm_blocks_free(w->s, h, (size_t)n) != PM_OK) FAIL(t, "free of %d owned blocks", n);
}

static void op_refill(thr_t *t) {
  int i = (int)rnd(t, DEVB);
  open_gates(t); /* a synchronous copy may wait for streams */
  while (t->dev_busy[i]) wait_pend(t, 0);
  dev_fill(t, i);
}

static void op_stats(thr_t *t) {
  pm_blocks_stats_t st;
  if (pm_blocks_get_stats(t->w->s, &st) != PM_OK) {
    FAIL(t, "get_stats");
    return;
  }
  uint64_t idle = 0, waiting = 0, quar = 0;
  if (pm_blocks_get_free(t->w->s, &idle, &waiting, &quar) != PM_OK) FAIL(t, "get_free");
  /* Whatever the others do, this thread's blocks are not free, waiting or quarantined. */
  uint64_t others = t->w->nhost - (uint64_t)t->nowned;
  if (st.free_blocks > others || idle + waiting + quar > others)
    FAIL(t,
         "free_blocks %llu, idle %llu, waiting %llu, quarantined %llu with %d of %llu blocks "
         "owned here",
         (unsigned long long)st.free_blocks, (unsigned long long)idle, (unsigned long long)waiting,
         (unsigned long long)quar, t->nowned, (unsigned long long)t->w->nhost);
}

static void *thr_main(void *arg) {
  thr_t *t = arg;
  world_t *w = t->w;
  for (int i = 0; i < DEVB; i++) dev_fill(t, i);
  for (int op = 0; op < t->ops; op++) {
    uint64_t r = rnd(t, 100);
    if (r < 22)
      op_alloc(t);
    else if (r < 40)
      op_swap_out(t);
    else if (r < 58)
      op_swap_in(t);
    else if (r < 78)
      op_free(t);
    else if (r < 84)
      op_refill(t);
    else if (r < 90 && t->npend)
      wait_pend(t, (int)rnd(t, (uint64_t)t->npend));
    else if (r < 93)
      op_stats(t);
    else if (r < 96 && t->npend)
      open_gate(t, &t->pend[rnd(t, (uint64_t)t->npend)]);
    else if (r < 98)
      wait_all(t);
    else if (t->npend)
      wait_pend(t, 0);
  }
  /* The end: gates open, the pending swaps checked, then a last swap_in or swap_out left in
   * flight with its blocks freed and its event dropped, for the store's close. */
  wait_all(t);
  for (int i = 0; i < DEVB; i++)
    if (!dev_holds(t, i, t->dev_tag[i])) FAIL(t, "device block %d at the end", i);
  for (int i = 0; i < t->nowned; i++) {
    uint64_t h = t->owned[i];
    if (t->host_tag[h] && !host_holds(w, h, t->host_tag[h]))
      FAIL(t, "host block %llu at the end", (unsigned long long)h);
  }
  t->no_gates = true;
  if (rnd(t, 2))
    op_swap_in(t);
  else
    op_swap_out(t);
  for (int i = 0; i < t->npend; i++) {
    if (t->pend[i].ev && pm_event_destroy(t->pend[i].ev) != PM_OK) FAIL(t, "event_destroy");
    t->pend[i].ev = NULL; /* checked by main once the store is closed (device synchronized) */
  }
  for (int i = 0; i < t->nowned; i++) atomic_store(&w->owner[t->owned[i]], -1);
  if (t->nowned && pm_blocks_free(w->s, t->owned, (size_t)t->nowned) != PM_OK)
    FAIL(t, "free at the end");
  t->nowned = 0;
  return NULL;
}

/* One seed: a store, regions, threads, faults as the seed picks; returns failures. */
static int run_seed(uint64_t seed, int ops, bool quiet) {
  uint64_t rng = seed * 0x2545F4914F6CDD1Dull + 1;
  static world_t w;
  memset(&w, 0, sizeof w);
  w.nthreads = 2 + (int)(pm_test_rand(&rng) % (MAXT - 1));
  w.nhost = 8 + pm_test_rand(&rng) % (MAXH - 8 + 1);
  w.fault = (int)(pm_test_rand(&rng) % FAULT_MODES);
  w.busy_holds = pm_backend_kind() == PM_BACKEND_CUDA;
  static const size_t sizes[] = {1, 37, 64, 513, 1000, 4099, 8192};
  uint64_t devblocks = (uint64_t)w.nthreads * DEVB;
  w.block_bytes = 0;
  for (int r = 0; r < NREG; r++) {
    size_t bytes = sizes[pm_test_rand(&rng) % (sizeof sizes / sizeof *sizes)];
    size_t stride = bytes + (size_t)(pm_test_rand(&rng) % 3) * (1 + pm_test_rand(&rng) % 97);
    w.dev_bytes[r] = stride * devblocks;
    REQUIRE_OK(pm_device_alloc(w.dev_bytes[r], (void **)&w.dev[r]));
    char *pad = malloc(w.dev_bytes[r]);
    memset(pad, PAD_BYTE, w.dev_bytes[r]);
    REQUIRE_OK(pm_memcpy(w.dev[r], pad, w.dev_bytes[r], PM_COPY_H2D));
    free(pad);
    w.regions[r] = (pm_kv_region_t){w.dev[r], stride, bytes};
    w.block_bytes += bytes;
  }
  w.layout = (pm_kv_layout_t){NREG, w.regions, devblocks, -1};
  static const char *cuts[] = {"0", "1024", "auto"}; /* DMA, both paths, calibrated */
  REQUIRE_OK(pm_option_set("blocks_kernel_max", cuts[pm_test_rand(&rng) % 3]));
  pm_blocks_config_t c;
  pm_blocks_config_init(&c);
  c.block_bytes = w.block_bytes;
  c.num_blocks = w.nhost;
  c.chunk_bytes = w.block_bytes * (1 + pm_test_rand(&rng) % 8); /* several chunks */
  REQUIRE_OK(pm_blocks_create(&c, &w.s));
  for (uint64_t h = 0; h < MAXH; h++) atomic_store(&w.owner[h], -1);
  REQUIRE_OK(pm_stream_create(&w.shared));
  REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_CREATE, 0, 0)); /* count, to match the destroys */
  REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_DESTROY, 0, 0));
  if (w.fault == FAULT_QUERY) {
    REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_QUERY, 0, 0.005));
    REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_SYNC, 0, 0.01));
  } else if (w.fault == FAULT_RECORD)
    REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_RECORD, 0, 0.05));
  static thr_t th[MAXT];
  pthread_t tid[MAXT];
  for (int i = 0; i < w.nthreads; i++) {
    memset(&th[i], 0, sizeof th[i]);
    th[i].w = &w;
    th[i].id = i;
    th[i].rng = pm_test_rand(&rng);
    th[i].ops = ops;
    REQUIRE_OK(pm_stream_create(&th[i].own[0]));
    REQUIRE_OK(pm_stream_create(&th[i].own[1]));
  }
  for (int i = 0; i < w.nthreads; i++)
    REQUIRE(pthread_create(&tid[i], NULL, thr_main, &th[i]) == 0);
  for (int i = 0; i < w.nthreads; i++) pthread_join(tid[i], NULL);
  REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_QUERY, 0, 0));
  REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_SYNC, 0, 0));
  REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_RECORD, 0, 0));
  /* Every block was freed, some while their last swaps still run: each is idle, waiting for
   * those swaps, or quarantined (a swap whose events failed named it), none lost. */
  pm_blocks_stats_t bs;
  uint64_t waiting, quar;
  uint64_t idle;
  CHECK_OK(pm_blocks_get_stats(w.s, &bs));
  CHECK(bs.free_blocks <= w.nhost);
  CHECK_OK(pm_blocks_get_free(w.s, &idle, &waiting, &quar));
  CHECK_EQ_SIZE(idle + waiting + quar, w.nhost);
  if (w.fault != FAULT_QUERY) CHECK_EQ_SIZE(quar, 0);
  CHECK_OK(pm_blocks_destroy(w.s)); /* with those swaps in flight */
  pm__fault_counts_t fc;
  pm__fault_counts(&fc); /* every event made (the store's, the calls') was destroyed */
  if (fc.calls[PM__FAULT_EVENT_CREATE] != fc.calls[PM__FAULT_EVENT_DESTROY]) {
    atomic_fetch_add(&w.failures, 1);
    fprintf(stderr, "%llu events created, %llu destroyed\n",
            (unsigned long long)fc.calls[PM__FAULT_EVENT_CREATE],
            (unsigned long long)fc.calls[PM__FAULT_EVENT_DESTROY]);
  }
  pm__fault_reset();
  for (int i = 0; i < w.nthreads; i++) {
    thr_t *t = &th[i];
    for (int k = 0; k < t->npend; k++)
      for (int j = 0; j < t->pend[k].n; j++) t->dev_busy[t->pend[k].dev[j] - gdev(t, 0)]--;
    for (int d = 0; d < DEVB; d++)
      if (t->dev_busy[d] == 0 && !dev_holds(t, d, t->dev_tag[d]))
        FAIL(t, "device block %d after the close", d);
    CHECK_OK(pm_stream_destroy(t->own[0]));
    CHECK_OK(pm_stream_destroy(t->own[1]));
  }
  CHECK_OK(pm_stream_destroy(w.shared));
  for (int r = 0; r < NREG; r++) { /* the padding between blocks was never written */
    char *buf = malloc(w.dev_bytes[r]);
    REQUIRE_OK(pm_memcpy(buf, w.dev[r], w.dev_bytes[r], PM_COPY_D2H));
    bool ok = true;
    for (uint64_t d = 0; d < devblocks && ok; d++)
      for (size_t o = w.regions[r].bytes; o < w.regions[r].block_stride && ok; o++)
        ok = (uint8_t)buf[d * w.regions[r].block_stride + o] == PAD_BYTE;
    if (!ok) {
      atomic_fetch_add(&w.failures, 1);
      fprintf(stderr, "region %d: padding overwritten\n", r);
    }
    free(buf);
    CHECK_OK(pm_device_free(w.dev[r]));
  }
  int f = atomic_load(&w.failures);
  if (f || !quiet)
    fprintf(
        stderr,
        "seed %llu: %d threads, %llu host blocks, fault mode %d, block %zu bytes: "
        "%d failures, %d allocs refused for a broken swap, %d blocks reused after a busy free\n",
        (unsigned long long)seed, w.nthreads, (unsigned long long)w.nhost, w.fault, w.block_bytes,
        f, atomic_load(&w.broken_allocs), atomic_load(&w.reuses));
  return f;
}

/* The first swap of a device measures the cut-off (blocks_kernel_max auto) and returns without
 * waiting for other streams: freeing the measurement's buffers there synchronized the whole
 * device (as cudaFree does), so a stream held by the calling thread (here a gate it opens only
 * after the swap) hung the swap. An opener lets the gate go if a free comes, so the old
 * behaviour fails the check instead of hanging. Runs before any other swap of the process: the
 * cut-off is measured once per device. */
static void test_first_swap_no_device_sync(void) {
  REQUIRE_OK(pm_option_set("blocks_kernel_max", "auto"));
  char *dev;
  REQUIRE_OK(pm_device_alloc(4 * 4096, (void **)&dev));
  pm_kv_region_t reg = {dev, 4096, 4096};
  pm_kv_layout_t L = {1, &reg, 4, -1};
  pm_blocks_config_t c;
  pm_blocks_config_init(&c);
  c.block_bytes = 4096;
  c.num_blocks = 4;
  c.background = 0;
  pm_blocks_t *s = NULL;
  REQUIRE_OK(pm_blocks_create(&c, &s));
  pm_stream_t held, b;
  REQUIRE_OK(pm_stream_create(&held));
  REQUIRE_OK(pm_stream_create(&b));
  uint64_t h[2], d[2] = {0, 1};
  REQUIRE_OK(pm_blocks_alloc(s, 2, h));
  pm_test_gate_t g;
  pm_test_gate_init(&g);
  REQUIRE_OK(pm_launch_host_func(held, pm_test_gate_wait, &g));
  REQUIRE_OK(pm__fault_set(PM__FAULT_DEVICE_FREE, 0, 0)); /* count, fail none */
  REQUIRE_OK(pm__fault_set(PM__FAULT_HOST_FREE, 0, 0));
  pm_test_opener_t o; /* the gate goes if memory is freed (the device synchronized) */
  pm_test_opener_start(&o, &g, (const int[]){PM__FAULT_DEVICE_FREE, PM__FAULT_HOST_FREE}, 2);
  pm_event_t ev = NULL;
  CHECK_OK(pm_blocks_swap_out(s, &L, d, h, 2, b, &ev));
  CHECK(!pm_test_opener_stop(&o)); /* the swap returned with the other stream still held */
  pm_test_gate_open(&g);
  pm_blocks_stats_t bs;
  CHECK_OK(pm_blocks_get_stats(s, &bs));
  CHECK(bs.kernel_max_calibrated);
  CHECK_OK(pm_event_synchronize(ev));
  CHECK_OK(pm_event_destroy(ev));
  pm__fault_reset();
  CHECK_OK(pm_stream_synchronize(held));
  CHECK_OK(pm_blocks_free(s, h, 2));
  CHECK_OK(pm_blocks_destroy(s)); /* releases the measurement's buffers (leak checkers) */
  CHECK_OK(pm_stream_destroy(held));
  CHECK_OK(pm_stream_destroy(b));
  pm_test_gate_destroy(&g);
  CHECK_OK(pm_device_free(dev));
}

/* A swap whose completion cannot be known (its events fail) quarantines the blocks it named:
 * freed while it ran, or freed later, they are never handed out again; an alloc that only they
 * would satisfy fails at once (no hang) with the device's status, naming that swap; idle blocks
 * keep coming and going; free_blocks counts only idle blocks and pm_blocks_get_free the
 * quarantined ones. Later swaps, on any stream, still retire: their freed blocks come back and
 * their events are reused (records and events stay bounded after the failure); the close
 * releases every event. */
static void test_broken_swap(void) {
  enum { NB = 6, DB = 8, LATER = 64 };
  pm_kv_region_t reg[2];
  char *dev[2];
  size_t bytes[2] = {100, 7}, stride[2] = {128, 7};
  for (int r = 0; r < 2; r++) {
    REQUIRE_OK(pm_device_alloc(stride[r] * DB, (void **)&dev[r]));
    reg[r] = (pm_kv_region_t){dev[r], stride[r], bytes[r]};
  }
  pm_kv_layout_t L = {2, reg, DB, -1};
  pm_blocks_config_t c;
  pm_blocks_config_init(&c);
  c.block_bytes = bytes[0] + bytes[1];
  c.num_blocks = NB;
  c.background = 0;
  pm_blocks_t *s = NULL;
  REQUIRE_OK(pm_blocks_create(&c, &s));
  REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_CREATE, 0, 0));
  REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_DESTROY, 0, 0));
  pm_stream_t a, b;
  REQUIRE_OK(pm_stream_create(&a));
  REQUIRE_OK(pm_stream_create(&b));
  uint64_t h[NB], d[NB] = {0, 1, 2, 3, 4, 5};
  REQUIRE_OK(pm_blocks_alloc(s, NB, h));
  pm_event_t ev = NULL;
  REQUIRE_OK(pm_blocks_swap_out(s, &L, d, h, NB, NULL, &ev)); /* swap 1 */
  CHECK_OK(pm_event_synchronize(ev));
  CHECK_OK(pm_event_destroy(ev));
  pm_test_gate_t g;
  pm_test_gate_init(&g);
  REQUIRE_OK(pm_launch_host_func(a, pm_test_gate_wait, &g));
  uint64_t din[3] = {6, 7, 5};
  REQUIRE_OK(pm_blocks_swap_in(s, &L, din, h, 3, a, NULL));             /* swap 2, held */
  CHECK_OK(pm_blocks_free(s, (const uint64_t[]){h[0], h[1], h[3]}, 3)); /* swap 2 reads h[0..2] */
  pm_blocks_stats_t bs;
  uint64_t waiting, quar;
  CHECK_OK(pm_blocks_get_stats(s, &bs));
  CHECK_EQ_SIZE(bs.free_blocks, 1); /* h[3] */
  CHECK_OK(pm_blocks_get_free(s, NULL, &waiting, &quar));
  CHECK_EQ_SIZE(waiting, 2);
  CHECK_EQ_SIZE(quar, 0);
  REQUIRE_OK(pm__fault_configure("event_query=1+,event_sync=1+")); /* the device cannot tell */
  uint64_t got[NB];
  pm_status_t st = pm_blocks_alloc(s, 3, got);
  CHECK_EQ_INT(st, PM_ERR_BACKEND);
  CHECK(strstr(pm_last_error(), "(swap 2 failed on the device)") != NULL);
  CHECK(strstr(pm_last_error(), "2 freed blocks are kept out of use") != NULL);
  CHECK_OK(pm_blocks_get_stats(s, &bs));
  CHECK_EQ_SIZE(bs.free_blocks, 1); /* nothing taken */
  CHECK_OK(pm_blocks_get_free(s, NULL, &waiting, &quar));
  CHECK_EQ_SIZE(waiting, 0);
  CHECK_EQ_SIZE(quar, 2);
  uint64_t idle[1];
  CHECK_OK(pm_blocks_alloc(s, 1, idle)); /* h[3]: idle, no wait */
  CHECK_EQ_SIZE(idle[0], h[3]);
  REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_QUERY, 0, 0));
  REQUIRE_OK(pm__fault_set(PM__FAULT_EVENT_SYNC, 0, 0));
  /* Later swaps on another stream, waited for and freed: they retire, their blocks come back
   * and their store events are reused, however many (swap 2's completion is still unknown). */
  pm__fault_counts_t fc;
  pm__fault_counts(&fc);
  uint64_t creates = fc.calls[PM__FAULT_EVENT_CREATE];
  for (int i = 0; i < LATER; i++) {
    REQUIRE_OK(pm_blocks_swap_out(s, &L, d, h + 4, 2, b, NULL));
    CHECK_OK(pm_stream_synchronize(b));
    CHECK_OK(pm_blocks_free(s, h + 4, 2));
    CHECK_OK(pm_blocks_get_stats(s, &bs));
    CHECK_EQ_SIZE(bs.free_blocks, 2);
    CHECK_OK(pm_blocks_alloc(s, 2, got));
    CHECK((got[0] == h[4] && got[1] == h[5]) || (got[0] == h[5] && got[1] == h[4]));
    h[4] = got[0];
    h[5] = got[1];
  }
  pm__fault_counts(&fc);
  CHECK(fc.calls[PM__FAULT_EVENT_CREATE] - creates <= 1); /* one event, reused */
  pm_test_gate_open(&g);
  CHECK_OK(pm_stream_synchronize(a));
  /* h[2], named by swap 2 and still allocated, is quarantined when freed. */
  CHECK_OK(pm_blocks_free(s, h + 2, 1));
  CHECK_OK(pm_blocks_free(s, h + 4, 2));
  CHECK_OK(pm_blocks_get_free(s, NULL, &waiting, &quar));
  CHECK_EQ_SIZE(waiting, 0);
  CHECK_EQ_SIZE(quar, 3);
  CHECK_EQ_INT(pm_blocks_alloc(s, 3, got), PM_ERR_BACKEND); /* still unknown: kept out of use */
  CHECK(strstr(pm_last_error(), "(swap 2 failed on the device)") != NULL);
  CHECK_EQ_INT(pm_blocks_alloc(s, NB, got), PM_ERR_NOMEM); /* past the arena */
  CHECK_OK(pm_blocks_free(s, idle, 1));
  CHECK_OK(pm_blocks_alloc(s, 3, got)); /* idle blocks still come and go */
  CHECK_OK(pm_blocks_free(s, got, 3));
  CHECK_OK(pm_blocks_get_stats(s, &bs));
  CHECK_EQ_SIZE(bs.free_blocks, NB - 3);
  CHECK_OK(pm_blocks_destroy(s));
  pm__fault_counts(&fc);
  CHECK_EQ_SIZE(fc.calls[PM__FAULT_EVENT_CREATE], fc.calls[PM__FAULT_EVENT_DESTROY]);
  pm__fault_reset();
  CHECK_OK(pm_stream_destroy(a));
  CHECK_OK(pm_stream_destroy(b));
  pm_test_gate_destroy(&g);
  for (int r = 0; r < 2; r++) CHECK_OK(pm_device_free(dev[r]));
}

/* Thousands of swaps held at once on many streams: the records outgrow the ring many times over
 * (its base held by the first stream's swaps while later ones retire and wrap around), blocks
 * are named by swaps on several streams, some twice in one swap_in, and freed while all of them
 * are held. Gates open one stream at a time, in a fixed shuffled order; after each, the store
 * says exactly which blocks wait: those that a swap on a stream still held names, no more (a
 * block kept back forever) and no fewer (a block handed back while a held swap reads it).
 * Between openings, allocs take only idle blocks (never one a held swap names), swaps on the
 * opened streams come and go (new records behind the held ones), and every block is
 * accounted for: idle + waiting + quarantined + owned is the arena. */
static void test_many_held_streams(void) {
  enum { NS = 12, PER = 4, NB = 64, OWN = 48, ROUNDS = 3000, BB = 64 };
  char *dev;
  REQUIRE_OK(pm_device_alloc((size_t)NS * PER * BB, (void **)&dev));
  pm_kv_region_t reg = {dev, BB, BB};
  pm_kv_layout_t L = {1, &reg, NS * PER, -1};
  pm_blocks_config_t c;
  pm_blocks_config_init(&c);
  c.block_bytes = BB;
  c.num_blocks = NB;
  c.background = 0;
  pm_blocks_t *s = NULL;
  REQUIRE_OK(pm_blocks_create(&c, &s));
  pm_stream_t st[NS];
  pm_test_gate_t g[NS];
  static bool named[NB][NS];
  memset(named, 0, sizeof named);
  bool held[NS];
  for (int k = 0; k < NS; k++) {
    REQUIRE_OK(pm_stream_create(&st[k]));
    pm_test_gate_init(&g[k]);
    REQUIRE_OK(pm_launch_host_func(st[k], pm_test_gate_wait, &g[k]));
    held[k] = true;
  }
  uint64_t own[OWN];
  REQUIRE_OK(pm_blocks_alloc(s, OWN, own));
  uint64_t rng = 0xb10c5;
  /* Swap_ins only: several streams may read one host block at once; each stream writes its own
   * device blocks, so nothing races on the device side either. */
  for (int r = 0; r < ROUNDS; r++) {
    int k = (int)(pm_test_rand(&rng) % NS);
    int n = 1 + (int)(pm_test_rand(&rng) % PER);
    uint64_t d[PER], h[PER];
    for (int j = 0; j < n; j++) {
      d[j] = (uint64_t)k * PER + (uint64_t)j;
      /* A third of the host ids repeat the previous one (a swap_in may read a block twice). */
      h[j] = j && pm_test_rand(&rng) % 3 == 0 ? h[j - 1] : own[pm_test_rand(&rng) % OWN];
      named[h[j]][k] = true;
    }
    REQUIRE_OK(pm_blocks_swap_in(s, &L, d, h, (size_t)n, st[k], NULL));
  }
  CHECK_OK(pm_blocks_free(s, own, OWN));
  uint64_t order[NS];
  for (int k = 0; k < NS; k++) order[k] = (uint64_t)k;
  for (int i = NS; i > 1; i--) {
    int j = (int)(pm_test_rand(&rng) % (uint64_t)i);
    uint64_t t = order[i - 1];
    order[i - 1] = order[j];
    order[j] = t;
  }
  uint64_t mine[NB];
  int nmine = 0;
  for (int step = 0; step <= NS; step++) {
    if (step > 0) {
      int k = (int)order[step - 1];
      pm_test_gate_open(&g[k]);
      CHECK_OK(pm_stream_synchronize(st[k]));
      held[k] = false;
    }
    /* Exactly the freed blocks that a held stream's swap names wait. */
    bool busy[NB];
    uint64_t expect_wait = 0;
    for (int b = 0; b < NB; b++) {
      busy[b] = false;
      for (int k = 0; k < NS; k++) busy[b] = busy[b] || (named[b][k] && held[k]);
    }
    bool is_mine[NB] = {false};
    for (int i = 0; i < nmine; i++) is_mine[mine[i]] = true;
    for (int b = 0; b < NB; b++) expect_wait += busy[b] && !is_mine[b];
    uint64_t idle = 0, waiting = 0, quar = 0;
    CHECK_OK(pm_blocks_get_free(s, &idle, &waiting, &quar));
    CHECK_EQ_SIZE(waiting, expect_wait);
    CHECK_EQ_SIZE(quar, 0);
    CHECK_EQ_SIZE(idle + waiting + quar + (uint64_t)nmine, NB);
    /* Take every idle block (no wait: they are idle), check none is busy, then swap some of
     * them out on an opened stream and free them again: new records behind the held ones. */
    uint64_t got[NB];
    CHECK_OK(pm_blocks_alloc(s, (size_t)idle, got));
    for (uint64_t i = 0; i < idle; i++)
      if (busy[got[i]]) {
        CHECK(!busy[got[i]]);
        break;
      }
    int open_k = -1;
    for (int k = 0; k < NS && open_k < 0; k++)
      if (!held[k]) open_k = k;
    if (open_k >= 0 && idle) {
      uint64_t n = PM__MIN(idle, (uint64_t)PER);
      uint64_t d[PER];
      for (uint64_t j = 0; j < n; j++) d[j] = (uint64_t)open_k * PER + j;
      for (int rep = 0; rep < 50; rep++)
        CHECK_OK(pm_blocks_swap_out(s, &L, d, got, (size_t)n, st[open_k], NULL));
    }
    /* Keep one block a step (owned across the openings), free the rest, busy or not. */
    if (idle) mine[nmine++] = got[--idle];
    CHECK_OK(pm_blocks_free(s, got, (size_t)idle));
    if (open_k >= 0) CHECK_OK(pm_stream_synchronize(st[open_k]));
  }
  uint64_t idle = 0, waiting = 0, quar = 0;
  CHECK_OK(pm_blocks_free(s, mine, (size_t)nmine));
  CHECK_OK(pm_blocks_get_free(s, &idle, &waiting, &quar));
  CHECK_EQ_SIZE(idle, NB);
  uint64_t all[NB];
  CHECK_OK(pm_blocks_alloc(s, NB, all));
  CHECK_OK(pm_blocks_free(s, all, NB));
  CHECK_OK(pm_blocks_destroy(s));
  for (int k = 0; k < NS; k++) {
    CHECK_OK(pm_stream_destroy(st[k]));
    pm_test_gate_destroy(&g[k]);
  }
  CHECK_OK(pm_device_free(dev));
}

int main(int argc, char **argv) {
  pm_test_init();
  test_first_swap_no_device_sync(); /* first: the only swap that measures the cut-off */
  if (argc <= 1) test_broken_swap();
  if (argc <= 1) test_many_held_streams();
  uint64_t first = argc > 1 ? strtoull(argv[1], NULL, 0) : 1;
  /* Fixed seeds: each picks 2-4 threads, the arena, the regions, the copy path and a fault
   * mode; fewer under valgrind (PINMEM_TEST_SMALL). */
  uint64_t nseeds = argc > 2 ? strtoull(argv[2], NULL, 0) : pm_test_small() ? 4 : 16;
  int ops = argc > 3 ? atoi(argv[3]) : pm_test_small() ? 100 : 200;
  for (uint64_t seed = first; seed < first + nseeds; seed++) {
    int f = run_seed(seed, ops, argc <= 1);
    CHECK_EQ_INT(f, 0);
  }
  CHECK_OK(pm_finalize());
  return pm_test_finish("test_blocks_model");
}
