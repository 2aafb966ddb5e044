/*
 * DESIGN: the data loader: worker threads read samples straight into pinned batch slots, each
 * slot goes to a device buffer on the loader's own stream in parts as it fills, and the consumer
 * takes the batches in order with pm_loader_next.
 *
 * Data structure: a ring of `nslots` slots (the prefetch depth). Global batch number g (epoch *
 * batches_per_epoch + index) lives in slot g % nslots. A slot holds a host buffer (pinned from
 * the pool, or malloc'd with pin_memory 0), a device buffer of the same size, the dataset index
 * of each row, timing events around the runs of its copy on the copy stream (two per run of
 * parts, so at most two per part: the copy's device time without the waits between runs), the
 * "copy done" event (ev_done: the end event of the slot's last run) and "release", recorded on
 * the consumer's stream when the batch is given back. Layout of a buffer: the fields of the dataset
 * one after another, field k at foff[k] (256-aligned) holding rows_max rows of fbytes[k] bytes; all
 * fields go behind one event. A slot also holds its pm_batch_field_t table, filled at create;
 * delivery only sets the row count.
 *
 * Parts (option loader_piece, default 4 MiB; 0 = one copy of the whole slot): the copied bytes of
 * a slot, [0, foff[last] + rows * fbytes[last]), are cut into byte ranges of `piece` bytes, and
 * each part is queued on the copy stream as soon as every row it touches is written, so the DMA
 * reads a part moments after the workers wrote it, from the CPU cache rather than DRAM (a 38 MB
 * slot filled whole is long out of the cache when its one copy starts). A part needs the rows
 * r with some byte of row r of some field inside its range (part_need: the largest such r + 1);
 * workers claim rows in order and a slot's "rows ready" (rows_ready) is the prefix of rows that
 * are all written, so part p can go once rows_ready >= part_need(p). The parts of field 0 go
 * early; a later field's region needs rows from 0 again, so small later fields (labels) go with
 * the last part, and a large later field goes once field 0 is complete: the simplest rule that
 * is always right, and best for the common case of one large field first. The default: a 4 MiB
 * DMA is long (76 us at 55 GB/s) against the few us a queued copy costs, and the bytes in flight
 * (16 workers x a claim of 8 rows x 150 KB, plus a part or two queued) stay within the cache.
 * Parts go to the stream in batch order and, within a batch, in part order, by one worker at a
 * time (`submitting`): the worker that finds the next part ready queues every consecutive ready
 * part from there, then looks again, so a worker that completes part p + 1 before p never queues
 * it first, and nothing is left unqueued (every completion calls submit_ready_locked, and the
 * submitter looks again after each run). The copy stream waits for the slot's release event
 * before the slot's first part; ev_done is recorded after its last part.
 *
 * Claims: a worker takes rows_per_claim consecutive rows of the filling slot at a time (automatic:
 * a batch over 2 x workers, within a part's rows; or cfg.claim_rows, capped at a batch). A
 * dataset that reads runs of rows (a rows dataset, or a select over one) gets one read_rows call
 * per claim, with the claim's first row of each field and the worker's index (0..workers-1,
 * given to each thread at its start), so a process worker behind it gets one message per claim;
 * other datasets are read row by row. With ordered_workers, claim k (counted under mu from the
 * loader's start) goes to worker k % workers: a worker whose turn it is not waits on its own
 * turn_cv, each claim signals the one of the worker next in turn (a broadcast per claim would
 * wake every worker for each claim), and stop and errors wake them all, so no one waits past
 * them. Opening a FREE slot is not a claim: any worker may do it, so the next in turn never
 * waits for a slot only a busy worker could open. Why: the rows a worker reads are then a
 * function of the configuration alone (the sampler's order and the claim size are), so workers
 * with random state of their own (augmentation seeded by worker id) give the same batches on
 * every run. The price: a slow worker holds up the claims after its turn, as a round-robin of
 * torch's does.
 *
 * Slot life: FREE -> OPENING (one worker waits for the slot's previous copy to finish and
 * writes the row indices) -> FILLING (workers claim chunks of rows in order and read each
 * sample into its place; the parts of the device copy are queued as their rows are written,
 * the first after the copy stream waits for the slot's release event, so the device buffer is
 * not overwritten while the consumer's stream may still read it) -> READY once the last part is
 * queued -> HELD (delivered) -> RELEASING -> FREE. With pin_memory 0 the copy is one plain
 * pageable copy done inside pm_loader_next on the consumer's thread (it blocks as
 * cudaMemcpyAsync from pageable memory does), which is what DataLoader(pin_memory=False) +
 * .to(device) costs. Host delivery has no device buffers, events or stream.
 *
 * Destroy with batches held (as torch's DataLoader shuts down with tensors alive): destroy stops
 * the workers, frees every slot not held and marks the loader destroyed; each held slot is freed
 * by its pm_batch_release (SLOT_GONE), and the party that sees held == 0 after the teardown frees
 * the loader itself. The loader stays in the handle set until then, so a release (or a misuse
 * with a stale pointer) finds it; every pm_loader_* call checks `destroyed` and refuses.
 *
 * Invariants: fill_g (the batch whose rows are being claimed) only moves forward, so every batch
 * below it has all its rows claimed; a slot is opened for batch g only when it is FREE, i.e. batch
 * g - nslots was released; deliver_g <= sub_g <= fill_g (sub_g: the batch whose parts are
 * queued next); a batch is READY only once its last part is queued, and the last part needs
 * every row, so a delivered batch is never short. An error at batch e (a read, an event, a copy)
 * sets err_g = min(err_g, e): workers stop claiming, the batches before e are still delivered
 * (their rows were all claimed before e's), and pm_loader_next returns the error from batch e on,
 * every time (pm_loader_state then points at e, so a resumed job retries it).
 *
 * Threads: workers are the loader's own threads (a long-running pipeline, not a fork-join job for
 * pm__parallel_for). Lock order: mu, then nothing; submit_mu (around each run of backend calls on
 * the copy stream) is taken without mu and holds only backend calls. Only the party that set
 * `submitting` (under mu) queues a slot's parts, and its run of backend calls goes outside mu.
 * No dataset read, user callback or backend call runs under mu. A slot's buffers and events are
 * touched only by the one party its state gives them to (the opener, the submitter while it
 * holds `submitting`, the consumer while HELD/RELEASING); state changes happen under mu, which
 * orders those phases.
 *
 * Files: loader.c (this one) creates and destroys the loader (configuration, resume checks,
 * slots, threads, the teardown with batches held); loader_fill.c is the workers' side (opening
 * slots, claims, reads, and queueing the parts of each slot's copy, with the part arithmetic and
 * the error record the other files use); loader_deliver.c is the consumer's (pm_loader_next,
 * batch wait and release, state and stats). loader_internal.h holds the types and the calls
 * between them. Calls go one way: loader_deliver.c -> loader.c -> loader_fill.c, and
 * loader_deliver.c -> loader_fill.c.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "loader_internal.h"

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

/* The rank and world size of config c, RANK / WORLD_SIZE read where it says -1 (before any
 * dataset is looked at, so that pm_loader_plan and pm_loader_create refuse alike). */
static pm_status_t resolve_ranks(const pm_loader_config_t *c, const char *fn, int *rank_out,
                                 int *world_out) {
  int rank = c->rank, world = c->world_size;
  pm_status_t st = PM_OK;
  if (rank < -1 || world < -1)
    return pm__set_error(PM_ERR_INVALID,
                         "%s: %s %d: give a value (rank >= 0, world_size >= 1), or -1 for the "
                         "environment's %s",
                         fn, rank < -1 ? "rank" : "world_size", rank < -1 ? rank : world,
                         rank < -1 ? "RANK" : "WORLD_SIZE");
  if (world <= 0) st = env_int("WORLD_SIZE", 1, 1 << 20, 1, &world);
  if (st == PM_OK && rank < 0) st = env_int("RANK", 0, (1 << 20) - 1, 0, &rank);
  if (st != PM_OK) return st;
  *rank_out = rank;
  *world_out = world;
  return PM_OK;
}

pm_status_t pm_loader_plan(const pm_loader_config_t *config, uint64_t samples,
                           pm_loader_plan_t *out) {
  const char *fn = "pm_loader_plan";
  if (!config || !out)
    return pm__set_error(PM_ERR_INVALID, "%s: %s is NULL", fn, !config ? "config" : "out");
  if (config->batch_size == 0) return pm__set_error(PM_ERR_INVALID, "%s: batch_size is 0", fn);
  int rank, world;
  pm_status_t st = resolve_ranks(config, fn, &rank, &world);
  if (st != PM_OK) return st;
  if (rank >= world) /* the sampler's refusal, in its words */
    return pm__set_error(PM_ERR_INVALID, "%s: sampler: rank %d is not in 0..%d (world size %d)", fn,
                         rank, world - 1, world);
  uint64_t per_rank, batches;
  pm__sampler_count(samples, config->batch_size, config->drop_last != 0, world, &per_rank,
                    &batches);
  *out = (pm_loader_plan_t){rank, world, per_rank, batches};
  return PM_OK;
}

/* A slot's buffers and events (after the consumer's stream is past its release). */
void pm__loader_free_slot(pm_loader_t *L, slot_t *s) {
  if (s->release_pending && s->ev_release) (void)pm_event_synchronize(s->ev_release);
  if (s->copy_pending && s->ev_done) (void)pm_event_synchronize(s->ev_done);
  if (s->dev) (void)pm_device_free(s->dev);
  if (s->ev_copy)
    for (uint32_t i = 0; i < 2 * L->max_parts; i++)
      if (s->ev_copy[i]) (void)pm_event_destroy(s->ev_copy[i]); /* ev_done is one of them */
  if (s->ev_release) (void)pm_event_destroy(s->ev_release);
  if (s->host) {
    if (L->pinned)
      (void)pm_host_free(s->host);
    else
      free(s->host);
  }
  free(s->indices);
  free(s->bf);
  free(s->chunk_done);
  free(s->ev_copy);
  memset(s, 0, sizeof *s);
  s->state = SLOT_GONE;
}

/* A slot's buffers: the host slot (pinned from the pool, or pageable), the device buffer and
 * its events, the row indices and the field table. On failure the slot holds what was made
 * (pm__loader_free_slot frees it). */
pm_status_t pm__loader_alloc_slot(pm_loader_t *L, slot_t *s) {
  const pm_loader_config_t *c = &L->cfg;
  uint64_t rows_max = L->rows_max;
  memset(s, 0, sizeof *s);
  s->state = SLOT_FREE;
  s->indices = malloc(sizeof(uint64_t) * (size_t)rows_max);
  s->bf = calloc((size_t)L->nfields, sizeof *s->bf);
  s->chunk_done = calloc((size_t)((rows_max + L->rows_per_claim - 1) / L->rows_per_claim), 1);
  s->ev_copy = calloc(2 * (size_t)L->max_parts, sizeof *s->ev_copy);
  s->nparts = 1;
  if (!s->indices || !s->bf || !s->chunk_done || !s->ev_copy)
    return pm__set_error(PM_ERR_NOMEM, "row indices");
  pm_status_t st;
  if (L->pinned) {
    st = pm_host_alloc(c->pool, L->slot_bytes, c->shared_slots ? PM_HOST_SHARED : PM_HOST_DEFAULT,
                       (void **)&s->host);
    /* The remedy names sizes only where size is the trouble (a refusal by the driver, a forked
     * child, are not). */
    bool size_trouble = st == PM_ERR_BUDGET || st == PM_ERR_NOMEM || st == PM_ERR_MEMLOCK;
    if (st != PM_OK)
      return pm__wrap_error(
          st, "pinned slot of %zu bytes%s", L->slot_bytes,
          size_trouble ? " (lower prefetch or batch_size, or raise the budget)" : "");
  } else {
    void *p = NULL;
    if (posix_memalign(&p, 4096, L->slot_bytes) != 0)
      return pm__set_error(PM_ERR_NOMEM, "pageable slot of %zu bytes", L->slot_bytes);
    s->host = p;
  }
  if (L->device) {
    st = pm_device_alloc(L->slot_bytes, (void **)&s->dev);
    for (uint32_t e = 0; e < 2 * L->max_parts && st == PM_OK; e++)
      st = pm_event_create(PM_EVENT_TIMING, &s->ev_copy[e]);
    if (st == PM_OK) st = pm_event_create(PM_EVENT_DEFAULT, &s->ev_release);
    if (st != PM_OK) return pm__wrap_error(st, "device buffer of %zu bytes", L->slot_bytes);
  }
  for (int k = 0; k < L->nfields; k++) {
    pm_batch_field_t *f = &s->bf[k];
    const pm_field_t *fi = &L->finfo[k];
    f->host = s->host + L->foff[k];
    f->data = L->device ? (void *)(s->dev + L->foff[k]) : f->host;
    f->bytes_per_sample = L->fbytes[k];
    f->ndim = 1 + fi->ndim;
    memcpy(f->shape + 1, fi->shape, sizeof(uint64_t) * (size_t)fi->ndim);
    f->info = fi;
  }
  return PM_OK;
}

static void free_slots(pm_loader_t *L) {
  if (!L->slots) return;
  for (int i = 0; i < L->nslots; i++) pm__loader_free_slot(L, &L->slots[i]);
  free(L->slots);
  L->slots = NULL;
}

static void stop_workers(pm_loader_t *L) {
  pthread_mutex_lock(&L->mu);
  L->stop = true;
  atomic_store(&L->stop_flag, true);
  pm__loader_wake_workers_locked(L);
  pthread_cond_broadcast(&L->ready_cv);
  pthread_mutex_unlock(&L->mu);
  for (int i = 0; i < L->started; i++) pthread_join(L->threads[i], NULL);
  L->started = 0;
}

/* The last of a loader: what the slots still hold, the stream, the locks, the handle. */
void pm__loader_free(pm_loader_t *L) {
  stop_workers(L);
  if (L->copy_stream) (void)pm_stream_synchronize(L->copy_stream);
  free_slots(L);
  while (L->orphans) { /* (none: each is freed by its release before the last free) */
    orphan_t *o = L->orphans;
    L->orphans = o->next;
    pm__loader_free_slot(L, &o->s);
    free(o);
  }
  if (L->copy_stream) (void)pm_stream_destroy(L->copy_stream);
  free(L->threads);
  free(L->wargs);
  pthread_mutex_destroy(&L->mu);
  pthread_mutex_destroy(&L->submit_mu);
  pthread_cond_destroy(&L->work_cv);
  pthread_cond_destroy(&L->ready_cv);
  if (L->turn_cv) {
    for (int i = 0; i < L->nworkers; i++) pthread_cond_destroy(&L->turn_cv[i]);
    free(L->turn_cv);
  }
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
  pm_status_t hst = pm__handle_check(dataset, PM__HANDLE_DATASET, fn);
  if (hst != PM_OK) return hst;
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
  if (c->shared_slots != 0 && c->shared_slots != 1)
    return pm__set_error(PM_ERR_INVALID, "%s: shared_slots %d is not 0 or 1", fn, c->shared_slots);
  if (c->lease_slots != 0 && c->lease_slots != 1)
    return pm__set_error(PM_ERR_INVALID, "%s: lease_slots %d is not 0 or 1", fn, c->lease_slots);
  /* Flags are 0 or 1, as the others: a 7 is a mistake (a field set from the wrong value), not
   * a yes. */
  const struct {
    const char *name;
    int v;
  } flags[] = {{"shuffle", c->shuffle}, {"drop_last", c->drop_last}, {"pin_memory", c->pin_memory}};
  for (size_t k = 0; k < sizeof flags / sizeof flags[0]; k++)
    if (flags[k].v != 0 && flags[k].v != 1)
      return pm__set_error(PM_ERR_INVALID, "%s: %s %d is not 0 or 1", fn, flags[k].name,
                           flags[k].v);
  if (c->shared_slots && !c->pin_memory)
    return pm__set_error(PM_ERR_INVALID,
                         "%s: shared_slots 1 needs pin_memory 1 (shared slots are pinned "
                         "PM_HOST_SHARED blocks)",
                         fn);
  int rank, world;
  pm_status_t st = resolve_ranks(c, fn, &rank, &world);
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
  L->err_sample = PM__NO_SAMPLE;
  L->device = c->delivery == PM_DELIVER_DEVICE;
  L->pinned = c->pin_memory != 0;

  st = pm__sampler_init(&L->sampler, dataset->info.samples, c->batch_size, c->shuffle != 0, c->seed,
                        c->drop_last != 0, rank, world);
  if (st != PM_OK) {
    pm__wrap_error(st, "%s", fn);
    goto fail;
  }
  if (c->resume && (st = check_resume(L, c->resume)) != PM_OK) goto fail;

  uint64_t rows_max = PM__MIN((uint64_t)c->batch_size, L->sampler.per_rank);
  size_t need = 0, sample_bytes = 0;
  L->nfields = pm__dataset_nfields(dataset);
  for (int k = 0; k < L->nfields; k++) {
    pm__dataset_field(dataset, k, &L->finfo[k]);
    L->fbytes[k] = L->finfo[k].bytes;
    sample_bytes += L->fbytes[k];
    if (L->fbytes[k] == 0 || rows_max > (SIZE_MAX / 4) / L->fbytes[k] ||
        need > SIZE_MAX / 4 - (size_t)rows_max * L->fbytes[k]) {
      st = pm__set_error(PM_ERR_INVALID, "%s: a batch of %llu samples of %zu bytes overflows", fn,
                         (unsigned long long)rows_max, L->fbytes[k]);
      goto fail;
    }
    L->foff[k] = pm__align_up(need, TARGET_ALIGN);
    need = L->foff[k] + (size_t)rows_max * L->fbytes[k];
  }
  if (c->slot_bytes && need > c->slot_bytes) {
    st = pm__set_error(PM_ERR_INVALID,
                       "%s: a batch of %llu samples of %zu bytes%s needs %zu bytes, more than "
                       "slot_bytes %zu",
                       fn, (unsigned long long)rows_max, sample_bytes,
                       L->nfields > 1 ? " (all fields)" : "", need, c->slot_bytes);
    goto fail;
  }
  L->slot_bytes = c->slot_bytes ? c->slot_bytes : need;

  /* The option table resolves auto and bounds both values (the arguments were checked above). */
  L->nworkers = c->workers ? c->workers : (int)pm__opt_int(PM__OPT_LOADER_WORKERS);
  L->nslots = c->prefetch ? c->prefetch : (int)pm__opt_int(PM__OPT_LOADER_PREFETCH);
  /* The slots together (and each in the pool's size classes) must be sizes at all: a slot_bytes
   * near SIZE_MAX has no size class (0), which the budget check below would divide by. */
  if (pm__size_class(L->slot_bytes) == 0 || L->slot_bytes > SIZE_MAX / 2 / (size_t)L->nslots) {
    st = pm__set_error(PM_ERR_INVALID, "%s: slot_bytes %zu is too large (%d slots of it)", fn,
                       L->slot_bytes, L->nslots);
    goto fail;
  }
  L->rows_per_claim = PM__MAX(rows_max / (uint64_t)(2 * L->nworkers), (uint64_t)1);
  /* Parts only where a worker queues the copy (pinned slots to the device), at most MAX_PARTS a
   * slot (larger parts for a larger slot), and a claim of rows no larger than a part, so a part
   * does not wait for rows far beyond it. */
  L->piece = L->device && L->pinned ? pm__opt_size(PM__OPT_LOADER_PIECE) : 0;
  size_t full = pm__loader_copy_bytes(L, rows_max);
  if (L->piece && full / L->piece >= MAX_PARTS) L->piece = (full + MAX_PARTS - 1) / MAX_PARTS;
  L->max_parts = pm__loader_part_count(L, rows_max);
  if (L->max_parts > 1 && !c->claim_rows)
    L->rows_per_claim =
        PM__MAX(PM__MIN(L->rows_per_claim, (uint64_t)(L->piece / sample_bytes)), (uint64_t)1);
  /* An explicit claim size is honoured as it is (a claim is one read_rows call, one message to
   * a process worker), capped at a batch: a part waits for its rows either way. */
  if (c->claim_rows) L->rows_per_claim = PM__MIN(c->claim_rows, rows_max);
  if (c->ordered_workers != 0 && c->ordered_workers != 1) {
    st = pm__set_error(PM_ERR_INVALID, "%s: ordered_workers %d is not 0 or 1", fn,
                       c->ordered_workers);
    goto fail;
  }
  L->ordered = c->ordered_workers == 1;
  L->rows_reads = pm__dataset_reads_rows(dataset);

  if (L->pinned) {
    /* The slots stay pinned together: when they can never all fit the budget, say so now
     * rather than wait (budget_policy wait) for frees of the loader's own slots. */
    pm_pool_stats_t ps;
    size_t slot_class = pm__size_class(L->slot_bytes);
    if (pm_pool_get_stats(c->pool, &ps) == PM_OK && ps.budget &&
        (slot_class > ps.budget || (size_t)L->nslots > ps.budget / slot_class)) {
      st = pm__set_error(PM_ERR_BUDGET,
                         "%s: %d pinned slots of %zu bytes (%zu with the pool's rounding) are "
                         "more than the whole budget of %zu bytes: lower prefetch or "
                         "batch_size, or raise the budget",
                         fn, L->nslots, L->slot_bytes, slot_class, ps.budget);
      goto fail;
    }
  }

  uint64_t bpe = L->sampler.batches;
  L->end_g = c->epochs == 0 || c->epochs > UINT64_MAX / bpe ? UINT64_MAX : c->epochs * bpe;
  if (c->resume) L->fill_g = L->deliver_g = c->resume->epoch * bpe + c->resume->batch;
  if (L->deliver_g > L->end_g) L->fill_g = L->deliver_g = L->end_g;
  L->sub_g = L->fill_g;

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
  L->rows_max = rows_max;
  for (int i = 0; i < L->nslots; i++) {
    st = pm__loader_alloc_slot(L, &L->slots[i]);
    if (st != PM_OK) {
      pm__wrap_error(st, "%s: slot %d of %d", fn, i + 1, L->nslots);
      goto fail;
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
  L->wargs = calloc((size_t)L->nworkers, sizeof *L->wargs);
  if (!L->threads || !L->wargs) {
    st = pm__set_error(PM_ERR_NOMEM, "%s: thread table", fn);
    goto fail;
  }
  if (L->ordered) {
    L->turn_cv = malloc((size_t)L->nworkers * sizeof *L->turn_cv);
    if (!L->turn_cv) {
      st = pm__set_error(PM_ERR_NOMEM, "%s: turn table", fn);
      goto fail;
    }
    for (int i = 0; i < L->nworkers; i++) pthread_cond_init(&L->turn_cv[i], NULL);
  }
  for (int i = 0; i < L->nworkers; i++) {
    /* Workers take none of the process's signals (the program's main thread may rely on them). */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    L->wargs[i].L = L;
    L->wargs[i].index = i; /* ordered claims and read_rows need to know which worker reads */
    int rc = pthread_create(&L->threads[i], NULL, pm__loader_worker_main, &L->wargs[i]);
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
  pm__loader_free(L);
  return pm__set_error(st, "%s", keep);
}
}

/* A live, not destroyed loader (the destroyed flag is read under mu: a release may run). */
pm_status_t pm__loader_check(const char *fn, pm_loader_t *L) {
  pm_status_t st = pm__handle_check(L, PM__HANDLE_LOADER, fn);
  if (st != PM_OK) return st;
  pthread_mutex_lock(&L->mu);
  bool gone = L->destroyed;
  pthread_mutex_unlock(&L->mu);
  if (gone)
    return pm__set_error(PM_ERR_INVALID, "%s: loader %p was already destroyed", fn, (void *)L);
  return PM_OK;
}

pm_status_t pm_loader_destroy(pm_loader_t *loader) {
  if (pm__handle_foreign(loader, PM__HANDLE_LOADER)) {
    /* The parent's loader, in a forked child: its workers do not exist here (joining them would
     * wait for ever) and its slots are not pinned. It is forgotten; its memory is left alone. */
    (void)pm__handle_remove(loader, PM__HANDLE_LOADER);
    return PM_OK;
  }
  const char *fn = "pm_loader_destroy";
  pm_status_t st = pm__handle_check(loader, PM__HANDLE_LOADER, fn);
  if (st != PM_OK) return st;
  pm_loader_t *L = loader;
  pthread_mutex_lock(&L->mu);
  if (L->destroyed) {
    pthread_mutex_unlock(&L->mu);
    return pm__set_error(PM_ERR_INVALID, "%s: loader %p was already destroyed", fn, (void *)L);
  }
  L->destroyed = true;
  pthread_mutex_unlock(&L->mu);

  pm_dataset_t *ds = L->ds;
  stop_workers(L);
  /* A pm_loader_next of another thread leaves (it sees stop) before anything goes. */
  pthread_mutex_lock(&L->mu);
  while (L->in_next) pthread_cond_wait(&L->ready_cv, &L->mu);
  pthread_mutex_unlock(&L->mu);
  if (L->copy_stream) (void)pm_stream_synchronize(L->copy_stream);
  atomic_fetch_sub(&ds->users, 1);

  /* Free every slot nobody holds now; a held one is freed by its release. */
  pthread_mutex_lock(&L->mu);
  for (int i = 0; i < L->nslots; i++) {
    slot_t *s = &L->slots[i];
    if (s->state == SLOT_HELD || s->state == SLOT_RELEASING || s->state == SLOT_GONE) continue;
    s->state = SLOT_GONE;
    pthread_mutex_unlock(&L->mu);
    pm__loader_free_slot(L, s); /* backend calls: not under mu */
    pthread_mutex_lock(&L->mu);
  }
  L->torn_down = true;
  bool last = L->held == 0;
  pthread_mutex_unlock(&L->mu);
  if (last) pm__loader_free(L);
  return PM_OK;
}
