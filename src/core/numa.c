/*
 * DESIGN: the machine's NUMA topology as sysfs describes it, for `pinmem info` and for placing
 * pinned memory and pinmem's threads next to a GPU (numa_place.c acts on it).
 *
 * Sources (all plain text files the kernel writes):
 *   <root>/devices/system/node/nodeN/cpulist   CPUs of node N ("0-3,8,10-11")
 *   <root>/devices/system/node/nodeN/meminfo   "Node N MemTotal:  123 kB", MemFree likewise
 *   <root>/bus/pci/devices/<bus id>/numa_node  the device's node; -1 when the firmware gives none
 *   <root>/bus/pci/devices/<bus id>/local_cpulist  CPUs close to the device
 * Everything goes through pm__topology_read with the root as an argument, so tests point it at
 * a fake tree in a temporary folder.
 *
 * Data: pm__topology_t is a fixed-size value the caller owns (nodes in ascending id, devices in
 * the order asked). CPU sets are bit masks of PM__CPUS_MAX bits.
 *
 * Invariants: a part that cannot be read or parsed is marked unknown (node -1, cpus_known and
 * mem_known false) and named in `problems`; it never fails the whole read, because a machine
 * without NUMA (no node folder, a container that hides /sys) is normal. Only bad arguments
 * fail. The cpulist parser rejects anything it does not fully understand instead of guessing.
 *
 * Threads: no state, no locks; reentrant.
 */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static void cpus_set(pm__cpus_t *c, int cpu) {
  c->bits[cpu / 64] |= (uint64_t)1 << (cpu % 64);
}

bool pm__cpus_has(const pm__cpus_t *c, int cpu) {
  if (!c || cpu < 0 || cpu >= PM__CPUS_MAX) return false;
  return (c->bits[cpu / 64] >> (cpu % 64)) & 1u;
}

int pm__cpus_count(const pm__cpus_t *c) {
  int n = 0;
  for (int i = 0; c && i < PM__CPUS_MAX / 64; i++) n += __builtin_popcountll(c->bits[i]);
  return n;
}

/* A decimal CPU id at *p; advances *p. -1 when there are no digits or the id is too large. */
static long parse_id(const char **p) {
  const char *s = *p;
  if (!isdigit((unsigned char)*s)) return -1;
  long v = 0;
  while (isdigit((unsigned char)*s)) {
    v = v * 10 + (*s - '0');
    if (v >= PM__CPUS_MAX) return -1;
    s++;
  }
  *p = s;
  return v;
}

pm_status_t pm__cpulist_parse(const char *text, pm__cpus_t *out) {
  if (!text || !out) return pm__set_error(PM_ERR_INVALID, "cpulist: text and out are required");
  pm__cpus_t c;
  memset(&c, 0, sizeof c);
  const char *p = text;
  /* The kernel writes "" (or "\n") for a node without CPUs, such as a memory-only node. */
  while (*p && *p != '\n') {
    long lo = parse_id(&p), hi = lo;
    if (lo >= 0 && *p == '-') {
      p++;
      hi = parse_id(&p);
    }
    if (lo < 0 || hi < 0 || hi < lo || (*p != ',' && *p != '\n' && *p != '\0'))
      return pm__set_error(PM_ERR_FORMAT,
                           "cpulist '%.64s' is malformed near '%.16s' (expected ids below %d "
                           "as 'a', 'a-b' with a <= b, separated by commas)",
                           text, p, PM__CPUS_MAX);
    for (long i = lo; i <= hi; i++) cpus_set(&c, (int)i);
    if (*p == ',') {
      p++;
      if (*p == '\0' || *p == '\n')
        return pm__set_error(PM_ERR_FORMAT, "cpulist '%.64s' ends with a comma", text);
    }
  }
  if (*p == '\n' && p[1] != '\0')
    return pm__set_error(PM_ERR_FORMAT, "cpulist '%.64s' has text after its line", text);
  *out = c;
  return PM_OK;
}

void pm__cpulist_format(const pm__cpus_t *cpus, char *buf, size_t len) {
  if (!buf || len == 0) return;
  buf[0] = '\0';
  if (!cpus) return;
  size_t used = 0;
  for (int i = 0; i < PM__CPUS_MAX; i++) {
    if (!pm__cpus_has(cpus, i)) continue;
    int j = i;
    while (j + 1 < PM__CPUS_MAX && pm__cpus_has(cpus, j + 1)) j++;
    int w = j > i ? snprintf(buf + used, len - used, "%s%d-%d", used ? "," : "", i, j)
                  : snprintf(buf + used, len - used, "%s%d", used ? "," : "", i);
    if (w < 0 || (size_t)w >= len - used) { /* out of room: cut at the last whole entry */
      buf[used] = '\0';
      return;
    }
    used += (size_t)w;
    i = j;
  }
}

static void add_problem(pm__topology_t *t, const char *fmt, ...) PM__PRINTF(2, 3);
static void add_problem(pm__topology_t *t, const char *fmt, ...) {
  size_t used = strlen(t->problems);
  if (used + 3 >= sizeof t->problems) return;
  if (used) {
    memcpy(t->problems + used, "; ", 3);
    used += 2;
  }
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(t->problems + used, sizeof t->problems - used, fmt, ap);
  va_end(ap);
}

/* The first line of a small sysfs file, without its newline. false if it cannot be read. */
static bool read_line(const char *path, char *buf, size_t len) {
  FILE *f = fopen(path, "r");
  if (!f) return false;
  bool ok = fgets(buf, (int)len, f) != NULL;
  fclose(f);
  if (ok) buf[strcspn(buf, "\n")] = '\0';
  return ok;
}

/* A cpulist file into *cpus; problems are noted under `what`. */
static bool read_cpulist(pm__topology_t *t, const char *path, const char *what, pm__cpus_t *cpus) {
  char line[4096];
  errno = 0;
  if (!read_line(path, line, sizeof line)) {
    /* An empty file (a CPU-less node) reads as no line: that is an empty set, not a problem. */
    FILE *f = fopen(path, "r");
    if (f) {
      fclose(f);
      memset(cpus, 0, sizeof *cpus);
      return true;
    }
    add_problem(t, "%s: %s", what, errno ? strerror(errno) : "unreadable");
    return false;
  }
  if (pm__cpulist_parse(line, cpus) != PM_OK) {
    add_problem(t, "%s: malformed '%.40s'", what, line);
    pm__clear_error();
    return false;
  }
  return true;
}

/* MemTotal and MemFree of a node's meminfo ("Node 0 MemTotal:  65843552 kB"). */
static bool read_meminfo(pm__topology_t *t, const char *path, const char *what, size_t *total,
                         size_t *free_bytes) {
  FILE *f = fopen(path, "r");
  if (!f) {
    add_problem(t, "%s: %s", what, strerror(errno));
    return false;
  }
  char line[256];
  bool have_total = false, have_free = false;
  while (fgets(line, sizeof line, f)) {
    int node;
    char key[64];
    unsigned long long kb;
    if (sscanf(line, "Node %d %63[^:]: %llu kB", &node, key, &kb) != 3) continue;
    if (strcmp(key, "MemTotal") == 0) {
      *total = (size_t)kb * 1024;
      have_total = true;
    } else if (strcmp(key, "MemFree") == 0) {
      *free_bytes = (size_t)kb * 1024;
      have_free = true;
    }
  }
  fclose(f);
  if (!have_total || !have_free) add_problem(t, "%s: no MemTotal/MemFree lines", what);
  return have_total && have_free;
}

static int cmp_node(const void *a, const void *b) {
  const pm__numa_node_t *x = a, *y = b;
  return (x->id > y->id) - (x->id < y->id);
}

static void read_nodes(const char *root, pm__topology_t *t) {
  char dir[3100], path[3200], what[64];
  snprintf(dir, sizeof dir, "%s/devices/system/node", root);
  DIR *d = opendir(dir);
  if (!d) {
    add_problem(t, "%s: %s (no NUMA information)", dir, strerror(errno));
    return;
  }
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (strncmp(e->d_name, "node", 4) != 0 || !isdigit((unsigned char)e->d_name[4])) continue;
    char *end;
    long id = strtol(e->d_name + 4, &end, 10);
    /* "node01" is not a name the kernel writes; skipping it keeps nodeN's path exact. */
    if (*end != '\0' || id < 0 || id > 1000000 || (e->d_name[4] == '0' && e->d_name[5])) continue;
    if (t->node_count == PM__NUMA_MAX_NODES) {
      add_problem(t, "more than %d nodes: the rest are left out", PM__NUMA_MAX_NODES);
      break;
    }
    pm__numa_node_t *n = &t->nodes[t->node_count++];
    memset(n, 0, sizeof *n);
    n->id = (int)id;
    snprintf(path, sizeof path, "%s/node%ld/cpulist", dir, id);
    snprintf(what, sizeof what, "node%ld/cpulist", id);
    n->cpus_known = read_cpulist(t, path, what, &n->cpus);
    snprintf(path, sizeof path, "%s/node%ld/meminfo", dir, id);
    snprintf(what, sizeof what, "node%ld/meminfo", id);
    n->mem_known = read_meminfo(t, path, what, &n->mem_total, &n->mem_free);
  }
  closedir(d);
  qsort(t->nodes, (size_t)t->node_count, sizeof t->nodes[0], cmp_node);
}

static void read_device(const char *root, const char *bus_id, pm__topology_t *t,
                        pm__numa_device_t *dev) {
  memset(dev, 0, sizeof *dev);
  dev->node = -1;
  size_t i = 0;
  for (; bus_id && bus_id[i] && i + 1 < sizeof dev->pci_bus_id; i++)
    dev->pci_bus_id[i] = (char)tolower((unsigned char)bus_id[i]);
  dev->pci_bus_id[i] = '\0';
  if (!dev->pci_bus_id[0]) return; /* no PCI location (the host backend): nothing to read */
  /* A bus id is hex digits, ':' and '.': anything else would make a path outside the tree. */
  if (strspn(dev->pci_bus_id, "0123456789abcdef:.") != strlen(dev->pci_bus_id)) {
    add_problem(t, "PCI bus id '%s' is not of the form 0000:3b:00.0", dev->pci_bus_id);
    return;
  }
  char path[4200], line[64], what[96];
  snprintf(path, sizeof path, "%s/bus/pci/devices/%s/numa_node", root, dev->pci_bus_id);
  errno = 0;
  if (read_line(path, line, sizeof line)) {
    char *end;
    long v = strtol(line, &end, 10);
    if (end != line && *end == '\0' && v >= -1 && v < 1000000)
      dev->node = (int)v;
    else
      add_problem(t, "%s/numa_node: malformed '%.20s'", dev->pci_bus_id, line);
  } else {
    add_problem(t, "%s/numa_node: %s", dev->pci_bus_id, errno ? strerror(errno) : "empty");
  }
  snprintf(path, sizeof path, "%s/bus/pci/devices/%s/local_cpulist", root, dev->pci_bus_id);
  snprintf(what, sizeof what, "%s/local_cpulist", dev->pci_bus_id);
  dev->cpus_known = read_cpulist(t, path, what, &dev->cpus);
}

pm_status_t pm__topology_read(const char *sysfs_root, const char *const *bus_ids, int n,
                              pm__topology_t *out) {
  if (!out) return pm__set_error(PM_ERR_INVALID, "topology: out is required");
  if (n < 0 || n > PM__NUMA_MAX_DEVICES || (n > 0 && !bus_ids))
    return pm__set_error(PM_ERR_INVALID, "topology: %d bus ids (at most %d, ids required)", n,
                         PM__NUMA_MAX_DEVICES);
  const char *root = sysfs_root ? sysfs_root : "/sys";
  if (strlen(root) > 3000) return pm__set_error(PM_ERR_INVALID, "topology: sysfs root too long");
  memset(out, 0, sizeof *out);
  read_nodes(root, out);
  out->multi_node = out->node_count > 1;
  for (int i = 0; i < n; i++) read_device(root, bus_ids[i], out, &out->devices[i]);
  out->device_count = n;
  return PM_OK;
}
