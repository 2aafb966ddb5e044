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
 * Mechanism: pthread_atfork handlers, installed when the library is loaded (a constructor; the
 * static library's users keep this object through the -u pm__fork_install link option that the
 * pinmem_static target carries). fork.c sits on top of every module it resets: it calls each
 * module's atfork hook and nothing calls up into it; the fork generation lives in handles.c, a
 * leaf, which counts the forks in its child hook and keeps the "armed" flag: the handlers act only
 * once pinmem was used (pm_init or the first handle). Before
 * fork() the prepare handler takes every process-wide lock in the library's lock order, so no
 * table is copied half-updated; the parent handler releases them; the child handler bumps the
 * fork generation and gives each module fresh locks and empty per-process state. Locks of
 * objects (a pool's, a stream's, a loader's) are not taken: those objects are foreign in the
 * child and never locked there.
 *
 * Lock order taken by prepare: pool default_lock -> init (init_lock) -> api (reg_lock) ->
 * config -> copy engine (completion queue, reaper) -> thread pool -> host backend (obj_lock,
 * rec_lock, mem_lock) -> registry -> shared memory (core/shared.c, shared_api.c) -> handles.
 * Each is a leaf or follows the order its file documents.
 */
#include <pthread.h>

#include "internal.h"


/* Whether prepare found pinmem in use (pm__fork_armed), for parent and child of the same fork:
 * a process that never used pinmem forks untouched, as it did before the handlers existed. */
static bool g_active;

static void prepare(void) {
  g_active = pm__fork_armed();
  if (!g_active) return;
  /* pm_pool_default holds default_lock while pm_pool_create starts the backend (init_lock). */
  pm__pool_atfork(PM__FORK_PREPARE);
  pm__init_atfork(PM__FORK_PREPARE);
  pm__api_atfork(PM__FORK_PREPARE);
  pm__config_atfork(PM__FORK_PREPARE);
  pm__copy_atfork(PM__FORK_PREPARE);
  pm__threadpool_atfork(PM__FORK_PREPARE);
  pm__host_atfork(PM__FORK_PREPARE);
  pm__registry_atfork(PM__FORK_PREPARE);
  pm__shared_atfork(PM__FORK_PREPARE);
  pm__shared_api_atfork(PM__FORK_PREPARE);
  pm__handles_atfork_prepare();
  pm__numa_atfork(PM__FORK_PREPARE);
}

static void parent(void) {
  if (!g_active) return;
  pm__numa_atfork(PM__FORK_PARENT);
  pm__handles_atfork_parent();
  pm__shared_api_atfork(PM__FORK_PARENT);
  pm__shared_atfork(PM__FORK_PARENT);
  pm__registry_atfork(PM__FORK_PARENT);
  pm__host_atfork(PM__FORK_PARENT);
  pm__threadpool_atfork(PM__FORK_PARENT);
  pm__copy_atfork(PM__FORK_PARENT);
  pm__config_atfork(PM__FORK_PARENT);
  pm__api_atfork(PM__FORK_PARENT);
  pm__init_atfork(PM__FORK_PARENT);
  pm__pool_atfork(PM__FORK_PARENT);
}

static void child(void) {
  if (!g_active) return;
  pm__numa_atfork(PM__FORK_CHILD);
  pm__handles_atfork_child(); /* counts the fork: handles made before it are foreign now */
  pm__shared_api_atfork(PM__FORK_CHILD);
  pm__shared_atfork(PM__FORK_CHILD);
  pm__registry_atfork(PM__FORK_CHILD);
  pm__host_atfork(PM__FORK_CHILD);
  pm__threadpool_atfork(PM__FORK_CHILD);
  pm__copy_atfork(PM__FORK_CHILD);
  pm__config_atfork(PM__FORK_CHILD);
  pm__pool_atfork(PM__FORK_CHILD);
  pm__api_atfork(PM__FORK_CHILD);
  pm__init_atfork(PM__FORK_CHILD);
}

/* Non-static so that `-u pm__fork_install` keeps this object in a static link. */
void pm__fork_install(void);
__attribute__((constructor)) void pm__fork_install(void) {
  (void)pthread_atfork(prepare, parent, child);
}
