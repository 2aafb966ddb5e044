/*
 * DESIGN: the loader's workers (loader.c's DESIGN comment describes the whole loader: slots,
 * parts, claims, the slot life, the invariants and the lock order). A worker thread opens the
 * FREE slot of the next batch (waits for its previous copy, writes the row indices), claims runs
 * of rows of the filling slot (in turn with ordered_workers, each worker waiting on its own
 * condition variable), reads them into the slot, grows the slot's prefix of written rows, and
 * queues every part of the device copy whose rows are all written, in order, one submitter at a
 * time. The lowest of the loader's files, so it also holds what the others call: the part
 * arithmetic, queueing a run of parts, the first-error record and the wake-up of the workers.
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "loader_internal.h"

/* ---- helpers ------------------------------------------------------------------------------- */

size_t pm__loader_copy_bytes(const pm_loader_t *L, uint64_t rows) {
  int last = L->nfields - 1;
  return L->foff[last] + (size_t)rows * L->fbytes[last];
}

/* Wake every worker: those waiting for work and, with ordered claims, those waiting for their
 * turn (a stop or an error concerns them all). */
void pm__loader_wake_workers_locked(pm_loader_t *L) {
  pthread_cond_broadcast(&L->work_cv);
  if (L->turn_cv)
    for (int i = 0; i < L->nworkers; i++) pthread_cond_broadcast(&L->turn_cv[i]);
}

/* Record the first error by batch order (with mu held); `sample` is the dataset index whose read
 * failed, PM__NO_SAMPLE when the error is not one sample's. */
void pm__loader_set_error_locked(pm_loader_t *L, uint64_t g, pm_status_t st, const char *msg,
                                 uint64_t sample) {
  if (g < L->err_g) {
    L->err_g = g;
    L->err = st;
    L->err_sample = sample;
    snprintf(L->err_msg, sizeof L->err_msg, "%s", msg && msg[0] ? msg : pm_strerror(st));
  }
  pthread_cond_broadcast(&L->ready_cv);
  pm__loader_wake_workers_locked(L);
}

/* The device time of a slot's copy: its runs of parts, without the waits between them. */
void pm__loader_add_copy_time(pm_loader_t *L, slot_t *s, double *acc) {
  (void)L;
  for (uint32_t i = 0; i < s->nruns; i++) {
    double sec;
    if (pm_event_elapsed(s->ev_copy[2 * i], s->ev_copy[2 * i + 1], &sec) == PM_OK && sec > 0)
      *acc += sec;
  }
}

/* Parts of the copy of a batch of `rows` rows. */
uint32_t pm__loader_part_count(const pm_loader_t *L, uint64_t rows) {
  size_t total = pm__loader_copy_bytes(L, rows);
  if (!L->piece || total <= L->piece) return 1;
  return (uint32_t)((total + L->piece - 1) / L->piece);
}

/* Rows that must be written before part p of a batch of `rows` rows can be copied: one more
 * than the last row of any field with a byte in the part (0 for a part of padding alone). */
static uint64_t part_need(const pm_loader_t *L, uint64_t rows, uint32_t nparts, uint32_t p) {
  if (nparts == 1) return rows;
  size_t a = (size_t)p * L->piece, b = PM__MIN(a + L->piece, pm__loader_copy_bytes(L, rows));
  uint64_t need = 0;
  for (int k = 0; k < L->nfields; k++) {
    size_t lo = L->foff[k], hi = lo + (size_t)rows * L->fbytes[k];
    if (b <= lo || a >= hi) continue;
    uint64_t last = (uint64_t)((PM__MIN(b, hi) - 1 - lo) / L->fbytes[k]);
    need = PM__MAX(need, last + 1);
  }
  return need;
}

/* Everything the worker does to start a slot for batch g outside the lock. */
static pm_status_t open_slot(pm_loader_t *L, slot_t *s, uint64_t g, bool sync, double *copy_t) {
  if (sync) {
    /* The previous batch's copy may still read the host buffer we are about to overwrite. */
    pm_status_t st = pm_event_synchronize(s->ev_done);
    if (st != PM_OK) return pm__wrap_error(st, "waiting for the copy of an earlier batch");
    pm__loader_add_copy_time(L, s, copy_t);
  }
  uint64_t bpe = L->sampler.batches;
  uint64_t epoch = g / bpe, first = (g % bpe) * L->sampler.batch;
  for (uint64_t r = 0; r < s->rows; r++)
    s->indices[r] = pm__sampler_index(&L->sampler, epoch, first + r);
  return PM_OK;
}

/* Queue parts p0..p1-1 of a slot's host -> device copy on the copy stream as one run between two
 * timing events: the first part behind the consumer's release of the slot's device buffer, and
 * the "copy done" event after the last part. Only the party that owns the slot's submission
 * calls this (the `submitting` worker, or the consumer for a pageable slot). */
pm_status_t pm__loader_queue_parts(pm_loader_t *L, slot_t *s, uint32_t p0, uint32_t p1,
                                   const char *what) {
  size_t total = pm__loader_copy_bytes(L, s->rows);
  pm_status_t st = PM_OK;
  pthread_mutex_lock(&L->submit_mu);
  if (p0 == 0) {
    s->nruns = 0;
    if (s->release_pending) {
      st = pm_stream_wait_event(L->copy_stream, s->ev_release);
      if (st == PM_OK) s->release_pending = false;
    }
  }
  pm_event_t end = s->ev_copy[2 * s->nruns + 1];
  if (st == PM_OK) st = pm_event_record(s->ev_copy[2 * s->nruns], L->copy_stream);
  uint32_t failed = 0; /* the part whose copy failed, 1-based */
  for (uint32_t p = p0; p < p1 && st == PM_OK; p++) {
    size_t a = s->nparts == 1 ? 0 : (size_t)p * L->piece;
    size_t n = s->nparts == 1 ? total : PM__MIN(L->piece, total - a);
    st = pm_memcpy_async(s->dev + a, s->host + a, n, PM_COPY_H2D, L->copy_stream);
    if (st != PM_OK) failed = p + 1;
  }
  if (st == PM_OK) st = pm_event_record(end, L->copy_stream);
  if (st == PM_OK) {
    s->nruns++;
    if (p1 == s->nparts) {
      s->ev_done = end;
      s->copy_pending = true;
    }
  }
  pthread_mutex_unlock(&L->submit_mu);
  if (st != PM_OK) {
    if (s->nparts == 1) return pm__wrap_error(st, "%s", what);
    if (failed)
      return pm__wrap_error(st, "%s (part %u of %u)", what, (unsigned)failed, (unsigned)s->nparts);
    return pm__wrap_error(st, "%s (parts %u..%u of %u)", what, (unsigned)p0 + 1, (unsigned)p1,
                          (unsigned)s->nparts);
  }
  return PM_OK;
}

/* With mu held (released around the backend calls, held again on return): queue every part
 * that is ready, in batch order and, within a batch, in part order, one worker at a time. A
 * batch whose last part is queued becomes READY. */
static void submit_ready_locked(pm_loader_t *L) {
  char msg[512];
  while (!L->submitting && !L->stop) {
    uint64_t g = L->sub_g;
    if (g >= L->err_g || g >= L->end_g) return;
    slot_t *s = &L->slots[g % (uint64_t)L->nslots];
    if (s->state != SLOT_FILLING || s->seq != g || s->failed) return;
    uint32_t p0 = s->parts_queued, p1 = p0;
    while (p1 < s->nparts && part_need(L, s->rows, s->nparts, p1) <= s->rows_ready) p1++;
    if (p1 == p0) return;
    L->submitting = true;
    pthread_mutex_unlock(&L->mu);
    pm_status_t st = pm__loader_queue_parts(L, s, p0, p1, "device copy of a batch");
    if (st != PM_OK) snprintf(msg, sizeof msg, "%s", pm_last_error());
    pthread_mutex_lock(&L->mu);
    L->submitting = false;
    if (st != PM_OK) {
      s->failed = true;
      pm__loader_set_error_locked(L, g, st, msg, PM__NO_SAMPLE);
      return;
    }
    s->parts_queued = p1;
    if (p1 == s->nparts) {
      s->state = SLOT_READY;
      L->sub_g = g + 1;
      pthread_cond_broadcast(&L->ready_cv);
    }
  }
}

/* ---- workers ------------------------------------------------------------------------------ */

void *pm__loader_worker_main(void *arg) {
  pm_loader_t *L = ((worker_arg_t *)arg)->L;
  const int me = ((worker_arg_t *)arg)->index;
  pm_dataset_t *ds = L->ds;
  pm__scratch_t scratch = {NULL, 0};
  char msg[512];
  /* Events and copies need the loader's device (a new thread starts on device 0). */
  pm__thread_enter(L->device ? L->device_index : -1);
  pm__dataset_worker_set(me); /* for a rows dataset read one sample at a time (in a zip) */

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
      s->claimed = s->done = s->rows_ready = 0;
      s->nparts = pm__loader_part_count(L, s->rows);
      s->parts_queued = 0;
      memset(s->chunk_done, 0, (size_t)((s->rows + L->rows_per_claim - 1) / L->rows_per_claim));
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
        pm__loader_set_error_locked(L, g, st, msg, PM__NO_SAMPLE);
      }
      pthread_cond_broadcast(&L->work_cv);
      continue;
    }
    if (s->state != SLOT_FILLING || s->seq != g) {
      /* Being opened by another worker, or still holding batch g - nslots. */
      pthread_cond_wait(&L->work_cv, &L->mu);
      continue;
    }
    if (L->ordered && L->claims % (uint64_t)L->nworkers != (uint64_t)me) {
      /* Another worker's turn: the claim before ours signals our own condition variable (a
       * stop or an error wakes everyone). One variable per worker: a broadcast per claim would
       * wake every worker for each claim, which costs more than the claims themselves at tens
       * of thousands of rows a second. */
      pthread_cond_wait(&L->turn_cv[me], &L->mu);
      continue;
    }

    uint64_t r0 = s->claimed, r1 = PM__MIN(s->rows, r0 + L->rows_per_claim);
    s->claimed = r1;
    L->claims++;
    if (r1 == s->rows) L->fill_g = g + 1;
    if (r1 == s->rows) pthread_cond_broadcast(&L->work_cv);
    if (L->ordered) pthread_cond_signal(&L->turn_cv[L->claims % (uint64_t)L->nworkers]);
    pthread_mutex_unlock(&L->mu);

    uint64_t epoch = g / L->sampler.batches;
    pm_status_t st = PM_OK;
    void *dsts[PM_MAX_FIELDS];
    double t0 = pm__now();
    uint64_t r = r0;
    uint64_t bad = PM__NO_SAMPLE; /* the sample whose read failed, when one is known */
    if (L->rows_reads) {
      /* The claim's rows are consecutive in the slot: one call writes them all. */
      if (!atomic_load_explicit(&L->stop_flag, memory_order_relaxed)) {
        for (int k = 0; k < L->nfields; k++)
          dsts[k] = s->host + L->foff[k] + (size_t)r0 * L->fbytes[k];
        pm__dataset_claim_set(g, r0);
        st = pm__dataset_read_rows(ds, epoch, r1 - r0, s->indices + r0, dsts, me);
        if (st == PM_OK) {
          r = r1;
        } else {
          /* One call read the whole claim: the failing row is known only if it was alone. */
          if (r1 - r0 == 1) bad = s->indices[r0];
          snprintf(msg, sizeof msg, "epoch %llu, batch %llu, row %llu (a claim of %llu rows): %s",
                   (unsigned long long)epoch, (unsigned long long)(g % L->sampler.batches),
                   (unsigned long long)r0, (unsigned long long)(r1 - r0), pm_last_error());
        }
      }
    } else {
      for (; r < r1 && st == PM_OK; r++) {
        if (atomic_load_explicit(&L->stop_flag, memory_order_relaxed)) break;
        for (int k = 0; k < L->nfields; k++)
          dsts[k] = s->host + L->foff[k] + (size_t)r * L->fbytes[k];
        pm__dataset_claim_set(g, r);
        st = pm__dataset_read_fields(ds, epoch, s->indices[r], dsts, &scratch);
        if (st != PM_OK) {
          bad = s->indices[r];
          snprintf(msg, sizeof msg, "epoch %llu, batch %llu, row %llu: %s",
                   (unsigned long long)epoch, (unsigned long long)(g % L->sampler.batches),
                   (unsigned long long)r, pm_last_error());
        }
      }
    }
    double t1 = pm__now();

    pthread_mutex_lock(&L->mu);
    L->st.read_seconds += t1 - t0;
    s->done += r1 - r0;
    if (st != PM_OK) {
      s->failed = true;
      pm__loader_set_error_locked(L, g, st, msg, bad);
    } else if (r == r1) {
      /* Every row of the claim is written (not cut short by a stop): the ready prefix grows. */
      s->chunk_done[r0 / L->rows_per_claim] = 1;
      while (s->rows_ready < s->rows && s->chunk_done[s->rows_ready / L->rows_per_claim])
        s->rows_ready = PM__MIN(s->rows_ready + L->rows_per_claim, s->rows);
    }
    if (L->device && L->pinned) {
      submit_ready_locked(L);
    } else if (s->done == s->rows && !s->failed && !L->stop) {
      s->state = SLOT_READY;
      pthread_cond_broadcast(&L->ready_cv);
    }
  }
  pthread_mutex_unlock(&L->mu);
  pm__scratch_free(&scratch);
  return NULL;
}
