/* DESIGN: a stand-alone probe of the both-ways link ceiling, kept so the figures in
 * docs/performance.md can be measured again. It asks one question: does anything beat one DMA per
 * direction when host->device and device->host run at the same time? Variants, all on pinned
 * memory, 1 GiB each way by default, timed with events, rotated within each round so drift in
 * the link does not favour one variant:
 *   ce1       one cudaMemcpyAsync per direction, each on its own stream (what pinmem does)
 *   ce2/ce4   each direction split into 2 or 4 pieces on as many streams (more copy engines)
 *   ce_k_d2h  H2D by the copy engine, D2H by a kernel storing into mapped host memory
 *   k_h2d_ce  H2D by a kernel loading mapped host memory, D2H by the copy engine
 *   reg1      as ce1, but the host buffers are 2 MiB aligned malloc memory (THP) registered
 *   h2d/d2h   one direction alone, for the unidirectional ceiling in the same process
 *   h2d4/d2h4 one direction alone, split into 4 pieces on 4 streams (pair mode only)
 * Output: one JSON line per variant and round, then medians on stderr.
 *   nvcc -O2 -arch=sm_90 -o bidir_probe bench/probes/bidir_probe.cu
 *   ./bidir_probe [bytes_each_way] [rounds] [reps]
 *   ./bidir_probe BYTES pair A B [pairs]: A and B alternated run by run, the median of the
 *     per-pair ratios B/A (drift in the link cancels within a pair). */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#define CK(x)                                                                  \
  do {                                                                         \
    cudaError_t e_ = (x);                                                      \
    if (e_ != cudaSuccess) {                                                   \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,                \
              cudaGetErrorString(e_));                                         \
      exit(1);                                                                 \
    }                                                                          \
  } while (0)

/* Grid-stride 16-byte copy: one side may be mapped host memory. */
__global__ void copy16(uint4 *__restrict__ dst, const uint4 *__restrict__ src, size_t n16) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  size_t step = (size_t)gridDim.x * blockDim.x;
  for (; i < n16; i += step) dst[i] = src[i];
}

typedef struct {
  char *hsrc, *hdst;     /* cudaHostAlloc, mapped */
  char *rsrc, *rdst;     /* malloc + cudaHostRegister */
  char *dsrc, *ddst;     /* device */
  cudaStream_t s[8];
  cudaEvent_t e0, e1, ej[8];
  size_t n;
  int sms;
} probe_t;

static void split(probe_t *p, char *dst, const char *src, size_t n, int k, int first,
                  cudaMemcpyKind kind) {
  size_t piece = (n / k + 4095) & ~(size_t)4095;
  for (int i = 0; i < k; i++) {
    size_t off = (size_t)i * piece;
    if (off >= n) break;
    size_t len = n - off < piece ? n - off : piece;
    CK(cudaMemcpyAsync(dst + off, src + off, len, kind, p->s[first + i]));
  }
}

static void kcopy(probe_t *p, void *dst, const void *src, size_t n, cudaStream_t s) {
  copy16<<<p->sms * 4, 512, 0, s>>>((uint4 *)dst, (const uint4 *)src, n / 16);
  CK(cudaGetLastError());
}

/* A variant: how many copy-engine pieces each direction takes (0: that direction is not
 * moved), which direction a kernel moves instead, and whether the registered buffers are used. */
typedef struct {
  const char *name;
  int h2d_k, d2h_k;
  int kernel; /* 1: H2D by a kernel, 2: D2H by a kernel */
  int reg;
} variant_t;
static const variant_t variants[] = {
    {"ce1", 1, 1, 0, 0},      {"ce2", 2, 2, 0, 0},  {"ce4", 4, 4, 0, 0},
    {"ce_k_d2h", 1, 1, 2, 0}, {"k_h2d_ce", 1, 1, 1, 0}, {"reg1", 1, 1, 0, 1},
    {"h2d", 1, 0, 0, 0},      {"d2h", 0, 1, 0, 0},  {"h2d4", 4, 0, 0, 0},
    {"d2h4", 0, 4, 0, 0},
};

/* Runs variant v once; returns GB/s over the bytes moved. D2H goes on streams 4.., H2D on 0.. */
static double run(probe_t *p, const char *v) {
  const variant_t *var = NULL;
  for (size_t i = 0; i < sizeof variants / sizeof variants[0]; i++)
    if (!strcmp(variants[i].name, v)) var = &variants[i];
  if (!var) {
    fprintf(stderr, "unknown variant %s\n", v);
    exit(2);
  }
  size_t n = p->n;
  char *hs = var->reg ? p->rsrc : p->hsrc, *hd = var->reg ? p->rdst : p->hdst;
  CK(cudaDeviceSynchronize());
  CK(cudaEventRecord(p->e0, p->s[0]));
  for (int i = 1; i < 8; i++) CK(cudaStreamWaitEvent(p->s[i], p->e0, 0));
  double moved = 0;
  if (var->d2h_k) {
    if (var->kernel == 2)
      kcopy(p, hd, p->ddst, n, p->s[4]);
    else
      split(p, hd, p->ddst, n, var->d2h_k, 4, cudaMemcpyDeviceToHost);
    moved += n;
  }
  if (var->h2d_k) {
    if (var->kernel == 1)
      kcopy(p, p->dsrc, hs, n, p->s[0]);
    else
      split(p, p->dsrc, hs, n, var->h2d_k, 0, cudaMemcpyHostToDevice);
    moved += n;
  }
  for (int i = 1; i < 8; i++) { /* every stream joins stream 0 (unused ones cost nothing) */
    CK(cudaEventRecord(p->ej[i], p->s[i]));
    CK(cudaStreamWaitEvent(p->s[0], p->ej[i], 0));
  }
  CK(cudaEventRecord(p->e1, p->s[0]));
  CK(cudaEventSynchronize(p->e1));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, p->e0, p->e1));
  return moved / (ms * 1e-3) / 1e9;
}

static int cmpd(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static char *thp_alloc(size_t n) {
  void *p = NULL;
  if (posix_memalign(&p, 2u << 20, n)) return NULL;
  madvise(p, n, MADV_HUGEPAGE);
  memset(p, 1, n);
  return (char *)p;
}

int main(int argc, char **argv) {
  size_t n = argc > 1 ? strtoull(argv[1], NULL, 0) : (1ull << 30);
  int rounds = argc > 2 ? atoi(argv[2]) : 3;
  int reps = argc > 3 ? atoi(argv[3]) : 7;
  static const char *vs[] = {"ce1", "ce2", "ce4", "ce_k_d2h", "k_h2d_ce", "reg1", "h2d", "d2h"};
  enum { NV = sizeof vs / sizeof vs[0] };
  probe_t p;
  memset(&p, 0, sizeof p);
  p.n = n;
  CK(cudaDeviceGetAttribute(&p.sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaHostAlloc((void **)&p.hsrc, n, cudaHostAllocMapped));
  CK(cudaHostAlloc((void **)&p.hdst, n, cudaHostAllocMapped));
  p.rsrc = thp_alloc(n);
  p.rdst = thp_alloc(n);
  if (!p.rsrc || !p.rdst) return 1;
  CK(cudaHostRegister(p.rsrc, n, cudaHostRegisterDefault));
  CK(cudaHostRegister(p.rdst, n, cudaHostRegisterDefault));
  memset(p.hsrc, 7, n);
  memset(p.hdst, 0, n);
  CK(cudaMalloc((void **)&p.dsrc, n));
  CK(cudaMalloc((void **)&p.ddst, n));
  CK(cudaMemset(p.ddst, 3, n));
  for (int i = 0; i < 8; i++) {
    CK(cudaStreamCreateWithFlags(&p.s[i], cudaStreamNonBlocking));
    CK(cudaEventCreate(&p.ej[i]));
  }
  CK(cudaEventCreate(&p.e0));
  CK(cudaEventCreate(&p.e1));
  for (int v = 0; v < NV; v++) run(&p, vs[v]); /* warm-up: every path once */

  if (argc > 4 && !strcmp(argv[2], "pair")) {
    const char *a = argv[3], *b = argv[4];
    int pairs = argc > 5 ? atoi(argv[5]) : 100;
    if (pairs < 1 || pairs > 4096) pairs = 100;
    double *ra = (double *)malloc(sizeof(double) * pairs), *rb = (double *)malloc(sizeof(double) * pairs),
           *q = (double *)malloc(sizeof(double) * pairs);
    for (int i = 0; i < pairs; i++) {
      if (i & 1) { /* alternate which goes first, too */
        rb[i] = run(&p, b);
        ra[i] = run(&p, a);
      } else {
        ra[i] = run(&p, a);
        rb[i] = run(&p, b);
      }
      q[i] = rb[i] / ra[i];
    }
    int wins = 0;
    for (int i = 0; i < pairs; i++) wins += q[i] > 1.0;
    qsort(ra, pairs, sizeof(double), cmpd);
    qsort(rb, pairs, sizeof(double), cmpd);
    qsort(q, pairs, sizeof(double), cmpd);
    printf("{\"probe\":\"bidir_pair\",\"a\":\"%s\",\"b\":\"%s\",\"pairs\":%d,\"bytes_each_way\":%zu,"
           "\"median_a_gbps\":%.2f,\"median_b_gbps\":%.2f,\"median_ratio\":%.4f,"
           "\"ratio_p25\":%.4f,\"ratio_p75\":%.4f,\"b_faster\":%d}\n",
           a, b, pairs, n, ra[pairs / 2], rb[pairs / 2], q[pairs / 2], q[pairs / 4],
           q[3 * pairs / 4], wins);
    fprintf(stderr, "%s vs %s: medians %.1f / %.1f GB/s, paired ratio %.4f (IQR %.4f..%.4f), b faster in %d of %d\n",
            a, b, ra[pairs / 2], rb[pairs / 2], q[pairs / 2], q[pairs / 4], q[3 * pairs / 4], wins, pairs);
    free(ra);
    free(rb);
    free(q);
    return 0;
  }

  static double all[NV][64 * 64];
  int cnt[NV] = {0};
  for (int r = 0; r < rounds; r++) {
    for (int j = 0; j < NV; j++) {
      int v = (j + r) % NV; /* rotate the order each round */
      double t[64];
      int k = reps < 64 ? reps : 64;
      for (int i = 0; i < k; i++) t[i] = run(&p, vs[v]);
      qsort(t, k, sizeof t[0], cmpd);
      printf("{\"probe\":\"bidir\",\"variant\":\"%s\",\"round\":%d,\"bytes_each_way\":%zu,"
             "\"median_gbps\":%.2f,\"min_gbps\":%.2f,\"max_gbps\":%.2f}\n",
             vs[v], r, n, t[k / 2], t[0], t[k - 1]);
      for (int i = 0; i < k && cnt[v] < 64 * 64; i++) all[v][cnt[v]++] = t[i];
    }
  }
  /* The copies' bytes: the last H2D must have delivered the pattern. */
  unsigned char probe_byte = 0;
  CK(cudaMemcpy(&probe_byte, p.dsrc + n - 1, 1, cudaMemcpyDeviceToHost));
  if (probe_byte != 7) {
    fprintf(stderr, "bytes did not arrive (%u)\n", probe_byte);
    return 1;
  }
  for (int v = 0; v < NV; v++) {
    qsort(all[v], cnt[v], sizeof(double), cmpd);
    fprintf(stderr, "%-9s median %6.1f GB/s (min %6.1f, max %6.1f, %d runs)\n", vs[v],
            all[v][cnt[v] / 2], all[v][0], all[v][cnt[v] - 1], cnt[v]);
  }
  return 0;
}
