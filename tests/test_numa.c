/* NUMA topology: the cpulist parser, pm__topology_read over a fake sysfs tree (two nodes, GPUs
 * on each, a GPU with node -1, a missing file, malformed lists), the real /sys, and where the
 * kernel actually put the pages of a pinned pool block (move_pages). */
#include <errno.h>
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
      printf("page placement part skipped: move_pages: %s (not available here)\n", strerror(e));
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

int main(void) {
  pm_test_init();
  test_cpulist();
  test_fake_tree();
  test_real_pages();
  return pm_test_finish("test_numa");
}
