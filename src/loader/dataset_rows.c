/*
 * DESIGN: rows datasets and selects.
 *
 * A rows dataset is a callback that writes a run of rows (every field of n samples) in one call.
 * It exists for readers whose cost per call is high, worker processes reached over a socket
 * above all: the loader hands each claim of rows (consecutive rows of a slot) to one read_rows
 * call, so a process worker gets one message per claim instead of one per sample. Its field
 * table is checked and completed as pm_dataset_create_fields does (dataset_fields.c), and it
 * reads one sample (pm_dataset_read_fields, pm_dataset_read_sample, a zip) as a run of one row.
 *
 * A select is a view: sample i is sample indices[i] of its base (what a sampler yields, repeats
 * allowed). It owns a copy of the indices and of the base's field table and holds the base as a
 * loader does (`users`), so the base cannot be destroyed under it. One sample is read through the
 * base's own read functions with the index mapped; over a dataset that reads rows (a rows
 * dataset, or a select over one) a run of rows is mapped as a whole and stays one read_rows call
 * on the rows dataset underneath: the point of reading rows is lost if a select splits it.
 *
 * The worker index: a loader passes it to read_rows with each claim. A rows dataset read one
 * sample at a time inside a loader (a zip of one) takes it from the thread: each loader worker
 * records its index once at its start (pm__dataset_worker_set), every other thread reads -1.
 * The claim's batch and first row come from the thread too (pm__dataset_claim_set before each
 * read), so a reader can order the failures of claims that fail at once.
 *
 * Reads take no locks (many worker threads read at once); both kinds hold no mutable state.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct rows_cb {
  pm_dataset_rows_callbacks_t cb; /* cb.fields points at the dataset's fields_tab */
} rows_cb_t;

typedef struct sel {
  pm_dataset_t *base;
  uint64_t n;
  uint64_t *indices;
} select_t;

static _Thread_local int tl_worker = -1;
static _Thread_local uint64_t tl_batch = UINT64_MAX, tl_row = UINT64_MAX;

void pm__dataset_worker_set(int worker) {
  tl_worker = worker;
}

void pm__dataset_claim_set(uint64_t batch, uint64_t row) {
  tl_batch = batch;
  tl_row = row;
}

void pm__dataset_claim_get(uint64_t *batch, uint64_t *row) {
  *batch = tl_batch;
  *row = tl_row;
}

bool pm__dataset_reads_rows(const pm_dataset_t *ds) {
  return ds->read_rows != NULL;
}

pm_status_t pm__dataset_read_rows(pm_dataset_t *ds, uint64_t epoch, uint64_t n,
                                  const uint64_t *indices, void *const *dsts, int worker) {
  return ds->read_rows(ds, epoch, n, indices, dsts, worker);
}

/* ---- rows datasets ------------------------------------------------------------------------- */

static pm_status_t rows_read(pm_dataset_t *ds, uint64_t epoch, uint64_t n, const uint64_t *indices,
                             void *const *dsts, int worker) {
  const rows_cb_t *r = ds->impl;
  pm_rows_request_t req;
  memset(&req, 0, sizeof req);
  req.epoch = epoch;
  req.n = n;
  req.indices = indices;
  req.dsts = dsts;
  req.worker = worker;
  req.batch = tl_batch;
  req.row = tl_row;
  int rc = r->cb.read_rows(&req, r->cb.user);
  if (rc == 0) return PM_OK;
  pm_status_t st = PM_ERR_IO;
  if (rc < 0 && strcmp(pm_status_name((pm_status_t)rc), "PM_STATUS_UNKNOWN") != 0)
    st = (pm_status_t)rc;
  if (n == 1)
    return pm__set_error(st, "dataset read_rows callback failed for sample %llu (returned %d)",
                         (unsigned long long)indices[0], rc);
  return pm__set_error(st,
                       "dataset read_rows callback failed for %llu rows from sample %llu "
                       "(returned %d)",
                       (unsigned long long)n, (unsigned long long)indices[0], rc);
}

/* One sample as a run of one row; a field without a destination (NULL) goes to a buffer of its
 * own, since the callback writes every field. */
static pm_status_t rows_read_one(pm_dataset_t *ds, uint64_t epoch, uint64_t index,
                                 void *const *dsts, pm__scratch_t *scratch) {
  (void)scratch;
  int n = ds->info.fields;
  void *all[PM_MAX_FIELDS], *tmp[PM_MAX_FIELDS] = {0};
  pm_status_t st = PM_OK;
  for (int k = 0; k < n && st == PM_OK; k++) {
    all[k] = dsts[k];
    if (!all[k] && !(all[k] = tmp[k] = malloc(ds->fields_tab[k].bytes)))
      st = pm__set_error(PM_ERR_NOMEM, "buffer for field %d (%zu bytes)", k,
                         ds->fields_tab[k].bytes);
  }
  if (st == PM_OK) st = rows_read(ds, epoch, 1, &index, all, tl_worker);
  for (int k = 0; k < n; k++) free(tmp[k]);
  return st;
}

static void rows_destroy(pm_dataset_t *ds) {
  rows_cb_t *r = ds->impl;
  if (r && r->cb.destroy) r->cb.destroy(r->cb.user); /* not under any lock */
  free(r);
  free(ds->fields_tab);
}

pm_status_t pm_dataset_create_rows(const pm_dataset_rows_callbacks_t *callbacks,
                                   pm_dataset_t **dataset_out) {
  const pm_dataset_rows_callbacks_t *c = callbacks;
  pm_dataset_t *ds;
  pm_status_t st = pm__dataset_callback_new(
      "pm_dataset_create_rows", c, c && c->read_rows, "read_rows", c ? c->samples : 0,
      c ? c->nfields : 0, c ? c->fields : NULL, sizeof(rows_cb_t), dataset_out, &ds);
  if (st != PM_OK) return st;
  rows_cb_t *r = ds->impl;
  r->cb = *c;
  r->cb.fields = ds->fields_tab;
  ds->read_fields = rows_read_one;
  ds->read_rows = rows_read;
  ds->destroy_impl = rows_destroy;
  *dataset_out = ds;
  return PM_OK;
}

/* ---- selects ------------------------------------------------------------------------------- */

static pm_status_t select_read(pm_dataset_t *ds, uint64_t epoch, uint64_t index, void *dst,
                               void *tdst, pm__scratch_t *scratch) {
  const select_t *v = ds->impl;
  return v->base->read(v->base, epoch, v->indices[index], dst, tdst, scratch);
}

static pm_status_t select_read_fields(pm_dataset_t *ds, uint64_t epoch, uint64_t index,
                                      void *const *dsts, pm__scratch_t *scratch) {
  const select_t *v = ds->impl;
  return pm__dataset_read_fields(v->base, epoch, v->indices[index], dsts, scratch);
}

static pm_status_t select_read_rows(pm_dataset_t *ds, uint64_t epoch, uint64_t n,
                                    const uint64_t *indices, void *const *dsts, int worker) {
  const select_t *v = ds->impl;
  /* A run's own copy of the mapped indices: one allocation per run is nothing beside a call
   * whose cost is what made the base read rows. */
  uint64_t *mapped = n > SIZE_MAX / sizeof *mapped ? NULL : malloc((size_t)n * sizeof *mapped);
  if (!mapped)
    return pm__set_error(PM_ERR_NOMEM, "indices of a run of %llu rows", (unsigned long long)n);
  for (uint64_t r = 0; r < n; r++) mapped[r] = v->indices[indices[r]];
  pm_status_t st = v->base->read_rows(v->base, epoch, n, mapped, dsts, worker);
  free(mapped);
  return st;
}

static void select_destroy(pm_dataset_t *ds) {
  select_t *v = ds->impl;
  if (v) {
    atomic_fetch_sub(&v->base->users, 1);
    free(v->indices);
    free(v);
  }
  free(ds->fields_tab);
}

pm_status_t pm_dataset_select(pm_dataset_t *base, const uint64_t *indices, uint64_t n,
                              pm_dataset_t **dataset_out) {
  const char *fn = "pm_dataset_select";
  if (!base || !indices || !dataset_out)
    return pm__set_error(PM_ERR_INVALID, "%s: %s is NULL", fn,
                         !base      ? "base"
                         : !indices ? "indices"
                                    : "dataset_out");
  pm_status_t st = pm__handle_check(base, PM__HANDLE_DATASET, fn);
  if (st != PM_OK) return st;
  if (n == 0) return pm__set_error(PM_ERR_INVALID, "%s: n is 0 (a select needs a sample)", fn);
  uint64_t have = base->info.samples;
  for (uint64_t i = 0; i < n; i++)
    if (indices[i] >= have)
      return pm__set_error(PM_ERR_INVALID, "%s: indices[%llu] is %llu, base has %llu samples", fn,
                           (unsigned long long)i, (unsigned long long)indices[i],
                           (unsigned long long)have);
  if (n > SIZE_MAX / sizeof(uint64_t))
    return pm__set_error(PM_ERR_NOMEM, "%s: %llu indices", fn, (unsigned long long)n);
  select_t *v = calloc(1, sizeof *v);
  uint64_t *copy = malloc((size_t)n * sizeof *copy);
  pm_field_t *tab = NULL;
  if (v && copy && base->fields_tab) {
    tab = malloc((size_t)base->info.fields * sizeof *tab);
    if (tab) memcpy(tab, base->fields_tab, (size_t)base->info.fields * sizeof *tab);
  }
  pm_dataset_t *ds = NULL;
  if (!v || !copy || (base->fields_tab && !tab))
    st = pm__set_error(PM_ERR_NOMEM, "%s: a copy of %llu indices", fn, (unsigned long long)n);
  if (st == PM_OK) st = pm__dataset_alloc(0, &ds);
  if (st != PM_OK) {
    free(v);
    free(copy);
    free(tab);
    return st;
  }
  memcpy(copy, indices, (size_t)n * sizeof *copy);
  v->base = base;
  v->n = n;
  v->indices = copy;
  atomic_fetch_add(&base->users, 1);
  ds->impl = v;
  ds->fields_tab = tab;
  ds->read = select_read;
  ds->read_fields = select_read_fields;
  ds->read_rows = base->read_rows ? select_read_rows : NULL;
  ds->destroy_impl = select_destroy;
  ds->info = base->info; /* fields, dtype, shape, io, note and files as the base's */
  ds->info.samples = n;
  *dataset_out = ds;
  return PM_OK;
}
