/*
 * DESIGN: the memory behind PM_HOST_SHARED pool segments. Pinned memory that another process can
 * map must be a file: the pool's other segments are anonymous (cudaHostAlloc, or mmap + touch +
 * register in pin.c), which a child sees only as a copy-on-write snapshot and a process started
 * with spawn cannot see at all. Here a segment is a memfd (memfd_create, close-on-exec), sized
 * with ftruncate, mapped MAP_SHARED, faulted in from several threads (pm__parallel_for, as pin.c
 * does) and then registered with the backend as PORTABLE (cudaHostRegister; mlock on the host
 * backend), so every device context sees it pinned. Once sized, a memfd's size is sealed
 * (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL): a peer that holds the fd cannot shrink it under
 * the owner's mapping (a SIGBUS there). Where memfd_create is missing (kernels before
 * 3.17, or a seccomp filter that answers ENOSYS) the file is an unlinked temporary file under
 * /dev/shm, which is the same tmpfs memory; if neither can be made the error says both reasons.
 *
 * Data structure: a small array of {base, size, fd}, one entry per live shared segment, so that
 * pm_host_shared_fd can name the fd of the segment the registry found. The pool owns the segment
 * and its bookkeeping (pool.c calls pm__shared_pin / pm__shared_unpin where it would call the
 * backend's host_alloc / host_free); this file owns the fd.
 *
 * Invariants: an entry exists exactly while its range is mapped and registered; the fd is closed
 * when the entry goes. A failed unregister keeps the mapping and the fd (as pin.c keeps its
 * mapping): the backend may still hold the pages, and the range must not be handed out again.
 *
 * Threads: shared_lock guards the array; it is a leaf (no backend call, no other pinmem lock
 * inside it). fork: the child forgets the parent's entries (its registry no longer lists the
 * segments) but keeps the inherited fds open: the parent may have told it which fd to map.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "internal.h"

#define PM__SHARED_PIECE ((size_t)2 << 20) /* one thread's share of the first touch */

atomic_int pm__shared_memfd_refused;
_Atomic(const char *) pm__shared_dir = "/dev/shm";

typedef struct pm__shared_seg {
  uintptr_t base;
  size_t size;
  int fd;
} pm__shared_seg_t;

static pthread_mutex_t shared_lock = PTHREAD_MUTEX_INITIALIZER;
static pm__shared_seg_t *segs;
static size_t nsegs, capsegs;

pm_status_t pm__shared_check_flags(const char *fn, unsigned flags) {
  if ((flags & PM_HOST_SHARED) && (flags & PM_HOST_WRITE_COMBINED))
    return pm__set_error(PM_ERR_INVALID,
                         "%s: PM_HOST_SHARED memory cannot be PM_HOST_WRITE_COMBINED (it is "
                         "registered file memory, which has no write-combined form)",
                         fn);
  return PM_OK;
}

/* memfd_create, or ENOSYS where the C library or the kernel has none. */
static int memfd(const char *name) {
  if (atomic_load_explicit(&pm__shared_memfd_refused, memory_order_relaxed)) {
    errno = ENOSYS;
    return -1;
  }
#if defined(MFD_CLOEXEC) && defined(MFD_ALLOW_SEALING)
  return memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
#elif defined(SYS_memfd_create)
  return (int)syscall(SYS_memfd_create, name, 3u /* MFD_CLOEXEC | MFD_ALLOW_SEALING */);
#else
  (void)name;
  errno = ENOSYS;
  return -1;
#endif
}

/* A new empty file of tmpfs memory: a memfd, else an unlinked file under pm__shared_dir. */
static pm_status_t open_file(int *fd_out, bool *is_memfd) {
  int fd = memfd("pinmem-shared");
  if (fd >= 0) {
    *fd_out = fd;
    *is_memfd = true;
    return PM_OK;
  }
  int e1 = errno;
  /* Out of fds or memory: a file under /dev/shm would fail the same way. Anything else (ENOSYS,
   * EPERM from a seccomp filter, EINVAL from a kernel without MFD_CLOEXEC) means no memfd here. */
  if (e1 == EMFILE || e1 == ENFILE || e1 == ENOMEM)
    return pm__set_error(e1 == ENOMEM ? PM_ERR_NOMEM : PM_ERR_BACKEND,
                         "memfd_create for shared pinned memory: %s", strerror(e1));
  const char *dir = atomic_load_explicit(&pm__shared_dir, memory_order_relaxed);
  char path[256];
  snprintf(path, sizeof path, "%s/pinmem-shared-XXXXXX", dir);
  fd = mkostemp(path, O_CLOEXEC);
  if (fd < 0) {
    int e2 = errno;
    return pm__set_error(PM_ERR_UNSUPPORTED,
                         "shared pinned memory needs memfd_create or a writable %s: "
                         "memfd_create: %s; creating a file in %s: %s",
                         dir, strerror(e1), dir, strerror(e2));
  }
  /* Unlinked at once: the memory goes when the last fd and mapping do, even after a crash. */
  (void)unlink(path);
  *fd_out = fd;
  return PM_OK;
}

/* Every process that holds the fd (a worker, a forked child, one it was passed to) could
 * ftruncate it: shrunk under the owner's mapping, the owner's next access to the lost pages is a
 * SIGBUS, and a pinned range (registered with the driver) would point at freed pages. Once sized,
 * the file's size is sealed both ways: no shrink for that reason, no grow because nothing here
 * ever grows it and a peer's growth would only spend tmpfs memory nobody maps or counts.
 * F_SEAL_SEAL last, so no process can lift or change the seals. The /dev/shm fallback cannot be
 * sealed (only a memfd made with MFD_ALLOW_SEALING can): docs/shared-memory.md says so. */
static pm_status_t seal_size(int fd) {
#if defined(F_ADD_SEALS) && defined(F_SEAL_SHRINK) && defined(F_SEAL_GROW) && defined(F_SEAL_SEAL)
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0) return PM_OK;
  int e = errno;
  return pm__set_error(PM_ERR_BACKEND,
                       "shared pinned memory: sealing the memfd's size (F_ADD_SEALS): %s",
                       strerror(e));
#else
  (void)fd;
  return pm__set_error(PM_ERR_UNSUPPORTED,
                       "shared pinned memory: this C library has no F_ADD_SEALS, so a memfd's size "
                       "cannot be sealed against a peer's ftruncate");
#endif
}

typedef struct pm__touch {
  char *base;
  size_t size;
} pm__touch_t;

static void touch_piece(void *vctx, size_t i) {
  const pm__touch_t *c = vctx;
  size_t start = i * PM__SHARED_PIECE;
  size_t end = PM__MIN(start + PM__SHARED_PIECE, c->size);
  size_t page = pm__page_size();
  volatile char *p = (volatile char *)c->base;
  for (size_t off = start; off < end; off += page) p[off] = 0; /* allocates the tmpfs page */
}

static pm_status_t table_add(uintptr_t base, size_t size, int fd) {
  pthread_mutex_lock(&shared_lock);
  if (nsegs == capsegs) {
    size_t cap = capsegs ? capsegs * 2 : 16;
    pm__shared_seg_t *grown = realloc(segs, cap * sizeof *grown);
    if (!grown) {
      pthread_mutex_unlock(&shared_lock);
      return pm__set_error(PM_ERR_NOMEM, "shared pinned memory: out of host memory for its table");
    }
    segs = grown;
    capsegs = cap;
  }
  segs[nsegs++] = (pm__shared_seg_t){base, size, fd};
  pthread_mutex_unlock(&shared_lock);
  return PM_OK;
}

pm_status_t pm__shared_pin(const pm__backend_t *b, size_t bytes, unsigned register_flags,
                           int threads, void **ptr_out) {
  bool bound;
  return pm__shared_pin_node(b, bytes, register_flags, threads, -1, &bound, ptr_out);
}

pm_status_t pm__shared_pin_node(const pm__backend_t *b, size_t bytes, unsigned register_flags,
                                int threads, int node, bool *bound_out, void **ptr_out) {
  *bound_out = false;
  if (!b || !ptr_out || bytes == 0)
    return pm__set_error(PM_ERR_INVALID, "pm__shared_pin: NULL argument or 0 bytes");
  size_t page = pm__page_size();
  if (bytes > SIZE_MAX - page || pm__align_up(bytes, page) > (size_t)INT64_MAX)
    return pm__set_error(PM_ERR_INVALID, "shared pinned memory: %zu bytes is too large", bytes);
  size_t size = pm__align_up(bytes, page);

  int fd = -1;
  bool is_memfd = false;
  pm_status_t st = open_file(&fd, &is_memfd);
  if (st != PM_OK) return st;
  if (ftruncate(fd, (off_t)size) != 0) {
    int e = errno;
    close(fd);
    return pm__set_error(PM_ERR_NOMEM, "shared pinned memory: sizing the file to %zu bytes: %s",
                         size, strerror(e));
  }
  if (is_memfd) {
    st = seal_size(fd);
    if (st != PM_OK) {
      close(fd);
      return st;
    }
  }
  void *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    int e = errno;
    close(fd);
    return pm__set_error(PM_ERR_NOMEM, "shared pinned memory: mmap(%zu bytes, MAP_SHARED): %s",
                         size, strerror(e));
  }
  /* A policy on a MAP_SHARED tmpfs mapping becomes the file's own (shmem keeps it), so the pages
   * that fallocate and the touch below allocate go to that node. */
  bool bound = node >= 0 && pm__numa_bind(base, size, node);
  /* A file in a sized tmpfs (/dev/shm is 64 MiB in many containers) that runs out of room raises
   * SIGBUS at the first touch, not ENOSPC at ftruncate: fallocate turns that into an error. A
   * memfd has no such size (only memory limits), so it skips this single-threaded fill; so does a
   * folder whose filesystem cannot fallocate (EOPNOTSUPP: no way to know its room beforehand). */
  if (!is_memfd && fallocate(fd, 0, 0, (off_t)size) != 0 && errno != EOPNOTSUPP) {
    int e = errno;
    munmap(base, size);
    close(fd);
    return pm__set_error(e == ENOSPC || e == ENOMEM ? PM_ERR_NOMEM : PM_ERR_BACKEND,
                         "shared pinned memory: reserving %zu bytes of tmpfs memory: %s", size,
                         strerror(e));
  }
  /* Fault the pages in from several threads before the register call, which then only locks
   * pages that are present (pin.c measured why). */
  pm__touch_t ctx = {base, size};
  pm__parallel_for(threads < 1 ? 1 : threads, (size + PM__SHARED_PIECE - 1) / PM__SHARED_PIECE,
                   touch_piece, &ctx);

  st = b->host_register(base, size, register_flags | PM_REGISTER_PORTABLE);
  if (st != PM_OK) {
    munmap(base, size);
    close(fd);
    return pm__wrap_error(st, "pinning %zu bytes of shared memory (memfd + mmap + register)", size);
  }
  st = table_add((uintptr_t)base, size, fd);
  if (st != PM_OK) {
    (void)b->host_unregister(base, size);
    munmap(base, size);
    close(fd);
    return st;
  }
  *bound_out = bound;
  *ptr_out = base;
  return PM_OK;
}

pm_status_t pm__shared_unpin(const pm__backend_t *b, void *ptr, size_t bytes) {
  if (!b || !ptr || bytes == 0)
    return pm__set_error(PM_ERR_INVALID, "pm__shared_unpin: NULL pointer or 0 bytes");
  size_t size = pm__align_up(bytes, pm__page_size());
  pm_status_t st = b->host_unregister(ptr, size);
  if (st != PM_OK)
    return pm__wrap_error(st,
                          "unpinning shared memory %p (%zu bytes): the range stays mapped and is "
                          "not reused",
                          ptr, size);
  int fd = -1;
  pthread_mutex_lock(&shared_lock);
  for (size_t i = 0; i < nsegs; i++) {
    if (segs[i].base == (uintptr_t)ptr) {
      fd = segs[i].fd;
      segs[i] = segs[--nsegs];
      break;
    }
  }
  pthread_mutex_unlock(&shared_lock);
  if (munmap(ptr, size) != 0) {
    int e = errno;
    st = pm__set_error(PM_ERR_INVALID, "munmap(%p, %zu) of shared memory failed: %s", ptr, size,
                       strerror(e));
  }
  if (fd >= 0)
    close(fd);
  else if (st == PM_OK)
    st = pm__set_error(PM_ERR_INTERNAL, "shared memory %p has no file on record", ptr);
  return st;
}

pm_status_t pm__shared_segment_fd(const void *base, int *fd_out) {
  int fd = -1;
  pthread_mutex_lock(&shared_lock);
  for (size_t i = 0; i < nsegs; i++)
    if (segs[i].base == (uintptr_t)base) fd = segs[i].fd;
  pthread_mutex_unlock(&shared_lock);
  if (fd < 0)
    return pm__set_error(PM_ERR_INTERNAL, "shared segment %p has no file on record", base);
  *fd_out = fd;
  return PM_OK;
}

void pm__shared_atfork(pm__fork_phase_t phase) {
  if (phase == PM__FORK_PREPARE) {
    pthread_mutex_lock(&shared_lock);
  } else if (phase == PM__FORK_PARENT) {
    pthread_mutex_unlock(&shared_lock);
  } else {
    /* The child is the thread that locked it in PREPARE: unlocking is valid, and unlike a fresh
     * initialiser it leaves ThreadSanitizer's view of the lock consistent. */
    pthread_mutex_unlock(&shared_lock);
    free(segs);
    segs = NULL;
    nsegs = capsegs = 0;
  }
}
