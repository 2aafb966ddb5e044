/*
 * `pinmem info`: what this machine offers for pinned memory and how pinmem is configured. It
 * keeps going when one part fails (a cuda backend asked for on a machine without a GPU still
 * shows the limits and the option table) and reports the first failure at the end, exit 1.
 */
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "internal.h"

typedef struct info_failure {
  pm_status_t status;
  char detail[1024];
} info_failure_t;

static void note_failure(info_failure_t *f, pm_status_t st) {
  if (f->status != PM_OK) return;
  f->status = st;
  snprintf(f->detail, sizeof f->detail, "%s",
           pm_last_error()[0] ? pm_last_error() : pm_strerror(st));
}

static const char *yes_no(int v) {
  return v > 0 ? "yes" : v == 0 ? "no" : "unknown";
}

/* The mode in brackets in /sys/kernel/mm/transparent_hugepage/enabled ("always [madvise]
 * never" -> "madvise"); "unavailable" when the file cannot be read. */
static void read_thp(char *mode, size_t mode_len, char *raw, size_t raw_len) {
  snprintf(mode, mode_len, "unavailable");
  raw[0] = '\0';
  FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
  if (!f) return;
  if (fgets(raw, (int)raw_len, f)) {
    raw[strcspn(raw, "\n")] = '\0';
    const char *lb = strchr(raw, '['), *rb = lb ? strchr(lb, ']') : NULL;
    if (lb && rb && rb > lb + 1) snprintf(mode, mode_len, "%.*s", (int)(rb - lb - 1), lb + 1);
  }
  fclose(f);
}

static const char *pcie_text(int gen, int width, char *buf, size_t len) {
  if (gen < 0 && width < 0)
    snprintf(buf, len, "unknown");
  else if (width < 0)
    snprintf(buf, len, "Gen%d", gen);
  else if (gen < 0)
    snprintf(buf, len, "x%d", width);
  else
    snprintf(buf, len, "Gen%d x%d", gen, width);
  return buf;
}

/* An option whose PINMEM_<NAME> variable is set but not in force was rejected: the library
 * fell back to the default and its value text says why ("auto (PINMEM_BUDGET='xyz' ignored:
 * ...)"). JSON readers get the variable's text and a flag as fields of their own. */
static const char *env_value(const pm_option_info_t *o) {
  return o->env ? getenv(o->env) : NULL;
}

/* Add `text` as rows of at most `width` characters, broken at spaces; `key` on the first. */
static void add_wrapped(cli_table_t *t, const char *key, const char *text, size_t width) {
  char line[256];
  const char *p = text ? text : "";
  bool first = true;
  do {
    size_t n = strlen(p);
    if (n > width) {
      n = width;
      while (n > 0 && p[n] != ' ') n--;
      if (n == 0) n = width; /* one long word */
    }
    if (n >= sizeof line) n = sizeof line - 1;
    memcpy(line, p, n);
    line[n] = '\0';
    cli_table_row(t, first ? key : "", line);
    first = false;
    p += n;
    while (*p == ' ') p++;
  } while (*p);
}

/* Why the backend in force was chosen: the variable or call that asked for it, else the
 * library's own account of its auto choice (with the CUDA error that ruled cuda out). */
static void backend_reason(bool started, char *buf, size_t len) {
  pm_option_info_t oi;
  bool have = pm_option_find("backend", &oi) == PM_OK;
  const char *why = started ? pm__backend_reason() : "";
  bool is_auto = strncmp(why, "auto: ", 6) == 0;
  if (have && oi.source == PM_OPTION_ENV)
    snprintf(buf, len, "%s=%s%s%s", oi.env, getenv(oi.env) ? getenv(oi.env) : oi.value,
             is_auto ? ": " : "", is_auto ? why + 6 : "");
  else if (have && oi.source == PM_OPTION_SET)
    snprintf(buf, len, "option backend set to %s%s%s", oi.value, is_auto ? ": " : "",
             is_auto ? why + 6 : "");
  else if (started)
    snprintf(buf, len, "%s", pm__backend_reason());
  else
    snprintf(buf, len, "auto");
}

/* The cuda backend in one line: compiled in or not, the driver and what it lacks, the kernels. */
static void driver_text(const pm_backend_info_t *bi, char *buf, size_t len) {
  if (!bi->cuda_compiled) {
    snprintf(buf, len, "not compiled in (-DPINMEM_CUDA=OFF)");
    return;
  }
  char ver[32] = "none";
  if (bi->driver_version)
    snprintf(ver, sizeof ver, "CUDA %d.%d", bi->driver_version / 1000,
             (bi->driver_version % 1000) / 10);
  snprintf(buf, len, "compiled in; driver %s%s%s%s%s%s%s%s", ver,
           bi->driver_library[0] ? " (" : "", bi->driver_library,
           bi->driver_library[0] ? ")" : "", bi->driver_missing[0] ? "; lacks " : "",
           bi->driver_missing, bi->kernels[0] ? "; kernels: " : "", bi->kernels);
}

/* A device's CPUs for the topology lines: its own local_cpulist, else its node's list. */
static const char *device_cpus(const pm__topology_t *t, const pm__numa_device_t *dv, char *buf,
                               size_t len, const char **from) {
  *from = "local_cpulist";
  if (dv->cpus_known) {
    pm__cpulist_format(&dv->cpus, buf, len);
    return buf;
  }
  for (int k = 0; dv->node >= 0 && k < t->node_count; k++)
    if (t->nodes[k].id == dv->node && t->nodes[k].cpus_known) {
      *from = "node";
      pm__cpulist_format(&t->nodes[k].cpus, buf, len);
      return buf;
    }
  *from = "none";
  snprintf(buf, len, "unknown");
  return buf;
}

/* What placement does (numa_place.c): the mode in force, libnuma, the threads, any fallback. */
static void numa_place_summary(const pm__numa_state_t *ps, char *buf, size_t len) {
  if (ps->mode == PM__NUMA_OFF)
    snprintf(buf, len, "off: pinned memory goes where the kernel's default policy puts it");
  else if (ps->mode == PM__NUMA_AUTO && !ps->multi_node)
    snprintf(buf, len, "single node: placement has nothing to do");
  else if (ps->mode == PM__NUMA_AUTO)
    snprintf(buf, len, "auto: each device's pinned memory on the device's node");
  else
    snprintf(buf, len, "node %ld: all pinned memory on it", ps->mode);
  bool acts = ps->mode >= 0 || (ps->mode == PM__NUMA_AUTO && ps->multi_node);
  if (acts && !ps->libnuma) {
    size_t used = strlen(buf);
    snprintf(buf + used, len - used, " (but %s: the default policy is used)", ps->libnuma_why);
  }
}

/* A node asked for (numa=N) that the machine does not have: said beside the mode. */
static void numa_missing_node(const pm__numa_state_t *ps, const pm__topology_t *t, char *buf,
                              size_t len) {
  bool node_exists = ps->mode < 0;
  for (int k = 0; k < t->node_count; k++) node_exists |= t->nodes[k].id == ps->mode;
  if (node_exists) return;
  size_t used = strlen(buf);
  snprintf(buf + used, len - used,
           " (this machine has no node %ld: every allocation falls back to the default policy)",
           ps->mode);
}

static void numa_mode_text(long mode, char *buf, size_t len) {
  if (mode == PM__NUMA_AUTO)
    snprintf(buf, len, "auto");
  else if (mode == PM__NUMA_OFF)
    snprintf(buf, len, "off");
  else
    snprintf(buf, len, "%ld", mode);
}

/* NUMA: device -> PCI bus id -> node -> CPUs, each node's CPUs and memory, and how many nodes.
 * Unreadable parts are shown as unknown and listed, never an error: many machines and
 * containers show no NUMA information at all. */
static void info_numa(bool json, info_failure_t *fail) {
  char b1[64], b2[64];
  int count = 0;
  if (pm_device_count(&count) != PM_OK) count = 0;
  if (count > PM__NUMA_MAX_DEVICES) count = PM__NUMA_MAX_DEVICES;
  char ids[PM__NUMA_MAX_DEVICES][32];
  const char *idp[PM__NUMA_MAX_DEVICES];
  for (int d = 0; d < count; d++) {
    pm_device_info_t di;
    ids[d][0] = '\0';
    if (pm_device_get_info(d, &di) == PM_OK) snprintf(ids[d], sizeof ids[d], "%s", di.pci_bus_id);
    idp[d] = ids[d];
  }
  pm__topology_t *t = calloc(1, sizeof *t);
  pm_status_t st = t ? pm__topology_read(NULL, idp, count, t)
                     : pm__set_error(PM_ERR_NOMEM, "NUMA topology: out of memory");
  if (st != PM_OK) {
    note_failure(fail, st);
    if (!json) printf("\nNUMA: %s: %s\n", pm_status_name(st), pm_last_error());
    free(t);
    return;
  }
  pm__numa_state_t ps;
  pm__numa_state(&ps);
  char place[400], mode[32];
  numa_place_summary(&ps, place, sizeof place);
  numa_mode_text(ps.mode, mode, sizeof mode);
  numa_missing_node(&ps, t, place, sizeof place);
  char cpus[1024], nodes_txt[64];
  if (t->node_count == 0)
    snprintf(nodes_txt, sizeof nodes_txt, "no NUMA information");
  else if (!t->multi_node)
    snprintf(nodes_txt, sizeof nodes_txt, "single node");
  else
    snprintf(nodes_txt, sizeof nodes_txt, "%d nodes", t->node_count);

  if (json) {
    cli_json_t j;
    cli_json_begin(&j);
    cli_json_str(&j, "info", "numa");
    cli_json_int(&j, "nodes", t->node_count);
    cli_json_bool(&j, "multi_node", t->multi_node);
    cli_json_str(&j, "summary", nodes_txt);
    cli_json_str(&j, "problems", t->problems);
    cli_json_end(&j);
    cli_json_begin(&j);
    cli_json_str(&j, "info", "numa_placement");
    cli_json_str(&j, "mode", mode);
    cli_json_str(&j, "summary", place);
    cli_json_bool(&j, "libnuma", ps.libnuma);
    cli_json_str(&j, "libnuma_problem", ps.libnuma ? NULL : ps.libnuma_why);
    cli_json_uint(&j, "bound", ps.bind_ok);
    cli_json_uint(&j, "bind_failures", ps.bind_failures);
    cli_json_str(&j, "last_failure", ps.last_failure[0] ? ps.last_failure : NULL);
    cli_json_bool(&j, "threads", ps.threads);
    cli_json_uint(&j, "threads_placed", ps.threads_placed);
    cli_json_uint(&j, "threads_refused", ps.threads_refused);
    cli_json_str(&j, "thread_problem", ps.last_thread_problem[0] ? ps.last_thread_problem : NULL);
    cli_json_end(&j);
    for (int k = 0; k < t->node_count; k++) {
      const pm__numa_node_t *n = &t->nodes[k];
      cli_json_begin(&j);
      cli_json_str(&j, "info", "numa_node");
      cli_json_int(&j, "node", n->id);
      if (n->cpus_known) {
        pm__cpulist_format(&n->cpus, cpus, sizeof cpus);
        cli_json_str(&j, "cpus", cpus);
        cli_json_int(&j, "cpu_count", pm__cpus_count(&n->cpus));
      } else {
        cli_json_null(&j, "cpus");
        cli_json_null(&j, "cpu_count");
      }
      if (n->mem_known) {
        cli_json_uint(&j, "mem_total", n->mem_total);
        cli_json_uint(&j, "mem_free", n->mem_free);
      } else {
        cli_json_null(&j, "mem_total");
        cli_json_null(&j, "mem_free");
      }
      cli_json_end(&j);
    }
    for (int d = 0; d < t->device_count; d++) {
      const pm__numa_device_t *dv = &t->devices[d];
      const char *from;
      cli_json_begin(&j);
      cli_json_str(&j, "info", "numa_device");
      cli_json_int(&j, "index", d);
      cli_json_bool(&j, "pci_location", dv->pci_bus_id[0] != '\0');
      cli_json_str(&j, "pci_bus_id", dv->pci_bus_id[0] ? dv->pci_bus_id : NULL);
      cli_json_int(&j, "node", dv->node);
      device_cpus(t, dv, cpus, sizeof cpus, &from);
      cli_json_str(&j, "cpus", strcmp(from, "none") ? cpus : NULL);
      cli_json_str(&j, "cpus_from", from);
      cli_json_int(&j, "placement_node", pm__numa_node_for(d));
      cli_json_end(&j);
    }
  } else {
    printf("\nNUMA: %s\n", nodes_txt);
    cli_table_t tb;
    cli_table_init(&tb, 2);
    for (int d = 0; d < t->device_count; d++) {
      const pm__numa_device_t *dv = &t->devices[d];
      char head[32], txt[1200], node[32];
      const char *from;
      snprintf(head, sizeof head, "device %d", d);
      if (!dv->pci_bus_id[0]) {
        snprintf(txt, sizeof txt, "no PCI location (the %s backend has no PCI device)",
                 pm_backend_name());
      } else {
        device_cpus(t, dv, cpus, sizeof cpus, &from);
        if (dv->node >= 0)
          snprintf(node, sizeof node, "node %d", dv->node);
        else
          snprintf(node, sizeof node, "node unknown");
        snprintf(txt, sizeof txt, "PCI %s -> %s -> CPUs %s%s", dv->pci_bus_id, node, cpus,
                 strcmp(from, "node") == 0 ? " (the node's)" : "");
      }
      cli_table_row(&tb, head, txt);
    }
    for (int k = 0; k < t->node_count; k++) {
      const pm__numa_node_t *n = &t->nodes[k];
      char head[32], txt[1300], mem[160];
      snprintf(head, sizeof head, "node %d", n->id);
      if (n->mem_known)
        snprintf(mem, sizeof mem, "memory %s (%s free)", cli_fmt_bytes(n->mem_total, b1, sizeof b1),
                 cli_fmt_bytes(n->mem_free, b2, sizeof b2));
      else
        snprintf(mem, sizeof mem, "memory unknown");
      if (n->cpus_known) {
        pm__cpulist_format(&n->cpus, cpus, sizeof cpus);
        snprintf(txt, sizeof txt, "CPUs %s (%d), %s", cpus[0] ? cpus : "none",
                 pm__cpus_count(&n->cpus), mem);
      } else {
        snprintf(txt, sizeof txt, "CPUs unknown, %s", mem);
      }
      cli_table_row(&tb, head, txt);
    }
    if (t->problems[0]) add_wrapped(&tb, "not read", t->problems, 76);
    cli_table_print(&tb, 2);

    /* Placement: what pinmem does with the topology. */
    char txt[700];
    printf("\nNUMA placement (option numa=%s): %s\n", mode, place);
    cli_table_init(&tb, 2);
    if (ps.libnuma)
      snprintf(txt, sizeof txt, "loaded (binding with mbind, MPOL_PREFERRED)");
    else
      snprintf(txt, sizeof txt, "not loaded: %s", ps.libnuma_why);
    cli_table_row(&tb, "libnuma", txt);
    for (int d = 0; d < t->device_count; d++) {
      char head[32];
      int n = pm__numa_node_for(d);
      snprintf(head, sizeof head, "device %d", d);
      if (n >= 0)
        snprintf(txt, sizeof txt, "pinned memory and threads on node %d", n);
      else
        snprintf(txt, sizeof txt, "no node chosen: the default policy");
      cli_table_row(&tb, head, txt);
    }
    if (!ps.threads)
      snprintf(txt, sizeof txt, "numa_threads=0: threads run where the scheduler puts them");
    else
      snprintf(txt, sizeof txt,
               "numa_threads=1: pinmem's threads move to their device's node's CPUs (%llu moved, "
               "%llu left in place)%s%s",
               ps.threads_placed, ps.threads_refused, ps.last_thread_problem[0] ? ": " : "",
               ps.last_thread_problem);
    add_wrapped(&tb, "threads", txt, 76);
    if (ps.bind_failures)
      snprintf(txt, sizeof txt, "%llu range(s) pinned with the default policy instead; last: %s",
               ps.bind_failures, ps.last_failure);
    else
      snprintf(txt, sizeof txt, "none (%llu range(s) bound)", ps.bind_ok);
    add_wrapped(&tb, "fallback", txt, 76);
    cli_table_print(&tb, 2);
  }
  free(t);
}

/* `pinmem info --summary`: the few lines a benchmark's reader needs about the machine. */
static int info_summary(bool json) {
  char b1[64], b2[64], reason[700], line[1600];
  pm_status_t init_st = pm_init();
  char detail[1024];
  snprintf(detail, sizeof detail, "%s", init_st == PM_OK ? "" : pm_last_error());
  backend_reason(init_st == PM_OK, reason, sizeof reason);
  size_t rlim = pm__memlock_rlimit_raw();
  bool cap = pm__has_cap_ipc_lock();
  int count = 0, nenv = 0, nopt = pm_option_count();
  if (init_st == PM_OK && pm_device_count(&count) != PM_OK) count = 0;
  pm_backend_info_t bi;
  if (pm_backend_info(&bi) != PM_OK) memset(&bi, 0, sizeof bi);
  if (bi.fallback) count = 0; /* the host backend's simulated devices are not on offer */
  for (int i = 0; i < nopt; i++) {
    pm_option_info_t o;
    if (pm_option_get(i, &o) == PM_OK && o.source != PM_OPTION_DEFAULT) nenv++;
  }
  size_t budget = 0;
  pm_pool_t *pool = NULL;
  pm_pool_stats_t ps;
  if (init_st == PM_OK && pm_pool_default(&pool) == PM_OK && pm_pool_get_stats(pool, &ps) == PM_OK)
    budget = ps.budget;
  pm__numa_state_t ns;
  pm__numa_state(&ns);
  char place[400];
  numa_place_summary(&ns, place, sizeof place);
  pm__topology_t *topo = calloc(1, sizeof *topo);
  if (topo && pm__topology_read(NULL, NULL, 0, topo) == PM_OK)
    numa_missing_node(&ns, topo, place, sizeof place);
  free(topo);
  char limit[200];
  if (rlim == SIZE_MAX)
    snprintf(limit, sizeof limit, "unlimited");
  else
    snprintf(limit, sizeof limit, "%s%s", cli_fmt_bytes(rlim, b1, sizeof b1),
             cap ? " (CAP_IPC_LOCK lifts it)" : " (no CAP_IPC_LOCK: pinning is limited to it)");
  if (json) {
    cli_json_t j;
    cli_json_begin(&j);
    cli_json_str(&j, "info", "summary");
    cli_json_str(&j, "version", pm_version());
    cli_json_str(&j, "backend", init_st == PM_OK ? pm_backend_name() : NULL);
    cli_json_str(&j, "backend_reason", reason);
    cli_json_int(&j, "devices", count);
    cli_json_bool(&j, "fallback", bi.fallback != 0);
    cli_json_str(&j, "numa_placement", place);
    if (rlim == SIZE_MAX)
      cli_json_null(&j, "memlock_rlimit_bytes");
    else
      cli_json_uint(&j, "memlock_rlimit_bytes", rlim);
    cli_json_bool(&j, "cap_ipc_lock", cap);
    cli_json_uint(&j, "pool_budget", budget);
    cli_json_int(&j, "options_set", nenv);
    cli_json_end(&j);
  } else {
    if (init_st == PM_OK)
      printf("pinmem %s, backend %s (%s)\n", pm_version(), pm_backend_name(), reason);
    else
      printf("pinmem %s, backend none (%s cannot start: %s: %s)\n", pm_version(), reason,
             pm_status_name(init_st), detail);
    for (int d = 0; d < count; d++) {
      pm_device_info_t di;
      if (pm_device_get_info(d, &di) != PM_OK) continue;
      char link[32], numa[32];
      pcie_text(di.pcie_gen, di.pcie_width, link, sizeof link);
      snprintf(numa, sizeof numa, "%d", di.numa_node);
      snprintf(line, sizeof line, "device %d: %s, %s, PCIe %s, NUMA node %s, %d copy engines", d,
               di.name, cli_fmt_bytes(di.total_memory, b1, sizeof b1), link,
               di.numa_node >= 0 ? numa : "unknown", di.async_engines);
      printf("%s\n", line);
    }
    if (!count)
      printf("devices: none%s\n", bi.fallback ? " (device memory refused; PINMEM_BACKEND=host "
                                                 "simulates devices)"
                                               : "");
    printf("NUMA placement: %s\n", place);
    printf("limits: RLIMIT_MEMLOCK %s; pool budget %s\n", limit,
           budget ? cli_fmt_bytes(budget, b2, sizeof b2) : "unknown");
    printf("options: %d of %d set (`pinmem info --options` shows them all)\n", nenv, nopt);
  }
  if (init_st != PM_OK) {
    fflush(stdout);
    fprintf(stderr, "pinmem: %s: %s\n", pm_status_name(init_st), detail);
    return CLI_EXIT_FAILURE;
  }
  return 0;
}

int cli_cmd_info(bool json, int what) {
  if (what == CLI_INFO_SUMMARY) return info_summary(json);
  bool machine = what == CLI_INFO_ALL;
  info_failure_t fail = {PM_OK, ""};
  char b1[64], b2[64], b3[64];

  pm_status_t init_st = pm_init();
  if (init_st != PM_OK) note_failure(&fail, init_st);
  const char *backend = pm_backend_name();
  char reason[700];
  backend_reason(init_st == PM_OK, reason, sizeof reason);
  /* The kernels load on first use: a zero-length one now, so the line below can say whether
   * the driver's JIT took pinmem's PTX (and why not). */
  if (init_st == PM_OK && pm_backend_kind() == PM_BACKEND_CUDA) (void)pm_launch_busy(NULL, 0.0);
  pm_backend_info_t bi;
  if (pm_backend_info(&bi) != PM_OK) memset(&bi, 0, sizeof bi);
  char drv_txt[1400];
  driver_text(&bi, drv_txt, sizeof drv_txt);

  /* ---- pinmem and the system ---- */
  size_t ram = pm__physical_memory();
  int cpus = pm__cpu_count();
  size_t page = pm__page_size();
  size_t rlim = pm__memlock_rlimit_raw();
  bool cap = pm__has_cap_ipc_lock();
  size_t memlock_eff = pm__memlock_limit();
  char thp[64], thp_raw[256];
  read_thp(thp, sizeof thp, thp_raw, sizeof thp_raw);

  if (!machine) {
    /* --options: the table alone. */
  } else if (json) {
    cli_json_t j;
    cli_json_begin(&j);
    cli_json_str(&j, "info", "pinmem");
    cli_json_str(&j, "version", pm_version());
    cli_json_str(&j, "backend", backend);
    cli_json_str(&j, "backend_reason", reason);
    cli_json_str(&j, "backend_status", pm_status_name(init_st));
    if (init_st != PM_OK) cli_json_str(&j, "backend_error", fail.detail);
    cli_json_bool(&j, "fallback", bi.fallback != 0);
    cli_json_bool(&j, "cuda_compiled", bi.cuda_compiled != 0);
    cli_json_int(&j, "driver_version", bi.driver_version);
    cli_json_str(&j, "driver_library", bi.driver_library);
    cli_json_str(&j, "driver_missing", bi.driver_missing);
    cli_json_str(&j, "kernels", bi.kernels);
    cli_json_end(&j);

    cli_json_begin(&j);
    cli_json_str(&j, "info", "system");
    cli_json_uint(&j, "physical_memory", ram);
    cli_json_int(&j, "cpus", cpus);
    cli_json_uint(&j, "page_size", page);
    cli_json_str(&j, "transparent_hugepage", thp);
    cli_json_str(&j, "transparent_hugepage_raw", thp_raw);
    cli_json_end(&j);

    cli_json_begin(&j);
    cli_json_str(&j, "info", "memlock");
    if (rlim == SIZE_MAX)
      cli_json_null(&j, "rlimit_bytes");
    else
      cli_json_uint(&j, "rlimit_bytes", rlim);
    cli_json_bool(&j, "rlimit_unlimited", rlim == SIZE_MAX);
    cli_json_bool(&j, "cap_ipc_lock", cap);
    cli_json_bool(&j, "cap_ipc_lock_lifts_limit", cap);
    if (memlock_eff == SIZE_MAX)
      cli_json_null(&j, "effective_limit_bytes");
    else
      cli_json_uint(&j, "effective_limit_bytes", memlock_eff);
    cli_json_end(&j);
  } else {
    cli_table_t t;
    printf("pinmem %s\n\n", pm_version());
    /* No silent CPU: a fallback says why before anything else. */
    if (bi.fallback)
      printf("%s\n  -> running on the host backend: device memory is refused; "
             "PINMEM_BACKEND=host simulates devices on purpose\n\n",
             strncmp(bi.reason, "auto: ", 6) == 0 ? bi.reason + 6 : bi.reason);
    cli_table_init(&t, 2);
    char msg[1900];
    if (init_st == PM_OK)
      snprintf(msg, sizeof msg, "%s (%s)", backend, reason);
    else
      snprintf(msg, sizeof msg, "none (%s cannot start: %s: %s)", reason, pm_status_name(init_st),
               fail.detail);
    cli_table_row(&t, "backend", msg);
    cli_table_row(&t, "cuda backend", drv_txt);
    char cpus_txt[32], mem_txt[128], lim_txt[256], thp_txt[400];
    snprintf(cpus_txt, sizeof cpus_txt, "%d", cpus);
    snprintf(mem_txt, sizeof mem_txt, "%s (page size %s)", cli_fmt_bytes(ram, b1, sizeof b1),
             cli_fmt_bytes(page, b2, sizeof b2));
    if (rlim == SIZE_MAX)
      snprintf(lim_txt, sizeof lim_txt, "unlimited");
    else
      snprintf(lim_txt, sizeof lim_txt, "%zu bytes (%s)%s", rlim,
               cli_fmt_bytes(rlim, b3, sizeof b3),
               cap ? "; CAP_IPC_LOCK lifts it: pinning is not limited"
                   : "; no CAP_IPC_LOCK: pinning is limited to it");
    if (thp_raw[0])
      snprintf(thp_txt, sizeof thp_txt, "%s (%s)", thp, thp_raw);
    else
      snprintf(thp_txt, sizeof thp_txt, "%s", thp);
    cli_table_row(&t, "physical memory", mem_txt);
    cli_table_row(&t, "CPUs", cpus_txt);
    cli_table_row(&t, "RLIMIT_MEMLOCK", lim_txt);
    cli_table_row(&t, "transparent huge pages", thp_txt);
    cli_table_print(&t, 0);
  }

  /* ---- devices ---- */
  if (machine && init_st == PM_OK) {
    int count = 0;
    pm_status_t st = pm_device_count(&count);
    if (st != PM_OK) note_failure(&fail, st);
    if (bi.fallback) count = 0; /* the host backend's simulated devices are not on offer */
    if (!json) printf("\ndevices: %d%s\n", st == PM_OK ? count : 0,
                      bi.fallback ? " (no CUDA device; see above)" : "");
    for (int d = 0; st == PM_OK && d < count; d++) {
      pm_device_info_t di;
      pm_status_t dst = pm_device_get_info(d, &di);
      if (dst != PM_OK) {
        note_failure(&fail, dst);
        if (!json) printf("  device %d: %s: %s\n", d, pm_status_name(dst), pm_last_error());
        continue;
      }
      char cc[32], cur[32], max[32];
      snprintf(cc, sizeof cc, "%d.%d", di.cc_major, di.cc_minor);
      pcie_text(di.pcie_gen, di.pcie_width, cur, sizeof cur);
      pcie_text(di.pcie_max_gen, di.pcie_max_width, max, sizeof max);
      if (json) {
        cli_json_t j;
        cli_json_begin(&j);
        cli_json_str(&j, "info", "device");
        cli_json_int(&j, "index", di.index);
        cli_json_str(&j, "name", di.name);
        cli_json_str(&j, "cc", cc);
        cli_json_uint(&j, "total_memory", di.total_memory);
        cli_json_uint(&j, "free_memory", di.free_memory);
        cli_json_str(&j, "pci_bus_id", di.pci_bus_id);
        cli_json_int(&j, "pcie_gen", di.pcie_gen);
        cli_json_int(&j, "pcie_width", di.pcie_width);
        cli_json_int(&j, "pcie_max_gen", di.pcie_max_gen);
        cli_json_int(&j, "pcie_max_width", di.pcie_max_width);
        cli_json_int(&j, "numa_node", di.numa_node);
        cli_json_int(&j, "copy_engines", di.async_engines);
        cli_json_bool(&j, "can_map_host_memory", di.can_map_host_memory > 0);
        cli_json_bool(&j, "unified_addressing", di.unified_addressing > 0);
        cli_json_bool(&j, "managed_memory", di.managed_memory > 0);
        cli_json_bool(&j, "concurrent_managed_access", di.concurrent_managed_access > 0);
        cli_json_bool(&j, "host_register_supported", di.host_register_supported > 0);
        cli_json_bool(&j, "host_register_read_only", di.host_register_read_only > 0);
        cli_json_bool(&j, "pageable_memory_access", di.pageable_memory_access > 0);
        cli_json_end(&j);
      } else {
        cli_table_t t;
        char head[300], memtxt[128], link[80], num[32], numa[32], managed[64];
        snprintf(head, sizeof head, "device %d", di.index);
        snprintf(memtxt, sizeof memtxt, "%s (%s free)",
                 cli_fmt_bytes(di.total_memory, b1, sizeof b1),
                 cli_fmt_bytes(di.free_memory, b2, sizeof b2));
        snprintf(link, sizeof link, "%s (max %s)", cur, max);
        snprintf(num, sizeof num, "%d", di.async_engines);
        snprintf(numa, sizeof numa, "%d", di.numa_node);
        snprintf(managed, sizeof managed, "%s (concurrent access: %s)", yes_no(di.managed_memory),
                 yes_no(di.concurrent_managed_access));
        cli_table_init(&t, 2);
        cli_table_row(&t, head, di.name);
        cli_table_row(&t, "  compute capability", cc);
        cli_table_row(&t, "  memory", memtxt);
        cli_table_row(&t, "  PCI bus id", di.pci_bus_id[0] ? di.pci_bus_id : "unknown");
        cli_table_row(&t, "  PCIe link", link);
        cli_table_row(&t, "  NUMA node", di.numa_node >= 0 ? numa : "unknown");
        cli_table_row(&t, "  copy engines", num);
        cli_table_row(&t, "  can map host memory", yes_no(di.can_map_host_memory));
        cli_table_row(&t, "  unified addressing", yes_no(di.unified_addressing));
        cli_table_row(&t, "  managed memory", managed);
        cli_table_row(&t, "  host register", yes_no(di.host_register_supported));
        cli_table_row(&t, "  read-only registration", yes_no(di.host_register_read_only));
        cli_table_row(&t, "  pageable memory access", yes_no(di.pageable_memory_access));
        cli_table_print(&t, 2);
      }
    }
  }

  /* ---- NUMA topology ---- */
  if (machine && init_st == PM_OK) info_numa(json, &fail);

  /* ---- the default pool ---- */
  if (machine && init_st == PM_OK) {
    pm_pool_t *pool = NULL;
    pm_pool_stats_t ps;
    pm_status_t st = pm_pool_default(&pool);
    if (st == PM_OK) st = pm_pool_get_stats(pool, &ps);
    if (st != PM_OK) {
      note_failure(&fail, st);
      if (!json) printf("\ndefault pool: %s: %s\n", pm_status_name(st), pm_last_error());
    } else if (json) {
      cli_json_t j;
      cli_json_begin(&j);
      cli_json_str(&j, "info", "pool");
      cli_json_uint(&j, "budget", ps.budget);
      cli_json_uint(&j, "pinned_bytes", ps.pinned_bytes);
      cli_json_end(&j);
    } else {
      char txt[200];
      snprintf(txt, sizeof txt, "%zu bytes (%s)", ps.budget,
               cli_fmt_bytes(ps.budget, b1, sizeof b1));
      printf("\ndefault pool\n");
      cli_table_t t;
      cli_table_init(&t, 2);
      cli_table_row(&t, "budget", txt);
      cli_table_print(&t, 2);
    }
  }

  /* ---- options ---- */
  int n = pm_option_count();
  cli_table_t t, docs;
  if (!json) {
    printf("%soptions (value in force and where it came from)\n", machine ? "\n" : "");
    cli_table_init(&t, 5);
    cli_table_init(&docs, 2);
    cli_table_row(&t, "NAME", "ENV", "VALUE", "SOURCE", "DEFAULT");
    cli_table_row(&docs, "NAME", "MEANING");
  }
  for (int i = 0; i < n; i++) {
    pm_option_info_t o;
    pm_status_t st = pm_option_get(i, &o);
    if (st != PM_OK) {
      note_failure(&fail, st);
      continue;
    }
    const char *env = env_value(&o);
    if (json) {
      cli_json_t j;
      cli_json_begin(&j);
      cli_json_str(&j, "info", "option");
      cli_json_str(&j, "name", o.name);
      cli_json_str(&j, "env", o.env);
      cli_json_str(&j, "value", o.value);
      cli_json_str(&j, "source", pm__option_source_name(o.source));
      cli_json_str(&j, "default", o.default_value);
      cli_json_str(&j, "doc", o.doc);
      if (env) {
        cli_json_str(&j, "env_value", env);
        cli_json_bool(&j, "env_ignored", o.source == PM_OPTION_DEFAULT);
      }
      cli_json_end(&j);
    } else {
      cli_table_row(&t, o.name, o.env, o.value, pm__option_source_name(o.source), o.default_value);
      add_wrapped(&docs, o.name, o.doc, 76);
    }
  }
  if (!json) {
    cli_table_print(&t, 2);
    printf("\n");
    cli_table_print(&docs, 2);
  }

  if (fail.status != PM_OK) {
    fflush(stdout);
    fprintf(stderr, "pinmem: %s: %s\n", pm_status_name(fail.status), fail.detail);
    return CLI_EXIT_FAILURE;
  }
  return 0;
}
