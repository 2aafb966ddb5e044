/*
 * Helpers shared by pinmem's C test programs: see helpers.h.
 */
#include "helpers.h"

#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

/* valgrind's client requests (no-ops outside valgrind). Without the header a forked child keeps
 * its leak check, and a valgrind run can count the parent's memory as the child's loss. */
#if defined(__has_include)
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#define PM_TEST_HAVE_VALGRIND_H 1
#endif
#endif

int pm_test_failures;
int pm_test_checks;
int pm_test_skips;

void pm_test_skip(const char *fmt, ...) {
  char why[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  pm_test_skips++;
  printf("SKIPPED: %s\n", why);
  fflush(stdout);
}

void pm_test_init(void) {
  pm_status_t st = pm_init();
  if (st == PM_ERR_NO_DEVICE) {
    const char *want = getenv("PINMEM_BACKEND");
    printf("SKIP: backend '%s' not available here: %s\n", want ? want : "auto", pm_last_error());
    exit(PM_TEST_SKIP);
  }
  if (st != PM_OK) {
    fprintf(stderr, "pm_init failed: %s: %s\n", pm_status_name(st), pm_last_error());
    exit(1);
  }
  printf("backend: %s\n", pm_backend_name());
}

int pm_test_finish(const char *name) {
  char skipped[64] = "";
  if (pm_test_skips)
    snprintf(skipped, sizeof skipped, "; %d skipped (the SKIPPED lines say why)", pm_test_skips);
  if (pm_test_failures) {
    printf("%s: %d of %d checks failed%s\n", name, pm_test_failures, pm_test_checks, skipped);
    return 1;
  }
  printf("%s: all %d checks passed%s\n", name, pm_test_checks, skipped);
  return 0;
}

bool pm_test_small(void) {
  const char *v = getenv("PINMEM_TEST_SMALL");
  return v && v[0] && strcmp(v, "0") != 0;
}

/* One byte of the fill stream after another: pm_test_fill and its check draw the same. */
static inline unsigned char fill_next(uint64_t *x) {
  *x ^= *x >> 12;
  *x ^= *x << 25;
  *x ^= *x >> 27;
  return (unsigned char)((*x * 0x2545F4914F6CDD1Dull) >> 56);
}

void pm_test_fill(void *p, size_t n, uint64_t seed) {
  unsigned char *b = (unsigned char *)p;
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 0x1234567ull;
  for (size_t i = 0; i < n; i++) b[i] = fill_next(&x);
}

size_t pm_test_fill_mismatch(const void *p, size_t n, uint64_t seed) {
  const unsigned char *b = (const unsigned char *)p;
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 0x1234567ull;
  for (size_t i = 0; i < n; i++)
    if (b[i] != fill_next(&x)) return i;
  return n;
}

bool pm_test_fill_ok(const void *p, size_t n, uint64_t seed) {
  return pm_test_fill_mismatch(p, n, seed) == n;
}

uint64_t pm_test_rand(uint64_t *state) {
  uint64_t x = *state;
  *state += 0x9E3779B97F4A7C15ull;
  return pm__mix64(x); /* splitmix64: the finaliser of the state after the step */
}

void pm_test_sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

void pm_test_gate_init(pm_test_gate_t *g) {
  pthread_mutex_init(&g->mu, NULL);
  pthread_cond_init(&g->cv, NULL);
  g->open = false;
}

void pm_test_gate_wait(void *gate) {
  pm_test_gate_t *g = gate;
  pthread_mutex_lock(&g->mu);
  while (!g->open) pthread_cond_wait(&g->cv, &g->mu);
  pthread_mutex_unlock(&g->mu);
}

void pm_test_gate_open(pm_test_gate_t *g) {
  pthread_mutex_lock(&g->mu);
  g->open = true;
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
}

void pm_test_gate_destroy(pm_test_gate_t *g) {
  pthread_cond_destroy(&g->cv);
  pthread_mutex_destroy(&g->mu);
}

static void *opener_main(void *arg) {
  pm_test_opener_t *o = arg;
  for (;;) {
    pm__fault_counts_t c;
    pm__fault_counts(&c);
    for (int i = 0; i < o->nops; i++) {
      if (c.calls[o->ops[i]] > 0) {
        atomic_store(&o->opened, true);
        pm_test_gate_open(o->gate);
        return NULL;
      }
    }
    if (atomic_load(&o->stop)) return NULL;
    sched_yield();
  }
}

void pm_test_opener_start(pm_test_opener_t *o, pm_test_gate_t *g, const int *ops, int nops) {
  memset(o, 0, sizeof *o);
  o->gate = g;
  o->nops = nops < 4 ? nops : 4;
  memcpy(o->ops, ops, (size_t)o->nops * sizeof *ops);
  atomic_init(&o->stop, false);
  atomic_init(&o->opened, false);
  if (pthread_create(&o->thread, NULL, opener_main, o) != 0) {
    fprintf(stderr, "pm_test_opener_start: pthread_create failed\n");
    abort();
  }
}

bool pm_test_opener_stop(pm_test_opener_t *o) {
  atomic_store(&o->stop, true);
  pthread_join(o->thread, NULL);
  return atomic_load(&o->opened);
}

static long long vm_locked_raw(void) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return -1;
  char line[256];
  long long kb = -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "VmLck: %lld kB", &kb) == 1) break;
  fclose(f);
  return kb < 0 ? -1 : kb * 1024;
}

long long pm_test_vm_locked(void) {
  static int works = -1; /* first call: does locking 4 pages show in VmLck? */
  if (works < 0) {
    size_t pg = pm__page_size();
    void *m = mmap(NULL, 4 * pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    long long before = vm_locked_raw();
    works = m != MAP_FAILED && before >= 0 && mlock(m, 4 * pg) == 0 &&
            vm_locked_raw() - before >= (long long)(4 * pg);
    if (m != MAP_FAILED) munmap(m, 4 * pg);
    if (!works) pm_test_skip("locked-memory checks: mlock does not show in VmLck here");
  }
  return works ? vm_locked_raw() : -1;
}

bool pm_test_tmpdir(char *dir, size_t len, const char *name) {
  const char *tmp = getenv("TMPDIR");
  int n = snprintf(dir, len, "%s/pinmem-%s.XXXXXX", tmp && tmp[0] ? tmp : "/tmp", name);
  return n > 0 && (size_t)n < len && mkdtemp(dir) != NULL;
}

void pm_test_rmtree(const char *dir) {
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

bool pm_test_limit_memlock(size_t bytes) {
  struct rlimit rl = {bytes, bytes};
  if (setrlimit(RLIMIT_MEMLOCK, &rl) != 0) return false;
  /* root's CAP_IPC_LOCK makes the limit moot: become nobody, which drops it. */
  if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) return false;
  return pm__memlock_limit() != SIZE_MAX;
}

void pm_test_child_no_leak_check(void) {
#ifdef PM_TEST_HAVE_VALGRIND_H
  /* --leak-check is one of valgrind's options a program may change while it runs. */
  VALGRIND_CLO_CHANGE("--leak-check=no");
#endif
}

_Noreturn void pm_test_child_exit(int code) {
  pm_test_child_no_leak_check();
  _exit(code);
}
