/*
 * Copy-engine soak: many thousand random pm_copy_async / pm_copy_batch_async copies, each
 * checked by checksum, on several streams at once. For the GPU machine (bench/gpu_soak.sh);
 * CTest label "soak" only, so `make test` does not run it.
 *
 * Each round picks a host memory kind (pageable, pool block, registered), a direction, a path
 * (auto, staged, direct where the host side is pinned), a size (log-uniform from 1 byte to
 * max_bytes), unaligned offsets and a stream; H2D copies are read back with a plain pm_memcpy,
 * D2H copies land on a device buffer filled with known bytes first. Every transfer's bytes and
 * the guard bytes around it are compared. Several rounds are in flight at once (one per
 * stream), so fences, completion threads and bounce memory are exercised concurrently.
 *
 * Usage: soak_copy [copies] [max_bytes] [seed]   (defaults 20000, 64M, 1; env SOAK_COPIES etc.)
 * Prints a summary line and one JSON line; exit 0 only with zero mismatches and zero errors.
 */
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "internal.h"

#define SLOTS 4 /* rounds in flight, one stream each */
#define GUARD 64

static uint64_t rng_state;
static uint64_t rnd(void) {
  return pm_test_rand(&rng_state);
}

static uint64_t fnv(const void *p, size_t n) {
  const unsigned char *b = p;
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

enum { HOST_PAGEABLE, HOST_POOL, HOST_REGISTERED, HOST_KINDS };
static const char *host_name[] = {"pageable", "pool", "registered"};

typedef struct round {
  bool active, h2d, batch;
  int host_kind;
  pm_copy_path_t path;
  size_t n, hoff, doff, hsize, dsize;
  char *halloc, *h;  /* host buffer and the copy's host pointer */
  char *dalloc, *d;  /* device buffer and the copy's device pointer */
  char *want;        /* expected bytes of the destination buffer (whole, with guards) */
  pm_fence_t fence;
  uint64_t id;
} round_t;

static struct {
  uint64_t copies, bytes, mismatches, errors, by_kind[HOST_KINDS], staged, direct, batches;
} tot;

static size_t pick_size(size_t max_bytes) {
  /* log-uniform over [1, max_bytes], plus the edges that matter */
  switch (rnd() % 16) {
    case 0:
      return 1;
    case 1:
      return 4096;
    case 2:
      return (size_t)4 << 20; /* the default staging chunk */
    case 3:
      return ((size_t)4 << 20) + 1;
    default:
      break;
  }
  double lg = (double)(rnd() % 10000) / 10000.0 * 26.0; /* up to 2^26 = 64M */
  size_t n = (size_t)1 << (int)lg;
  n += rnd() % n;
  if (n > max_bytes) n = 1 + rnd() % max_bytes;
  return n ? n : 1;
}

static pm_status_t host_get(round_t *r) {
  r->hsize = r->n + r->hoff + GUARD;
  void *p = NULL;
  pm_status_t st = PM_OK;
  switch (r->host_kind) {
    case HOST_PAGEABLE:
      p = malloc(r->hsize);
      if (!p) return PM_ERR_NOMEM;
      break;
    case HOST_POOL:
      st = pm_host_alloc(NULL, r->hsize, PM_HOST_DEFAULT, &p);
      break;
    case HOST_REGISTERED: {
      size_t pg = pm__page_size();
      r->hsize = pm__align_up(r->hsize, pg);
      if (posix_memalign(&p, pg, r->hsize) != 0) return PM_ERR_NOMEM;
      st = pm_register(p, r->hsize, PM_REGISTER_DEFAULT);
      if (st != PM_OK) {
        free(p);
        p = NULL;
      }
      break;
    }
  }
  if (st != PM_OK) return st;
  r->halloc = p;
  r->h = r->halloc + r->hoff;
  return PM_OK;
}

static void host_put(round_t *r) {
  if (!r->halloc) return;
  pm_status_t st = PM_OK;
  switch (r->host_kind) {
    case HOST_PAGEABLE:
      free(r->halloc);
      break;
    case HOST_POOL:
      st = pm_host_free(r->halloc);
      break;
    case HOST_REGISTERED:
      st = pm_unregister(r->halloc);
      free(r->halloc);
      break;
  }
  if (st != PM_OK) {
    tot.errors++;
    fprintf(stderr, "soak_copy: releasing host memory: %s: %s\n", pm_status_name(st),
            pm_last_error());
  }
  r->halloc = r->h = NULL;
}

static void fail(round_t *r, const char *what, pm_status_t st) {
  tot.errors++;
  fprintf(stderr, "soak_copy: copy %llu (%s %s, %zu bytes, path %d): %s: %s: %s\n",
          (unsigned long long)r->id, r->h2d ? "H2D" : "D2H", host_name[r->host_kind], r->n,
          (int)r->path, what, pm_status_name(st), pm_last_error());
}

static void round_start(round_t *r, pm_stream_t s, size_t max_bytes, uint64_t id) {
  memset(r, 0, sizeof *r);
  r->id = id;
  r->h2d = rnd() & 1;
  r->host_kind = (int)(rnd() % HOST_KINDS);
  r->n = pick_size(max_bytes);
  r->hoff = rnd() % 64;
  r->doff = rnd() % 64;
  r->batch = r->n >= 64 && rnd() % 8 == 0;
  int pk = (int)(rnd() % 3);
  r->path = pk == 0 ? PM_PATH_AUTO
                    : pk == 1 ? PM_PATH_STAGED
                              : (r->host_kind == HOST_PAGEABLE ? PM_PATH_AUTO : PM_PATH_DIRECT);
  pm_status_t st = host_get(r);
  if (st != PM_OK) {
    fail(r, "host buffer", st);
    return;
  }
  r->dsize = r->n + r->doff + GUARD;
  void *d = NULL;
  st = pm_device_alloc(r->dsize, &d);
  if (st != PM_OK) {
    fail(r, "pm_device_alloc", st);
    host_put(r);
    return;
  }
  r->dalloc = d;
  r->d = r->dalloc + r->doff;

  /* Fill both sides with distinct bytes; the destination's expected image is its old bytes
   * with the copied range replaced. */
  size_t dst_size = r->h2d ? r->dsize : r->hsize;
  char *tmp = malloc(r->dsize);
  r->want = malloc(dst_size);
  if (!tmp || !r->want) {
    free(tmp);
    fail(r, "malloc", PM_ERR_NOMEM);
    return;
  }
  pm_test_fill(r->halloc, r->hsize, id * 2 + 1);
  pm_test_fill(tmp, r->dsize, id * 2 + 2);
  st = pm_memcpy(r->dalloc, tmp, r->dsize, PM_COPY_H2D);
  if (r->h2d) {
    memcpy(r->want, tmp, r->dsize);
    memcpy(r->want + r->doff, r->h, r->n);
  } else {
    memcpy(r->want, r->halloc, r->hsize);
    memcpy(r->want + r->hoff, tmp + r->doff, r->n);
  }
  free(tmp);
  if (st != PM_OK) {
    fail(r, "pm_memcpy (device fill)", st);
    return;
  }

  pm_copy_options_t o;
  pm_copy_options_init(&o);
  o.path = r->path;
  void *dst = r->h2d ? (void *)r->d : (void *)r->h;
  const void *src = r->h2d ? (const void *)r->h : (const void *)r->d;
  if (r->batch) {
    pm_copy_item_t items[4];
    size_t q = r->n / 4;
    for (int i = 0; i < 4; i++) {
      size_t off = (size_t)i * q, len = i == 3 ? r->n - 3 * q : q;
      items[i].dst = (char *)dst + off;
      items[i].src = (const char *)src + off;
      items[i].bytes = len;
    }
    st = pm_copy_batch_async(items, 4, s, &o, &r->fence);
    tot.batches++;
  } else {
    st = pm_copy_async(dst, src, r->n, s, &o, &r->fence);
  }
  if (st != PM_OK) {
    fail(r, r->batch ? "pm_copy_batch_async" : "pm_copy_async", st);
    return;
  }
  r->active = true;
}

static void round_finish(round_t *r) {
  if (r->active) {
    pm_status_t st = pm_fence_wait(r->fence);
    pm_copy_path_t path = PM_PATH_AUTO;
    if (st == PM_OK && pm_fence_path(r->fence, &path) == PM_OK) {
      if (path == PM_PATH_STAGED)
        tot.staged++;
      else
        tot.direct++;
    }
    pm_fence_release(r->fence);
    if (st != PM_OK) {
      fail(r, "pm_fence_wait", st);
    } else {
      bool ok;
      if (r->h2d) {
        char *got = malloc(r->dsize);
        ok = got && pm_memcpy(got, r->dalloc, r->dsize, PM_COPY_D2H) == PM_OK &&
             fnv(got, r->dsize) == fnv(r->want, r->dsize) && !memcmp(got, r->want, r->dsize);
        free(got);
      } else {
        ok = fnv(r->halloc, r->hsize) == fnv(r->want, r->hsize);
      }
      tot.copies++;
      tot.bytes += r->n;
      tot.by_kind[r->host_kind]++;
      if (!ok) {
        tot.mismatches++;
        fprintf(stderr, "soak_copy: MISMATCH copy %llu (%s %s, %zu bytes, offsets %zu/%zu, path "
                "%d, batch %d)\n", (unsigned long long)r->id, r->h2d ? "H2D" : "D2H",
                host_name[r->host_kind], r->n, r->hoff, r->doff, (int)r->path, (int)r->batch);
      }
    }
  }
  if (r->dalloc) {
    pm_status_t st = pm_device_free(r->dalloc);
    if (st != PM_OK) fail(r, "pm_device_free", st);
  }
  host_put(r);
  free(r->want);
  memset(r, 0, sizeof *r);
}

static size_t arg_size(int argc, char **argv, int i, const char *env, size_t def) {
  const char *t = argc > i ? argv[i] : getenv(env);
  size_t v;
  if (t && pm_parse_size(t, &v) == PM_OK && v > 0) return v;
  return def;
}

int main(int argc, char **argv) {
  pm_test_init();
  size_t copies = arg_size(argc, argv, 1, "SOAK_COPIES", 20000);
  size_t max_bytes = arg_size(argc, argv, 2, "SOAK_MAX_BYTES", (size_t)64 << 20);
  uint64_t seed = arg_size(argc, argv, 3, "SOAK_SEED", 1);
  rng_state = seed;
  printf("soak_copy: %zu copies up to %zu bytes, seed %llu, %d in flight\n", copies, max_bytes,
         (unsigned long long)seed, SLOTS);

  pm_stream_t streams[SLOTS];
  for (int i = 0; i < SLOTS; i++) REQUIRE_OK(pm_stream_create(&streams[i]));
  static round_t rounds[SLOTS];
  double t0 = pm__now(), last = t0;
  for (size_t i = 0; i < copies; i++) {
    round_t *r = &rounds[i % SLOTS];
    round_finish(r);
    round_start(r, streams[i % SLOTS], max_bytes, i);
    double now = pm__now();
    if (now - last > 10) {
      last = now;
      printf("  %zu/%zu copies, %llu mismatches, %llu errors\n", i, copies,
             (unsigned long long)tot.mismatches, (unsigned long long)tot.errors);
      fflush(stdout);
    }
  }
  for (int i = 0; i < SLOTS; i++) round_finish(&rounds[i]);
  for (int i = 0; i < SLOTS; i++) CHECK_OK(pm_stream_destroy(streams[i]));
  double secs = pm__now() - t0;

  pm_pool_stats_t ps;
  CHECK_OK(pm_pool_get_stats(NULL, &ps));
  CHECK_EQ_SIZE(ps.in_use_bytes, 0);
  CHECK_EQ_SIZE(ps.registered_bytes, 0);
  printf("soak_copy: %llu copies verified (%llu pageable, %llu pool, %llu registered; %llu "
         "staged, %llu direct, %llu batches), %.1f GiB in %.1f s: %llu mismatches, %llu errors; "
         "pool peak %zu bytes\n",
         (unsigned long long)tot.copies, (unsigned long long)tot.by_kind[0],
         (unsigned long long)tot.by_kind[1], (unsigned long long)tot.by_kind[2],
         (unsigned long long)tot.staged, (unsigned long long)tot.direct,
         (unsigned long long)tot.batches, (double)tot.bytes / (1 << 30), secs,
         (unsigned long long)tot.mismatches, (unsigned long long)tot.errors, ps.pinned_peak);
  printf("{\"bench\":\"soak_copy\",\"backend\":\"%s\",\"copies\":%llu,\"bytes\":%llu,"
         "\"seconds\":%.3f,\"mismatches\":%llu,\"errors\":%llu,\"seed\":%llu,"
         "\"verified\":%s}\n",
         pm_backend_name(), (unsigned long long)tot.copies, (unsigned long long)tot.bytes, secs,
         (unsigned long long)tot.mismatches, (unsigned long long)tot.errors,
         (unsigned long long)seed, tot.mismatches || tot.errors ? "false" : "true");
  CHECK_EQ_INT(tot.mismatches, 0);
  CHECK_EQ_INT(tot.errors, 0);
  CHECK(tot.copies == copies);
  CHECK_OK(pm_finalize());
  return pm_test_finish("soak_copy");
}
