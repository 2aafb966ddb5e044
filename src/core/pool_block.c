/*
 * DESIGN: the pool's blocks (see pool.c for the whole pool). Size classes (eight per power of
 * two, at most 12.5% waste), the free bins with their bitmap (one bin set per flag group, and
 * per NUMA node a segment was pinned for: blocks of different nodes are different segments,
 * so coalescing never joins them and a bin holds one node's blocks only), the
 * recycled block structs, the hash map of allocated, pending and quarantined blocks keyed by
 * start address, coalescing a freed block with its free neighbours, carving a request off a
 * bigger free block, and the lookups (usable size, pointer query) that resolve a pointer to its
 * block. Nothing here calls the backend or takes a lock except the lookups (pool lock only) and
 * pm__pool_segment_release (called without the lock). Invariants: a block is in the bins iff it
 * is FREE; cached_bytes is the sum of binned blocks; blocks tile their segment in address order
 * and no two adjacent blocks are both FREE.
 */
#include <stdlib.h>
#include <string.h>

#include "pool_internal.h"

/* ---- size classes and bins ---------------------------------------------------------------- */

static inline int floor_log2(size_t v) {
  return 63 - __builtin_clzll((unsigned long long)v);
}

size_t pm__size_class(size_t bytes) {
  /* Eight steps per power of two: for n in [2^k, 2^(k+1)) round up to a multiple of 2^(k-3), so
   * the waste is below 2^(k-3) <= n/8. Below 2 KiB the 256-byte floor takes over. 0 is given
   * the smallest class; a size whose class does not fit in size_t gives 0. */
  if (bytes <= 2048) return bytes == 0 ? PM__GRAN : pm__align_up(bytes, PM__GRAN);
  size_t g = (size_t)1 << (floor_log2(bytes) - 3);
  if (bytes > SIZE_MAX - (g - 1)) return 0;
  return pm__align_up(bytes, g);
}

/* Floor mapping of a size (a multiple of 256) to its bin: every block in bin i is at least the
 * class boundary that starts bin i, so a request rounded to a class fits any block of its bin. */
static inline int bin_index(size_t s) {
  if (s < 2048) return (int)(s / PM__GRAN) - 1;
  int k = floor_log2(s);
  int j = (int)((s >> (k - 3)) & 7);
  return 7 + (k - 11) * 8 + j;
}

void pm__pool_bin_insert(pm_pool_t *p, pm__block_t *b) {
  pm__group_t *g = b->seg->group;
  int i = bin_index(b->size);
  b->bin = i;
  b->lprev = NULL;
  b->lnext = g->bins[i];
  if (b->lnext) b->lnext->lprev = b;
  g->bins[i] = b;
  g->bitmap[i >> 6] |= 1ull << (i & 63);
  p->cached += b->size;
}

void pm__pool_bin_remove(pm_pool_t *p, pm__block_t *b) {
  pm__group_t *g = b->seg->group;
  if (b->lprev)
    b->lprev->lnext = b->lnext;
  else
    g->bins[b->bin] = b->lnext;
  if (b->lnext) b->lnext->lprev = b->lprev;
  if (!g->bins[b->bin]) g->bitmap[b->bin >> 6] &= ~(1ull << (b->bin & 63));
  b->lprev = b->lnext = NULL;
  p->cached -= b->size;
}

pm__block_t *pm__pool_bin_find(pm__group_t *g, size_t need) {
  int i = bin_index(need);
  int w = i >> 6;
  uint64_t m = g->bitmap[w] & (~0ull << (i & 63));
  while (!m) {
    if (++w == PM__BITMAP_WORDS) return NULL;
    m = g->bitmap[w];
  }
  return g->bins[w * 64 + __builtin_ctzll(m)];
}

/* ---- block structs, hash ------------------------------------------------------------------ */

void pm__pool_uses_reset(pm__block_t *b) {
  if (b->uses != b->inline_uses) free(b->uses);
  b->uses = b->inline_uses;
  b->cap_uses = PM__INLINE_USES;
  b->nuses = 0;
}

static pm__block_t *block_get(pm_pool_t *p) {
  pm__block_t *b = p->spare;
  if (b) {
    p->spare = b->lnext;
    p->nspare--;
  } else {
    b = malloc(sizeof *b);
    if (!b) return NULL;
  }
  memset(b, 0, sizeof *b);
  b->uses = b->inline_uses;
  b->cap_uses = PM__INLINE_USES;
  return b;
}

static void block_put(pm_pool_t *p, pm__block_t *b) {
  pm__pool_uses_reset(b);
  if (p->nspare >= PM__SPARE_BLOCKS_MAX) {
    free(b);
    return;
  }
  b->lnext = p->spare;
  p->spare = b;
  p->nspare++;
}

static inline size_t hash_slot(const pm_pool_t *p, const void *ptr) {
  uint64_t x = (uint64_t)((uintptr_t)ptr >> 8) * 0x9E3779B97F4A7C15ull;
  return (size_t)(x >> (64 - p->hash_bits));
}

static void hash_grow(pm_pool_t *p) {
  unsigned bits = p->hash_bits + 1;
  size_t cap = (size_t)1 << bits;
  pm__block_t **nh = calloc(cap, sizeof *nh);
  if (!nh) return; /* longer chains, still correct */
  pm__block_t **old = p->hash;
  size_t oldcap = (size_t)1 << p->hash_bits;
  p->hash = nh;
  p->hash_bits = bits;
  for (size_t i = 0; i < oldcap; i++) {
    for (pm__block_t *b = old[i], *n; b; b = n) {
      n = b->hnext;
      size_t s = hash_slot(p, b->ptr);
      b->hnext = nh[s];
      nh[s] = b;
    }
  }
  free(old);
}

static void hash_insert(pm_pool_t *p, pm__block_t *b) {
  if (p->hash_count >= ((size_t)1 << p->hash_bits) && p->hash_bits < 40) hash_grow(p);
  size_t s = hash_slot(p, b->ptr);
  b->hnext = p->hash[s];
  p->hash[s] = b;
  p->hash_count++;
}

static pm__block_t *hash_find(const pm_pool_t *p, const void *ptr) {
  for (pm__block_t *b = p->hash[hash_slot(p, ptr)]; b; b = b->hnext)
    if (b->ptr == ptr) return b;
  return NULL;
}

static void hash_remove(pm_pool_t *p, pm__block_t *b) {
  pm__block_t **pp = &p->hash[hash_slot(p, b->ptr)];
  while (*pp && *pp != b) pp = &(*pp)->hnext;
  if (*pp) {
    *pp = b->hnext;
    p->hash_count--;
  }
  b->hnext = NULL;
}

/* The block holding ptr (any state), *exact if ptr is its start; NULL if no segment holds it. */
pm__block_t *pm__pool_locate_locked(pm_pool_t *p, const void *ptr, bool *exact) {
  pm__block_t *b = hash_find(p, ptr);
  if (b) {
    *exact = true;
    return b;
  }
  const char *c = ptr;
  for (pm__segment_t *s = p->segments; s; s = s->next) {
    if (c < s->base || c >= s->base + s->size) continue;
    for (b = s->first; b; b = b->anext) {
      if (c >= b->ptr && c < b->ptr + b->size) {
        *exact = (c == b->ptr);
        return b;
      }
    }
    return NULL;
  }
  return NULL;
}

/* ---- coalescing, carving, segments' blocks ------------------------------------------------- */

/* A block whose last use is over becomes free: leave the hash, merge with free neighbours, bin. */
void pm__pool_make_free_locked(pm_pool_t *p, pm__block_t *b) {
  hash_remove(p, b);
  pm__pool_uses_reset(b);
  b->state = PM__B_FREE;
  b->requested = 0;
  pm__block_t *prev = b->aprev, *next = b->anext;
  if (prev && prev->state == PM__B_FREE) {
    pm__pool_bin_remove(p, prev);
    prev->size += b->size;
    prev->anext = next;
    if (next) next->aprev = prev;
    block_put(p, b);
    b = prev;
  }
  if (next && next->state == PM__B_FREE) {
    pm__pool_bin_remove(p, next);
    b->size += next->size;
    b->anext = next->anext;
    if (b->anext) b->anext->aprev = b;
    block_put(p, next);
  }
  pm__pool_bin_insert(p, b);
}

pm_status_t pm__pool_segment_release(pm_pool_t *p, pm__segment_t *s) {
  pm_status_t st = pm__registry_remove((uintptr_t)s->base, PM_MEMORY_POOL, NULL);
  pm_status_t st2;
  if (s->flags & PM_HOST_SHARED)
    st2 = pm__shared_unpin(p->b, s->base, s->size);
  else
    st2 = s->fast ? pm__fast_unpin(p->b, s->base, s->size) : p->b->host_free(s->base, s->size);
  return st2 != PM_OK ? st2 : st;
}

void pm__pool_segment_unlink_locked(pm_pool_t *p, pm__segment_t *s) {
  if (s->prev)
    s->prev->next = s->next;
  else
    p->segments = s->next;
  if (s->next) s->next->prev = s->prev;
  s->prev = s->next = NULL;
}

void pm__pool_carve_locked(pm_pool_t *p, pm__block_t *b, size_t need) {
  if (b->size - need < PM__GRAN) return;
  pm__block_t *r = block_get(p);
  if (!r) return; /* no memory for the struct: hand out the whole block */
  r->ptr = b->ptr + need;
  r->size = b->size - need;
  r->seg = b->seg;
  r->state = PM__B_FREE;
  r->aprev = b;
  r->anext = b->anext;
  if (r->anext) r->anext->aprev = r;
  b->anext = r;
  b->size = need;
  pm__pool_bin_insert(p, r);
}

void pm__pool_mark_in_use_locked(pm_pool_t *p, pm__block_t *b, size_t bytes) {
  b->state = PM__B_IN_USE;
  b->requested = bytes;
  size_t end = (size_t)(b->ptr - b->seg->base) + b->size;
  if (end > b->seg->handed) b->seg->handed = end;
  hash_insert(p, b);
  p->in_use += b->size;
  p->requested += bytes;
  p->in_use_blocks++;
  p->allocs++;
}

/* ---- lookups ------------------------------------------------------------------------------- */

pm_status_t pm__pool_usable_size(pm_pool_t *p, const void *ptr, size_t *bytes_out) {
  if (!p || !ptr || !bytes_out)
    return pm__set_error(PM_ERR_INVALID, "pm_host_usable_size: NULL argument");
  pthread_mutex_lock(&p->lock);
  bool exact = false;
  pm__block_t *b = pm__pool_locate_locked(p, ptr, &exact);
  pm_status_t st = PM_OK;
  size_t size = 0;
  if (!b)
    st = pm__set_error(PM_ERR_NOT_FOUND, "pm_host_usable_size(%p): not in pool %p", ptr, (void *)p);
  else if (pm__pool_never_handed(b, ptr))
    st = pm__set_error(PM_ERR_INVALID,
                       "pm_host_usable_size(%p): not allocated by pm_host_alloc (never handed out)",
                       ptr);
  else if (b->state != PM__B_IN_USE)
    st = pm__set_error(PM_ERR_INVALID, "pm_host_usable_size(%p): the block was freed", ptr);
  else if (!exact)
    st = pm__set_error(PM_ERR_INVALID,
                       "pm_host_usable_size(%p): not the start of a block (it starts at %p)", ptr,
                       (void *)b->ptr);
  else
    size = b->size;
  pthread_mutex_unlock(&p->lock);
  if (st == PM_OK) *bytes_out = size;
  return st;
}

pm_status_t pm__pool_block_info(pm_pool_t *p, const void *ptr, pm_pointer_info_t *info) {
  if (!p || !info) return pm__set_error(PM_ERR_INVALID, "pm__pool_block_info: NULL argument");
  pthread_mutex_lock(&p->lock);
  bool exact = false;
  pm__block_t *b = pm__pool_locate_locked(p, ptr, &exact);
  if (!b) {
    pthread_mutex_unlock(&p->lock);
    return pm__set_error(PM_ERR_NOT_FOUND, "%p is not in pool %p", ptr, (void *)p);
  }
  pm_pointer_info_t r;
  memset(&r, 0, sizeof r);
  r.kind = PM_MEMORY_POOL;
  r.base = b->ptr;
  r.size = b->size;
  r.flags = b->seg->flags;
  r.device_ptr =
      b->seg->dev_base ? (char *)b->seg->dev_base + ((const char *)ptr - b->seg->base) : NULL;
  r.pool = p;
  r.in_use = b->state == PM__B_IN_USE;
  pthread_mutex_unlock(&p->lock);
  *info = r;
  return PM_OK;
}
