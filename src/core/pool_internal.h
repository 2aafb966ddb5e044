/*
 * The pool's private header: its types and the calls between its files (pool.c, pool_block.c,
 * pool_stream.c, pool_budget.c); nothing outside src/core/pool*.c includes it. The pool's design,
 * invariants and lock order are in pool.c's DESIGN comment. Every *_locked call is made with the
 * pool lock held; those that drop and retake it say so.
 */
#ifndef PINMEM_POOL_INTERNAL_H
#define PINMEM_POOL_INTERNAL_H

#include <pthread.h>

#include "internal.h"

#define PM__GRAN ((size_t)256)            /* minimum class granularity and alignment */
#define PM__SMALL_LIMIT ((size_t)1 << 20) /* requests below this share 2 MiB segments */
#define PM__SMALL_SEGMENT ((size_t)2 << 20)
#define PM__NBINS 448 /* covers every 64-bit size (max index 430) */
#define PM__BITMAP_WORDS (PM__NBINS / 64)
#define PM__NGROUPS 16 /* one bin set per PM_HOST_* flag combination */
#define PM__HOST_FLAGS (PM_HOST_MAPPED | PM_HOST_WRITE_COMBINED | PM_HOST_PORTABLE | PM_HOST_SHARED)
#define PM__INLINE_USES 4
#define PM__SPARE_BLOCKS_MAX 1024
#define PM__WAIT_SLICE_S 0.001

enum { PM__B_FREE = 0, PM__B_IN_USE, PM__B_PENDING, PM__B_QUARANTINED };

typedef struct pm__use {
  pm_stream_t stream;
  pm_event_t event; /* recorded at free (NULL until then, or if creating one failed) */
  bool done;        /* nothing left to wait for on this stream */
} pm__use_t;

typedef struct pm__segment pm__segment_t;
typedef struct pm__block pm__block_t;
typedef struct pm__group pm__group_t;

struct pm__block {
  char *ptr;
  size_t size;      /* capacity */
  size_t requested; /* what the caller asked for, while in use */
  pm__segment_t *seg;
  pm__block_t *aprev, *anext; /* address order within the segment */
  pm__block_t *lprev, *lnext; /* bin list (FREE) or pending list (PENDING) */
  pm__block_t *hnext;         /* hash chain */
  int state;
  int bin;
  int nuses, cap_uses;
  pm__use_t *uses;
  pm__use_t inline_uses[PM__INLINE_USES];
};

struct pm__segment {
  char *base;
  size_t size;
  unsigned flags;
  bool fast; /* pinned by pm__fast_pin (else backend host_alloc) */
  /* The NUMA node it was pinned for (-1: none asked): its blocks serve only requests for that
   * node. bound: the placement took; false means the default policy (a counted failure). */
  int node;
  bool bound;
  pm__group_t *group; /* its bin set: node and flags decide it once, at creation */
  void *dev_base;
  /* Bytes from base that have ever been handed out (a high-water mark). A block is always
   * handed out from the front of a free block, so every byte below it was once the caller's and
   * none above it ever was: a free of an address above it names memory pm_host_alloc never
   * returned, not a double free. */
  size_t handed;
  pm__block_t *first;
  pm__segment_t *prev, *next;
};

/* A free block's address at or above its segment's high-water mark was never handed out: the
 * caller's pointer did not come from pm_host_alloc, which "the block was freed" would hide. */
static inline bool pm__pool_never_handed(const pm__block_t *b, const void *ptr) {
  return b->state == PM__B_FREE && (size_t)((const char *)ptr - b->seg->base) >= b->seg->handed;
}

struct pm__group {
  pm__block_t *bins[PM__NBINS];
  uint64_t bitmap[PM__BITMAP_WORDS];
};

struct pm_pool_s {
  pthread_mutex_t lock;
  pthread_cond_t cv; /* budget released, block freed, poll/trim finished */
  const pm__backend_t *b;

  /* resolved configuration */
  size_t budget;
  bool budget_memlock; /* the automatic budget was cut to RLIMIT_MEMLOCK (host backend) */
  int policy;
  double wait_timeout_s;
  int pin_threads;
  size_t fast_pin_min;
  bool huge_pages;
  /* The backend refused to register host memory (PM_ERR_UNSUPPORTED: a platform without host
   * registration): segments come from its allocator from then on (segment_create). */
  atomic_bool register_refused;

  pm__group_t groups[PM__NGROUPS]; /* blocks of node -1 (no placement asked) */
  /* Blocks pinned for node n: their own bin sets, made when the first such segment is, so a
   * block freed for one node never serves another and node -1 (the common case) pays nothing. */
  pm__group_t *node_groups[PM__NUMA_MAX_NODES];
  uint64_t node_bind_failures[PM__NUMA_MAX_NODES];
  pm__segment_t *segments;
  pm__block_t **hash;
  unsigned hash_bits;
  size_t hash_count;
  pm__block_t *pending;
  pm__block_t *spare; /* recycled block structs */
  size_t nspare;

  /* event cache: capacity always >= events_total, so returning an event never allocates */
  pm_event_t *events;
  size_t nevents, cap_events, events_total;

  int waiters;    /* threads in a timed wait on cv */
  int releasers;  /* threads outside the lock with pending blocks or segments detached */
  size_t freeing; /* frees between "pending" and "on the list" */
  size_t in_use_blocks;
  size_t quarantined, quarantined_bytes; /* never reset: quarantined blocks stay until destroy */

  size_t pinned, peak, in_use, requested, cached, pending_bytes, registered;
  uint64_t nsegments, allocs, frees, cache_hits, backend_allocs, backend_frees;
  uint64_t budget_waits, budget_failures, numa_bind_failures;
  double backend_alloc_s, backend_free_s;
};

/* ---- budget helpers (under the pool lock) -------------------------------------------------- */

static inline void wake_locked(pm_pool_t *p) {
  if (p->waiters) pthread_cond_broadcast(&p->cv);
}

static inline void reserve_locked(pm_pool_t *p, size_t bytes) {
  p->pinned += bytes;
  if (p->pinned > p->peak) p->peak = p->pinned;
}

static inline void unreserve_locked(pm_pool_t *p, size_t bytes) {
  p->pinned = bytes <= p->pinned ? p->pinned - bytes : 0;
  wake_locked(p);
}

/* A request to serve from the bins or with a new segment (pm__pool_acquire_locked). */
typedef struct pm__acquire {
  const char *what;
  bool use_bins;
  unsigned group;
  int node;           /* NUMA node the memory is for; -1 none */
  size_t need;        /* class size, for the bins */
  size_t bytes;       /* what the caller asked for */
  size_t seg_pref;    /* preferred new segment */
  size_t seg_min;     /* smallest new segment that serves the request */
  pm__block_t *block; /* out: a cached block, now in use */
  size_t reserved;    /* out: bytes reserved for a new segment */
} pm__acquire_t;

/* ---- pool_block.c: bins, block structs, the block map, segments' blocks ------------------- */

void pm__pool_bin_insert(pm_pool_t *p, pm__block_t *b);
void pm__pool_bin_remove(pm_pool_t *p, pm__block_t *b);
/* The first block of the smallest non-empty bin that holds `need`, or NULL. */
pm__block_t *pm__pool_bin_find(pm__group_t *g, size_t need);
/* The bin set of a node and flag group; NULL for a node whose set is not made yet. */
static inline pm__group_t *pm__pool_group(pm_pool_t *p, int node, unsigned flags) {
  if (node < 0) return &p->groups[flags & PM__HOST_FLAGS];
  return p->node_groups[node] ? &p->node_groups[node][flags & PM__HOST_FLAGS] : NULL;
}
void pm__pool_uses_reset(pm__block_t *b);
/* The block holding ptr (any state), *exact if ptr is its start; NULL if no segment holds it. */
pm__block_t *pm__pool_locate_locked(pm_pool_t *p, const void *ptr, bool *exact);
/* A block whose last use is over becomes free: leave the hash, merge with free neighbours, bin. */
void pm__pool_make_free_locked(pm_pool_t *p, pm__block_t *b);
/* Split the tail beyond `need` off a block taken from a bin (or a new segment) and bin it. */
void pm__pool_carve_locked(pm_pool_t *p, pm__block_t *b, size_t need);
void pm__pool_mark_in_use_locked(pm_pool_t *p, pm__block_t *b, size_t bytes);
/* Leave the registry and unpin (no lock held). */
pm_status_t pm__pool_segment_release(pm_pool_t *p, pm__segment_t *s);
void pm__pool_segment_unlink_locked(pm_pool_t *p, pm__segment_t *s);

/* ---- pool_stream.c: stream-ordered frees and quarantine ----------------------------------- */

/* Pool destroy (no lock): every device synchronized, so quarantined memory may go back. */
bool pm__pool_devices_idle(pm_pool_t *p);
/* The segment holds a quarantined block. */
bool pm__pool_segment_quarantined(const pm__segment_t *s);
/* Poll every pending block; true if any became free. Drops and retakes the lock. */
bool pm__pool_poll_pending_locked(pm_pool_t *p);

/* ---- pool_budget.c: waiting, trimming, acquiring ------------------------------------------ */

/* Wait on the pool's condition variable for at most `seconds`. */
void pm__pool_wait_slice_locked(pm_pool_t *p, double seconds);
/* Release every segment that is one free block; returns the bytes given back. Drops and
 * retakes the lock. */
size_t pm__pool_trim_locked(pm_pool_t *p, pm_status_t *failed);
/* Serve `a` from the bins or reserve budget for a new segment. May drop the lock. */
pm_status_t pm__pool_acquire_locked(pm_pool_t *p, pm__acquire_t *a);

#endif
