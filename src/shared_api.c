/*
 * DESIGN: the public calls of shared pinned memory, beside api.c at the top of the layers (they
 * use the registry, the pool, core/shared.c and api.c's pm_register; nothing below calls them).
 *
 * - pm_host_shared_fd: the registry names the pool segment holding a pointer, the pool the block
 *   (which must be allocated), core/shared.c the segment's fd. The segment's memfd starts at the
 *   segment's base, so a pointer's offset in the file is its distance from that base.
 * - pm_shared_map / pm_shared_unmap: the other side, in a process that received the fd. A mapping
 *   starts on the page that holds `offset`, so any offset works; the caller sees the byte at
 *   `offset`. PM_SHARED_PIN pins exactly [ptr, ptr + bytes) through pm_register, so the
 *   registry, the budget and the copy engine treat it as any registration.
 *
 * Data structure: a list of the live mappings {ptr, bytes, map base, map length}, so that
 * pm_shared_unmap refuses what pm_shared_map did not return (a munmap of someone else's memory
 * would be a crash later). pm_shared_unmap unregisters whatever registration the registry holds
 * on the mapping's pages (the pin of PM_SHARED_PIN, or the caller's own), so a caller may
 * pm_unregister a pinned mapping itself, or pm_register an unpinned one.
 *
 * Threads: map_lock guards the list; it is a leaf (held for list steps only, never across mmap,
 * pm_register or pm_unregister). An entry is taken off the list before it is unpinned and
 * unmapped, so two concurrent unmaps of one pointer cannot both proceed. fork: a child inherits
 * the mappings (MAP_SHARED) but not their pinning (the registry forgets it), so its entries are
 * kept and its unmaps find nothing to unregister.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

typedef struct pm__mapping pm__mapping_t;
struct pm__mapping {
  char *ptr;     /* what pm_shared_map returned */
  size_t bytes;  /* what it was asked for */
  void *base;    /* the mapping itself: page aligned, at or below ptr */
  size_t length; /* its length */
  pm__mapping_t *next;
};

static pthread_mutex_t map_lock = PTHREAD_MUTEX_INITIALIZER;
static pm__mapping_t *mappings;

#define PM__NULL_ARG(fn, name) pm__set_error(PM_ERR_INVALID, "%s: %s is NULL", fn, name)

pm_status_t pm_host_shared_fd(const void *ptr, int *fd_out, uint64_t *offset_out,
                              size_t *bytes_out) {
  static const char fn[] = "pm_host_shared_fd";
  if (!ptr) return PM__NULL_ARG(fn, "ptr");
  if (!fd_out) return PM__NULL_ARG(fn, "fd_out");
  if (!offset_out) return PM__NULL_ARG(fn, "offset_out");
  if (!bytes_out) return PM__NULL_ARG(fn, "bytes_out");
  pm__range_t r;
  if (!pm__registry_find(ptr, &r))
    return pm__set_error(PM_ERR_INVALID,
                         "%s(%p): not shared memory (pinmem does not track this address; "
                         "allocate it with pm_host_alloc(PM_HOST_SHARED))",
                         fn, ptr);
  if (r.kind != PM_MEMORY_POOL)
    return pm__set_error(PM_ERR_INVALID,
                         "%s(%p): the address is %s, not a PM_HOST_SHARED pool block", fn, ptr,
                         pm__memory_kind_desc(r.kind));
  if (!(r.flags & PM_HOST_SHARED))
    return pm__set_error(PM_ERR_INVALID,
                         "%s(%p): a pool block allocated without PM_HOST_SHARED (only "
                         "pm_host_alloc(PM_HOST_SHARED) memory lives in a file another process "
                         "can map)",
                         fn, ptr);
  pm_pointer_info_t info;
  pm_status_t st = pm__pool_block_info((pm_pool_t *)r.owner, ptr, &info);
  if (st == PM_ERR_NOT_FOUND) /* the segment went between the two lookups: freed and trimmed */
    return pm__set_error(PM_ERR_INVALID, "%s(%p): the shared block holding it was freed", fn, ptr);
  if (st != PM_OK) return pm__wrap_error(st, "%s(%p)", fn, ptr);
  if (!info.in_use)
    return pm__set_error(PM_ERR_INVALID, "%s(%p): the shared block holding it was freed", fn, ptr);
  int fd = -1;
  st = pm__shared_segment_fd((const void *)r.base, &fd);
  if (st != PM_OK) return pm__wrap_error(st, "%s(%p)", fn, ptr);
  *fd_out = fd;
  *offset_out = (uint64_t)((uintptr_t)ptr - r.base);
  *bytes_out = (size_t)((uintptr_t)info.base + info.size - (uintptr_t)ptr);
  return PM_OK;
}

pm_status_t pm_shared_map(int fd, uint64_t offset, size_t bytes, unsigned flags, void **ptr_out) {
  static const char fn[] = "pm_shared_map";
  if (!ptr_out) return PM__NULL_ARG(fn, "ptr_out");
  if (fd < 0) return pm__set_error(PM_ERR_INVALID, "%s: fd %d is not a file descriptor", fn, fd);
  if (bytes == 0) return pm__set_error(PM_ERR_INVALID, "%s(fd %d): bytes is 0", fn, fd);
  if (flags & ~PM_SHARED_PIN)
    return pm__set_error(PM_ERR_INVALID, "%s(fd %d): unknown flags 0x%x (0 or PM_SHARED_PIN)", fn,
                         fd, flags & ~PM_SHARED_PIN);
  struct stat sb;
  if (fstat(fd, &sb) != 0) {
    int e = errno;
    return pm__set_error(PM_ERR_INVALID, "%s: fd %d: fstat: %s", fn, fd, strerror(e));
  }
  if (!S_ISREG(sb.st_mode))
    return pm__set_error(PM_ERR_INVALID,
                         "%s: fd %d is not a shared memory file (not a regular file: a memfd "
                         "from pm_host_shared_fd is one)",
                         fn, fd);
  uint64_t size = sb.st_size > 0 ? (uint64_t)sb.st_size : 0;
  if (offset > size || bytes > size - offset)
    return pm__set_error(PM_ERR_INVALID,
                         "%s(fd %d, offset %llu, %zu bytes): beyond the end of the file (%llu "
                         "bytes)",
                         fn, fd, (unsigned long long)offset, bytes, (unsigned long long)size);
  size_t page = pm__page_size();
  uint64_t start = offset & ~(uint64_t)(page - 1);
  size_t delta = (size_t)(offset - start);
  if (bytes > SIZE_MAX - delta - page)
    return pm__set_error(PM_ERR_INVALID, "%s(fd %d): %zu bytes is too large", fn, fd, bytes);
  size_t length = pm__align_up(delta + bytes, page);
  void *base = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)start);
  if (base == MAP_FAILED) {
    int e = errno;
    return pm__set_error(e == ENOMEM ? PM_ERR_NOMEM : PM_ERR_INVALID,
                         "%s(fd %d, offset %llu, %zu bytes): mmap read-write, MAP_SHARED: %s%s", fn,
                         fd, (unsigned long long)offset, bytes, strerror(e),
                         e == EACCES ? " (the fd must be open for reading and writing)" : "");
  }
  char *ptr = (char *)base + delta;
  pm__mapping_t *m = malloc(sizeof *m);
  if (!m) {
    munmap(base, length);
    return pm__set_error(PM_ERR_NOMEM, "%s: out of host memory", fn);
  }
  *m = (pm__mapping_t){ptr, bytes, base, length, NULL};
  if (flags & PM_SHARED_PIN) {
    pm_status_t st = pm_register(ptr, bytes, PM_REGISTER_PORTABLE);
    if (st != PM_OK) {
      free(m);
      munmap(base, length);
      return pm__wrap_error(st, "%s(fd %d, offset %llu, %zu bytes, PM_SHARED_PIN)", fn, fd,
                            (unsigned long long)offset, bytes);
    }
  }
  pthread_mutex_lock(&map_lock);
  m->next = mappings;
  mappings = m;
  pthread_mutex_unlock(&map_lock);
  *ptr_out = ptr;
  return PM_OK;
}

pm_status_t pm_shared_unmap(void *ptr, size_t bytes) {
  static const char fn[] = "pm_shared_unmap";
  if (!ptr) return PM__NULL_ARG(fn, "ptr");
  pm_status_t st = PM_OK;
  pthread_mutex_lock(&map_lock);
  pm__mapping_t **pp = &mappings;
  while (*pp && (*pp)->ptr != ptr) pp = &(*pp)->next;
  pm__mapping_t *m = *pp;
  if (!m)
    st = pm__set_error(PM_ERR_NOT_FOUND,
                       "%s(%p): not a mapping from pm_shared_map (or already unmapped)", fn, ptr);
  else if (m->bytes != bytes)
    st = pm__set_error(PM_ERR_INVALID, "%s(%p, %zu bytes): pm_shared_map mapped %zu bytes there",
                       fn, ptr, bytes, m->bytes);
  else
    *pp = m->next;
  pthread_mutex_unlock(&map_lock);
  if (st != PM_OK) return st;

  /* The memory goes, so must every registration on it: the mapping's own pin (PM_SHARED_PIN,
   * unless the caller unpinned it already) and any the caller made on it with pm_register, at
   * ptr or inside. Unmapping under one left the registry naming memory that is gone (charged to
   * the budget, reported as pinned, and refusing a later registration of whatever is mapped
   * there next). A failure leaves the pages pinned, and the mapping stays, listed, so the caller
   * can try again. */
  pm__range_t r;
  while (st == PM_OK && pm__registry_find_overlap((uintptr_t)m->base, m->length, &r)) {
    if (r.kind != PM_MEMORY_REGISTERED)
      st = pm__set_error(PM_ERR_INTERNAL, "%s(%p): the mapping holds a %s", fn, ptr,
                         pm__memory_kind_desc(r.kind));
    else
      st = pm_unregister((void *)r.base);
  }
  if (st != PM_OK) {
    pthread_mutex_lock(&map_lock);
    m->next = mappings;
    mappings = m;
    pthread_mutex_unlock(&map_lock);
    return pm__wrap_error(st, "%s(%p)", fn, ptr);
  }
  if (munmap(m->base, m->length) != 0) {
    int e = errno;
    st = pm__set_error(PM_ERR_INVALID, "%s(%p): munmap(%p, %zu): %s", fn, ptr, m->base, m->length,
                       strerror(e));
  }
  free(m);
  return st;
}

void pm__shared_api_atfork(pm__fork_phase_t phase) {
  if (phase == PM__FORK_PREPARE) {
    pthread_mutex_lock(&map_lock);
  } else if (phase == PM__FORK_PARENT) {
    pthread_mutex_unlock(&map_lock);
  } else {
    /* The child is the thread that locked it in PREPARE: unlocking is valid, and unlike a fresh
     * initialiser it leaves ThreadSanitizer's view of the lock consistent. */
    pthread_mutex_unlock(&map_lock);
  }
}
