/*
 * DESIGN: acting on the NUMA topology (numa.c reads it): which node new pinned memory goes to,
 * binding a range to that node before its first touch, and keeping pinmem's threads on that
 * node's CPUs.
 *
 * Placement state, process-wide, read lazily under place_lock: the nodes of the topology (read
 * once, with no device), and each device's node, read the first time a device's node matters
 * (option numa=auto on a machine with more than one node). A device's PCI bus id comes from the
 * backend's device_info of that device alone: asking every device would create a CUDA context
 * on devices the process never uses (cuda device_info switches to the device). On a single-node
 * machine nothing beyond the node list is read. pm__numa_test_override points all of it at a
 * fake sysfs tree with given bus ids.
 *
 * Binding uses libnuma, loaded at run time (dlopen "libnuma.so.1", prototypes from <numaif.h>)
 * so libpinmem starts on machines without it and says why placement is off. Without <numa.h> at
 * build time the binding is compiled out (and said so). The policy is MPOL_PREFERRED, not BIND:
 * pinned memory on the far node is slower, but a bound range whose node runs out of memory gets
 * the OOM killer at first touch; preferred falls back to another node instead. A node outside
 * the process's allowed memory nodes (cpuset) is refused before mbind (older kernels would turn
 * it silently into local allocation). Every refusal is counted and its reason kept for
 * `pinmem info`; it never fails an allocation (the caller pins with the default policy).
 *
 * Threads: pm__numa_thread_follow sets a thread's affinity once to its device's node's CPUs
 * intersected with the CPUs the process was allowed at first use; a thread-local remembers the
 * node applied, so a repeated call is one compare. pm__numa_cpus_for gives the same CPU set
 * (one rule, node_cpus) to the Python package, whose loader worker processes set their own
 * affinity to it.
 *
 * Lock order: place_lock is a leaf, held only for loads and stores: sysfs is read and the
 * backend's device_info called with it released. No other pinmem lock is taken inside it.
 */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#if defined(PINMEM_HAVE_NUMA_H)
#include <numa.h>
#include <numaif.h>
/* Mode flags get_mempolicy may return with the mode (linux/mempolicy.h; numaif.h lacks them). */
#ifndef MPOL_F_STATIC_NODES
#define MPOL_F_STATIC_NODES (1 << 15)
#endif
#ifndef MPOL_F_RELATIVE_NODES
#define MPOL_F_RELATIVE_NODES (1 << 14)
#endif
#endif

#define PM__MASK_BITS 1024 /* node ids of a policy mask; nodes above are refused */
#define PM__MASK_WORDS (PM__MASK_BITS / (8 * sizeof(unsigned long)))

/* ---- libnuma, loaded at run time ---------------------------------------------------------- */

#if defined(PINMEM_HAVE_NUMA_H)
static struct {
  __typeof__(numa_available) *available;
  __typeof__(mbind) *mbind;
  __typeof__(get_mempolicy) *get_mempolicy;
  __typeof__(set_mempolicy) *set_mempolicy;
} nl;
#endif
static pthread_once_t nl_once = PTHREAD_ONCE_INIT;
static bool nl_loaded;
static char nl_why[200];

static void nl_load(void) {
#if defined(PINMEM_HAVE_NUMA_H)
  void *h = dlopen("libnuma.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *e = dlerror();
    snprintf(nl_why, sizeof nl_why, "libnuma.so.1 not loaded: %s (install libnuma1)",
             e ? e : "not found");
    return;
  }
  /* Kept loaded for the life of the process: its functions are called from any thread. */
  *(void **)&nl.available = dlsym(h, "numa_available");
  *(void **)&nl.mbind = dlsym(h, "mbind");
  *(void **)&nl.get_mempolicy = dlsym(h, "get_mempolicy");
  *(void **)&nl.set_mempolicy = dlsym(h, "set_mempolicy");
  if (!nl.available || !nl.mbind || !nl.get_mempolicy || !nl.set_mempolicy) {
    snprintf(nl_why, sizeof nl_why, "libnuma.so.1 lacks numa_available/mbind/get_mempolicy/"
                                    "set_mempolicy");
    return;
  }
  if (nl.available() < 0) {
    snprintf(nl_why, sizeof nl_why, "libnuma: the kernel has no NUMA support (numa_available)");
    return;
  }
  nl_loaded = true;
#else
  snprintf(nl_why, sizeof nl_why, "built without <numa.h> (libnuma-dev): binding compiled out");
#endif
}

static bool libnuma(void) {
  pthread_once(&nl_once, nl_load);
  return nl_loaded;
}

/* ---- placement state ------------------------------------------------------------------------ */

static pthread_mutex_t place_lock = PTHREAD_MUTEX_INITIALIZER;
static pm__topology_t *topo;    /* the nodes (no devices); NULL until read */
static atomic_int multi = -1;   /* -1 not read yet, 0 one node or none, 1 more than one */
static int dev_node[PM__NUMA_MAX_DEVICES]; /* -1 unknown; valid where dev_read */
static bool dev_read[PM__NUMA_MAX_DEVICES];
static char *fake_root;                          /* test override of /sys */
static char *fake_ids[PM__NUMA_MAX_DEVICES];     /* its bus ids, device k = fake_ids[k] */
static int fake_n;

static atomic_ullong bind_ok, bind_failures, threads_placed, threads_refused;
static char last_failure[256], last_thread_problem[256]; /* under place_lock */

/* Thread placement: the CPUs the process was allowed at first use (saved once). */
static bool allowed_saved;
static cpu_set_t allowed;

static void note(char *where, size_t len, const char *fmt, ...) PM__PRINTF(3, 4);
static void note(char *where, size_t len, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  pthread_mutex_lock(&place_lock);
  vsnprintf(where, len, fmt, ap);
  pthread_mutex_unlock(&place_lock);
  va_end(ap);
}

/* fork: place_lock is a leaf (nothing else is locked under it), so fork.c takes it last and
 * gives it back first; the child keeps what was read (the machine did not change). */
void pm__numa_atfork(pm__fork_phase_t phase) {
  if (phase == PM__FORK_PREPARE)
    pthread_mutex_lock(&place_lock);
  else
    pthread_mutex_unlock(&place_lock); /* the child is the thread that locked it */
}

/* The node list, read once (again after an override). The files are read without the lock, so
 * place_lock is only ever held for a few loads and stores (fork: a child never inherits it
 * held across a slow read). */
static void ensure_nodes(void) {
  if (atomic_load_explicit(&multi, memory_order_acquire) >= 0) return;
  pthread_mutex_lock(&place_lock);
  char *root = fake_root ? strdup(fake_root) : NULL;
  pthread_mutex_unlock(&place_lock);
  pm__topology_t *t = calloc(1, sizeof *t);
  if (t && pm__topology_read(root, NULL, 0, t) != PM_OK) {
    free(t);
    t = NULL;
  }
  pm__clear_error();
  free(root);
  pthread_mutex_lock(&place_lock);
  if (atomic_load(&multi) < 0) { /* first, or nothing known: then there is nothing to place */
    free(topo);
    topo = t;
    t = NULL;
    atomic_store(&multi, topo && topo->multi_node ? 1 : 0);
  }
  pthread_mutex_unlock(&place_lock);
  free(t);
}

/* The node of `device` per sysfs, -1 when unknown. Reads it the first time. */
static int device_node(int device) {
  if (device < 0 || device >= PM__NUMA_MAX_DEVICES) return -1;
  pthread_mutex_lock(&place_lock);
  if (dev_read[device]) {
    int n = dev_node[device];
    pthread_mutex_unlock(&place_lock);
    return n;
  }
  char id[64] = "";
  char *root = fake_root ? strdup(fake_root) : NULL;
  bool fake = fake_root != NULL;
  if (fake && device < fake_n && fake_ids[device])
    snprintf(id, sizeof id, "%s", fake_ids[device]);
  pthread_mutex_unlock(&place_lock);

  if (!fake) {
    /* Outside the lock: the backend may take its own locks (and cuda's device_info switches
     * devices). Only the device asked about is touched. */
    const pm__backend_t *b = pm__backend();
    pm_device_info_t di;
    if (b && b->device_info(device, &di) == PM_OK) snprintf(id, sizeof id, "%s", di.pci_bus_id);
    pm__clear_error();
  }
  int node = -1;
  pm__topology_t *t = calloc(1, sizeof *t);
  const char *ids[1] = {id};
  if (t && id[0] && pm__topology_read(root, ids, 1, t) == PM_OK) node = t->devices[0].node;
  pm__clear_error();
  free(t);
  free(root);

  pthread_mutex_lock(&place_lock);
  if (!dev_read[device]) { /* an override in between wins; otherwise record */
    dev_node[device] = node;
    dev_read[device] = true;
  }
  node = dev_node[device];
  pthread_mutex_unlock(&place_lock);
  return node;
}

int pm__numa_node_for(int device) {
  long mode = pm__opt_int(PM__OPT_NUMA);
  if (mode == PM__NUMA_OFF) return -1;
  if (mode >= 0) return (int)mode;
  if (device < 0) return -1;
  ensure_nodes();
  if (atomic_load_explicit(&multi, memory_order_acquire) != 1) return -1;
  return device_node(device);
}

int pm__numa_node_current(const pm__backend_t *b) {
  long mode = pm__opt_int(PM__OPT_NUMA);
  if (mode == PM__NUMA_OFF) return -1;
  if (mode >= 0) return (int)mode;
  /* auto: the current device matters only where there is more than one node, so a single-node
   * machine never asks the backend anything (get_device creates no context: cudaGetDevice). */
  ensure_nodes();
  if (atomic_load_explicit(&multi, memory_order_acquire) != 1 || !b) return -1;
  int dev = -1;
  if (b->get_device(&dev) != PM_OK) {
    pm__clear_error();
    return -1;
  }
  return device_node(dev);
}

void pm__numa_test_override(const char *sysfs_root, const char *const *bus_ids, int n) {
  pthread_mutex_lock(&place_lock);
  free(fake_root);
  fake_root = NULL;
  for (int i = 0; i < fake_n; i++) free(fake_ids[i]);
  fake_n = 0;
  if (sysfs_root) {
    fake_root = strdup(sysfs_root);
    for (int i = 0; i < n && i < PM__NUMA_MAX_DEVICES; i++)
      fake_ids[fake_n++] = strdup(bus_ids && bus_ids[i] ? bus_ids[i] : "");
  }
  free(topo);
  topo = NULL;
  memset(dev_read, 0, sizeof dev_read);
  atomic_store(&multi, -1);
  pthread_mutex_unlock(&place_lock);
}

/* ---- binding memory ------------------------------------------------------------------------- */

static void count_failure(int node, const char *what, const char *why) {
  atomic_fetch_add(&bind_failures, 1);
  note(last_failure, sizeof last_failure, "%s for node %d: %s", what, node, why);
}

#if defined(PINMEM_HAVE_NUMA_H)
static void mask_of(int node, unsigned long *mask) {
  memset(mask, 0, PM__MASK_WORDS * sizeof *mask);
  mask[(size_t)node / (8 * sizeof *mask)] |= 1ul << ((size_t)node % (8 * sizeof *mask));
}

/* A node the process may place memory on (cpuset mems_allowed); else *why says so. */
static bool node_allowed(int node, char *why, size_t len) {
  if (node < 0 || node >= PM__MASK_BITS) {
    snprintf(why, len, "node id out of range");
    return false;
  }
  unsigned long allowed_mask[PM__MASK_WORDS];
  memset(allowed_mask, 0, sizeof allowed_mask);
  if (nl.get_mempolicy(NULL, allowed_mask, PM__MASK_BITS + 1, NULL, MPOL_F_MEMS_ALLOWED) != 0) {
    snprintf(why, len, "get_mempolicy(MPOL_F_MEMS_ALLOWED): %s", strerror(errno));
    return false;
  }
  size_t w = (size_t)node / (8 * sizeof(unsigned long));
  if (!((allowed_mask[w] >> ((size_t)node % (8 * sizeof(unsigned long)))) & 1ul)) {
    snprintf(why, len, "not among the memory nodes this process may use (no such node, or a "
                       "cpuset without it)");
    return false;
  }
  return true;
}
#endif

/* libnuma is there and the process may use `node`; else the failure of `what` is counted. */
static bool placeable(int node, const char *what) {
  if (!libnuma()) {
    count_failure(node, what, nl_why);
    return false;
  }
#if defined(PINMEM_HAVE_NUMA_H)
  char why[200];
  if (!node_allowed(node, why, sizeof why)) {
    count_failure(node, what, why);
    return false;
  }
  return true;
#else
  return false;
#endif
}

bool pm__numa_bind(void *addr, size_t len, int node) {
  if (node < 0 || !addr || len == 0 || !placeable(node, "binding")) return false;
#if defined(PINMEM_HAVE_NUMA_H)
  char why[200];
  unsigned long mask[PM__MASK_WORDS];
  mask_of(node, mask);
  if (nl.mbind(addr, len, MPOL_PREFERRED, mask, PM__MASK_BITS + 1, 0) != 0) {
    snprintf(why, sizeof why, "mbind(MPOL_PREFERRED): %s", strerror(errno));
    count_failure(node, "binding", why);
    return false;
  }
  atomic_fetch_add(&bind_ok, 1);
  return true;
#else
  return false;
#endif
}

bool pm__numa_prefer_begin(int node, pm__numa_policy_t *saved) {
  memset(saved, 0, sizeof *saved);
  if (node < 0 || !placeable(node, "preferring")) return false;
#if defined(PINMEM_HAVE_NUMA_H)
  char why[200];
  _Static_assert(sizeof saved->mask == PM__MASK_WORDS * sizeof(unsigned long), "mask size");
  if (nl.get_mempolicy(&saved->mode, saved->mask, PM__MASK_BITS + 1, NULL, 0) != 0) {
    snprintf(why, sizeof why, "get_mempolicy: %s", strerror(errno));
    count_failure(node, "preferring", why);
    return false;
  }
  unsigned long mask[PM__MASK_WORDS];
  mask_of(node, mask);
  if (nl.set_mempolicy(MPOL_PREFERRED, mask, PM__MASK_BITS + 1) != 0) {
    snprintf(why, sizeof why, "set_mempolicy(MPOL_PREFERRED): %s", strerror(errno));
    count_failure(node, "preferring", why);
    return false;
  }
  saved->active = true;
  atomic_fetch_add(&bind_ok, 1);
  return true;
#else
  return false;
#endif
}

void pm__numa_prefer_end(pm__numa_policy_t *saved) {
  if (!saved || !saved->active) return;
  saved->active = false;
#if defined(PINMEM_HAVE_NUMA_H)
  /* The thread's own policy comes back as it was (MPOL_DEFAULT takes no mask). */
  int mode = saved->mode;
  const unsigned long *mask = (mode & ~(MPOL_F_STATIC_NODES | MPOL_F_RELATIVE_NODES)) ==
                                      MPOL_DEFAULT
                                  ? NULL
                                  : saved->mask;
  if (nl.set_mempolicy(mode, mask, mask ? PM__MASK_BITS + 1 : 0) != 0)
    note(last_failure, sizeof last_failure, "restoring a thread's memory policy: %s",
         strerror(errno));
#endif
}

/* ---- threads -------------------------------------------------------------------------------- */

static _Thread_local int tl_node = -1; /* node this thread was placed for; -1 none */
static _Thread_local bool tl_moved;    /* its affinity was changed by pinmem */

static void restore_thread(void) {
  if (!tl_moved) return;
  pthread_mutex_lock(&place_lock);
  cpu_set_t m = allowed;
  pthread_mutex_unlock(&place_lock);
  (void)pthread_setaffinity_np(pthread_self(), sizeof m, &m);
  tl_moved = false;
}

/* The CPUs pinmem puts work for `node` on: the node's CPUs within those the process was allowed
 * at first use (saved here the first time). Their count; 0 when none (*known: whether the
 * node's CPUs are known at all). The one rule for pinmem's threads and its worker processes. */
static int node_cpus(int node, pm__cpus_t *out, bool *known) {
  memset(out, 0, sizeof *out);
  ensure_nodes();
  pthread_mutex_lock(&place_lock);
  if (!allowed_saved) {
    CPU_ZERO(&allowed);
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) CPU_ZERO(&allowed);
    allowed_saved = true;
  }
  const pm__numa_node_t *nd = NULL;
  for (int i = 0; topo && i < topo->node_count; i++)
    if (topo->nodes[i].id == node) nd = &topo->nodes[i];
  int count = 0;
  if (nd && nd->cpus_known)
    for (int c = 0; c < PM__CPUS_MAX && c < CPU_SETSIZE; c++)
      if (pm__cpus_has(&nd->cpus, c) && CPU_ISSET(c, &allowed)) {
        out->bits[c / 64] |= UINT64_C(1) << (c % 64);
        count++;
      }
  if (known) *known = nd && nd->cpus_known;
  pthread_mutex_unlock(&place_lock);
  return count;
}

int pm__numa_cpus_for(int device, pm__cpus_t *out) {
  memset(out, 0, sizeof *out);
  if (!pm__opt_int(PM__OPT_NUMA_THREADS) || device < 0) return 0;
  int node = pm__numa_node_for(device);
  if (node < 0) return 0;
  return node_cpus(node, out, NULL) > 0;
}

void pm__numa_thread_follow(int device) {
  if (!pm__opt_int(PM__OPT_NUMA_THREADS)) return;
  int node = device < 0 ? -1 : pm__numa_node_for(device);
  if (node == tl_node) return;
  tl_node = node;
  if (node < 0) {
    restore_thread();
    return;
  }
  pm__cpus_t cpus;
  bool known = false;
  int count = node_cpus(node, &cpus, &known);
  if (count == 0) {
    atomic_fetch_add(&threads_refused, 1);
    note(last_thread_problem, sizeof last_thread_problem,
         "node %d: %s: threads left where they were", node,
         known ? "none of its CPUs is allowed to this process" : "its CPUs are unknown");
    restore_thread();
    return;
  }
  cpu_set_t want;
  CPU_ZERO(&want);
  for (int c = 0; c < PM__CPUS_MAX && c < CPU_SETSIZE; c++)
    if (pm__cpus_has(&cpus, c)) CPU_SET(c, &want);
  int e = pthread_setaffinity_np(pthread_self(), sizeof want, &want);
  if (e != 0) {
    atomic_fetch_add(&threads_refused, 1);
    note(last_thread_problem, sizeof last_thread_problem, "node %d: pthread_setaffinity_np: %s",
         node, strerror(e));
    return;
  }
  tl_moved = true;
  atomic_fetch_add(&threads_placed, 1);
}

/* ---- what `pinmem info` shows -------------------------------------------------------------- */

void pm__numa_state(pm__numa_state_t *out) {
  memset(out, 0, sizeof *out);
  out->mode = pm__opt_int(PM__OPT_NUMA);
  out->threads = pm__opt_int(PM__OPT_NUMA_THREADS) != 0;
  out->libnuma = libnuma();
  snprintf(out->libnuma_why, sizeof out->libnuma_why, "%s", nl_why);
  ensure_nodes();
  out->multi_node = atomic_load(&multi) == 1;
  out->bind_ok = atomic_load(&bind_ok);
  out->bind_failures = atomic_load(&bind_failures);
  out->threads_placed = atomic_load(&threads_placed);
  out->threads_refused = atomic_load(&threads_refused);
  pthread_mutex_lock(&place_lock);
  out->node_count = topo ? topo->node_count : 0;
  snprintf(out->last_failure, sizeof out->last_failure, "%s", last_failure);
  snprintf(out->last_thread_problem, sizeof out->last_thread_problem, "%s", last_thread_problem);
  pthread_mutex_unlock(&place_lock);
}
