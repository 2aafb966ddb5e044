/*
 * `pinmem bench copy --devices LIST|all`: host<->device copies through pinmem's copy engine on
 * several devices, each device alone and all at once. Cases: H2D and D2H from pinned (a pool
 * block: one DMA) and pageable memory (staged). Each device has its own thread (which makes the
 * device current, as a rank does), its own stream and its own buffers. A round is one copy of
 * --size bytes per device, started together (a barrier) and timed per device on its thread
 * (submit to fence complete); the median of --repeat rounds is reported. Rows: per device alone,
 * per device together with its "together / alone" ratio, and the aggregate (bytes of every
 * device over the slowest device's median round). Every copy's bytes are checked once per case
 * and device. On one device it says so and the together rows equal alone.
 *
 * JSON: one object per row, bench "copy_devices", with case, bytes, seconds, gbps, verified,
 * device (null for the aggregate), mode ("alone", "together", "aggregate"), ratio (together
 * rows), devices (how many ran together).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_copy_common.h"

#define BD_MAX 16
#define BD_ROUNDS_MAX 100

typedef struct bd bd_t;

typedef struct bd_dev {
  bd_t *B;
  int device;
  pm_stream_t stream;
  void *dev, *pinned;
  char *pageable, *back;
  double t[BD_ROUNDS_MAX];
  bool ok;
  pthread_t thread;
} bd_dev_t;

struct bd {
  bd_dev_t d[BD_MAX];
  int n;
  size_t bytes;
  int repeat;
  bool json;
  int case_i;
  bool together;
  pthread_barrier_t bar;
};

static const char *const case_name[] = {"h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable"};

static void one_copy(bd_t *B, bd_dev_t *d) {
  bool h2d = B->case_i < 2, pinned = B->case_i % 2 == 0;
  void *host = pinned ? d->pinned : (void *)d->pageable;
  pm_fence_t f = NULL;
  cli_check(h2d ? pm_copy_async(d->dev, host, B->bytes, d->stream, NULL, &f)
                : pm_copy_async(host, d->dev, B->bytes, d->stream, NULL, &f));
  cli_check(pm_fence_wait(f));
  cli_check(pm_fence_release(f));
}

/* A pattern per device that is never all zero and differs at every offset's neighbours. */
static void fill_pattern(void *p, size_t n, uint64_t seed) {
  unsigned char *c = p;
  for (size_t i = 0; i < n; i++) c[i] = (unsigned char)((i * 131 + seed * 7) ^ (i >> 9));
}

static bool check_pattern(const void *p, size_t n, uint64_t seed) {
  const unsigned char *c = p;
  for (size_t i = 0; i < n; i++)
    if (c[i] != (unsigned char)((i * 131 + seed * 7) ^ (i >> 9))) {
      fprintf(stderr, "pinmem: byte %zu differs (device pattern %llu)\n", i,
              (unsigned long long)seed);
      return false;
    }
  return true;
}

/* The copies landed: H2D checked by copying back, D2H in host memory. */
static bool verify(bd_t *B, bd_dev_t *d) {
  bool h2d = B->case_i < 2, pinned = B->case_i % 2 == 0;
  uint64_t seed = 1000 + (uint64_t)d->device;
  if (h2d) {
    memset(d->back, 0, B->bytes);
    cli_check(pm_memcpy(d->back, d->dev, B->bytes, PM_COPY_D2H));
    return check_pattern(d->back, B->bytes, seed);
  }
  return check_pattern(pinned ? d->pinned : (void *)d->pageable, B->bytes, seed);
}

static void *dev_main(void *arg) {
  bd_dev_t *d = arg;
  bd_t *B = d->B;
  cli_check(pm_device_set(d->device));
  bool h2d = B->case_i < 2;
  /* D2H: the device buffer holds the pattern, the host side is cleared before each round. */
  for (int r = 0; r < B->repeat + 1; r++) {
    if (!h2d) memset(B->case_i % 2 == 0 ? d->pinned : (void *)d->pageable, 0, B->bytes);
    if (B->together) pthread_barrier_wait(&B->bar);
    double t0 = pm__now();
    one_copy(B, d);
    if (r > 0) d->t[r - 1] = pm__now() - t0; /* round 0 warms up */
  }
  d->ok = verify(B, d);
  return NULL;
}

static void run(bd_t *B, int only) {
  B->together = only < 0;
  if (B->together) pthread_barrier_init(&B->bar, NULL, (unsigned)B->n);
  for (int i = 0; i < B->n; i++)
    if (only < 0 || only == i)
      if (pthread_create(&B->d[i].thread, NULL, dev_main, &B->d[i]) != 0) {
        fprintf(stderr, "pinmem: cannot start a thread for device %d\n", B->d[i].device);
        exit(CLI_EXIT_FAILURE);
      }
  for (int i = 0; i < B->n; i++)
    if (only < 0 || only == i) pthread_join(B->d[i].thread, NULL);
  if (B->together) pthread_barrier_destroy(&B->bar);
}

static void row(bd_t *B, const char *mode, int device, double seconds, double ratio, bool ok) {
  double gbps = (double)B->bytes * (device < 0 ? B->n : 1) / seconds / 1e9;
  if (B->json) {
    cli_json_t j;
    cli_json_row(&j, "copy_devices", case_name[B->case_i],
                 (unsigned long long)B->bytes * (unsigned long long)(device < 0 ? B->n : 1),
                 seconds, gbps);
    cli_json_bool(&j, "verified", ok);
    if (device < 0)
      cli_json_null(&j, "device");
    else
      cli_json_int(&j, "device", device);
    cli_json_str(&j, "mode", mode);
    if (ratio > 0)
      cli_json_double(&j, "ratio", ratio);
    else
      cli_json_null(&j, "ratio");
    cli_json_int(&j, "devices", strcmp(mode, "alone") ? B->n : 1);
    cli_json_end(&j);
  } else {
    char dev[16], r[16];
    snprintf(dev, sizeof dev, device < 0 ? "all" : "%d", device);
    snprintf(r, sizeof r, ratio > 0 ? "%.2f" : "", ratio);
    printf("  %-13s %-9s %-4s %9.2f GB/s  %8.3f ms  %-5s %s\n", case_name[B->case_i], mode, dev,
           gbps, seconds * 1e3, r, ok ? "" : "VERIFY FAILED");
  }
}

static int parse_devices(const char *list, int count, int *out) {
  if (!strcmp(list, "all")) {
    int n = PM__MIN(count, BD_MAX);
    for (int i = 0; i < n; i++) out[i] = i;
    return n;
  }
  /* strtok_r skips empty items: "0," and ",0" ran as "0". They are refused, as in every list. */
  int empty = cli_list_empty_item(list);
  if (empty) cli_usage_error("--devices: item %d of '%s' is empty", empty, list);
  int n = 0;
  char *copy = cli_xstrdup(list), *save = NULL;
  for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    char *end = NULL;
    long v = strtol(tok, &end, 10);
    if (*end || end == tok || v < 0 || v >= count)
      cli_usage_error("--devices: '%s' is not a device (this backend has %d: 0..%d)", tok, count,
                      count - 1);
    for (int i = 0; i < n; i++)
      if (out[i] == v) cli_usage_error("--devices: device %ld named twice", v);
    if (n == BD_MAX) cli_usage_error("--devices: at most %d devices", BD_MAX);
    out[n++] = (int)v;
  }
  free(copy);
  if (!n) cli_usage_error("--devices: no device named");
  return n;
}

int bc_bench_devices(const char *list, bool json, size_t bytes, int repeat) {
  cli_check(pm_init());
  int count = 0;
  cli_check(pm_device_count(&count));
  /* No device (auto fell back: pm_device_count says 0): pm_device_set(0) fails saying why, where
   * "all" would name no device and the rows would divide by none. */
  if (count < 1) cli_check(pm_device_set(0));
  if (count < 1) cli_usage_error("--devices: this backend has no device");
  bd_t *B = calloc(1, sizeof *B);
  if (!B) cli_fail(PM_ERR_NOMEM);
  int ids[BD_MAX];
  B->n = parse_devices(list, count, ids);
  B->bytes = bytes;
  B->repeat = PM__MAX(1, PM__MIN(repeat, BD_ROUNDS_MAX));
  B->json = json;
  for (int i = 0; i < B->n; i++) {
    bd_dev_t *d = &B->d[i];
    d->B = B;
    d->device = ids[i];
    cli_check(pm_device_set(d->device));
    cli_check(pm_stream_create(&d->stream));
    cli_check(pm_device_alloc(bytes, &d->dev));
    cli_check(pm_host_alloc(NULL, bytes, 0, &d->pinned));
    d->pageable = cli_xmalloc(bytes);
    d->back = cli_xmalloc(bytes);
  }
  char sz[32];
  if (!json) {
    printf("pinmem bench copy --devices %s: backend %s, %s per copy, median of %d rounds\n", list,
           pm_backend_name(), cli_fmt_bytes(bytes, sz, sizeof sz), B->repeat);
    if (B->n == 1)
      printf(
          "one device (%d): the together rows are the alone rows again; there is nothing to "
          "share.\n",
          ids[0]);
    printf("  %-13s %-9s %-4s %14s  %11s  %-5s\n", "case", "mode", "dev", "bandwidth", "median",
           "ratio");
  } else if (B->n == 1) {
    cli_json_t j;
    cli_json_begin(&j);
    cli_json_str(&j, "bench", "copy_devices");
    cli_json_str(&j, "case", "note");
    cli_json_str(&j, "note", "one device: together equals alone, no sharing measured");
    cli_json_int(&j, "devices", 1);
    cli_json_end(&j);
  }
  bool failed = false;
  double alone[BD_MAX];
  for (int c = 0; c < 4; c++) {
    B->case_i = c;
    for (int i = 0; i < B->n; i++) {
      bd_dev_t *d = &B->d[i];
      cli_check(pm_device_set(d->device));
      /* The pattern: pageable and pinned sources (H2D), or the device buffer (D2H). */
      fill_pattern(d->pinned, bytes, 1000 + (uint64_t)d->device);
      fill_pattern(d->pageable, bytes, 1000 + (uint64_t)d->device);
      if (c >= 2) cli_check(pm_memcpy(d->dev, d->pinned, bytes, PM_COPY_H2D));
    }
    for (int i = 0; i < B->n; i++) {
      run(B, i);
      alone[i] = cli_median(B->d[i].t, B->repeat);
      row(B, "alone", B->d[i].device, alone[i], 0, B->d[i].ok);
      failed |= !B->d[i].ok;
    }
    run(B, -1);
    double slowest = 0;
    bool all_ok = true;
    for (int i = 0; i < B->n; i++) {
      double t = cli_median(B->d[i].t, B->repeat);
      slowest = PM__MAX(slowest, t);
      row(B, "together", B->d[i].device, t, alone[i] / t, B->d[i].ok);
      all_ok &= B->d[i].ok;
    }
    row(B, "aggregate", -1, slowest, 0, all_ok);
    failed |= !all_ok;
  }
  for (int i = 0; i < B->n; i++) {
    bd_dev_t *d = &B->d[i];
    cli_check(pm_device_set(d->device));
    cli_check(pm_stream_destroy(d->stream));
    cli_check(pm_device_free(d->dev));
    cli_check(pm_host_free(d->pinned));
    free(d->pageable);
    free(d->back);
  }
  free(B);
  if (failed) {
    fprintf(stderr, "pinmem: some copies delivered wrong bytes (see VERIFY FAILED above)\n");
    return CLI_EXIT_FAILURE;
  }
  return 0;
}
