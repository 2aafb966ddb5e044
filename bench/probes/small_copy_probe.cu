/* DESIGN: a stand-alone probe of the fixed cost of a small copy, kept so the figures in
 * docs/performance.md can be measured again. pm_copy_async of a small pageable buffer must ask the
 * backend whether an address the registry does not know is device memory
 * (cudaPointerGetAttributes); this times that question beside the copies, per call, in one
 * process:
 *   attr_pageable / attr_device / attr_pinned   cudaPointerGetAttributes on each kind of memory
 *   cu_attr_pageable   the driver's cuPointerGetAttribute(MEMORY_TYPE) on pageable memory
 *   plain_pageable     cudaMemcpyAsync of BYTES from pageable memory to the device
 *   pm_memcpy_pageable pm_memcpy_async, the same copy (registry checks, no classification)
 *   pm_copy_pageable   pm_copy_async, the same copy (classification included)
 *   pm_copy_pinned     pm_copy_async from pinmem's pinned memory
 *   pm_copy_foreign    pm_copy_async from cudaHostAlloc memory pinmem does not track
 * Each row: the median over ROUNDS rounds of the mean over N calls (copies: N queued, then the
 * stream synchronized, so the time is the enqueue cost plus the copies themselves).
 *   nvcc -O2 -arch=sm_90 -Iinclude -o small_copy_probe bench/probes/small_copy_probe.cu \
 *        BUILD/libpinmem.a -lcuda -lpthread -ldl
 *   ./small_copy_probe [bytes] [n] [rounds] */
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pinmem.h"

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmpd(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

#define PMCK(x)                                                              \
  do {                                                                       \
    if ((x) != PM_OK) {                                                      \
      fprintf(stderr, "%s failed: %s\n", #x, pm_last_error());              \
      exit(1);                                                               \
    }                                                                        \
  } while (0)

int main(int argc, char **argv) {
  size_t bytes = argc > 1 ? strtoull(argv[1], NULL, 0) : 4096;
  int n = argc > 2 ? atoi(argv[2]) : 2000;
  int rounds = argc > 3 ? atoi(argv[3]) : 9;
  if (n < 1 || rounds < 1 || rounds > 99) return 2;
  PMCK(pm_init());
  pm_stream_t s;
  PMCK(pm_stream_create(&s));
  cudaStream_t cs; /* the plain copies' own stream */
  if (cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking) != cudaSuccess) return 1;
  void *dev = NULL, *pinned = NULL;
  PMCK(pm_device_alloc(bytes, &dev));
  PMCK(pm_host_alloc(NULL, bytes, 0, &pinned));
  char *pageable = (char *)malloc(bytes);
  void *cdev = NULL, *foreign = NULL;
  if (!pageable || cudaMalloc(&cdev, bytes) != cudaSuccess ||
      cudaHostAlloc(&foreign, bytes, cudaHostAllocDefault) != cudaSuccess)
    return 1;
  memset(foreign, 1, bytes);
  memset(pageable, 1, bytes);
  memset(pinned, 1, bytes);

  static const char *names[] = {"attr_pageable", "attr_device",        "attr_pinned",
                                "cu_attr_pageable", "plain_pageable", "pm_memcpy_pageable",
                                "pm_copy_pageable", "pm_copy_pinned",     "pm_copy_foreign"};
  enum { NC = sizeof names / sizeof names[0] };
  double t[NC][99];
  for (int r = 0; r < rounds; r++) {
    for (int c = 0; c < NC; c++) {
      cudaDeviceSynchronize();
      double t0 = now();
      for (int i = 0; i < n; i++) {
        struct cudaPointerAttributes a;
        switch (c) {
          case 0:
            (void)cudaPointerGetAttributes(&a, pageable);
            break;
          case 1:
            (void)cudaPointerGetAttributes(&a, cdev);
            break;
          case 2:
            (void)cudaPointerGetAttributes(&a, pinned);
            break;
          case 3: {
            unsigned int mt = 0;
            (void)cuPointerGetAttribute(&mt, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                        (CUdeviceptr)(uintptr_t)pageable);
            break;
          }
          case 4:
            (void)cudaMemcpyAsync(dev, pageable, bytes, cudaMemcpyHostToDevice, cs);
            break;
          case 5:
            PMCK(pm_memcpy_async(dev, pageable, bytes, PM_COPY_H2D, s));
            break;
          case 6:
            PMCK(pm_copy_async(dev, pageable, bytes, s, NULL, NULL));
            break;
          case 7:
            PMCK(pm_copy_async(dev, pinned, bytes, s, NULL, NULL));
            break;
          case 8:
            PMCK(pm_copy_async(dev, foreign, bytes, s, NULL, NULL));
            break;
        }
      }
      cudaDeviceSynchronize();
      (void)cudaGetLastError();
      t[c][r] = (now() - t0) / n * 1e6;
    }
  }
  for (int c = 0; c < NC; c++) {
    qsort(t[c], rounds, sizeof(double), cmpd);
    printf("{\"probe\":\"small_copy\",\"case\":\"%s\",\"bytes\":%zu,\"calls\":%d,\"rounds\":%d,"
           "\"median_us\":%.3f,\"min_us\":%.3f,\"max_us\":%.3f}\n",
           names[c], bytes, n, rounds, t[c][rounds / 2], t[c][0], t[c][rounds - 1]);
    fprintf(stderr, "%-20s %8.3f us per call (min %.3f, max %.3f)\n", names[c],
            t[c][rounds / 2], t[c][0], t[c][rounds - 1]);
  }
  pm_host_free(pinned);
  pm_device_free(dev);
  cudaFree(cdev);
  cudaFreeHost(foreign);
  free(pageable);
  pm_stream_destroy(s);
  cudaStreamDestroy(cs);
  return 0;
}
