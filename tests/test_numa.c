/* NUMA topology: the cpulist parser, pm__topology_read over a fake sysfs tree (two nodes, GPUs
 * on each, a GPU with node -1, a missing file, malformed lists), the real /sys, and where the
 * kernel actually put the pages of a pinned pool block (move_pages).
 * NUMA placement: pool blocks of each kind bound to a node (the kernel asked where the pages are
 * and which policy the range has), numa off and auto, a node this machine lacks (fallback,
 * counted), per-node caches, and thread placement, over the real machine and a fake tree. */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "check.h"
#include "internal.h"

/* ---- the cpulist parser ---- */

static void check_bad_cpulist(const char *text) {
  pm__cpus_t c;
  memset(&c, 0xa5, sizeof c);
  pm_status_t st = pm__cpulist_parse(text, &c);
  if (st != PM_ERR_FORMAT) fprintf(stderr, "cpulist '%s' was accepted\n", text);
  CHECK_ERR_MSG(st, PM_ERR_FORMAT);
  CHECK(strstr(pm_last_error(), "cpulist") != NULL);
  /* Outputs are set only on success. */
  CHECK(c.bits[0] == 0xa5a5a5a5a5a5a5a5ull);
}

static void test_cpulist(void) {
  pm__cpus_t c;
  char buf[256];
  CHECK_OK(pm__cpulist_parse("0-3,8,10-11", &c));
  CHECK_EQ_INT(pm__cpus_count(&c), 7);
  for (int i = 0; i < 16; i++)
    CHECK_EQ_INT(pm__cpus_has(&c, i), (i <= 3 || i == 8 || i == 10 || i == 11));
  pm__cpulist_format(&c, buf, sizeof buf);
  CHECK(strcmp(buf, "0-3,8,10-11") == 0);

  CHECK_OK(pm__cpulist_parse("5\n", &c));
  CHECK_EQ_INT(pm__cpus_count(&c), 1);
  CHECK(pm__cpus_has(&c, 5));
  CHECK_OK(pm__cpulist_parse("1023", &c));
  CHECK(pm__cpus_has(&c, 1023));
  CHECK(!pm__cpus_has(&c, 1024) && !pm__cpus_has(&c, -1));
  CHECK_OK(pm__cpulist_parse("0-1023", &c));
  CHECK_EQ_INT(pm__cpus_count(&c), 1024);
  pm__cpulist_format(&c, buf, sizeof buf);
  CHECK(strcmp(buf, "0-1023") == 0);
  /* A memory-only node has an empty list. */
  CHECK_OK(pm__cpulist_parse("", &c));
  CHECK_EQ_INT(pm__cpus_count(&c), 0);
  CHECK_OK(pm__cpulist_parse("\n", &c));
  CHECK_EQ_INT(pm__cpus_count(&c), 0);
  pm__cpulist_format(&c, buf, sizeof buf);
  CHECK(buf[0] == '\0');

  /* Formatting into a short buffer cuts at a whole entry. */
  CHECK_OK(pm__cpulist_parse("0,2,4,6,8,10", &c));
  pm__cpulist_format(&c, buf, 8);
  CHECK(strcmp(buf, "0,2,4,6") == 0);

  const char *bad[] = {"3-1",     "1,,2", "1,",  ",1",   "a",    "-1",    "1-",
                       "0-99999", "1024", "1 2", "1\n2", "0-3x", "1-2-3", "99999999999999999999"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) check_bad_cpulist(bad[i]);
  CHECK_ERR_MSG(pm__cpulist_parse(NULL, &c), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm__cpulist_parse("0", NULL), PM_ERR_INVALID);
}

/* ---- a fake sysfs tree ---- */

static void put(const char *root, const char *rel, const char *text) {
  char path[1024];
  snprintf(path, sizeof path, "%s/%s", root, rel);
  /* mkdir -p of the file's folder */
  for (char *s = path + strlen(root) + 1; *s; s++) {
    if (*s != '/') continue;
    *s = '\0';
    REQUIRE(mkdir(path, 0755) == 0 || errno == EEXIST);
    *s = '/';
  }
  FILE *f = fopen(path, "w");
  REQUIRE(f != NULL);
  fputs(text, f);
  REQUIRE(fclose(f) == 0);
}

static void put_node(const char *root, int id, const char *cpulist, unsigned long total_kb,
                     unsigned long free_kb) {
  char rel[128], text[512];
  snprintf(rel, sizeof rel, "devices/system/node/node%d/cpulist", id);
  put(root, rel, cpulist);
  snprintf(rel, sizeof rel, "devices/system/node/node%d/meminfo", id);
  snprintf(text, sizeof text,
           "Node %d MemTotal:       %lu kB\nNode %d MemFree:        %lu kB\n"
           "Node %d MemUsed:        %lu kB\nNode %d HugePages_Total:     0\n",
           id, total_kb, id, free_kb, id, total_kb - free_kb, id);
  put(root, rel, text);
}

static void put_gpu(const char *root, const char *bus_id, const char *node, const char *cpus) {
  char rel[256];
  if (node) {
    snprintf(rel, sizeof rel, "bus/pci/devices/%s/numa_node", bus_id);
    put(root, rel, node);
  }
  if (cpus) {
    snprintf(rel, sizeof rel, "bus/pci/devices/%s/local_cpulist", bus_id);
    put(root, rel, cpus);
  }
}

static const pm__numa_node_t *node_by_id(const pm__topology_t *t, int id) {
  for (int i = 0; i < t->node_count; i++)
    if (t->nodes[i].id == id) return &t->nodes[i];
  return NULL;
}

static bool cpus_are(const pm__cpus_t *c, const char *want) {
  char buf[512];
  pm__cpulist_format(c, buf, sizeof buf);
  if (strcmp(buf, want) != 0) fprintf(stderr, "cpus '%s', want '%s'\n", buf, want);
  return strcmp(buf, want) == 0;
}

static void test_fake_tree(void) {
  char root[512];
  REQUIRE(pm_test_tmpdir(root, sizeof root, "numa"));
  pm__topology_t *t = calloc(1, sizeof *t);
  REQUIRE(t != NULL);

  /* No node folder at all (a kernel without NUMA, a container hiding /sys): no nodes, named. */
  CHECK_OK(pm__topology_read(root, NULL, 0, t));
  CHECK_EQ_INT(t->node_count, 0);
  CHECK(!t->multi_node);
  CHECK(strstr(t->problems, "no NUMA information") != NULL);

  /* Two sockets; the kernel lists node1 before node0 here, the result is still in id order. */
  put_node(root, 1, "8-15,24-31\n", 2097152, 1048576);
  put_node(root, 0, "0-7,16-23\n", 4194304, 3145728);
  put(root, "devices/system/node/possible", "0-1\n"); /* not a node folder */
  put(root, "devices/system/node/online", "0-1\n");
  put_gpu(root, "0000:3b:00.0", "0\n", "0-7,16-23\n");
  put_gpu(root, "0000:af:00.0", "1\n", "8-15,24-31\n");
  put_gpu(root, "0000:d8:00.0", "-1\n", "0-31\n"); /* firmware gave no node */
  put_gpu(root, "0000:5e:00.0", NULL, "0-3,x\n");  /* numa_node missing, list bad */
  const char *ids[] = {"0000:3B:00.0", "0000:af:00.0", "0000:d8:00.0", "0000:5e:00.0", "",
                       "0000:00:00.0", "../../../etc"};
  const int n = (int)(sizeof ids / sizeof ids[0]);
  CHECK_OK(pm__topology_read(root, ids, n, t));

  CHECK_EQ_INT(t->node_count, 2);
  CHECK(t->multi_node);
  CHECK_EQ_INT(t->nodes[0].id, 0);
  CHECK_EQ_INT(t->nodes[1].id, 1);
  const pm__numa_node_t *n0 = node_by_id(t, 0), *n1 = node_by_id(t, 1);
  REQUIRE(n0 && n1);
  CHECK(n0->cpus_known && cpus_are(&n0->cpus, "0-7,16-23"));
  CHECK(n1->cpus_known && cpus_are(&n1->cpus, "8-15,24-31"));
  CHECK(n0->mem_known && n1->mem_known);
  CHECK_EQ_SIZE(n0->mem_total, 4194304ull * 1024);
  CHECK_EQ_SIZE(n0->mem_free, 3145728ull * 1024);
  CHECK_EQ_SIZE(n1->mem_total, 2097152ull * 1024);
  CHECK_EQ_SIZE(n1->mem_free, 1048576ull * 1024);

  CHECK_EQ_INT(t->device_count, n);
  /* Bus ids are matched lowercased, as sysfs writes them. */
  CHECK(strcmp(t->devices[0].pci_bus_id, "0000:3b:00.0") == 0);
  CHECK_EQ_INT(t->devices[0].node, 0);
  CHECK(t->devices[0].cpus_known && cpus_are(&t->devices[0].cpus, "0-7,16-23"));
  CHECK_EQ_INT(t->devices[1].node, 1);
  CHECK(t->devices[1].cpus_known && cpus_are(&t->devices[1].cpus, "8-15,24-31"));
  CHECK_EQ_INT(t->devices[2].node, -1);
  CHECK(t->devices[2].cpus_known && cpus_are(&t->devices[2].cpus, "0-31"));
  CHECK_EQ_INT(t->devices[3].node, -1);
  CHECK(!t->devices[3].cpus_known);
  CHECK(strstr(t->problems, "0000:5e:00.0/numa_node") != NULL);
  CHECK(strstr(t->problems, "0000:5e:00.0/local_cpulist: malformed '0-3,x'") != NULL);
  /* The host backend's device: no PCI location, nothing read, nothing to complain about. */
  CHECK(t->devices[4].pci_bus_id[0] == '\0');
  CHECK_EQ_INT(t->devices[4].node, -1);
  CHECK(!t->devices[4].cpus_known);
  CHECK(strstr(t->problems, "''") == NULL);
  /* A device the tree does not have, and an id that would leave the tree. */
  CHECK_EQ_INT(t->devices[5].node, -1);
  CHECK(strstr(t->problems, "0000:00:00.0/numa_node") != NULL);
  CHECK_EQ_INT(t->devices[6].node, -1);
  CHECK(strstr(t->problems, "'../../../etc' is not of the form") != NULL);
  if (strstr(t->problems, "node0") || strstr(t->problems, "node1"))
    fprintf(stderr, "unexpected problems: %s\n", t->problems);
  CHECK(strstr(t->problems, "node0") == NULL && strstr(t->problems, "node1") == NULL);

  /* A malformed node list and a missing meminfo: that part unknown, the rest still read. */
  put(root, "devices/system/node/node1/cpulist", "8-x\n");
  char path[1024];
  snprintf(path, sizeof path, "%s/devices/system/node/node0/meminfo", root);
  REQUIRE(unlink(path) == 0);
  CHECK_OK(pm__topology_read(root, ids, 2, t));
  CHECK_EQ_INT(t->node_count, 2);
  n0 = node_by_id(t, 0);
  n1 = node_by_id(t, 1);
  REQUIRE(n0 && n1);
  CHECK(n0->cpus_known && cpus_are(&n0->cpus, "0-7,16-23"));
  CHECK(!n0->mem_known);
  CHECK(!n1->cpus_known);
  CHECK(n1->mem_known);
  CHECK_EQ_SIZE(n1->mem_total, 2097152ull * 1024);
  CHECK(strstr(t->problems, "node1/cpulist: malformed '8-x'") != NULL);
  CHECK(strstr(t->problems, "node0/meminfo") != NULL);
  CHECK_EQ_INT(t->devices[1].node, 1);

  /* One node: not multi-node. A memory-only node (empty cpulist) reads as no CPUs. */
  pm_test_rmtree(root);
  REQUIRE(pm_test_tmpdir(root, sizeof root, "numa1"));
  put_node(root, 0, "0-3\n", 1024, 512);
  CHECK_OK(pm__topology_read(root, NULL, 0, t));
  CHECK_EQ_INT(t->node_count, 1);
  CHECK(!t->multi_node);
  CHECK(t->problems[0] == '\0');
  put(root, "devices/system/node/node2/cpulist", "");
  put(root, "devices/system/node/node2/meminfo", "Node 2 MemTotal: 8 kB\nNode 2 MemFree: 4 kB\n");
  CHECK_OK(pm__topology_read(root, NULL, 0, t));
  CHECK_EQ_INT(t->node_count, 2);
  CHECK(t->multi_node);
  CHECK(t->nodes[1].id == 2 && t->nodes[1].cpus_known);
  CHECK_EQ_INT(pm__cpus_count(&t->nodes[1].cpus), 0);
  CHECK_EQ_SIZE(t->nodes[1].mem_total, 8192);

  /* Bad arguments. */
  CHECK_ERR_MSG(pm__topology_read(root, NULL, 0, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm__topology_read(root, NULL, 1, t), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm__topology_read(root, ids, -1, t), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm__topology_read(root, ids, PM__NUMA_MAX_DEVICES + 1, t), PM_ERR_INVALID);

  pm_test_rmtree(root);
  free(t);
}

/* ---- this machine ---- */

/* The real /sys, and where the kernel put a pinned pool block's pages: each page's node from
 * move_pages with no target nodes. One node (or no NUMA information): node 0. More: a node
 * that the topology lists. */
static void test_real_pages(void) {
  pm__topology_t *t = calloc(1, sizeof *t);
  REQUIRE(t != NULL);
  CHECK_OK(pm__topology_read(NULL, NULL, 0, t));
  printf("this machine: %d NUMA node(s)%s%s\n", t->node_count, t->problems[0] ? "; not read: " : "",
         t->problems);
  for (int i = 0; i < t->node_count; i++) {
    CHECK(t->nodes[i].cpus_known);
    CHECK(t->nodes[i].mem_known && t->nodes[i].mem_total > 0);
  }
  if (t->node_count > 0) {
    int with_cpus = 0;
    for (int i = 0; i < t->node_count; i++) with_cpus += pm__cpus_count(&t->nodes[i].cpus) > 0;
    CHECK(with_cpus > 0);
  }

  const size_t page = pm__page_size();
  const size_t npages = 64, bytes = npages * page;
  void *p = NULL;
  CHECK_OK(pm_host_alloc(NULL, bytes, 0, &p));
  REQUIRE(p != NULL);
  pm_test_fill(p, bytes, 19); /* touch every page */
  void *pages[64];
  int status[64];
  for (size_t i = 0; i < npages; i++) {
    pages[i] = (char *)p + i * page;
    status[i] = -12345;
  }
  long rc = syscall(SYS_move_pages, 0, (unsigned long)npages, pages, NULL, status, 0);
  if (rc != 0) {
    int e = errno;
    if (e == ENOSYS || e == EPERM || e == EACCES)
      pm_test_skip("page placement: move_pages: %s (not available here)", strerror(e));
    else
      CHECK(!"move_pages failed");
    if (e != ENOSYS && e != EPERM && e != EACCES)
      fprintf(stderr, "move_pages: rc %ld: %s\n", rc, strerror(e));
  } else {
    int counts[PM__NUMA_MAX_NODES] = {0};
    for (size_t i = 0; i < npages; i++) {
      if (status[i] < 0 || status[i] >= PM__NUMA_MAX_NODES) {
        fprintf(stderr, "page %zu: status %d\n", i, status[i]);
        CHECK(status[i] >= 0 && status[i] < PM__NUMA_MAX_NODES);
        continue;
      }
      counts[status[i]]++;
      if (t->node_count <= 1)
        CHECK_EQ_INT(status[i], 0);
      else
        CHECK(node_by_id(t, status[i]) != NULL);
    }
    printf("pinned block of %zu pages:", npages);
    for (int nd = 0; nd < PM__NUMA_MAX_NODES; nd++)
      if (counts[nd]) printf(" %d on node %d", counts[nd], nd);
    printf("\n");
  }
  CHECK(pm_test_fill_ok(p, bytes, 19)); /* asking moved nothing */
  CHECK_OK(pm_host_free(p));
  free(t);
}

/* ---- placement ---- */

#define MPOL_DEFAULT_ 0
#define MPOL_PREFERRED_ 1
#define MPOL_F_ADDR_ (1 << 1)

/* Per-node page counts of [p, p + bytes) from move_pages with no target nodes (every page).
 * false (and a line saying why) where the kernel will not answer here. */
static bool page_nodes(const void *p, size_t bytes, int counts[PM__NUMA_MAX_NODES]) {
  const size_t page = pm__page_size();
  size_t n = bytes / page;
  void **pages = calloc(n, sizeof *pages);
  int *status = calloc(n, sizeof *status);
  REQUIRE(pages && status);
  for (size_t i = 0; i < n; i++) {
    pages[i] = (char *)p + i * page;
    status[i] = -12345;
  }
  memset(counts, 0, PM__NUMA_MAX_NODES * sizeof *counts);
  long rc = syscall(SYS_move_pages, 0, (unsigned long)n, pages, NULL, status, 0);
  int e = errno;
  bool ok = rc == 0;
  if (!ok && (e == ENOSYS || e == EPERM || e == EACCES)) {
    printf("page placement not checked: move_pages: %s\n", strerror(e));
  } else if (!ok) {
    fprintf(stderr, "move_pages: %s\n", strerror(e));
    CHECK(!"move_pages failed");
  } else {
    for (size_t i = 0; i < n; i++) {
      if (status[i] < 0 || status[i] >= PM__NUMA_MAX_NODES) {
        fprintf(stderr, "page %zu: status %d (not present?)\n", i, status[i]);
        CHECK(status[i] >= 0 && status[i] < PM__NUMA_MAX_NODES);
        continue;
      }
      counts[status[i]]++;
    }
  }
  free(pages);
  free(status);
  return ok;
}

/* The memory policy the kernel holds for the page at p (MPOL_F_ADDR), or the thread's (NULL). */
static int policy_of(const void *p) {
  int mode = -1;
  unsigned long mask[1024 / (8 * sizeof(unsigned long))];
  long rc = syscall(SYS_get_mempolicy, &mode, mask, 1025ul, p, p ? (unsigned long)MPOL_F_ADDR_ : 0ul);
  if (rc != 0) fprintf(stderr, "get_mempolicy: %s\n", strerror(errno));
  CHECK(rc == 0);
  return mode;
}

static pm_pool_t *small_pool(void) {
  pm_pool_config_t c;
  pm_pool_config_init(&c);
  c.fast_pin_min = (size_t)1 << 20; /* 1 MiB and up: mmap + touch + register */
  c.pin_threads = 2;
  pm_pool_t *p = NULL;
  CHECK_OK(pm_pool_create(&c, &p));
  REQUIRE(p != NULL);
  return p;
}

/* The entry of `node` in a pool's per-node stats; node -2 entries mean "absent". */
static pm_pool_node_stats_t node_stats(pm_pool_t *p, int node, int *count) {
  pm_pool_node_stats_t all[PM__NUMA_MAX_NODES + 1], r;
  memset(&r, 0, sizeof r);
  r.node = -2;
  int n = 0;
  CHECK_OK(pm_pool_numa_stats(p, all, PM__NUMA_MAX_NODES + 1, &n));
  CHECK(n >= 1 && all[0].node == -1); /* node -1 always comes first */
  for (int i = 0; i < n && i <= PM__NUMA_MAX_NODES; i++)
    if (all[i].node == node) r = all[i];
  if (count) *count = n;
  return r;
}

static bool real_multi_node(void) {
  pm__topology_t *t = calloc(1, sizeof *t);
  REQUIRE(t != NULL);
  CHECK_OK(pm__topology_read(NULL, NULL, 0, t));
  bool multi = t->multi_node;
  free(t);
  return multi;
}

/* numa=0 on the real machine: a fast-pinned block, a block from the backend's allocator and a
 * shared block each have every page on node 0, the bound ones carry the preferred policy, the
 * thread's own policy is back to what it was, and the stats say node 0 with no failure. */
static void test_place_node0(void) {
  CHECK_OK(pm_pool_trim(NULL, NULL)); /* RLIMIT_MEMLOCK is small here: give back what is cached */
  CHECK_OK(pm_option_set("numa", "0"));
  CHECK_EQ_INT(pm__numa_node_for(0), 0);
  CHECK_EQ_INT(pm__numa_node_for(-1), 0);
  pm__numa_state_t st0;
  pm__numa_state(&st0);
  if (!st0.libnuma) {
    /* Built or run without libnuma: every placement falls back, and says so. */
    printf("libnuma not available (%s): checking the fallback only\n", st0.libnuma_why);
    CHECK(st0.libnuma_why[0] != '\0');
  }
  int thread_policy = policy_of(NULL);
  pm_pool_t *pool = small_pool();
  const size_t sizes[3] = {(size_t)1 << 20, 8192, 256 << 10};
  const unsigned flags[3] = {0, 0, PM_HOST_SHARED};
  const char *what[3] = {"fast-pinned", "backend allocator", "shared"};
  void *p[3] = {NULL, NULL, NULL};
  for (int k = 0; k < 3; k++) {
    CHECK_OK(pm_host_alloc(pool, sizes[k], flags[k], &p[k]));
    REQUIRE(p[k] != NULL);
    pm_test_fill(p[k], sizes[k], 40 + (uint64_t)k);
    int counts[PM__NUMA_MAX_NODES];
    size_t span = pm__align_up(sizes[k], pm__page_size());
    if (page_nodes(p[k], span, counts)) {
      CHECK_EQ_INT(counts[0], (int)(span / pm__page_size()));
      printf("numa=0 %s block: %d of %zu pages on node 0\n", what[k], counts[0],
             span / pm__page_size());
    }
    CHECK(pm_test_fill_ok(p[k], sizes[k], 40 + (uint64_t)k));
  }
  if (st0.libnuma) {
    /* The mappings pinmem made itself carry the policy; the backend's allocation does not (the
     * thread preferred node 0 during the call), and the thread is back to its own policy. */
    CHECK_EQ_INT(policy_of(p[0]), MPOL_PREFERRED_);
    CHECK_EQ_INT(policy_of(p[2]), MPOL_PREFERRED_);
    CHECK_EQ_INT(policy_of(NULL), thread_policy);
    pm_pool_node_stats_t n0 = node_stats(pool, 0, NULL);
    CHECK_EQ_INT(n0.node, 0);
    CHECK_EQ_SIZE(n0.segments, 3);
    CHECK_EQ_SIZE(n0.blocks, 3);
    CHECK_EQ_SIZE(n0.bind_failures, 0);
    CHECK_EQ_SIZE(n0.unbound_bytes, 0);
    CHECK(n0.pinned_bytes >= sizes[0] + sizes[1] + sizes[2]);
    pm_pool_stats_t s;
    CHECK_OK(pm_pool_get_stats(pool, &s));
    CHECK_EQ_SIZE(s.numa_bind_failures, 0);
    CHECK_EQ_SIZE(s.pinned_bytes, n0.pinned_bytes);
    pm_pool_node_stats_t none = node_stats(pool, -1, NULL);
    CHECK_EQ_SIZE(none.segments, 0);
  }
  for (int k = 0; k < 3; k++) CHECK_OK(pm_host_free(p[k]));
  CHECK_OK(pm_pool_destroy(pool));
  CHECK_OK(pm_option_set("numa", NULL));
}

/* numa=off, and auto on a single-node machine: nothing placed, everything under node -1. */
static void test_place_off_auto(void) {
  const char *modes[2] = {"off", "auto"};
  bool multi = real_multi_node();
  for (int m = 0; m < 2; m++) {
    CHECK_OK(pm_option_set("numa", modes[m]));
    if (m == 1 && multi) {
      printf("numa=auto not checked as single-node: this machine has more than one node\n");
      continue;
    }
    CHECK_EQ_INT(pm__numa_node_for(0), -1);
    CHECK_EQ_INT(pm__numa_node_for(-1), -1);
    pm_pool_t *pool = small_pool();
    void *a = NULL, *b = NULL;
    CHECK_OK(pm_host_alloc(pool, (size_t)1 << 20, 0, &a));
    CHECK_OK(pm_host_alloc(pool, 4096, 0, &b));
    CHECK_EQ_INT(policy_of(a), MPOL_DEFAULT_);
    int count = 0;
    pm_pool_node_stats_t none = node_stats(pool, -1, &count);
    CHECK_EQ_INT(count, 1); /* node -1 alone */
    CHECK_EQ_SIZE(none.segments, 2);
    CHECK_EQ_SIZE(none.blocks, 2);
    CHECK_EQ_SIZE(none.bind_failures, 0);
    pm_pool_stats_t s;
    CHECK_OK(pm_pool_get_stats(pool, &s));
    CHECK_EQ_SIZE(s.numa_bind_failures, 0);
    CHECK_OK(pm_host_free(a));
    CHECK_OK(pm_host_free(b));
    CHECK_OK(pm_pool_destroy(pool));
  }
  CHECK_OK(pm_option_set("numa", NULL));
}

/* A CPU this process may run on (the last one), for a fake node that owns it. */
static int allowed_cpu(void) {
  cpu_set_t m;
  REQUIRE(sched_getaffinity(0, sizeof m, &m) == 0);
  int last = -1;
  for (int c = 0; c < CPU_SETSIZE; c++)
    if (CPU_ISSET(c, &m)) last = c;
  REQUIRE(last >= 0);
  return last;
}

/* A fake two-socket tree: device 0 on node 1, device 1 on node 0, device 2 with no node,
 * device 3 on node 2 whose CPU the process may not use. Node 1 owns `cpu` alone. */
static void fake_two_nodes(char *root, size_t len, int cpu) {
  REQUIRE(pm_test_tmpdir(root, len, "numaplace"));
  char cpus[32];
  snprintf(cpus, sizeof cpus, "%d\n", cpu);
  put_node(root, 0, "0-1023\n", 4194304, 3145728);
  put_node(root, 1, cpus, 2097152, 1048576);
  put_node(root, 2, "1000\n", 1024, 512);
  put_gpu(root, "0000:3b:00.0", "1\n", cpus);
  put_gpu(root, "0000:af:00.0", "0\n", "0-7\n");
  put_gpu(root, "0000:d8:00.0", "-1\n", "0-7\n");
  put_gpu(root, "0000:5e:00.0", "2\n", "1000\n");
  static const char *ids[4] = {"0000:3b:00.0", "0000:af:00.0", "0000:d8:00.0", "0000:5e:00.0"};
  pm__numa_test_override(root, ids, 4);
}

/* The chosen node follows the fake topology; an allocation for device 0 (node 1, which this
 * machine lacks) falls back to the default policy: pages present, the failure counted in the
 * pool's stats and in the state `pinmem info` shows. */
static void test_place_fake(void) {
  if (real_multi_node()) {
    printf("fake-tree fallback not checked: this machine has more than one node (node 1 may "
           "exist)\n");
    return;
  }
  char root[512];
  fake_two_nodes(root, sizeof root, allowed_cpu());
  CHECK_OK(pm_option_set("numa", "auto"));
  CHECK_EQ_INT(pm__numa_node_for(0), 1);
  CHECK_EQ_INT(pm__numa_node_for(1), 0);
  CHECK_EQ_INT(pm__numa_node_for(2), -1);
  CHECK_EQ_INT(pm__numa_node_for(4), -1); /* not in the tree */
  CHECK_EQ_INT(pm__numa_node_for(-1), -1);
  CHECK_OK(pm_option_set("numa", "off"));
  CHECK_EQ_INT(pm__numa_node_for(0), -1);
  CHECK_OK(pm_option_set("numa", "1"));
  CHECK_EQ_INT(pm__numa_node_for(1), 1);
  CHECK_OK(pm_option_set("numa", "auto"));

  pm__numa_state_t before, after;
  pm__numa_state(&before);
  CHECK(before.multi_node);
  CHECK_EQ_INT(before.node_count, 3);
  CHECK_EQ_INT(before.mode, PM__NUMA_AUTO);

  int dev = -1;
  CHECK_OK(pm_device_get(&dev));
  REQUIRE(dev == 0); /* the host backend's current device; device 0 sits on node 1 here */
  pm_pool_t *pool = small_pool();
  void *a = NULL, *b = NULL;
  CHECK_OK(pm_host_alloc(pool, (size_t)1 << 20, 0, &a));
  CHECK_OK(pm_host_alloc(pool, 4096, 0, &b));
  pm_test_fill(a, (size_t)1 << 20, 77);
  int counts[PM__NUMA_MAX_NODES];
  if (page_nodes(a, (size_t)1 << 20, counts))
    CHECK_EQ_INT(counts[0], (int)(((size_t)1 << 20) / pm__page_size()));
  CHECK_EQ_INT(policy_of(a), MPOL_DEFAULT_);
  CHECK(pm_test_fill_ok(a, (size_t)1 << 20, 77));

  pm_pool_node_stats_t n1 = node_stats(pool, 1, NULL);
  CHECK_EQ_INT(n1.node, 1);
  CHECK_EQ_SIZE(n1.segments, 2);
  CHECK_EQ_SIZE(n1.bind_failures, 2);
  CHECK_EQ_SIZE(n1.unbound_bytes, n1.pinned_bytes);
  pm_pool_stats_t s;
  CHECK_OK(pm_pool_get_stats(pool, &s));
  CHECK_EQ_SIZE(s.numa_bind_failures, 2);
  pm__numa_state(&after);
  CHECK(after.bind_failures >= before.bind_failures + 2);
  CHECK(strstr(after.last_failure, "node 1") != NULL);
  printf("fallback reported: %s\n", after.last_failure);

  CHECK_OK(pm_host_free(a));
  CHECK_OK(pm_host_free(b));
  CHECK_OK(pm_pool_destroy(pool));
  CHECK_OK(pm_option_set("numa", NULL));
  pm__numa_test_override(NULL, NULL, 0);
  pm_test_rmtree(root);
}

/* A block freed while pinned for node 0 never serves node 1, and does serve node 0 again. */
static void test_place_caches(void) {
  const size_t sizes[2] = {(size_t)1 << 20, 4096};
  for (int k = 0; k < 2; k++) {
    pm_pool_t *pool = small_pool();
    void *a = NULL, *b = NULL, *c = NULL;
    CHECK_OK(pm_option_set("numa", "0"));
    CHECK_OK(pm_host_alloc(pool, sizes[k], 0, &a));
    CHECK_OK(pm_host_free(a));
    CHECK_OK(pm_option_set("numa", "1"));
    CHECK_OK(pm_host_alloc(pool, sizes[k], 0, &b));
    CHECK(b != a);
    pm_pool_node_stats_t n0 = node_stats(pool, 0, NULL), n1 = node_stats(pool, 1, NULL);
    CHECK_EQ_SIZE(n0.segments, 1);
    CHECK_EQ_SIZE(n0.blocks, 0);
    CHECK(n0.cached_bytes >= sizes[k]);
    CHECK_EQ_SIZE(n1.segments, 1);
    CHECK_EQ_SIZE(n1.blocks, 1);
    CHECK_OK(pm_option_set("numa", "0"));
    pm_pool_stats_t s0, s1;
    CHECK_OK(pm_pool_get_stats(pool, &s0));
    CHECK_OK(pm_host_alloc(pool, sizes[k], 0, &c));
    CHECK(c == a); /* node 0's cached block */
    CHECK_OK(pm_pool_get_stats(pool, &s1));
    CHECK_EQ_SIZE(s1.cache_hits, s0.cache_hits + 1);
    CHECK_EQ_SIZE(s1.segments, 2);
    /* And node 1's block, freed, serves node 1 only: node off (-1) pins anew. */
    CHECK_OK(pm_host_free(b));
    CHECK_OK(pm_option_set("numa", "off"));
    void *d = NULL;
    CHECK_OK(pm_host_alloc(pool, sizes[k], 0, &d));
    CHECK(d != b && d != c);
    CHECK_OK(pm_pool_get_stats(pool, &s1));
    CHECK_EQ_SIZE(s1.segments, 3);
    CHECK_OK(pm_host_free(c));
    CHECK_OK(pm_host_free(d));
    /* Trim is pool-wide: every node's cached segments go. */
    size_t released = 0;
    CHECK_OK(pm_pool_trim(pool, &released));
    CHECK_OK(pm_pool_get_stats(pool, &s1));
    CHECK_EQ_SIZE(s1.segments, 0);
    CHECK_EQ_SIZE(s1.pinned_bytes, 0);
    CHECK_OK(pm_pool_destroy(pool));
  }
  CHECK_OK(pm_option_set("numa", NULL));
  /* Bad arguments. */
  int n = -1;
  CHECK_ERR_MSG(pm_pool_numa_stats(NULL, NULL, 0, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_pool_numa_stats(NULL, NULL, 2, &n), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_pool_numa_stats(NULL, NULL, -1, &n), PM_ERR_INVALID);
  CHECK_OK(pm_pool_numa_stats(NULL, NULL, 0, &n));
  CHECK(n >= 1);
}

typedef struct follow_case {
  int device;
  int failed; /* pthread_getaffinity_np calls that failed (checked by the main thread) */
  cpu_set_t before, after, back;
} follow_case_t;

static void *follow_thread(void *arg) {
  follow_case_t *c = arg;
  c->failed += pthread_getaffinity_np(pthread_self(), sizeof c->before, &c->before) != 0;
  pm__numa_thread_follow(c->device);
  pm__numa_thread_follow(c->device); /* a repeat changes nothing */
  c->failed += pthread_getaffinity_np(pthread_self(), sizeof c->after, &c->after) != 0;
  pm__numa_thread_follow(-1); /* no device: back where it was */
  c->failed += pthread_getaffinity_np(pthread_self(), sizeof c->back, &c->back) != 0;
  return NULL;
}

static follow_case_t run_follow(int device) {
  follow_case_t c;
  memset(&c, 0, sizeof c);
  c.device = device;
  pthread_t t;
  REQUIRE(pthread_create(&t, NULL, follow_thread, &c) == 0);
  REQUIRE(pthread_join(t, NULL) == 0);
  CHECK_EQ_INT(c.failed, 0);
  return c;
}

/* Thread placement over the fake tree: device 0's node owns one CPU the process may use, so a
 * thread working for device 0 ends up on exactly that CPU; device 3's node has only a CPU the
 * process may not use, so the thread stays as it was and that is counted; numa_threads=0 leaves
 * threads alone. */
static void test_place_threads(void) {
  cpu_set_t all;
  REQUIRE(sched_getaffinity(0, sizeof all, &all) == 0);
  if (CPU_ISSET(1000, &all)) {
    printf("thread placement not checked: CPU 1000 is allowed here\n");
    return;
  }
  int cpu = allowed_cpu();
  char root[512];
  fake_two_nodes(root, sizeof root, cpu);
  CHECK_OK(pm_option_set("numa", "auto"));
  CHECK_OK(pm_option_set("numa_threads", "1"));

  follow_case_t c = run_follow(0);
  CHECK(CPU_EQUAL(&c.before, &all));
  CHECK_EQ_INT(CPU_COUNT(&c.after), 1);
  CHECK(CPU_ISSET(cpu, &c.after));
  CHECK(CPU_EQUAL(&c.back, &all));

  pm__numa_state_t s0, s1;
  pm__numa_state(&s0);
  c = run_follow(3);
  CHECK(CPU_EQUAL(&c.after, &all));
  pm__numa_state(&s1);
  CHECK_EQ_SIZE(s1.threads_refused, s0.threads_refused + 1);
  CHECK(strstr(s1.last_thread_problem, "node 2") != NULL);

  c = run_follow(2); /* a device with no node: nothing to do */
  CHECK(CPU_EQUAL(&c.after, &all));

  CHECK_OK(pm_option_set("numa_threads", "0"));
  c = run_follow(0);
  CHECK(CPU_EQUAL(&c.after, &all));
  CHECK_OK(pm_option_set("numa_threads", NULL));
  CHECK_OK(pm_option_set("numa", "off"));
  c = run_follow(0);
  CHECK(CPU_EQUAL(&c.after, &all));
  CHECK_OK(pm_option_set("numa", NULL));
  pm__numa_test_override(NULL, NULL, 0);
  pm_test_rmtree(root);
}

int main(void) {
  pm_test_init();
  test_cpulist();
  test_fake_tree();
  test_real_pages();
  test_place_node0();
  test_place_off_auto();
  test_place_fake();
  test_place_caches();
  test_place_threads();
  return pm_test_finish("test_numa");
}
