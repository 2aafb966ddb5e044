/*
 * DESIGN: the set of live handles, so that a stale or foreign handle is refused with
 * PM_ERR_INVALID instead of being dereferenced.
 *
 * Every object a user holds by pointer (fence, pool, dataset, loader) is entered here when it
 * is created and taken out when it is destroyed; public calls check the set before they touch
 * the object. A magic number inside the object cannot do this: after free the memory may be
 * unmapped, reused by another object of the same type, or still hold the old magic.
 *
 * Data structure: one open-addressing table of (address, kind) entries; an empty slot has
 * address 0, a deleted one address 1 (tombstone). The table is rebuilt at twice the live count
 * when live + tombstones pass half of it. The kind is part of the key, so a freed pool whose
 * address is reused by a loader is not taken for a live pool.
 *
 * Fork: each entry keeps the fork generation it was made in (this file counts the forks this
 * process went through, in its child hook, so the count sits in a leaf that fork.c calls down to).
 * In a forked child the parent's objects stay in the set but are "foreign": their threads do not
 * exist here and their memory is not pinned, so every call on one is refused with PM_ERR_STATE, and
 * its destroy only forgets it (pm__handle_foreign).
 *
 * Lock order: g_mu is a leaf; nothing is called while holding it. fork.c takes it before fork()
 * (pm__handles_atfork_prepare) so the table is never copied half-rebuilt, and the child starts
 * with a fresh lock.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "internal.h"

typedef struct entry {
  uintptr_t addr; /* 0 empty, 1 deleted */
  int kind;
  unsigned gen; /* pm__fork_generation() when it was entered */
} entry_t;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_uint g_generation; /* forks between the process that loaded pinmem and this one */
static atomic_bool g_fork_armed;  /* pm__fork_arm was called: fork.c's handlers act */
static entry_t *g_tab;
static size_t g_cap, g_used; /* used: live + deleted slots */

static size_t slot_hash(uintptr_t key, int kind, size_t cap) {
  uint64_t k = ((uint64_t)key >> 4) ^ ((uint64_t)(unsigned)kind << 56);
  return (size_t)((k * 0x9E3779B97F4A7C15ull) >> 17) & (cap - 1);
}

/* Slot of (addr, kind), or of the first free slot on its probe path when absent. */
static size_t find_locked(uintptr_t addr, int kind, bool *found) {
  size_t i = slot_hash(addr, kind, g_cap), first_free = SIZE_MAX;
  for (;;) {
    const entry_t *e = &g_tab[i];
    if (e->addr == addr && e->kind == kind) {
      *found = true;
      return i;
    }
    if (e->addr <= 1 && first_free == SIZE_MAX) first_free = i;
    if (e->addr == 0) {
      *found = false;
      return first_free;
    }
    i = (i + 1) & (g_cap - 1);
  }
}

static const char *kind_name(pm__handle_kind_t kind) {
  switch (kind) { PM__HANDLE_KIND_MAP(PM__NAME_CASE) }
  return "handle";
}

pm_status_t pm__handle_add(const void *h, pm__handle_kind_t kind) {
  uintptr_t addr = (uintptr_t)h;
  pm_status_t st = PM_OK;
  pm__fork_arm(); /* a process holding handles must reset this lock in a forked child */
  pthread_mutex_lock(&g_mu);
  if ((g_used + 1) * 2 > g_cap) {
    size_t live = 0;
    for (size_t i = 0; i < g_cap; i++) live += g_tab[i].addr > 1;
    size_t cap = 64;
    while (cap < (live + 1) * 4) cap *= 2;
    entry_t *t = calloc(cap, sizeof *t);
    if (!t) {
      st = pm__set_error(PM_ERR_NOMEM, "malloc of the %s handle table (%zu slots) failed",
                         kind_name(kind), cap);
      goto out;
    }
    entry_t *old = g_tab;
    size_t old_cap = g_cap;
    g_tab = t;
    g_cap = cap;
    g_used = 0;
    for (size_t i = 0; i < old_cap; i++) {
      if (old[i].addr <= 1) continue;
      bool found;
      g_tab[find_locked(old[i].addr, old[i].kind, &found)] = old[i];
      g_used++;
    }
    free(old);
  }
  bool found;
  size_t i = find_locked(addr, (int)kind, &found);
  if (!found) {
    if (g_tab[i].addr == 0) g_used++;
    g_tab[i] = (entry_t){addr, (int)kind, 0};
  }
  g_tab[i].gen = pm__fork_generation();
out:
  pthread_mutex_unlock(&g_mu);
  return st;
}

bool pm__handle_remove(const void *h, pm__handle_kind_t kind) {
  bool found = false;
  pthread_mutex_lock(&g_mu);
  if (g_cap) {
    size_t i = find_locked((uintptr_t)h, (int)kind, &found);
    if (found) g_tab[i].addr = 1;
  }
  pthread_mutex_unlock(&g_mu);
  return found;
}

/* 0: not in the set; 1: live, made in this process; 2: made before the latest fork (foreign). */
static int handle_state(const void *h, pm__handle_kind_t kind) {
  bool found = false;
  int state = 0;
  if (!h) return 0;
  unsigned gen = pm__fork_generation();
  pthread_mutex_lock(&g_mu);
  if (g_cap) {
    size_t i = find_locked((uintptr_t)h, (int)kind, &found);
    if (found) state = g_tab[i].gen == gen ? 1 : 2;
  }
  pthread_mutex_unlock(&g_mu);
  return state;
}

bool pm__handle_live(const void *h, pm__handle_kind_t kind) {
  return handle_state(h, kind) == 1;
}

bool pm__handle_foreign(const void *h, pm__handle_kind_t kind) {
  return handle_state(h, kind) == 2;
}

pm_status_t pm__handle_check(const void *h, pm__handle_kind_t kind, const char *fn) {
  if (!h) return pm__set_error(PM_ERR_INVALID, "%s: %s is NULL", fn, kind_name(kind));
  int state = handle_state(h, kind);
  if (state == 2)
    return pm__set_error(PM_ERR_STATE,
                         "%s: %s %p was made by the parent process before fork(); its threads "
                         "and pinned memory do not exist in this child (destroy it, which only "
                         "forgets it, and make a new one)",
                         fn, kind_name(kind), h);
  if (state == 0)
    return pm__set_error(PM_ERR_INVALID, "%s: %s %p is unknown or was already destroyed", fn,
                         kind_name(kind), h);
  return PM_OK;
}

void pm__handles_atfork_prepare(void) { pthread_mutex_lock(&g_mu); }
void pm__handles_atfork_parent(void) { pthread_mutex_unlock(&g_mu); }

void pm__fork_arm(void) {
  atomic_store_explicit(&g_fork_armed, true, memory_order_release);
}

bool pm__fork_armed(void) {
  return atomic_load_explicit(&g_fork_armed, memory_order_acquire);
}

unsigned pm__fork_generation(void) {
  return atomic_load_explicit(&g_generation, memory_order_relaxed);
}

void pm__handles_atfork_child(void) {
  atomic_fetch_add_explicit(&g_generation, 1, memory_order_relaxed);
  pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
  g_mu = fresh;
}
