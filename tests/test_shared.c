/*
 * Shared pinned memory: pm_host_alloc(PM_HOST_SHARED), pm_host_shared_fd, pm_shared_map and
 * pm_shared_unmap, and loaders with shared_slots.
 * - a shared block is a pool block reported as shared and pinned; its memfd holds the bytes at
 *   the offset pm_host_shared_fd gives, for the block's start and for pointers inside it;
 * - forked children map the fd (pm_shared_map, with and without PM_SHARED_PIN, and a plain mmap)
 *   and write patterns the parent then reads in its own block, and read what the parent wrote;
 * - budget: shared blocks are charged like others, and a freed shared block never serves a plain
 *   allocation nor a freed plain block a shared one;
 * - copies from and to a shared block are direct (pinned), from an unpinned mapping staged;
 * - bad input gets a status and a message; no fd is left open once the pool lets a segment go;
 * - a peer holding the memfd cannot shrink or grow it (sealed), and the owner keeps every byte;
 * - pm_shared_unmap of a PM_SHARED_PIN mapping the caller already unregistered still unmaps;
 * - the /dev/shm fallback where memfd_create is missing, and the error when neither works;
 * - a loader with shared_slots=1 delivers correct batches whose host slots are shared.
 * Every child runs under alarm(), so a hang fails the test instead of stalling it.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "internal.h"

#include "tsan_fork.h"

#define CHILD_ALARM_S 30
#define KiB ((size_t)1024)
#define MiB ((size_t)1 << 20)

static bool g_cuda;

/* ---- helpers --------------------------------------------------------------------------------- */

/* Run fn(arg) in a forked child under alarm(); true if it exited with status 0. */
static bool in_child(const char *name, void (*fn)(void *), void *arg) {
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid < 0) {
    fprintf(stderr, "%s: fork failed\n", name);
    return false;
  }
  if (pid == 0) {
    alarm(CHILD_ALARM_S);
    pm_test_failures = 0; /* the child's own count */
    fn(arg);
    fflush(stdout);
    fflush(stderr);
    pm_test_child_exit(pm_test_failures ? 1 : 0);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
  }
  if (WIFSIGNALED(status)) {
    fprintf(stderr, "%s: child killed by signal %d%s\n", name, WTERMSIG(status),
            WTERMSIG(status) == SIGALRM ? " (it hung)" : "");
    return false;
  }
  if (WEXITSTATUS(status) != 0)
    fprintf(stderr, "%s: child exited with %d\n", name, WEXITSTATUS(status));
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

/* Open file descriptors of this process (entries of /proc/self/fd, less the one reading it). */
static int count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  int n = 0;
  for (struct dirent *e; (e = readdir(d));)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n - 1;
}

/* What /proc/self/fd/<fd> points to ("/memfd:pinmem-shared (deleted)"). */
static void fd_target(int fd, char *out, size_t len) {
  char link[64];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, out, len - 1);
  out[n > 0 ? n : 0] = '\0';
}

/* Mappings of shared memory files in this process (lines of /proc/self/maps). */
static int count_shared_maps(void) {
  FILE *f = fopen("/proc/self/maps", "r");
  if (!f) return -1;
  char line[512];
  int n = 0;
  while (fgets(line, sizeof line, f))
    if (strstr(line, "pinmem-shared")) n++;
  fclose(f);
  return n;
}

static pm_pool_t *make_pool(size_t budget) {
  pm_pool_config_t c;
  pm_pool_config_init(&c);
  c.budget = budget;
  c.exhaust_policy = PM_EXHAUST_FAIL;
  pm_pool_t *p = NULL;
  REQUIRE_OK(pm_pool_create(&c, &p));
  return p;
}

/* ---- a shared block and its file ------------------------------------------------------------- */

static void test_alloc_and_fd(void) {
  const size_t n = 100003; /* odd, not a page multiple */
  unsigned char *p = NULL;
  REQUIRE_OK(pm_host_alloc(NULL, n, PM_HOST_SHARED, (void **)&p));
  pm_test_fill(p, n, 11);

  pm_pointer_info_t info;
  CHECK_OK(pm_pointer_query(p, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_POOL);
  CHECK(info.flags & PM_HOST_SHARED);
  CHECK(info.in_use);
  CHECK(info.base == p);
  CHECK(pm__backend()->pointer_kind(p) == PM__PTR_PINNED);
  CHECK(pm__backend()->pointer_kind(p + n - 1) == PM__PTR_PINNED);

  int fd = -1;
  uint64_t off = 0;
  size_t bytes = 0;
  CHECK_OK(pm_host_shared_fd(p, &fd, &off, &bytes));
  REQUIRE(fd >= 0);
  size_t usable = 0;
  CHECK_OK(pm_host_usable_size(p, &usable));
  CHECK_EQ_SIZE(bytes, usable);
  CHECK(bytes >= n);
  int fdflags = fcntl(fd, F_GETFD);
  CHECK(fdflags >= 0 && (fdflags & FD_CLOEXEC)); /* not leaked into exec'd programs */
  char target[256];
  fd_target(fd, target, sizeof target);
  CHECK(strstr(target, "memfd:pinmem-shared") != NULL);
  struct stat sb;
  CHECK(fstat(fd, &sb) == 0 && (uint64_t)sb.st_size >= off + bytes);

  /* The file holds the block's bytes at that offset: read them without any mapping. */
  unsigned char *back = malloc(n);
  REQUIRE(back);
  CHECK(pread(fd, back, n, (off_t)off) == (ssize_t)n);
  CHECK(pm_test_fill_ok(back, n, 11));

  /* A pointer inside the block: its own offset, and the bytes left to the block's end. */
  int fd2 = -1;
  uint64_t off2 = 0;
  size_t bytes2 = 0;
  CHECK_OK(pm_host_shared_fd(p + 4097, &fd2, &off2, &bytes2));
  CHECK_EQ_INT(fd2, fd);
  CHECK_EQ_SIZE(off2, off + 4097);
  CHECK_EQ_SIZE(bytes2, bytes - 4097);
  CHECK_OK(pm_host_shared_fd(p + bytes - 1, &fd2, &off2, &bytes2));
  CHECK_EQ_SIZE(bytes2, 1);

  /* Writes through the file show in the block (one memory, two ways in). */
  pm_test_fill(back, 1000, 12);
  CHECK(pwrite(fd, back, 1000, (off_t)(off + 5)) == 1000);
  CHECK(pm_test_fill_ok(p + 5, 1000, 12));

  /* Two small blocks of one segment: one file, different offsets. */
  void *a = NULL, *b = NULL;
  REQUIRE_OK(pm_host_alloc(NULL, 3000, PM_HOST_SHARED, &a));
  REQUIRE_OK(pm_host_alloc(NULL, 3000, PM_HOST_SHARED, &b));
  int fa = -1, fb = -1;
  uint64_t oa = 0, ob = 0;
  size_t ba = 0, bb = 0;
  CHECK_OK(pm_host_shared_fd(a, &fa, &oa, &ba));
  CHECK_OK(pm_host_shared_fd(b, &fb, &ob, &bb));
  CHECK(oa != ob);
  CHECK_EQ_SIZE((uintptr_t)b - (uintptr_t)a, ob - oa); /* the same file when in one segment */
  CHECK_EQ_INT(fa, fb);
  CHECK_OK(pm_host_free(a));
  CHECK_OK(pm_host_free(b));

  /* Flags combine: shared + mapped gives a device pointer; portable is implied anyway. */
  void *m = NULL, *dp = NULL;
  CHECK_OK(pm_host_alloc(NULL, 5000, PM_HOST_SHARED | PM_HOST_MAPPED | PM_HOST_PORTABLE, &m));
  if (m) {
    CHECK_OK(pm_host_device_pointer(m, &dp));
    CHECK(dp != NULL);
    CHECK_OK(pm_host_shared_fd(m, &fa, &oa, &ba));
    CHECK_OK(pm_host_free(m));
  }

  free(back);
  CHECK_OK(pm_host_free(p));
  /* After the free the block's file is no longer the caller's. */
  CHECK_ERR_MSG(pm_host_shared_fd(p, &fd2, &off2, &bytes2), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "freed") != NULL);
}

/* ---- children that map the block ------------------------------------------------------------- */

typedef struct share {
  int fd;
  uint64_t off;
  size_t bytes; /* of the block, from off */
  size_t n;     /* what the parent filled */
} share_t;

/* The child reads the parent's pattern and writes seed 21 over the first half, through
 * pm_shared_map; a second mapping with PM_SHARED_PIN is pinned here and writes seed 22 over the
 * second half. */
static void child_pm_map(void *arg) {
  const share_t *s = arg;
  unsigned char *q = NULL;
  REQUIRE_OK(pm_shared_map(s->fd, s->off, s->n, 0, (void **)&q));
  CHECK(pm_test_fill_ok(q, s->n, 20));
  pm_pointer_info_t info;
  CHECK_OK(pm_pointer_query(q, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_PAGEABLE); /* mapped, not pinned */
  size_t half = s->n / 2;
  pm_test_fill(q, half, 21);

  /* The second half at its own (unaligned) offset, pinned in this process. */
  unsigned char *r = NULL;
  pm_status_t st = pm_shared_map(s->fd, s->off + half, s->n - half, PM_SHARED_PIN, (void **)&r);
  if (g_cuda) {
    /* The CUDA driver cannot be used in a forked child: pinning needs it, the map alone not. */
    CHECK_ST(st, PM_ERR_STATE);
    REQUIRE_OK(pm_shared_map(s->fd, s->off + half, s->n - half, 0, (void **)&r));
  } else {
    REQUIRE_OK(st);
    CHECK_OK(pm_pointer_query(r + 17, &info));
    CHECK_EQ_INT(info.kind, PM_MEMORY_REGISTERED);
    CHECK(info.base == r);
    CHECK_EQ_SIZE(info.size, s->n - half);
  }
  unsigned char *want = malloc(s->n);
  REQUIRE(want);
  pm_test_fill(want, s->n, 20);
  CHECK(memcmp(r, want + half, s->n - half) == 0); /* the parent's bytes at that offset */
  pm_test_fill(r, s->n - half, 22);
  CHECK(pm_test_fill_ok(q + half, s->n - half, 22)); /* one memory: seen through q too */
  free(want);
  CHECK_OK(pm_shared_unmap(r, s->n - half));
  CHECK_OK(pm_pointer_query(r, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_PAGEABLE); /* the registration went with the mapping */
  CHECK_OK(pm_shared_unmap(q, s->n));
}

/* Without pinmem: a plain mmap of the page holding the offset, writing seed 23 at +100. */
static void child_plain_mmap(void *arg) {
  const share_t *s = arg;
  long pg = sysconf(_SC_PAGESIZE);
  uint64_t start = s->off & ~(uint64_t)(pg - 1);
  size_t delta = (size_t)(s->off - start);
  size_t len = delta + s->n;
  unsigned char *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, (off_t)start);
  REQUIRE(m != MAP_FAILED);
  pm_test_fill(m + delta + 100, s->n - 100, 23);
  munmap(m, len);
}

static void test_fork_children(void) {
  const size_t n = 70001;
  unsigned char *p = NULL;
  REQUIRE_OK(pm_host_alloc(NULL, n, PM_HOST_SHARED, (void **)&p));
  share_t s = {.n = n};
  REQUIRE_OK(pm_host_shared_fd(p, &s.fd, &s.off, &s.bytes));
  pm_test_fill(p, n, 20);

  CHECK(in_child("pm_shared_map child", child_pm_map, &s));
  size_t half = n / 2;
  CHECK(pm_test_fill_ok(p, half, 21));
  CHECK(pm_test_fill_ok(p + half, n - half, 22));

  CHECK(in_child("plain mmap child", child_plain_mmap, &s));
  CHECK(pm_test_fill_ok(p + 100, n - 100, 23));
  CHECK(pm_test_fill_ok(p, 100, 21)); /* the bytes before it as the first child left them */

  /* A pointer inside the block works the same: its offset is the one to map. */
  share_t inner = {.n = 5000};
  REQUIRE_OK(pm_host_shared_fd(p + 999, &inner.fd, &inner.off, &inner.bytes));
  CHECK_EQ_SIZE(inner.bytes, s.bytes - 999);
  pm_test_fill(p + 999, inner.n, 20);
  CHECK(in_child("pm_shared_map child, inner pointer", child_pm_map, &inner));
  CHECK(pm_test_fill_ok(p + 999, inner.n / 2, 21));
  CHECK(pm_test_fill_ok(p + 999 + inner.n / 2, inner.n - inner.n / 2, 22));
  CHECK(pm_test_fill_ok(p + 100, 899, 23)); /* untouched before it */

  CHECK_OK(pm_host_free(p));
}

/* In a forked child the parent's blocks are not pinned (fork rule), so not shared blocks there
 * either; the child's own shared memory works (host backend). */
static void child_after_fork(void *arg) {
  void *parent_block = arg;
  int fd;
  uint64_t off;
  size_t bytes;
  CHECK_ERR_MSG(pm_host_shared_fd(parent_block, &fd, &off, &bytes), PM_ERR_INVALID);
  void *q = NULL;
  CHECK_OK(pm_host_alloc(NULL, 4096, PM_HOST_SHARED, &q));
  if (q) {
    CHECK_OK(pm_host_shared_fd(q, &fd, &off, &bytes));
    CHECK_OK(pm_host_free(q));
  }
}

static void test_fork_rule(void) {
  if (g_cuda) return; /* a cuda child cannot allocate: test_fork covers that rule */
  void *p = NULL;
  REQUIRE_OK(pm_host_alloc(NULL, 4096, PM_HOST_SHARED, &p));
  CHECK(in_child("shared memory after fork", child_after_fork, p));
  CHECK_OK(pm_host_free(p));
}

/* ---- budget and caching apart ------------------------------------------------------------ */

static void test_budget_and_separate_cache(void) {
  const size_t big = 1536 * KiB; /* a size class of its own: one segment of exactly this size */
  pm_pool_t *pool = make_pool(4 * MiB);
  pm_pool_stats_t st0, st;
  REQUIRE_OK(pm_pool_get_stats(pool, &st0));

  void *a = NULL;
  REQUIRE_OK(pm_host_alloc(pool, big, PM_HOST_SHARED, &a));
  CHECK_OK(pm_pool_get_stats(pool, &st));
  CHECK_EQ_SIZE(st.pinned_bytes, big); /* charged like any block */
  CHECK_EQ_SIZE(st.in_use_bytes, big);
  CHECK_EQ_SIZE(st.backend_allocs, st0.backend_allocs + 1);

  void *b = NULL;
  REQUIRE_OK(pm_host_alloc(pool, big, PM_HOST_SHARED, &b));
  void *c = NULL;
  CHECK_ERR_MSG(pm_host_alloc(pool, big, PM_HOST_SHARED, &c), PM_ERR_BUDGET); /* 4.5 > 4 MiB */
  CHECK(c == NULL);
  CHECK_OK(pm_host_free(b));

  /* A's twin is cached as shared: a plain allocation must pin its own segment. */
  CHECK_OK(pm_pool_get_stats(pool, &st0));
  CHECK_EQ_SIZE(st0.cached_bytes, big);
  void *plain = NULL;
  REQUIRE_OK(pm_host_alloc(pool, big, PM_HOST_DEFAULT, &plain));
  CHECK_OK(pm_pool_get_stats(pool, &st));
  CHECK_EQ_SIZE(st.cache_hits, st0.cache_hits);
  CHECK_EQ_SIZE(st.backend_allocs, st0.backend_allocs + 1);
  pm_pointer_info_t info;
  CHECK_OK(pm_pointer_query(plain, &info));
  CHECK(!(info.flags & PM_HOST_SHARED));
  int fd;
  uint64_t off;
  size_t bytes;
  CHECK_ERR_MSG(pm_host_shared_fd(plain, &fd, &off, &bytes), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "PM_HOST_SHARED") != NULL);

  /* The budget was full (a + cached b + plain = 4.5 MiB > 4 MiB), so the cached shared block was
   * trimmed to make room: its file is gone with it. */
  CHECK_OK(pm_pool_get_stats(pool, &st));
  CHECK_EQ_SIZE(st.cached_bytes, 0);
  CHECK_EQ_SIZE(st.pinned_bytes, 2 * big);

  /* The other way: a freed plain block never serves a shared allocation. */
  CHECK_OK(pm_host_free(plain));
  CHECK_OK(pm_pool_get_stats(pool, &st0));
  void *s2 = NULL;
  REQUIRE_OK(pm_host_alloc(pool, big, PM_HOST_SHARED, &s2));
  CHECK_OK(pm_pool_get_stats(pool, &st));
  CHECK_EQ_SIZE(st.cache_hits, st0.cache_hits);
  CHECK_OK(pm_host_shared_fd(s2, &fd, &off, &bytes));
  CHECK_OK(pm_pointer_query(s2, &info));
  CHECK(info.flags & PM_HOST_SHARED);

  /* A freed shared block serves the next shared allocation (from the cache). */
  CHECK_OK(pm_host_free(s2));
  CHECK_OK(pm_pool_get_stats(pool, &st0));
  void *s3 = NULL;
  REQUIRE_OK(pm_host_alloc(pool, big, PM_HOST_SHARED, &s3));
  CHECK(s3 == s2);
  CHECK_OK(pm_pool_get_stats(pool, &st));
  CHECK_EQ_SIZE(st.cache_hits, st0.cache_hits + 1);
  CHECK_OK(pm_host_free(s3));
  CHECK_OK(pm_host_free(a));

  /* Small blocks share 2 MiB segments, per kind: a plain small block is never carved from a
   * shared segment, nor a shared one from a plain segment. */
  void *ss = NULL, *sp = NULL;
  size_t trimmed = 0;
  CHECK_OK(pm_pool_trim(pool, &trimmed));
  REQUIRE_OK(pm_host_alloc(pool, 1000, PM_HOST_SHARED, &ss));
  REQUIRE_OK(pm_host_alloc(pool, 1000, PM_HOST_DEFAULT, &sp));
  pm_pointer_info_t is, ip;
  CHECK_OK(pm_pointer_query(ss, &is));
  CHECK_OK(pm_pointer_query(sp, &ip));
  pm__range_t rs, rp;
  CHECK(pm__registry_find(ss, &rs) && pm__registry_find(sp, &rp));
  CHECK(rs.base != rp.base); /* two segments */
  CHECK(rs.flags & PM_HOST_SHARED);
  CHECK(!(rp.flags & PM_HOST_SHARED));
  CHECK_OK(pm_host_free(ss));
  CHECK_OK(pm_host_free(sp));

  /* pm_pool_reserve of shared memory: the next shared allocation is a cache hit. */
  CHECK_OK(pm_pool_trim(pool, &trimmed));
  CHECK_OK(pm_pool_reserve(pool, big, PM_HOST_SHARED));
  CHECK_OK(pm_pool_get_stats(pool, &st0));
  void *r = NULL;
  REQUIRE_OK(pm_host_alloc(pool, big, PM_HOST_SHARED, &r));
  CHECK_OK(pm_pool_get_stats(pool, &st));
  CHECK_EQ_SIZE(st.cache_hits, st0.cache_hits + 1);
  CHECK_OK(pm_host_shared_fd(r, &fd, &off, &bytes));
  CHECK_EQ_SIZE(off, 0);
  CHECK_OK(pm_host_free(r));

  CHECK_OK(pm_pool_destroy(pool));
}

/* ---- copies --------------------------------------------------------------------------------- */

static pm_copy_path_t h2d_path(void *dev, const void *src, size_t n, pm_stream_t s) {
  pm_fence_t f = NULL;
  pm_copy_path_t path = PM_PATH_AUTO;
  CHECK_OK(pm_copy_async(dev, src, n, s, NULL, &f));
  CHECK_OK(pm_fence_wait(f));
  CHECK_OK(pm_fence_path(f, &path));
  CHECK_OK(pm_fence_release(f));
  return path;
}

static void test_copy(void) {
  const size_t n = 300007;
  /* Pageable copies of this size are staged, so "direct" below means "pinned". */
  pm_option_info_t old;
  REQUIRE_OK(pm_option_find("copy_stage_min", &old));
  REQUIRE_OK(pm_option_set("copy_stage_min", "64K"));
  pm_stream_t s = NULL;
  REQUIRE_OK(pm_stream_create(&s));
  unsigned char *p = NULL, *back = malloc(n);
  void *dev = NULL;
  REQUIRE(back);
  REQUIRE_OK(pm_host_alloc(NULL, n, PM_HOST_SHARED, (void **)&p));
  REQUIRE_OK(pm_device_alloc(n, &dev));

  pm__mem_t kind;
  uintptr_t base;
  size_t size;
  CHECK_OK(pm__classify(pm__backend(), p + 1, n - 1, "src", &kind, &base, &size));
  CHECK_EQ_INT(kind, PM__MEM_PINNED);

  pm_test_fill(p, n, 31);
  CHECK_EQ_INT(h2d_path(dev, p, n, s), PM_PATH_DIRECT);
  CHECK_OK(pm_memcpy(back, dev, n, PM_COPY_D2H));
  CHECK(pm_test_fill_ok(back, n, 31));

  /* Unaligned piece with pm_memcpy_async, and D2H into the shared block. */
  pm_test_fill(p + 3, 1001, 32);
  CHECK_OK(pm_memcpy_async((char *)dev + 5, p + 3, 1001, PM_COPY_H2D, s));
  CHECK_OK(pm_stream_synchronize(s)); /* a pinned source is read on the stream, later */
  memset(p, 0x11, n);
  CHECK_OK(pm_memcpy_async(p + 7, (char *)dev + 5, 1001, PM_COPY_D2H, s));
  CHECK_OK(pm_stream_synchronize(s));
  CHECK(pm_test_fill_ok(p + 7, 1001, 32));
  pm_test_fill(back, n, 33);
  CHECK_OK(pm_memcpy(dev, back, n, PM_COPY_H2D));
  pm_fence_t f = NULL;
  CHECK_OK(pm_copy_async(p, dev, n, s, NULL, &f));
  CHECK_OK(pm_fence_wait(f));
  pm_copy_path_t path = PM_PATH_AUTO;
  CHECK_OK(pm_fence_path(f, &path));
  CHECK_EQ_INT(path, PM_PATH_DIRECT);
  CHECK_OK(pm_fence_release(f));
  CHECK(pm_test_fill_ok(p, n, 33));

  /* The same file mapped again in this process: pinned with PM_SHARED_PIN (direct), pageable
   * without (staged); the bytes are the block's either way. */
  int fd;
  uint64_t off;
  size_t bytes;
  REQUIRE_OK(pm_host_shared_fd(p, &fd, &off, &bytes));
  unsigned char *m = NULL, *mp = NULL;
  REQUIRE_OK(pm_shared_map(fd, off, n, 0, (void **)&m));
  REQUIRE_OK(pm_shared_map(fd, off, n, PM_SHARED_PIN, (void **)&mp));
  CHECK(m != p && mp != p && m != mp);
  CHECK(pm_test_fill_ok(m, n, 33));
  CHECK_EQ_INT(h2d_path(dev, m, n, s), PM_PATH_STAGED);
  CHECK_EQ_INT(h2d_path(dev, mp, n, s), PM_PATH_DIRECT);
  CHECK_OK(pm_memcpy(back, dev, n, PM_COPY_D2H));
  CHECK(pm_test_fill_ok(back, n, 33));
  pm_test_fill(mp, n, 34);
  CHECK(pm_test_fill_ok(p, n, 34));
  CHECK_OK(pm_shared_unmap(mp, n));
  CHECK_OK(pm_shared_unmap(m, n));

  CHECK_OK(pm_device_free(dev));
  CHECK_OK(pm_host_free(p));
  CHECK_OK(pm_stream_destroy(s));
  free(back);
  REQUIRE_OK(pm_option_set("copy_stage_min", old.value));
}

/* ---- bad input --------------------------------------------------------------------------- */

static void test_bad_input(void) {
  int fd = -1;
  uint64_t off = 0;
  size_t bytes = 0;
  void *p = NULL;
  REQUIRE_OK(pm_host_alloc(NULL, 5000, PM_HOST_SHARED, &p));
  REQUIRE_OK(pm_host_shared_fd(p, &fd, &off, &bytes));

  /* pm_host_shared_fd */
  CHECK_ERR_MSG(pm_host_shared_fd(NULL, &fd, &off, &bytes), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_host_shared_fd(p, NULL, &off, &bytes), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "fd_out") != NULL);
  CHECK_ERR_MSG(pm_host_shared_fd(p, &fd, NULL, &bytes), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_host_shared_fd(p, &fd, &off, NULL), PM_ERR_INVALID);
  char stack[64];
  CHECK_ERR_MSG(pm_host_shared_fd(stack, &fd, &off, &bytes), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "not shared") != NULL);
  void *plain = NULL, *dev = NULL;
  REQUIRE_OK(pm_host_alloc(NULL, 5000, PM_HOST_DEFAULT, &plain));
  CHECK_ERR_MSG(pm_host_shared_fd(plain, &fd, &off, &bytes), PM_ERR_INVALID);
  REQUIRE_OK(pm_device_alloc(100, &dev));
  CHECK_ERR_MSG(pm_host_shared_fd(dev, &fd, &off, &bytes), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "device") != NULL);
  unsigned char reg[8192];
  CHECK_OK(pm_register(reg, sizeof reg, 0));
  CHECK_ERR_MSG(pm_host_shared_fd(reg + 10, &fd, &off, &bytes), PM_ERR_INVALID);
  CHECK_OK(pm_unregister(reg));
  int fd0 = fd;
  CHECK_EQ_INT(fd, fd0); /* outputs untouched by the failures */

  /* Flags */
  void *q = NULL;
  CHECK_ERR_MSG(pm_host_alloc(NULL, 100, PM_HOST_SHARED | PM_HOST_WRITE_COMBINED, &q),
                PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "WRITE_COMBINED") != NULL);
  CHECK_ERR_MSG(pm_pool_reserve(NULL, 100, PM_HOST_SHARED | PM_HOST_WRITE_COMBINED),
                PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_host_alloc(NULL, 100, 1u << 4, &q), PM_ERR_INVALID);
  CHECK(q == NULL);

  /* pm_shared_map */
  void *m = (void *)&m;
  CHECK_ERR_MSG(pm_shared_map(fd, off, 100, 0, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_shared_map(-1, 0, 100, 0, &m), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "fd -1") != NULL);
  CHECK_ERR_MSG(pm_shared_map(fd, off, 0, 0, &m), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_shared_map(fd, off, 100, 4u, &m), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "flags") != NULL);
  struct stat sb;
  REQUIRE(fstat(fd, &sb) == 0);
  uint64_t fsize = (uint64_t)sb.st_size;
  CHECK_ERR_MSG(pm_shared_map(fd, fsize + 1, 1, 0, &m), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "beyond") != NULL);
  CHECK_ERR_MSG(pm_shared_map(fd, fsize - 10, 11, 0, &m), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_shared_map(fd, 10, SIZE_MAX, 0, &m), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_shared_map(fd, UINT64_MAX, 1, 0, &m), PM_ERR_INVALID);
  CHECK(m == (void *)&m); /* never written on failure */
  /* The last byte of the file is fine. */
  void *last = NULL;
  CHECK_OK(pm_shared_map(fd, fsize - 1, 1, 0, &last));
  CHECK_OK(pm_shared_unmap(last, 1));
  int pipefd[2];
  REQUIRE(pipe(pipefd) == 0);
  CHECK_ERR_MSG(pm_shared_map(pipefd[0], 0, 1, 0, &m), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "not a regular file") != NULL);
  int closed = pipefd[0];
  close(pipefd[0]);
  close(pipefd[1]);
  CHECK_ERR_MSG(pm_shared_map(closed, 0, 1, 0, &m), PM_ERR_INVALID); /* EBADF */
  CHECK(strstr(pm_last_error(), "fstat") != NULL);
  /* Read-only descriptor of the same file: mmap read-write refuses it. */
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  int ro = open(path, O_RDONLY | O_CLOEXEC);
  if (ro >= 0) {
    CHECK_ERR_MSG(pm_shared_map(ro, off, 100, 0, &m), PM_ERR_INVALID);
    CHECK(strstr(pm_last_error(), "reading and writing") != NULL);
    close(ro);
  }
  CHECK(m == (void *)&m);

  /* pm_shared_unmap */
  void *good = NULL;
  REQUIRE_OK(pm_shared_map(fd, off, 200, 0, &good));
  CHECK_ERR_MSG(pm_shared_unmap(NULL, 200), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_shared_unmap(stack, 64), PM_ERR_NOT_FOUND);
  CHECK_ERR_MSG(pm_shared_unmap(p, 5000), PM_ERR_NOT_FOUND); /* a block, not a mapping */
  CHECK_ERR_MSG(pm_shared_unmap((char *)good + 1, 199), PM_ERR_NOT_FOUND);
  CHECK_ERR_MSG(pm_shared_unmap(good, 100), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "200") != NULL);
  CHECK_OK(pm_shared_unmap(good, 200));
  CHECK_ERR_MSG(pm_shared_unmap(good, 200), PM_ERR_NOT_FOUND); /* twice */

  /* PM_SHARED_PIN beyond the default pool's budget: the registration's status, nothing mapped. */
  pm_pool_stats_t ps;
  REQUIRE_OK(pm_pool_get_stats(NULL, &ps));
  int maps = count_shared_maps();
  CHECK(maps > 0);
  if (pm_pool_set_budget(NULL, ps.pinned_bytes + 4096) == PM_OK) {
    m = (void *)&m;
    CHECK_ERR_MSG(pm_shared_map(fd, off, 5000, PM_SHARED_PIN, &m), PM_ERR_BUDGET);
    CHECK(strstr(pm_last_error(), "pm_shared_map") != NULL);
    CHECK(m == (void *)&m);
    CHECK_EQ_INT(count_shared_maps(), maps);
    CHECK_OK(pm_pool_set_budget(NULL, ps.budget));
  } else {
    CHECK(0); /* the budget could not be lowered to just above what is held */
  }

  /* Freeing memory from pm_shared_map with the pool's call is refused, as for any pageable. */
  REQUIRE_OK(pm_shared_map(fd, off, 200, PM_SHARED_PIN, &good));
  CHECK_ERR_MSG(pm_host_free(good), PM_ERR_WRONG_KIND);
  CHECK_OK(pm_shared_unmap(good, 200));

  CHECK_OK(pm_device_free(dev));
  CHECK_OK(pm_host_free(plain));
  CHECK_OK(pm_host_free(p));
}

/* ---- a peer cannot resize the file --------------------------------------------------------- */

typedef struct seal_peer {
  int fd;
  off_t size; /* the file's size */
} seal_peer_t;

/* A process holding the fd tries every way to change the file's size; each must be refused with
 * EPERM (the seals), and the seals themselves must be final. */
static void child_resize(void *arg) {
  const seal_peer_t *s = arg;
  int seals = fcntl(s->fd, F_GET_SEALS);
  CHECK(seals >= 0 && (seals & F_SEAL_SHRINK) && (seals & F_SEAL_GROW) && (seals & F_SEAL_SEAL));
  errno = 0;
  CHECK(ftruncate(s->fd, 0) != 0 && errno == EPERM);
  errno = 0;
  CHECK(ftruncate(s->fd, s->size / 2) != 0 && errno == EPERM);
  errno = 0;
  CHECK(ftruncate(s->fd, s->size + 4096) != 0 && errno == EPERM);
  errno = 0;
  CHECK(fallocate(s->fd, 0, s->size, 4096) != 0 && errno == EPERM);
  errno = 0;
  CHECK(fcntl(s->fd, F_ADD_SEALS, F_SEAL_WRITE) != 0 && errno == EPERM); /* sealed for good */
  /* A second open of the same file (another file description) meets the same seals. */
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", s->fd);
  int again = open(path, O_RDWR | O_CLOEXEC);
  if (again >= 0) {
    errno = 0;
    CHECK(ftruncate(again, 0) != 0 && errno == EPERM);
    close(again);
  }
  struct stat sb;
  CHECK(fstat(s->fd, &sb) == 0 && sb.st_size == s->size);
}

static void test_peer_cannot_resize(void) {
  const size_t n = 3 * MiB + 5; /* a segment of its own, several pages */
  unsigned char *p = NULL;
  REQUIRE_OK(pm_host_alloc(NULL, n, PM_HOST_SHARED, (void **)&p));
  seal_peer_t s;
  uint64_t off;
  size_t bytes;
  REQUIRE_OK(pm_host_shared_fd(p, &s.fd, &off, &bytes));
  struct stat sb;
  REQUIRE(fstat(s.fd, &sb) == 0);
  s.size = sb.st_size;
  pm_test_fill(p, n, 41);
  bool refused = in_child("peer resizing the shared file", child_resize, &s);
  CHECK(refused);
  REQUIRE(fstat(s.fd, &sb) == 0);
  CHECK_EQ_SIZE(sb.st_size, s.size);
  /* The owner reads and writes every byte of its block after the peer's attempts (a shrunk file
   * would end this process with SIGBUS here; the check above stops first if a resize got by). */
  if (refused && sb.st_size == s.size) {
    CHECK(pm_test_fill_ok(p, n, 41));
    pm_test_fill(p, n, 42);
    CHECK(pm_test_fill_ok(p, n, 42));
  }
  CHECK_OK(pm_host_free(p));
}

/* ---- pm_unregister of a pinned mapping, then pm_shared_unmap -------------------------------- */

static void test_unregister_then_unmap(void) {
  const size_t n = 20000;
  unsigned char *p = NULL;
  REQUIRE_OK(pm_host_alloc(NULL, n, PM_HOST_SHARED, (void **)&p));
  int fd;
  uint64_t off;
  size_t bytes;
  REQUIRE_OK(pm_host_shared_fd(p, &fd, &off, &bytes));
  pm_test_fill(p, n, 43);
  int maps = count_shared_maps();
  pm_pool_stats_t ps0, ps;
  REQUIRE_OK(pm_pool_get_stats(NULL, &ps0));

  unsigned char *m = NULL;
  REQUIRE_OK(pm_shared_map(fd, off, n, PM_SHARED_PIN, (void **)&m));
  CHECK(pm_test_fill_ok(m, n, 43));
  CHECK_EQ_INT(count_shared_maps(), maps + 1);
  /* The caller unpins the mapping itself, as it may any registration. */
  CHECK_OK(pm_unregister(m));
  pm_pointer_info_t info;
  CHECK_OK(pm_pointer_query(m, &info));
  CHECK_EQ_INT(info.kind, PM_MEMORY_PAGEABLE);
  /* The unmap still works: the mapping goes, nothing stays charged, and a second unmap is the
   * usual NOT_FOUND. */
  CHECK_OK(pm_shared_unmap(m, n));
  CHECK_EQ_INT(count_shared_maps(), maps);
  CHECK_ERR_MSG(pm_shared_unmap(m, n), PM_ERR_NOT_FOUND);
  CHECK_OK(pm_pool_get_stats(NULL, &ps));
  CHECK_EQ_SIZE(ps.registered_bytes, ps0.registered_bytes);

  /* Unregistered and registered again by the caller: the unmap takes the registration with it
   * (the memory goes, so must its pinning). */
  REQUIRE_OK(pm_shared_map(fd, off, n, PM_SHARED_PIN, (void **)&m));
  CHECK_OK(pm_unregister(m));
  CHECK_OK(pm_register(m, n, 0));
  CHECK_OK(pm_shared_unmap(m, n));
  CHECK_EQ_INT(count_shared_maps(), maps);
  CHECK_OK(pm_pool_get_stats(NULL, &ps));
  CHECK_EQ_SIZE(ps.registered_bytes, ps0.registered_bytes);
  CHECK(pm_test_fill_ok(p, n, 43)); /* the owner's block is untouched */

  /* Mapped without PM_SHARED_PIN and registered by the caller, at the start or inside: the
   * unmap takes those registrations too (it unmapped under them, leaving the registry naming
   * memory that was gone, charged to the budget and refusing the next registration there). */
  for (size_t at = 0; at <= 5000; at += 5000) {
    REQUIRE_OK(pm_shared_map(fd, off, n, 0, (void **)&m));
    CHECK_OK(pm_register(m + at, 4096, 0));
    CHECK_OK(pm_shared_unmap(m, n));
    CHECK_EQ_INT(count_shared_maps(), maps);
    CHECK_OK(pm_pointer_query(m + at, &info));
    CHECK_EQ_INT(info.kind, PM_MEMORY_PAGEABLE);
    CHECK_ERR_MSG(pm_unregister(m + at), PM_ERR_NOT_FOUND);
    CHECK_OK(pm_pool_get_stats(NULL, &ps));
    CHECK_EQ_SIZE(ps.registered_bytes, ps0.registered_bytes);
  }
  CHECK_OK(pm_host_free(p));
}

/* ---- no fd left behind ---------------------------------------------------------------------- */

static void test_no_fd_leak(void) {
  int before = count_fds();
  REQUIRE(before > 0);
  pm_pool_t *pool = make_pool(8 * MiB);
  void *v[6] = {0};
  const size_t sizes[6] = {1, 4096, 100000, 1536 * KiB, 3000, MiB + 1};
  for (int i = 0; i < 6; i++) REQUIRE_OK(pm_host_alloc(pool, sizes[i], PM_HOST_SHARED, &v[i]));
  CHECK(count_fds() > before);
  pm_pool_stats_t st;
  CHECK_OK(pm_pool_get_stats(pool, &st));
  CHECK_EQ_INT(count_fds(), before + (int)st.segments); /* one file per segment */
  /* Maps of the files, pinned and not, and their unmaps hold no fd either. */
  int fd;
  uint64_t off;
  size_t bytes;
  REQUIRE_OK(pm_host_shared_fd(v[2], &fd, &off, &bytes));
  void *m1 = NULL, *m2 = NULL;
  REQUIRE_OK(pm_shared_map(fd, off, 100000, 0, &m1));
  REQUIRE_OK(pm_shared_map(fd, off, 100000, PM_SHARED_PIN, &m2));
  CHECK_EQ_INT(count_fds(), before + (int)st.segments);
  CHECK_OK(pm_shared_unmap(m1, 100000));
  CHECK_OK(pm_shared_unmap(m2, 100000));
  for (int i = 0; i < 6; i++) CHECK_OK(pm_host_free(v[i]));
  /* Freed blocks stay cached with their files; trimming lets them go. */
  size_t released = 0;
  CHECK_OK(pm_pool_trim(pool, &released));
  CHECK(released > 0);
  CHECK_EQ_INT(count_fds(), before);
  /* And destroying a pool that still caches shared blocks. */
  for (int i = 0; i < 6; i++) REQUIRE_OK(pm_host_alloc(pool, sizes[i], PM_HOST_SHARED, &v[i]));
  for (int i = 0; i < 6; i++) CHECK_OK(pm_host_free(v[i]));
  CHECK(count_fds() > before);
  CHECK_OK(pm_pool_destroy(pool));
  CHECK_EQ_INT(count_fds(), before);
}

/* ---- without memfd_create -------------------------------------------------------------------- */

static void test_fallback(void) {
  int before = count_fds();
  atomic_store(&pm__shared_memfd_refused, 1);
  pm_pool_t *pool = make_pool(4 * MiB);
  unsigned char *p = NULL;
  struct stat dsb;
  if (stat("/dev/shm", &dsb) == 0 && access("/dev/shm", W_OK) == 0) {
    REQUIRE_OK(pm_host_alloc(pool, 10000, PM_HOST_SHARED, (void **)&p));
    int fd;
    uint64_t off;
    size_t bytes;
    REQUIRE_OK(pm_host_shared_fd(p, &fd, &off, &bytes));
    char target[256];
    fd_target(fd, target, sizeof target);
    CHECK(strncmp(target, "/dev/shm/pinmem-shared-", 23) == 0);
    CHECK(strstr(target, "(deleted)") != NULL); /* unlinked at once */
    int fdflags = fcntl(fd, F_GETFD);
    CHECK(fdflags >= 0 && (fdflags & FD_CLOEXEC));
    share_t s = {.fd = fd, .off = off, .bytes = bytes, .n = 10000};
    pm_test_fill(p, 10000, 20);
    CHECK(in_child("pm_shared_map child, /dev/shm file", child_pm_map, &s));
    CHECK(pm_test_fill_ok(p, 5000, 21));
    CHECK(pm_test_fill_ok(p + 5000, 5000, 22));
    CHECK_OK(pm_host_free(p));
    size_t released = 0;
    CHECK_OK(pm_pool_trim(pool, &released)); /* the next allocation must make a new file */
    CHECK_EQ_SIZE(released, 2 * MiB);
  } else {
    pm_test_skip("the /dev/shm fallback: /dev/shm is not writable here (only the failure without "
                 "it is tested)");
  }
  /* Neither way: a clear error naming both. */
  atomic_store(&pm__shared_dir, "/nonexistent-pinmem-dir");
  void *q = NULL;
  CHECK_ERR_MSG(pm_host_alloc(pool, 10000, PM_HOST_SHARED, &q), PM_ERR_UNSUPPORTED);
  CHECK(strstr(pm_last_error(), "memfd_create") != NULL);
  CHECK(strstr(pm_last_error(), "/nonexistent-pinmem-dir") != NULL);
  CHECK(q == NULL);
  pm_pool_stats_t st;
  CHECK_OK(pm_pool_get_stats(pool, &st));
  CHECK_EQ_SIZE(st.pinned_bytes, 0); /* the failed segment gave its budget back */
  atomic_store(&pm__shared_dir, "/dev/shm");
  atomic_store(&pm__shared_memfd_refused, 0);
  CHECK_OK(pm_pool_destroy(pool));
  CHECK_EQ_INT(count_fds(), before);
}

/* ---- threads ------------------------------------------------------------------------------- */

static pm_pool_t *g_tpool;

static void *thread_main(void *arg) {
  uint64_t seed = (uint64_t)(uintptr_t)arg;
  for (int i = 0; i < 40; i++) {
    size_t n = 100 + (size_t)(pm_test_rand(&seed) % 20000);
    unsigned flags = (i & 1) ? PM_HOST_SHARED : PM_HOST_DEFAULT;
    unsigned char *p = NULL;
    if (pm_host_alloc(g_tpool, n, flags, (void **)&p) != PM_OK) continue; /* budget: fine */
    pm_test_fill(p, n, seed);
    int fd;
    uint64_t off;
    size_t bytes;
    pm_status_t st = pm_host_shared_fd(p + n / 2, &fd, &off, &bytes);
    if ((flags & PM_HOST_SHARED) ? st != PM_OK : st != PM_ERR_INVALID) return (void *)1;
    if (flags & PM_HOST_SHARED) {
      unsigned char c = 0;
      if (pread(fd, &c, 1, (off_t)off) != 1 || c != p[n / 2]) return (void *)2;
    }
    if (!pm_test_fill_ok(p, n, seed)) return (void *)3;
    if (pm_host_free(p) != PM_OK) return (void *)4;
  }
  return NULL;
}

static void test_threads(void) {
  g_tpool = make_pool(4 * MiB);
  pthread_t t[4];
  for (int i = 0; i < 4; i++)
    REQUIRE(pthread_create(&t[i], NULL, thread_main, (void *)(uintptr_t)(i + 1)) == 0);
  for (int i = 0; i < 4; i++) {
    void *rc = NULL;
    pthread_join(t[i], &rc);
    CHECK_EQ_INT((intptr_t)rc, 0);
  }
  CHECK_OK(pm_pool_destroy(g_tpool));
}

/* ---- a loader with shared slots ------------------------------------------------------------ */

static int pat_read(uint64_t index, void *dst, void *user) {
  pm_test_fill(dst, *(size_t *)user, index + 1);
  return 0;
}

typedef struct slot_share {
  int fd;
  uint64_t off;
  size_t bytes;
  const uint64_t *indices;
  size_t rows, row_bytes;
} slot_share_t;

/* Another process reads the batch from the slot's file (plain mmap, no pinmem). */
static void child_read_slot(void *arg) {
  const slot_share_t *s = arg;
  long pg = sysconf(_SC_PAGESIZE);
  uint64_t start = s->off & ~(uint64_t)(pg - 1);
  size_t delta = (size_t)(s->off - start);
  size_t len = delta + s->rows * s->row_bytes;
  unsigned char *m = mmap(NULL, len, PROT_READ, MAP_SHARED, s->fd, (off_t)start);
  REQUIRE(m != MAP_FAILED);
  for (size_t r = 0; r < s->rows; r++)
    CHECK(pm_test_fill_ok(m + delta + r * s->row_bytes, s->row_bytes, s->indices[r] + 1));
  munmap(m, len);
}

static void run_loader(pm_delivery_t delivery) {
  size_t sample = 333; /* odd row size */
  const uint64_t samples = 50;
  pm_dataset_callbacks_t cb;
  memset(&cb, 0, sizeof cb);
  cb.samples = samples;
  cb.sample_bytes = sample;
  cb.read = pat_read;
  cb.user = &sample;
  pm_dataset_t *ds = NULL;
  REQUIRE_OK(pm_dataset_create(&cb, &ds));
  pm_loader_config_t c;
  pm_loader_config_init(&c);
  CHECK_EQ_INT(c.shared_slots, 0); /* off unless asked for */
  c.batch_size = 7;
  c.workers = 2;
  c.prefetch = 3;
  c.shuffle = 1;
  c.seed = 5;
  c.epochs = 2;
  c.delivery = delivery;
  c.shared_slots = 1;
  pm_loader_t *ld = NULL;
  REQUIRE_OK(pm_loader_create(ds, &c, &ld));
  unsigned char *back = malloc(7 * sample);
  REQUIRE(back);
  uint64_t batches = 0, rows = 0;
  bool child_done = false;
  pm_batch_t b;
  pm_status_t st;
  while ((st = pm_loader_next(ld, &b)) == PM_OK) {
    batches++;
    rows += b.samples;
    int fd;
    uint64_t off;
    size_t bytes;
    CHECK_OK(pm_host_shared_fd(b.host_inputs, &fd, &off, &bytes));
    CHECK(bytes >= b.inputs_bytes);
    pm_pointer_info_t info;
    CHECK_OK(pm_pointer_query(b.host_inputs, &info));
    CHECK(info.flags & PM_HOST_SHARED);
    const unsigned char *rowsrc = b.host_inputs;
    if (delivery == PM_DELIVER_DEVICE) {
      CHECK_OK(pm_event_synchronize(b.event));
      CHECK_OK(pm_memcpy(back, b.inputs, b.inputs_bytes, PM_COPY_D2H));
      rowsrc = back;
    }
    for (size_t r = 0; r < b.samples; r++)
      CHECK(pm_test_fill_ok(rowsrc + r * sample, sample, b.indices[r] + 1));
    if (!child_done) {
      slot_share_t s = {fd, off, bytes, b.indices, b.samples, sample};
      CHECK(in_child("process reading a loader slot", child_read_slot, &s));
      child_done = true;
    }
    CHECK_OK(pm_batch_release(&b, NULL));
  }
  CHECK_ST(st, PM_ERR_STATE);
  CHECK_EQ_SIZE(batches, 2 * ((samples + 6) / 7));
  CHECK_EQ_SIZE(rows, 2 * samples);
  CHECK_OK(pm_loader_destroy(ld));
  CHECK_OK(pm_dataset_destroy(ds));
  free(back);
}

static void test_loader(void) {
  run_loader(PM_DELIVER_HOST);
  run_loader(PM_DELIVER_DEVICE);

  /* Config checks. */
  size_t sample = 16;
  pm_dataset_callbacks_t cb;
  memset(&cb, 0, sizeof cb);
  cb.samples = 10;
  cb.sample_bytes = sample;
  cb.read = pat_read;
  cb.user = &sample;
  pm_dataset_t *ds = NULL;
  REQUIRE_OK(pm_dataset_create(&cb, &ds));
  pm_loader_config_t c;
  pm_loader_config_init(&c);
  c.batch_size = 2;
  c.shared_slots = 1;
  c.pin_memory = 0;
  pm_loader_t *ld = (pm_loader_t *)&ld;
  CHECK_ERR_MSG(pm_loader_create(ds, &c, &ld), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "pin_memory") != NULL);
  c.pin_memory = 1;
  c.shared_slots = 2;
  CHECK_ERR_MSG(pm_loader_create(ds, &c, &ld), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "shared_slots") != NULL);
  CHECK(ld == (pm_loader_t *)&ld);
  /* Plain slots are not shared. */
  c.shared_slots = 0;
  c.delivery = PM_DELIVER_HOST;
  REQUIRE_OK(pm_loader_create(ds, &c, &ld));
  pm_batch_t b;
  REQUIRE_OK(pm_loader_next(ld, &b));
  int fd;
  uint64_t off;
  size_t bytes;
  CHECK_ERR_MSG(pm_host_shared_fd(b.host_inputs, &fd, &off, &bytes), PM_ERR_INVALID);
  CHECK_OK(pm_batch_release(&b, NULL));
  CHECK_OK(pm_loader_destroy(ld));
  CHECK_OK(pm_dataset_destroy(ds));
}

/* Name each test as it starts, so a hang or a crash shows where; then give the default pool's
 * cache back, so the tests together stay within a small RLIMIT_MEMLOCK. */
#define RUN(fn)                         \
  do {                                  \
    printf("-- %s\n", #fn);             \
    fn();                               \
    CHECK_OK(pm_pool_trim(NULL, NULL)); \
  } while (0)

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  pm_test_init();
  g_cuda = pm_backend_kind() == PM_BACKEND_CUDA;
  /* A stream (a thread on the host backend) lives through the tests, as in any process that
   * copies. ThreadSanitizer checks a child forked from a single-threaded process in full, and the
   * atfork handlers of the registry and the pool give the child fresh locks by assignment, which
   * it reads as locks still held; children of a multi-threaded process it leaves alone (as
   * test_fork's). */
  pm_stream_t keep = NULL;
  REQUIRE_OK(pm_stream_create(&keep));
  RUN(test_alloc_and_fd);
  RUN(test_fork_children);
  RUN(test_fork_rule);
  RUN(test_budget_and_separate_cache);
  RUN(test_copy);
  RUN(test_bad_input);
  RUN(test_peer_cannot_resize);
  RUN(test_unregister_then_unmap);
  RUN(test_no_fd_leak);
  RUN(test_fallback);
  RUN(test_threads);
  RUN(test_loader);
  CHECK_OK(pm_stream_destroy(keep));
  CHECK_OK(pm_finalize());
  return pm_test_finish("test_shared");
}
