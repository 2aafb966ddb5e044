/*
 * DESIGN: facts about the machine and the process that the pool, the config defaults and the
 * CLI need: a monotonic clock, page size, RAM, usable CPUs, the locked-memory limit, and a PCI
 * device's link from sysfs (the cuda backend's device_info).
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
#include <stdlib.h>
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

/* ---- PCI link attributes ------------------------------------------------------------------ */

/* Read a small sysfs attribute into buf (NUL-terminated, trailing newline removed). */
static int read_sysfs(const char *bus_id, const char *attr, char *buf, size_t len) {
  char path[256];
  int n = snprintf(path, sizeof path, "/sys/bus/pci/devices/%s/%s", bus_id, attr);
  if (n < 0 || (size_t)n >= sizeof path) return -1;
  FILE *f = fopen(path, "re");
  if (!f) return -1;
  size_t got = fread(buf, 1, len - 1, f);
  fclose(f);
  if (got == 0) return -1;
  buf[got] = '\0';
  while (got > 0 && (buf[got - 1] == '\n' || buf[got - 1] == ' ')) buf[--got] = '\0';
  return 0;
}

/* "32.0 GT/s PCIe" (or "32 GT/s", "2.5 GT/s") -> 5; -1 for "Unknown" or anything else. Parsed by
 * hand: strtod would follow the caller's LC_NUMERIC and misread "2.5" under a decimal comma. */
static int pcie_gen_from_speed(const char *text) {
  static const int tenths[] = {25, 50, 80, 160, 320, 640, 1280}; /* GT/s x 10, gen 1..7 */
  const char *c = text;
  long v = 0;
  if (*c < '0' || *c > '9') return -1;
  while (*c >= '0' && *c <= '9' && v < 100000) v = v * 10 + (*c++ - '0');
  v *= 10;
  if (*c == '.' && c[1] >= '0' && c[1] <= '9') v += c[1] - '0';
  for (size_t i = 0; i < sizeof tenths / sizeof tenths[0]; i++)
    if (v == tenths[i]) return (int)i + 1;
  return -1;
}

int pm__pcie_sysfs_int(const char *bus_id, const char *attr, int min_valid) {
  char buf[64];
  if (read_sysfs(bus_id, attr, buf, sizeof buf) != 0) return -1;
  char *end = NULL;
  long v = strtol(buf, &end, 10);
  if (end == buf || v < min_valid || v > 1 << 20) return -1;
  return (int)v;
}

int pm__pcie_sysfs_gen(const char *bus_id, const char *attr) {
  char buf[64];
  if (read_sysfs(bus_id, attr, buf, sizeof buf) != 0) return -1;
  return pcie_gen_from_speed(buf);
}
