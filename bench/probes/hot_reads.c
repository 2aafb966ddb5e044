/*
 * DESIGN: how fast can threads bring a page-cache-hot file into host slot buffers, by way of
 * the kernel's copy (pread) or a mapping of the page cache and a copy in user space (mmap)?
 * The host half of a hot load (pinmem's read_file copies page cache -> pinned slot, then DMAs
 * the slot); the DMA is left out, so the figures are the host's ceiling for each way. Each
 * thread claims units of `chunk` bytes from a shared counter and copies them into its own two
 * slots in turn (slots reused, as pinmem's ring does). Cases, rotated within each round:
 *   anon      memcpy from an anonymous buffer already in memory (the memory's own ceiling)
 *   pread     pread of each unit into the slot
 *   mmap      the whole file mapped once (MAP_POPULATE; its setup timed in), memcpy per unit
 *   mmapwin   each unit mapped by its thread (MAP_POPULATE), memcpy, munmap
 *   mmapfault the whole file mapped once without MAP_POPULATE: pages fault in as copied
 * Usage: hot_reads FILE [threads,...] [chunk_mib] [rounds]. Prints JSON lines.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

enum { ANON, PREAD, MMAP, MMAPWIN, MMAPFAULT, NCASES };
static const char *names[] = {"anon", "pread", "mmap", "mmapwin", "mmapfault"};

typedef struct {
  int fd, mode;
  size_t size, chunk;
  const char *src; /* anon buffer or whole mapping */
  atomic_size_t next;
  atomic_int bad;
} job_t;

typedef struct {
  job_t *j;
  char *slot[2];
} worker_t;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void *work(void *arg) {
  worker_t *w = arg;
  job_t *j = w->j;
  int turn = 0;
  for (;;) {
    size_t k = atomic_fetch_add(&j->next, 1);
    size_t off = k * j->chunk;
    if (off >= j->size) break;
    size_t n = j->size - off < j->chunk ? j->size - off : j->chunk;
    char *dst = w->slot[turn ^= 1];
    if (j->mode == PREAD) {
      size_t done = 0;
      while (done < n) {
        ssize_t r = pread(j->fd, dst + done, n - done, (off_t)(off + done));
        if (r <= 0) {
          atomic_store(&j->bad, 1);
          return NULL;
        }
        done += (size_t)r;
      }
    } else if (j->mode == MMAPWIN) {
      void *m = mmap(NULL, n, PROT_READ, MAP_SHARED | MAP_POPULATE, j->fd, (off_t)off);
      if (m == MAP_FAILED) {
        atomic_store(&j->bad, 1);
        return NULL;
      }
      memcpy(dst, m, n);
      munmap(m, n);
    } else {
      memcpy(dst, j->src + off, n);
    }
  }
  return NULL;
}

static char *slot_alloc(size_t n) {
  char *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return NULL;
  madvise(p, n, MADV_HUGEPAGE);
  memset(p, 1, n);
  return p;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s FILE [threads,...] [chunk_mib] [rounds]\n", argv[0]);
    return 2;
  }
  const char *path = argv[1];
  int tlist[16], nt = 0;
  char *spec = strdup(argc > 2 ? argv[2] : "8,12,16");
  for (char *t = strtok(spec, ","); t && nt < 16; t = strtok(NULL, ",")) tlist[nt++] = atoi(t);
  size_t chunk = (size_t)(argc > 3 ? atoi(argv[3]) : 8) << 20;
  int rounds = argc > 4 ? atoi(argv[4]) : 5;
  int fd = open(path, O_RDONLY);
  struct stat sb;
  if (fd < 0 || fstat(fd, &sb) != 0) {
    perror(path);
    return 1;
  }
  size_t size = (size_t)sb.st_size;
  /* Make the file hot: read it once through the page cache. */
  char *tmp = malloc(chunk);
  for (size_t off = 0; off < size; off += chunk)
    if (pread(fd, tmp, chunk, (off_t)off) < 0) return 1;
  free(tmp);
  char *anon = slot_alloc(size);
  if (!anon) return 1;
  int maxt = 0;
  for (int i = 0; i < nt; i++) maxt = tlist[i] > maxt ? tlist[i] : maxt;
  worker_t *ws = calloc((size_t)maxt, sizeof *ws);
  for (int i = 0; i < maxt; i++)
    for (int s = 0; s < 2; s++) ws[i].slot[s] = slot_alloc(chunk);
  pthread_t *th = calloc((size_t)maxt, sizeof *th);
  for (int ti = 0; ti < nt; ti++) {
    int threads = tlist[ti];
    double best[NCASES], sum[NCASES];
    for (int c = 0; c < NCASES; c++) best[c] = 1e30, sum[c] = 0;
    for (int r = 0; r < rounds; r++) {
      for (int cc = 0; cc < NCASES; cc++) {
        int c = (cc + r) % NCASES;
        job_t j = {.fd = fd, .mode = c, .size = size, .chunk = chunk};
        atomic_init(&j.next, 0);
        atomic_init(&j.bad, 0);
        double t0 = now();
        void *map = NULL;
        if (c == ANON) j.src = anon;
        if (c == MMAP || c == MMAPFAULT) {
          map = mmap(NULL, size, PROT_READ, MAP_SHARED | (c == MMAP ? MAP_POPULATE : 0), fd, 0);
          if (map == MAP_FAILED) return 1;
          j.src = map;
        }
        for (int i = 0; i < threads; i++) {
          ws[i].j = &j;
          pthread_create(&th[i], NULL, work, &ws[i]);
        }
        for (int i = 0; i < threads; i++) pthread_join(th[i], NULL);
        if (map) munmap(map, size);
        double dt = now() - t0;
        if (atomic_load(&j.bad)) {
          fprintf(stderr, "%s failed\n", names[c]);
          return 1;
        }
        if (dt < best[c]) best[c] = dt;
        sum[c] += dt;
      }
    }
    for (int c = 0; c < NCASES; c++)
      printf("{\"probe\":\"hot_reads\",\"case\":\"%s\",\"threads\":%d,\"chunk_mib\":%zu,"
             "\"bytes\":%zu,\"rounds\":%d,\"best_gbps\":%.2f,\"mean_gbps\":%.2f}\n",
             names[c], threads, chunk >> 20, size, rounds, (double)size / best[c] / 1e9,
             (double)size * rounds / sum[c] / 1e9);
    fflush(stdout);
  }
  return 0;
}
