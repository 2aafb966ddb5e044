/*
 * DESIGN: the data loader: worker threads read samples straight into pinned batch slots, a copy
 * stage moves each full slot to a device buffer on the loader's own stream, and the consumer
 * takes the batches in order with pm_loader_next.
 *
 * Data structure: a ring of `nslots` slots (the prefetch depth). Global batch number g (epoch *
 * batches_per_epoch + index) lives in slot g % nslots. A slot holds a host buffer (pinned from
 * the pool, or malloc'd with pin_memory 0), a device buffer of the same size, the dataset index
 * of each row, and three events: copy start/done on the copy stream (timing events: the copy's
 * device time) and "release", recorded on the consumer's stream when the batch is given back.
 * Layout of a buffer: inputs [rows_max * sample_bytes], then at targets_off (256-aligned) the
 * targets of token datasets.
 *
 * Slot life: FREE -> OPENING (one worker waits for the slot's previous copy to finish and
 * writes the row indices) -> FILLING (workers claim chunks of rows in order and read each
 * sample into its place) -> the worker that completes the last row submits the device copy
 * (after the copy stream waits for the slot's release event, so the device buffer is not
 * overwritten while the consumer's stream may still read it) -> READY -> HELD (delivered) ->
 * RELEASING -> FREE. With pin_memory 0 the copy is a plain pageable copy done inside
 * pm_loader_next on the consumer's thread (it blocks as cudaMemcpyAsync from pageable memory
 * does), which is what DataLoader(pin_memory=False) + .to(device) costs. Host delivery has no
 * device buffers, events or stream.
 *
 * Invariants: fill_g (the batch whose rows are being claimed) only moves forward, so every batch
 * below it has all its rows claimed; a slot is opened for batch g only when it is FREE, i.e. batch
 * g - nslots was released; deliver_g <= fill_g; a batch is delivered only when READY, so never
 * short. An error at batch e (a read, an event, a copy) sets err_g = min(err_g, e): workers stop
 * claiming, the batches before e are still delivered (their rows were all claimed before e's),
 * and pm_loader_next returns the error from batch e on, every time (pm_loader_state then points at
 * e, so a resumed job retries it).
 *
 * Threads: workers are the loader's own threads (a long-running pipeline, not a fork-join job for
 * pm__parallel_for). Lock order: mu, then nothing; submit_mu (keeps each slot's wait/record/copy/
 * record sequence contiguous on the copy stream) is taken without mu and holds only backend calls.
 * No dataset read, user callback or backend call runs under mu. A slot's buffers and events are
 * touched only by the one party its state gives them to (the opener, the worker finishing it,
 * the consumer while HELD/RELEASING); state changes happen under mu, which orders those phases.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define LOADER_MAGIC 0x4c4f4144u /* "LOAD" */
#define MAX_WORKERS 256
#define MAX_SLOTS 4096
#define TARGET_ALIGN ((size_t)256)

enum { SLOT_FREE, SLOT_OPENING, SLOT_FILLING, SLOT_READY, SLOT_HELD, SLOT_RELEASING };

typedef struct slot {
  int state;
  uint64_t seq;                 /* global batch number (not FREE) */
  uint64_t rows, claimed, done; /* rows of the batch, claimed and completed by workers */
  bool failed;
  bool copy_pending;    /* ev_done recorded and its time not yet counted */
  bool release_pending; /* ev_release recorded since the last copy into dev */
  unsigned char *host;
  unsigned char *dev;
  uint64_t *indices;
  pm_event_t ev_start, ev_done, ev_release;
} slot_t;

struct pm_loader_s {
  unsigned magic;
  pm_dataset_t *ds;
  pm__sampler_t sampler;
  pm_loader_config_t cfg;
  size_t sample_bytes, target_bytes, targets_off, slot_bytes;
  uint64_t rows_per_claim;
  int nslots, nworkers, started;
  slot_t *slots;
  pthread_t *threads;
  pm_stream_t copy_stream;
  bool device, pinned;
  int device_index;
  uint64_t end_g; /* UINT64_MAX: no end */
  atomic_bool stop_flag;

  pthread_mutex_t mu;
  pthread_cond_t work_cv, ready_cv;
  pthread_mutex_t submit_mu;
  /* guarded by mu */
  uint64_t fill_g, deliver_g;
  int held;
  bool stop, in_next;
  uint64_t err_g;
  pm_status_t err;
  char err_msg[512];
  pm_loader_stats_t st;
};

/* ---- helpers ------------------------------------------------------------------------------- */

static size_t copy_bytes(const pm_loader_t *L, uint64_t rows) {
  if (L->target_bytes) return L->targets_off + (size_t)rows * L->target_bytes;
  return (size_t)rows * L->sample_bytes;
}

/* Record the first error by batch order (with mu held). */
static void set_error_locked(pm_loader_t *L, uint64_t g, pm_status_t st, const char *msg) {
  if (g < L->err_g) {
    L->err_g = g;
    L->err = st;
    snprintf(L->err_msg, sizeof L->err_msg, "%s", msg && msg[0] ? msg : pm_strerror(st));
  }
  pthread_cond_broadcast(&L->ready_cv);
  pthread_cond_broadcast(&L->work_cv);
}

static void add_copy_time(pm_loader_t *L, slot_t *s, double *acc) {
  double sec;
  if (pm_event_elapsed(s->ev_start, s->ev_done, &sec) == PM_OK && sec > 0) *acc += sec;
}

/* Everything the worker does to start a slot for batch g outside the lock. */
static pm_status_t open_slot(pm_loader_t *L, slot_t *s, uint64_t g, bool sync, double *copy_t) {
  if (sync) {
    /* The previous batch's copy may still read the host buffer we are about to overwrite. */
    pm_status_t st = pm_event_synchronize(s->ev_done);
    if (st != PM_OK) return pm__wrap_error(st, "waiting for the copy of an earlier batch");
    add_copy_time(L, s, copy_t);
  }
  uint64_t bpe = L->sampler.batches;
  uint64_t epoch = g / bpe, first = (g % bpe) * L->sampler.batch;
  for (uint64_t r = 0; r < s->rows; r++)
    s->indices[r] = pm__sampler_index(&L->sampler, epoch, first + r);
  return PM_OK;
}

/* Queue a slot's host -> device copy on the copy stream, behind the consumer's release of the
 * slot's device buffer, between the slot's start and done events. */
static pm_status_t queue_copy(pm_loader_t *L, slot_t *s, const char *what) {
  pm_status_t st = PM_OK;
  if (s->release_pending) {
    st = pm_stream_wait_event(L->copy_stream, s->ev_release);
    if (st == PM_OK) s->release_pending = false;
  }
  if (st == PM_OK) st = pm_event_record(s->ev_start, L->copy_stream);
  if (st == PM_OK)
    st = pm_memcpy_async(s->dev, s->host, copy_bytes(L, s->rows), PM_COPY_H2D, L->copy_stream);
  if (st == PM_OK) st = pm_event_record(s->ev_done, L->copy_stream);
  if (st != PM_OK) return pm__wrap_error(st, "%s", what);
  s->copy_pending = true;
  return PM_OK;
}

static pm_status_t submit_copy(pm_loader_t *L, slot_t *s) {
  pthread_mutex_lock(&L->submit_mu);
  pm_status_t st = queue_copy(L, s, "device copy of a batch");
  pthread_mutex_unlock(&L->submit_mu);
  return st;
}

/* ---- workers ------------------------------------------------------------------------------ */

static void *worker_main(void *arg) {
  pm_loader_t *L = arg;
  pm_dataset_t *ds = L->ds;
  pm__scratch_t scratch = {NULL, 0};
  char msg[512];
  if (L->device) (void)pm_device_set(L->device_index); /* events and copies need the device */

  pthread_mutex_lock(&L->mu);
  for (;;) {
    if (L->stop) break;
    uint64_t g = L->fill_g;
    if (g >= L->end_g || g >= L->err_g) {
      pthread_cond_wait(&L->work_cv, &L->mu);
      continue;
    }
    slot_t *s = &L->slots[g % (uint64_t)L->nslots];

    if (s->state == SLOT_FREE) {
      s->state = SLOT_OPENING;
      s->seq = g;
      s->rows = pm__sampler_rows(&L->sampler, g % L->sampler.batches);
      s->claimed = s->done = 0;
      s->failed = false;
      bool sync = s->copy_pending;
      s->copy_pending = false;
      pthread_mutex_unlock(&L->mu);
      double t0 = pm__now(), copy_t = 0;
      pm_status_t st = open_slot(L, s, g, sync, &copy_t);
      if (st != PM_OK) snprintf(msg, sizeof msg, "%s", pm_last_error());
      double t1 = pm__now();
      pthread_mutex_lock(&L->mu);
      L->st.collate_seconds += t1 - t0;
      L->st.copy_seconds += copy_t;
      s->state = SLOT_FILLING;
      if (st != PM_OK) {
        s->failed = true;
        set_error_locked(L, g, st, msg);
      }
      pthread_cond_broadcast(&L->work_cv);
      continue;
    }
    if (s->state != SLOT_FILLING || s->seq != g) {
      /* Being opened by another worker, or still holding batch g - nslots. */
      pthread_cond_wait(&L->work_cv, &L->mu);
      continue;
    }

    uint64_t r0 = s->claimed, r1 = PM__MIN(s->rows, r0 + L->rows_per_claim);
    s->claimed = r1;
    if (r1 == s->rows) {
      L->fill_g = g + 1;
      pthread_cond_broadcast(&L->work_cv);
    }
    pthread_mutex_unlock(&L->mu);

    uint64_t epoch = g / L->sampler.batches;
    pm_status_t st = PM_OK;
    double t0 = pm__now();
    for (uint64_t r = r0; r < r1 && st == PM_OK; r++) {
      if (atomic_load_explicit(&L->stop_flag, memory_order_relaxed)) break;
      unsigned char *dst = s->host + (size_t)r * L->sample_bytes;
      unsigned char *tdst =
          L->target_bytes ? s->host + L->targets_off + (size_t)r * L->target_bytes : NULL;
      st = ds->read(ds, epoch, s->indices[r], dst, tdst, &scratch);
      if (st != PM_OK) {
        snprintf(msg, sizeof msg, "epoch %llu, batch %llu, row %llu: %s", (unsigned long long)epoch,
                 (unsigned long long)(g % L->sampler.batches), (unsigned long long)r,
                 pm_last_error());
      }
    }
    double t1 = pm__now();

    pthread_mutex_lock(&L->mu);
    L->st.read_seconds += t1 - t0;
    s->done += r1 - r0;
    if (st != PM_OK) {
      s->failed = true;
      set_error_locked(L, g, st, msg);
    }
    if (s->done == s->rows && !s->failed && !L->stop) {
      if (L->device && L->pinned) {
        pthread_mutex_unlock(&L->mu);
        st = submit_copy(L, s);
        if (st != PM_OK) snprintf(msg, sizeof msg, "%s", pm_last_error());
        pthread_mutex_lock(&L->mu);
        if (st != PM_OK) {
          s->failed = true;
          set_error_locked(L, g, st, msg);
          continue;
        }
      }
      s->state = SLOT_READY;
      pthread_cond_broadcast(&L->ready_cv);
    }
  }
  pthread_mutex_unlock(&L->mu);
  pm__scratch_free(&scratch);
  return NULL;
}

/* ---- create / destroy ----------------------------------------------------------------------- */

void pm_loader_config_init(pm_loader_config_t *config) {
  if (!config) return;
  memset(config, 0, sizeof *config);
  config->rank = -1;
  config->world_size = -1;
  config->pin_memory = 1;
  config->delivery = PM_DELIVER_DEVICE;
  config->epochs = 1;
}

/* RANK / WORLD_SIZE: the value, the default when unset, PM_ERR_CONFIG when not an integer. */
static pm_status_t env_int(const char *name, long lo, long hi, int dflt, int *out) {
  const char *v = getenv(name);
  if (!v || !v[0]) {
    *out = dflt;
    return PM_OK;
  }
  char *end;
  errno = 0;
  long x = strtol(v, &end, 10);
  while (*end == ' ' || *end == '\n') end++;
  if (errno || end == v || *end || x < lo || x > hi)
    return pm__set_error(PM_ERR_CONFIG,
                         "pm_loader_create: %s='%.32s' is not an integer in %ld..%ld", name, v, lo,
                         hi);
  *out = (int)x;
  return PM_OK;
}

static void free_slots(pm_loader_t *L) {
  if (!L->slots) return;
  for (int i = 0; i < L->nslots; i++) {
    slot_t *s = &L->slots[i];
    if (s->release_pending && s->ev_release) (void)pm_event_synchronize(s->ev_release);
    if (s->dev) (void)pm_device_free(s->dev);
    if (s->ev_start) (void)pm_event_destroy(s->ev_start);
    if (s->ev_done) (void)pm_event_destroy(s->ev_done);
    if (s->ev_release) (void)pm_event_destroy(s->ev_release);
    if (s->host) {
      if (L->pinned)
        (void)pm_host_free(s->host);
      else
        free(s->host);
    }
    free(s->indices);
  }
  free(L->slots);
  L->slots = NULL;
}

static void stop_workers(pm_loader_t *L) {
  pthread_mutex_lock(&L->mu);
  L->stop = true;
  atomic_store(&L->stop_flag, true);
  pthread_cond_broadcast(&L->work_cv);
  pthread_cond_broadcast(&L->ready_cv);
  pthread_mutex_unlock(&L->mu);
  for (int i = 0; i < L->started; i++) pthread_join(L->threads[i], NULL);
  L->started = 0;
}

/* Teardown shared by destroy and a failed create. */
static void loader_free(pm_loader_t *L) {
  stop_workers(L);
  if (L->copy_stream) (void)pm_stream_synchronize(L->copy_stream);
  free_slots(L);
  if (L->copy_stream) (void)pm_stream_destroy(L->copy_stream);
  free(L->threads);
  pthread_mutex_destroy(&L->mu);
  pthread_mutex_destroy(&L->submit_mu);
  pthread_cond_destroy(&L->work_cv);
  pthread_cond_destroy(&L->ready_cv);
  L->magic = 0;
  (void)pm__handle_remove(L, PM__HANDLE_LOADER);
  free(L);
}

static pm_status_t check_resume(const pm_loader_t *L, const pm_loader_state_t *r) {
  const char *fn = "pm_loader_create";
  const pm__sampler_t *s = &L->sampler;
  if (r->magic != PM_LOADER_STATE_MAGIC)
    return pm__set_error(PM_ERR_INVALID,
                         "%s: resume state has a bad magic 0x%08x (not from "
                         "pm_loader_state?)",
                         fn, r->magic);
#define MISMATCH(what, a, b)                                                                       \
  pm__set_error(PM_ERR_INVALID,                                                                    \
                "%s: resume state was saved with %s %llu, this loader has %llu: the order of the " \
                "samples would differ",                                                            \
                fn, what, (unsigned long long)(a), (unsigned long long)(b))
  if (r->samples != s->n) return MISMATCH("samples", r->samples, s->n);
  if (r->batch_size != s->batch) return MISMATCH("batch_size", r->batch_size, s->batch);
  if (r->seed != s->seed && s->shuffle) return MISMATCH("seed", r->seed, s->seed);
  if ((r->flags & 1u) != (unsigned)s->shuffle)
    return MISMATCH("shuffle", r->flags & 1u, s->shuffle);
  if (((r->flags >> 1) & 1u) != (unsigned)s->drop_last)
    return MISMATCH("drop_last", (r->flags >> 1) & 1u, s->drop_last);
  if (r->world_size != s->world) return MISMATCH("world_size", r->world_size, s->world);
  if (r->rank != s->rank) return MISMATCH("rank", r->rank, s->rank);
#undef MISMATCH
  if (r->batch >= s->batches)
    return pm__set_error(PM_ERR_INVALID, "%s: resume state batch %llu, an epoch has %llu", fn,
                         (unsigned long long)r->batch, (unsigned long long)s->batches);
  if (L->cfg.epochs && r->epoch > L->cfg.epochs)
    return pm__set_error(PM_ERR_INVALID, "%s: resume state epoch %llu, the loader has %llu", fn,
                         (unsigned long long)r->epoch, (unsigned long long)L->cfg.epochs);
  if (r->epoch > UINT64_MAX / s->batches - 1)
    return pm__set_error(PM_ERR_INVALID, "%s: resume state epoch %llu is too large", fn,
                         (unsigned long long)r->epoch);
  return PM_OK;
}

pm_status_t pm_loader_create(pm_dataset_t *dataset, const pm_loader_config_t *config,
                             pm_loader_t **loader_out) {
  const char *fn = "pm_loader_create";
  if (!dataset || !config || !loader_out)
    return pm__set_error(PM_ERR_INVALID, "%s: %s is NULL", fn,
                         !dataset  ? "dataset"
                         : !config ? "config"
                                   : "loader_out");
  const pm_loader_config_t *c = config;
  if (c->batch_size == 0) return pm__set_error(PM_ERR_INVALID, "%s: batch_size is 0", fn);
  if (c->workers < 0 || c->workers > MAX_WORKERS)
    return pm__set_error(PM_ERR_INVALID, "%s: workers %d is not in 0..%d", fn, c->workers,
                         MAX_WORKERS);
  if (c->prefetch < 0 || c->prefetch > MAX_SLOTS)
    return pm__set_error(PM_ERR_INVALID, "%s: prefetch %d is not in 0..%d", fn, c->prefetch,
                         MAX_SLOTS);
  if ((unsigned)c->delivery > PM_DELIVER_HOST)
    return pm__set_error(PM_ERR_INVALID, "%s: unknown delivery %d", fn, (int)c->delivery);
  int rank = c->rank, world = c->world_size;
  pm_status_t st = PM_OK;
  if (world <= 0) st = env_int("WORLD_SIZE", 1, 1 << 20, 1, &world);
  if (st == PM_OK && rank < 0) st = env_int("RANK", 0, (1 << 20) - 1, 0, &rank);
  if (st != PM_OK) return st;
  PM__BACKEND_OR_RETURN(b);
  (void)b;

  pm_loader_t *L = calloc(1, sizeof *L);
  if (!L) return pm__set_error(PM_ERR_NOMEM, "%s: loader object", fn);
  pthread_mutex_init(&L->mu, NULL);
  pthread_mutex_init(&L->submit_mu, NULL);
  pthread_cond_init(&L->work_cv, NULL);
  pthread_cond_init(&L->ready_cv, NULL);
  atomic_init(&L->stop_flag, false);
  L->magic = LOADER_MAGIC;
  L->ds = dataset;
  L->cfg = *c;
  L->cfg.resume = NULL;
  L->cfg.rank = rank;
  L->cfg.world_size = world;
  L->err_g = UINT64_MAX;
  L->device = c->delivery == PM_DELIVER_DEVICE;
  L->pinned = c->pin_memory != 0;

  st = pm__sampler_init(&L->sampler, dataset->info.samples, c->batch_size, c->shuffle != 0, c->seed,
                        c->drop_last != 0, rank, world);
  if (st != PM_OK) {
    pm__wrap_error(st, "%s", fn);
    goto fail;
  }
  if (c->resume && (st = check_resume(L, c->resume)) != PM_OK) goto fail;

  L->sample_bytes = dataset->info.sample_bytes;
  L->target_bytes = dataset->info.target_bytes;
  uint64_t rows_max = PM__MIN((uint64_t)c->batch_size, L->sampler.per_rank);
  size_t need;
  if (rows_max > (SIZE_MAX / 4) / L->sample_bytes ||
      (L->target_bytes && rows_max > (SIZE_MAX / 4) / L->target_bytes)) {
    st = pm__set_error(PM_ERR_INVALID, "%s: a batch of %llu samples of %zu bytes overflows", fn,
                       (unsigned long long)rows_max, L->sample_bytes);
    goto fail;
  }
  L->targets_off = pm__align_up((size_t)rows_max * L->sample_bytes, TARGET_ALIGN);
  need = L->target_bytes ? L->targets_off + (size_t)rows_max * L->target_bytes
                         : (size_t)rows_max * L->sample_bytes;
  if (c->slot_bytes && need > c->slot_bytes) {
    st = pm__set_error(PM_ERR_INVALID,
                       "%s: a batch of %llu samples of %zu bytes%s needs %zu bytes, more than "
                       "slot_bytes %zu",
                       fn, (unsigned long long)rows_max, L->sample_bytes,
                       L->target_bytes ? " (and their targets)" : "", need, c->slot_bytes);
    goto fail;
  }
  L->slot_bytes = c->slot_bytes ? c->slot_bytes : need;

  L->nworkers = c->workers ? c->workers : (int)pm__opt_int(PM__OPT_LOADER_WORKERS);
  if (L->nworkers <= 0) L->nworkers = PM__MIN(16, pm__cpu_count());
  if (L->nworkers <= 0) L->nworkers = 1;
  if (L->nworkers > MAX_WORKERS) L->nworkers = MAX_WORKERS;
  L->nslots = c->prefetch ? c->prefetch : (int)pm__opt_int(PM__OPT_LOADER_PREFETCH);
  if (L->nslots <= 0) L->nslots = 4;
  if (L->nslots > MAX_SLOTS) L->nslots = MAX_SLOTS;
  L->rows_per_claim = PM__MAX(rows_max / (uint64_t)(2 * L->nworkers), (uint64_t)1);

  uint64_t bpe = L->sampler.batches;
  L->end_g = c->epochs == 0 || c->epochs > UINT64_MAX / bpe ? UINT64_MAX : c->epochs * bpe;
  if (c->resume) L->fill_g = L->deliver_g = c->resume->epoch * bpe + c->resume->batch;
  if (L->deliver_g > L->end_g) L->fill_g = L->deliver_g = L->end_g;

  if (L->device) {
    st = pm_device_get(&L->device_index);
    if (st == PM_OK) st = pm_stream_create(&L->copy_stream);
    if (st != PM_OK) {
      pm__wrap_error(st, "%s: copy stream", fn);
      goto fail;
    }
  }
  L->slots = calloc((size_t)L->nslots, sizeof *L->slots);
  if (!L->slots) {
    st = pm__set_error(PM_ERR_NOMEM, "%s: %d slots", fn, L->nslots);
    goto fail;
  }
  for (int i = 0; i < L->nslots; i++) {
    slot_t *s = &L->slots[i];
    s->state = SLOT_FREE;
    s->indices = malloc(sizeof(uint64_t) * (size_t)rows_max);
    if (!s->indices) {
      st = pm__set_error(PM_ERR_NOMEM, "%s: row indices", fn);
      goto fail;
    }
    if (L->pinned) {
      st = pm_host_alloc(c->pool, L->slot_bytes, PM_HOST_DEFAULT, (void **)&s->host);
      if (st != PM_OK) {
        pm__wrap_error(st,
                       "%s: pinned slot %d of %d (%zu bytes each; lower prefetch or "
                       "batch_size, or raise the budget)",
                       fn, i + 1, L->nslots, L->slot_bytes);
        goto fail;
      }
    } else {
      void *p = NULL;
      if (posix_memalign(&p, 4096, L->slot_bytes) != 0) {
        st = pm__set_error(PM_ERR_NOMEM, "%s: pageable slot of %zu bytes", fn, L->slot_bytes);
        goto fail;
      }
      s->host = p;
    }
    if (L->device) {
      st = pm_device_alloc(L->slot_bytes, (void **)&s->dev);
      if (st == PM_OK) st = pm_event_create(PM_EVENT_TIMING, &s->ev_start);
      if (st == PM_OK) st = pm_event_create(PM_EVENT_TIMING, &s->ev_done);
      if (st == PM_OK) st = pm_event_create(PM_EVENT_DEFAULT, &s->ev_release);
      if (st != PM_OK) {
        pm__wrap_error(st, "%s: device buffer %d of %d (%zu bytes each)", fn, i + 1, L->nslots,
                       L->slot_bytes);
        goto fail;
      }
    }
  }
  L->st.batches_per_epoch = bpe;
  L->st.samples_per_epoch = L->sampler.per_rank;
  L->st.workers = L->nworkers;
  L->st.prefetch = L->nslots;
  L->st.slot_bytes = L->slot_bytes;
  L->st.device_bytes = L->device ? (size_t)L->nslots * L->slot_bytes : 0;
  L->st.host_bytes = (size_t)L->nslots * L->slot_bytes;

  L->threads = calloc((size_t)L->nworkers, sizeof *L->threads);
  if (!L->threads) {
    st = pm__set_error(PM_ERR_NOMEM, "%s: thread table", fn);
    goto fail;
  }
  for (int i = 0; i < L->nworkers; i++) {
    /* Workers take none of the process's signals (the program's main thread may rely on them). */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&L->threads[i], NULL, worker_main, L);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
      st = pm__set_error(PM_ERR_NOMEM, "%s: pthread_create (worker %d of %d): %s", fn, i + 1,
                         L->nworkers, strerror(rc));
      goto fail;
    }
    L->started++;
  }
  st = pm__handle_add(L, PM__HANDLE_LOADER); /* so that a forked child can tell it is foreign */
  if (st != PM_OK) goto fail;
  atomic_fetch_add(&dataset->users, 1);
  *loader_out = L;
  return PM_OK;

fail : {
  /* Keep the detail of the failure through the teardown's own calls. */
  char keep[1024];
  snprintf(keep, sizeof keep, "%s", pm_last_error());
  loader_free(L);
  return pm__set_error(st, "%s", keep);
}
}

pm_status_t pm_loader_destroy(pm_loader_t *loader) {
  if (pm__handle_foreign(loader, PM__HANDLE_LOADER)) {
    /* The parent's loader, in a forked child: its workers do not exist here (joining them would
     * wait for ever) and its slots are not pinned. It is forgotten; its memory is left alone. */
    (void)pm__handle_remove(loader, PM__HANDLE_LOADER);
    return PM_OK;
  }
  if (!loader) return pm__set_error(PM_ERR_INVALID, "pm_loader_destroy: loader is NULL");
  if (loader->magic != LOADER_MAGIC)
    return pm__set_error(PM_ERR_INVALID, "pm_loader_destroy: %p is not a live loader",
                         (void *)loader);
  pm_status_t st = pm__handle_check(loader, PM__HANDLE_LOADER, "pm_loader_destroy");
  if (st != PM_OK) return st;
  pm_dataset_t *ds = loader->ds;
  loader_free(loader);
  atomic_fetch_sub(&ds->users, 1);
  return PM_OK;
}

/* ---- the consumer side -------------------------------------------------------------------- */

static pm_status_t check_loader(const char *fn, const pm_loader_t *L) {
  if (!L) return pm__set_error(PM_ERR_INVALID, "%s: loader is NULL", fn);
  if (L->magic != LOADER_MAGIC)
    return pm__set_error(PM_ERR_INVALID, "%s: %p is not a live loader", fn, (const void *)L);
  return pm__handle_check(L, PM__HANDLE_LOADER, fn); /* PM_ERR_STATE for the parent's, after fork */
}

/* The plain copy of a pageable slot, on the consumer's thread (pin_memory 0). */
static pm_status_t pageable_copy(pm_loader_t *L, slot_t *s) {
  return queue_copy(L, s, "plain copy of a pageable batch");
}

pm_status_t pm_loader_next(pm_loader_t *loader, pm_batch_t *batch_out) {
  const char *fn = "pm_loader_next";
  pm_status_t st = check_loader(fn, loader);
  if (st != PM_OK) return st;
  if (!batch_out) return pm__set_error(PM_ERR_INVALID, "%s: batch_out is NULL", fn);
  pm_loader_t *L = loader;
  double t0 = pm__now();

  pthread_mutex_lock(&L->mu);
  if (L->in_next) {
    pthread_mutex_unlock(&L->mu);
    return pm__set_error(PM_ERR_BUSY, "%s: another thread is inside pm_loader_next", fn);
  }
  uint64_t g = L->deliver_g;
  if (g >= L->end_g && g < L->err_g) {
    pthread_mutex_unlock(&L->mu);
    return pm__set_error(PM_ERR_STATE,
                         "%s: end of data: all %llu epochs (%llu batches each) "
                         "were delivered",
                         fn, (unsigned long long)L->cfg.epochs,
                         (unsigned long long)L->sampler.batches);
  }
  slot_t *s = &L->slots[g % (uint64_t)L->nslots];
  bool waited = false;
  double tw = 0;
  for (;;) {
    if (L->err_g <= g) {
      char msg[sizeof L->err_msg];
      st = L->err;
      memcpy(msg, L->err_msg, sizeof msg);
      pthread_mutex_unlock(&L->mu);
      return pm__set_error(st, "%s: %s", fn, msg);
    }
    if (s->state == SLOT_READY && s->seq == g) break;
    if (s->state == SLOT_HELD && s->seq < g) {
      /* Batch g reuses the slot of a batch the caller still holds: waiting would never end. */
      uint64_t old = s->seq;
      pthread_mutex_unlock(&L->mu);
      return pm__set_error(PM_ERR_BUSY,
                           "%s: the next batch needs the slot of batch %llu of epoch %llu, which "
                           "the caller still holds (%d slots: release batches in time, or raise "
                           "prefetch)",
                           fn, (unsigned long long)(old % L->sampler.batches),
                           (unsigned long long)(old / L->sampler.batches), L->nslots);
    }
    if (!waited) tw = pm__now();
    waited = true;
    pthread_cond_wait(&L->ready_cv, &L->mu);
  }
  double stall = waited ? pm__now() - tw : 0;
  s->state = SLOT_HELD;
  L->held++;
  L->deliver_g = g + 1;
  L->in_next = true;
  pthread_mutex_unlock(&L->mu);

  if (L->device && !L->pinned) {
    double tc = pm__now();
    st = pageable_copy(L, s);
    stall += pm__now() - tc;
    if (st != PM_OK) {
      char msg[sizeof L->err_msg];
      snprintf(msg, sizeof msg, "%s", pm_last_error());
      pthread_mutex_lock(&L->mu);
      /* Not delivered: the position stays at this batch, which now reports the error. */
      s->state = SLOT_READY;
      L->held--;
      L->deliver_g = g;
      L->in_next = false;
      set_error_locked(L, g, st, msg);
      pthread_mutex_unlock(&L->mu);
      return pm__set_error(st, "%s: %s", fn, msg);
    }
  }

  const pm_dataset_info_t *in = &L->ds->info;
  pm_batch_t b;
  memset(&b, 0, sizeof b);
  b.host_inputs = s->host;
  b.host_targets = L->target_bytes ? s->host + L->targets_off : NULL;
  b.inputs = L->device ? (void *)s->dev : b.host_inputs;
  b.targets = !L->target_bytes ? NULL
              : L->device      ? (void *)(s->dev + L->targets_off)
                               : b.host_targets;
  b.samples = (size_t)s->rows;
  b.inputs_bytes = b.samples * L->sample_bytes;
  b.targets_bytes = b.samples * L->target_bytes;
  b.ndim = in->ndim + 1;
  b.shape[0] = s->rows;
  memcpy(b.shape + 1, in->shape, sizeof(uint64_t) * (size_t)in->ndim);
  b.dtype = in->dtype;
  b.itemsize = in->itemsize;
  b.epoch = g / L->sampler.batches;
  b.index = g % L->sampler.batches;
  b.indices = s->indices;
  b.event = L->device ? s->ev_done : NULL;
  b.internal.loader = L;
  b.internal.seq = g;
  b.internal.slot = (int)(g % (uint64_t)L->nslots);
  *batch_out = b;

  pthread_mutex_lock(&L->mu);
  L->in_next = false;
  L->st.batches++;
  L->st.samples += s->rows;
  L->st.bytes += b.inputs_bytes + b.targets_bytes;
  L->st.waits += waited;
  L->st.stall_seconds += stall;
  L->st.next_seconds += pm__now() - t0;
  pthread_mutex_unlock(&L->mu);
  return PM_OK;
}

/* The slot of a delivered batch, or an error. */
static pm_status_t batch_slot(const char *fn, const pm_batch_t *b, slot_t **s_out) {
  if (!b) return pm__set_error(PM_ERR_INVALID, "%s: batch is NULL", fn);
  pm_loader_t *L = b->internal.loader;
  if (!L)
    return pm__set_error(PM_ERR_INVALID,
                         "%s: the batch was released already (or never "
                         "delivered)",
                         fn);
  pm_status_t st = check_loader(fn, L);
  if (st != PM_OK) return st;
  if (b->internal.slot < 0 || b->internal.slot >= L->nslots)
    return pm__set_error(PM_ERR_INVALID, "%s: the batch is corrupt (slot %d)", fn,
                         b->internal.slot);
  *s_out = &L->slots[b->internal.slot];
  return PM_OK;
}

pm_status_t pm_batch_wait_stream(const pm_batch_t *batch, pm_stream_t stream) {
  const char *fn = "pm_batch_wait_stream";
  slot_t *s = NULL;
  pm_status_t st = batch_slot(fn, batch, &s);
  if (st != PM_OK) return st;
  if (!batch->event) return PM_OK; /* host delivery: the data is in place already */
  st = pm_stream_wait_event(stream, batch->event);
  if (st != PM_OK) return pm__wrap_error(st, "%s", fn);
  return PM_OK;
}

pm_status_t pm_batch_release(pm_batch_t *batch, pm_stream_t stream) {
  const char *fn = "pm_batch_release";
  slot_t *s = NULL;
  pm_status_t st = batch_slot(fn, batch, &s);
  if (st != PM_OK) return st;
  pm_loader_t *L = batch->internal.loader;

  pthread_mutex_lock(&L->mu);
  if (s->state != SLOT_HELD || s->seq != batch->internal.seq) {
    pthread_mutex_unlock(&L->mu);
    return pm__set_error(PM_ERR_INVALID,
                         "%s: batch %llu of epoch %llu is not held (released "
                         "already?)",
                         fn, (unsigned long long)batch->index, (unsigned long long)batch->epoch);
  }
  s->state = SLOT_RELEASING;
  pthread_mutex_unlock(&L->mu);

  double copy_t = 0;
  if (L->device) {
    st = pm_event_record(s->ev_release, stream);
    if (st != PM_OK) {
      pthread_mutex_lock(&L->mu);
      s->state = SLOT_HELD; /* still the caller's: it may retry or destroy the loader */
      pthread_mutex_unlock(&L->mu);
      return pm__wrap_error(st, "%s: recording the release on the consumer's stream", fn);
    }
    s->release_pending = true;
    if (s->copy_pending && pm_event_query(s->ev_done) == PM_OK) {
      add_copy_time(L, s, &copy_t);
      s->copy_pending = false;
    }
  }
  pthread_mutex_lock(&L->mu);
  s->state = SLOT_FREE;
  L->held--;
  L->st.copy_seconds += copy_t;
  pthread_cond_broadcast(&L->work_cv);
  pthread_mutex_unlock(&L->mu);
  memset(batch, 0, sizeof *batch);
  return PM_OK;
}

pm_status_t pm_loader_state(pm_loader_t *loader, pm_loader_state_t *state_out) {
  pm_status_t st = check_loader("pm_loader_state", loader);
  if (st != PM_OK) return st;
  if (!state_out) return pm__set_error(PM_ERR_INVALID, "pm_loader_state: state_out is NULL");
  const pm__sampler_t *s = &loader->sampler;
  pm_loader_state_t r;
  memset(&r, 0, sizeof r);
  pthread_mutex_lock(&loader->mu);
  uint64_t g = loader->deliver_g;
  pthread_mutex_unlock(&loader->mu);
  r.magic = PM_LOADER_STATE_MAGIC;
  r.flags = (s->shuffle ? 1u : 0u) | (s->drop_last ? 2u : 0u);
  r.epoch = g / s->batches;
  r.batch = g % s->batches;
  r.seed = s->seed;
  r.samples = s->n;
  r.batch_size = s->batch;
  r.rank = s->rank;
  r.world_size = s->world;
  *state_out = r;
  return PM_OK;
}

pm_status_t pm_loader_get_stats(pm_loader_t *loader, pm_loader_stats_t *stats_out) {
  pm_status_t st = check_loader("pm_loader_get_stats", loader);
  if (st != PM_OK) return st;
  if (!stats_out) return pm__set_error(PM_ERR_INVALID, "pm_loader_get_stats: stats_out is NULL");
  pthread_mutex_lock(&loader->mu);
  *stats_out = loader->st;
  pthread_mutex_unlock(&loader->mu);
  return PM_OK;
}
