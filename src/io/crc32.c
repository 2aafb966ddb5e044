/*
 * DESIGN: CRC-32 (zlib's, the one of zip archives and so of torch.save's records) for the file
 * writes that ask for it (pm_file_options_t.crc32). zlib does the arithmetic: libz.so.1 is
 * loaded at run time (dlopen; PINMEM_ZLIB names another file), as libnuma and the CUDA driver
 * are, so libpinmem needs no zlib to build or to start, and the manylinux wheel carries none.
 * Where it cannot be loaded, a call that asks for CRCs fails with PM_ERR_UNSUPPORTED naming the
 * file and why, before a byte moves; every other call works.
 *
 * ISA-L computes the same CRC (crc32_gzip_refl: zlib's values, zlib's chaining) 3-6 times as
 * fast with carry-less multiplies: 11.6 GB/s on one thread of an H100 machine against zlib's
 * 2.0, which on the threads that also write a unit is the difference between a write that
 * waits for its CRCs and one that does not. It is used where found: the file PINMEM_ISAL names
 * (0 or off: never), else libisal.so.2 (Debian's and Ubuntu's libisal2), else a library named
 * later by pm__crc32_use (the Python package names the isal package's extension, which exports
 * the function). A candidate is kept only if it gives the check value of "123456789" whole and
 * chained; zlib still joins the pieces (crc32_combine, which ISA-L lacks), so zlib stays needed.
 *
 * Who computes what (file.c): the thread that writes a unit computes the CRC of each range's
 * piece of it, on the bytes it writes (a device range's on its copy in the bounce slot, still
 * in that CPU's cache), and after the call each range's pieces are joined in file order with
 * crc32_combine, which costs O(log n) in the piece's length. One thread's zlib crc32 runs at
 * 4.2 GB/s on a 2-CPU virtual machine (zlib 1.2.13).
 * A caller that needs CRCs of device memory gets them without another copy of the bytes, and
 * in one call: no interpreter lock or process boundary between the copy, the CRC and the write.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef unsigned long (*crc32_z_fn)(unsigned long crc, const unsigned char *buf, size_t len);
typedef unsigned long (*crc32_fn)(unsigned long crc, const unsigned char *buf, unsigned len);
/* z_off64_t and z_off_t are both 64 bits wide on the LP64 Linux targets pinmem builds for. */
typedef unsigned long (*crc32_combine_fn)(unsigned long crc1, unsigned long crc2, long len2);
/* ISA-L's: uint32_t crc32_gzip_refl(uint32_t init_crc, const unsigned char *buf, uint64_t len) */
typedef uint32_t (*isal_crc_fn)(uint32_t crc, const unsigned char *buf, uint64_t len);

static struct {
  crc32_z_fn z;       /* crc32_z (zlib 1.2.9 and later), else NULL */
  crc32_fn plain;     /* crc32: lengths of up to 4 GiB - 1 a call */
  crc32_combine_fn combine;
} zl;
static pthread_once_t zl_once = PTHREAD_ONCE_INIT;
static bool zl_loaded;
static char zl_why[512];

/* ISA-L's function once one passed its check; read on every unit's CRC, set at most once. */
static _Atomic(isal_crc_fn) isal_fn;
static pthread_mutex_t isal_mu = PTHREAD_MUTEX_INITIALIZER;
static char isal_from[300];  /* "ISA-L (its file)" (isal_mu; fixed once isal_fn is set) */
static char zl_from[300];    /* "zlib (its file)" once zlib is loaded */
static bool isal_refused;    /* PINMEM_ISAL=0/off: never ISA-L */
static bool isal_env_failed; /* PINMEM_ISAL named a file that did not do: CRC calls refused */

/* ISA-L's crc32_gzip_refl from path, if it is there and computes zlib's CRC: published as the
 * one in use (isal_fn, isal_from) and true; false with why. Callers: isal_load (once) and
 * pm__crc32_use (under isal_mu). */
static bool isal_take(const char *path, int flags, char *why, size_t len) {
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL | flags);
  if (!h) {
    const char *e = dlerror();
    snprintf(why, len, "%s", e ? e : path);
    return false;
  }
  isal_crc_fn f;
  *(void **)&f = dlsym(h, "crc32_gzip_refl");
  /* The check value of the CRC-32 (zlib's) of "123456789", whole and in two pieces chained. */
  static const unsigned char check[] = "123456789";
  if (!f || f(0, check, 9) != 0xCBF43926u || f(f(0, check, 4), check + 4, 5) != 0xCBF43926u) {
    snprintf(why, len, "%s %s", path,
             f ? "computes another CRC-32 than zlib's" : "has no crc32_gzip_refl");
    dlclose(h);
    return false;
  }
  /* Kept loaded for the life of the process, as zlib. */
  snprintf(isal_from, sizeof isal_from, "ISA-L (%s)", path);
  atomic_store_explicit(&isal_fn, f, memory_order_release);
  return true;
}

static void isal_load(void) {
  const char *env = getenv("PINMEM_ISAL");
  if (env && (!strcmp(env, "0") || !strcmp(env, "off"))) {
    isal_refused = true;
    return;
  }
  char why[256];
  if (!isal_take(env && *env ? env : "libisal.so.2", 0, why, sizeof why) && env && *env) {
    isal_env_failed = true;
    snprintf(zl_why, sizeof zl_why, "PINMEM_ISAL=%s: %s (unset it, or set it to 0 for zlib's CRC)",
             env, why);
  }
}

static void zl_load(void) {
  isal_load();
  if (isal_env_failed) return;
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
  snprintf(zl_from, sizeof zl_from, "zlib (%s)", path);
  zl_loaded = true;
}

pm_status_t pm__crc32_ready(void) {
  pthread_once(&zl_once, zl_load);
  if (zl_loaded) return PM_OK;
  return pm__set_error(PM_ERR_UNSUPPORTED, "%s", zl_why);
}

bool pm__crc32_use(const char *path) {
  pthread_once(&zl_once, zl_load);
  if (isal_refused || isal_env_failed || !path) return false;
  pthread_mutex_lock(&isal_mu);
  bool ok = atomic_load_explicit(&isal_fn, memory_order_acquire) != NULL;
  if (!ok) {
    char why[256];
    /* The caller's library is one the process has loaded already (RTLD_NOLOAD): pinmem does not
     * load a Python extension module on its own. */
    ok = isal_take(path, RTLD_NOLOAD, why, sizeof why);
  }
  pthread_mutex_unlock(&isal_mu);
  return ok;
}

const char *pm__crc32_impl(void) {
  pthread_once(&zl_once, zl_load);
  if (atomic_load_explicit(&isal_fn, memory_order_acquire)) return isal_from;
  return zl_loaded ? zl_from : NULL;
}

uint32_t pm__crc32(uint32_t crc, const void *p, size_t n) {
  const unsigned char *b = p;
  isal_crc_fn f = atomic_load_explicit(&isal_fn, memory_order_acquire);
  if (f) return f(crc, b, n);
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
