/*
 * DESIGN: CRC-32 (zlib's, the one of zip archives and so of torch.save's records) for the file
 * writes that ask for it (pm_file_options_t.crc32). zlib does the arithmetic: libz.so.1 is
 * loaded at run time (dlopen; PINMEM_ZLIB names another file), as libnuma and the CUDA driver
 * are, so libpinmem needs no zlib to build or to start, and the manylinux wheel carries none.
 * Where it cannot be loaded, a call that asks for CRCs fails with PM_ERR_UNSUPPORTED naming the
 * file and why, before a byte moves; every other call works.
 *
 * Who computes what (file.c): the thread that writes a unit computes the CRC of each range's
 * piece of it, on the bytes it writes (a device range's on its copy in the bounce slot, still
 * in that CPU's cache), and after the call each range's pieces are joined in file order with
 * crc32_combine, which costs O(log n) in the piece's length. One thread's crc32 runs at 4.2
 * GB/s on a 2-CPU virtual machine (zlib 1.2.13), so the call's threads keep up with a disk.
 * A caller that needs CRCs of device memory gets them without another copy of the bytes, and
 * in one call: no interpreter lock or process boundary between the copy, the CRC and the write.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

typedef unsigned long (*crc32_z_fn)(unsigned long crc, const unsigned char *buf, size_t len);
typedef unsigned long (*crc32_fn)(unsigned long crc, const unsigned char *buf, unsigned len);
/* z_off64_t and z_off_t are both 64 bits wide on the LP64 Linux targets pinmem builds for. */
typedef unsigned long (*crc32_combine_fn)(unsigned long crc1, unsigned long crc2, long len2);

static struct {
  crc32_z_fn z;       /* crc32_z (zlib 1.2.9 and later), else NULL */
  crc32_fn plain;     /* crc32: lengths of up to 4 GiB - 1 a call */
  crc32_combine_fn combine;
} zl;
static pthread_once_t zl_once = PTHREAD_ONCE_INIT;
static bool zl_loaded;
static char zl_why[512];

static void zl_load(void) {
  const char *path = getenv("PINMEM_ZLIB");
  if (!path || !*path) path = "libz.so.1";
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *e = dlerror();
    /* dlerror names the file */
    snprintf(zl_why, sizeof zl_why, "CRC-32 needs zlib, not loaded: %s (install zlib1g, or name "
             "the library with PINMEM_ZLIB)", e ? e : path);
    return;
  }
  /* Kept loaded for the life of the process: its functions run on any thread. */
  *(void **)&zl.z = dlsym(h, "crc32_z");
  *(void **)&zl.plain = dlsym(h, "crc32");
  *(void **)&zl.combine = dlsym(h, "crc32_combine64");
  if (!zl.combine) *(void **)&zl.combine = dlsym(h, "crc32_combine");
  if (!zl.plain || !zl.combine) {
    snprintf(zl_why, sizeof zl_why, "CRC-32 needs zlib: %s lacks crc32 or crc32_combine", path);
    return;
  }
  zl_loaded = true;
}

pm_status_t pm__crc32_ready(void) {
  pthread_once(&zl_once, zl_load);
  if (zl_loaded) return PM_OK;
  return pm__set_error(PM_ERR_UNSUPPORTED, "%s", zl_why);
}

uint32_t pm__crc32(uint32_t crc, const void *p, size_t n) {
  const unsigned char *b = p;
  if (zl.z) return (uint32_t)zl.z(crc, b, n);
  unsigned long c = crc;
  while (n) {
    unsigned len = n > (1u << 30) ? 1u << 30 : (unsigned)n;
    c = zl.plain(c, b, len);
    b += len;
    n -= len;
  }
  return (uint32_t)c;
}

uint32_t pm__crc32_combine(uint32_t crc1, uint32_t crc2, uint64_t len2) {
  return (uint32_t)zl.combine(crc1, crc2, (long)len2);
}
