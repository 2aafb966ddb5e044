/*
 * DESIGN: what pinmem does across fork().
 *
 * The rule (documented in pinmem.h and docs/RELIABILITY.md): a child forked from a process that
 * used pinmem starts afresh. With the host backend everything works in the child (the backend,
 * the default pool, copies, registrations, new loaders); nothing of the parent is claimed:
 * - the parent's threads (stream workers, completion threads, the thread pool, loader workers)
 *   do not exist in the child, so the child's bookkeeping of them is dropped and new ones start
 *   on first use;
 * - the parent's pinned memory is not pinned in the child (mlock is not inherited), so the
 *   registry and the host backend's tables start empty and the parent's default pool is left
 *   behind (its memory stays mapped, copied on write, and is never handed out as pinned);
 * - the parent's pools, datasets, loaders and fences are "foreign" (handles.c): every call on one
 *   fails with PM_ERR_STATE and its destroy only forgets it, returning at once.
 * With the cuda backend the CUDA driver cannot be used in a forked child at all, so the first
 * pinmem call that needs the backend fails with PM_ERR_STATE and says to use spawn or
 * forkserver; pinmem makes no CUDA call in such a child (pm_finalize included).
 *
 * Mechanism: pthread_atfork handlers, installed once by the first pm_init or handle. Before
 * fork() the prepare handler takes every process-wide lock in the library's lock order, so no
 * table is copied half-updated; the parent handler releases them; the child handler bumps the
 * fork generation and gives each module fresh locks and empty per-process state. Locks of
 * objects (a pool's, a stream's, a loader's) are not taken: those objects are foreign in the
 * child and never locked there.
 *
 * Lock order taken by prepare: pool default_lock -> api (init_lock, reg_lock) -> config ->
 * copy engine (completion queue, reaper) -> thread pool -> host backend (obj_lock, rec_lock,
 * mem_lock) -> registry -> handles. Each is a leaf or follows the order its file documents.
 */
#include <pthread.h>
#include <stdatomic.h>

#include "internal.h"

static atomic_uint g_generation;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

unsigned pm__fork_generation(void) {
  return atomic_load_explicit(&g_generation, memory_order_relaxed);
}

static void prepare(void) {
  /* pm_pool_default holds default_lock while pm_pool_create starts the backend (init_lock). */
  pm__pool_atfork(PM__FORK_PREPARE);
  pm__api_atfork(PM__FORK_PREPARE);
  pm__config_atfork(PM__FORK_PREPARE);
  pm__copy_atfork(PM__FORK_PREPARE);
  pm__threadpool_atfork(PM__FORK_PREPARE);
  pm__host_atfork(PM__FORK_PREPARE);
  pm__registry_atfork(PM__FORK_PREPARE);
  pm__handles_atfork_prepare();
}

static void parent(void) {
  pm__handles_atfork_parent();
  pm__registry_atfork(PM__FORK_PARENT);
  pm__host_atfork(PM__FORK_PARENT);
  pm__threadpool_atfork(PM__FORK_PARENT);
  pm__copy_atfork(PM__FORK_PARENT);
  pm__config_atfork(PM__FORK_PARENT);
  pm__api_atfork(PM__FORK_PARENT);
  pm__pool_atfork(PM__FORK_PARENT);
}

static void child(void) {
  atomic_fetch_add_explicit(&g_generation, 1, memory_order_relaxed);
  pm__handles_atfork_child();
  pm__registry_atfork(PM__FORK_CHILD);
  pm__host_atfork(PM__FORK_CHILD);
  pm__threadpool_atfork(PM__FORK_CHILD);
  pm__copy_atfork(PM__FORK_CHILD);
  pm__config_atfork(PM__FORK_CHILD);
  pm__pool_atfork(PM__FORK_CHILD);
  pm__api_atfork(PM__FORK_CHILD);
}

static void install(void) {
  (void)pthread_atfork(prepare, parent, child);
}

void pm__fork_watch(void) {
  (void)pthread_once(&g_once, install);
}
