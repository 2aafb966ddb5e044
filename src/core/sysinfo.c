/*
 * DESIGN: facts about the machine and the process that the pool, the config defaults and the
 * CLI need: a monotonic clock, page size, RAM, usable CPUs, and the locked-memory limit.
 *
 * The memlock limit matters because the host backend pins with mlock: RLIMIT_MEMLOCK caps it
 * unless the process holds CAP_IPC_LOCK (root usually does), in which case the kernel ignores
 * the limit. pm__memlock_limit() folds both into the one number callers budget against.
 * Nothing here is cached except the page size: limits and capabilities can change at run time
 * (setrlimit, capset) and these calls are rare (pool creation, `pinmem info`).
 *
 * Threads: no locks; the cached page size is a relaxed atomic (every thread stores the same).
 */
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define PM__CAP_IPC_LOCK 14 /* linux/capability.h */

double pm__now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

size_t pm__page_size(void) {
  static _Atomic size_t cached;
  size_t v = atomic_load_explicit(&cached, memory_order_relaxed);
  if (v) return v;
  long ps = sysconf(_SC_PAGESIZE);
  v = ps > 0 ? (size_t)ps : 4096;
  atomic_store_explicit(&cached, v, memory_order_relaxed);
  return v;
}

size_t pm__physical_memory(void) {
  long pages = sysconf(_SC_PHYS_PAGES);
  if (pages <= 0) return 0;
  size_t ps = pm__page_size();
  if ((size_t)pages > SIZE_MAX / ps) return SIZE_MAX;
  return (size_t)pages * ps;
}

int pm__cpu_count(void) {
  /* The affinity mask, not the machine: a container or taskset may give us fewer CPUs than
   * are online, and spawning a touch thread per online CPU would oversubscribe. */
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

bool pm__has_cap_ipc_lock(void) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return false;
  char line[256];
  bool has = false;
  while (fgets(line, sizeof line, f)) {
    unsigned long long caps;
    if (strncmp(line, "CapEff:", 7) == 0) {
      if (sscanf(line + 7, "%llx", &caps) == 1) has = (caps >> PM__CAP_IPC_LOCK) & 1ull;
      break;
    }
  }
  fclose(f);
  return has;
}

size_t pm__memlock_rlimit_raw(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0) return SIZE_MAX;
  if (rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= (rlim_t)SIZE_MAX) return SIZE_MAX;
  return (size_t)rl.rlim_cur;
}

size_t pm__memlock_limit(void) {
  size_t raw = pm__memlock_rlimit_raw();
  if (raw == SIZE_MAX) return SIZE_MAX;
  if (pm__has_cap_ipc_lock()) return SIZE_MAX;
  return raw;
}
