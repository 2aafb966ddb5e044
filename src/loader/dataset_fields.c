/*
 * DESIGN: fields. A sample may have several fields (an image and its label, token inputs and
 * targets); a loader reads all of them into one slot per batch. This file gives every dataset
 * a field table and one read entry for all its fields, and adds the two multi-field kinds:
 * callbacks that write every field of a sample in one call (so a Python dataset's __getitem__
 * runs once per sample, and random augmentation stays consistent across fields), and zips
 * (sample i of each of n datasets side by side: X and Y .npy files).
 *
 * The older kinds (one field; token datasets: inputs and targets) keep their info and read
 * function; their fields follow from the info (pm__dataset_field), so nothing is stored twice.
 * The multi-field kinds own a field table (fields_tab, info.fields entries), and their read
 * function for pm_dataset_read_sample goes through read_fields.
 *
 * A zip holds its datasets as a loader does (`users`), so they cannot be destroyed under it.
 * Both kinds are in the live handle set through pm__dataset_alloc, as every dataset.
 * Reads take no locks (many worker threads read at once); the kinds hold no mutable state.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct fields_cb {
  pm_dataset_fields_callbacks_t cb; /* cb.fields points at the dataset's fields_tab */
} fields_cb_t;

typedef struct zip {
  size_t n;
  pm_dataset_t **parts;
  int *first; /* the first field of part j in the zip's table */
} zip_t;

/* ---- fields of any dataset ----------------------------------------------------------------- */

int pm__dataset_nfields(const pm_dataset_t *ds) {
  if (ds->info.fields > 0) return ds->info.fields;
  return ds->info.target_bytes ? 2 : 1;
}

void pm__dataset_field(const pm_dataset_t *ds, int k, pm_field_t *out) {
  if (ds->fields_tab) {
    *out = ds->fields_tab[k];
    return;
  }
  const pm_dataset_info_t *in = &ds->info;
  memset(out, 0, sizeof *out);
  out->dtype = in->dtype;
  out->itemsize = in->itemsize;
  snprintf(out->descr, sizeof out->descr, "%s", in->descr);
  if (k == 0) {
    out->bytes = in->sample_bytes;
    out->ndim = in->ndim;
    memcpy(out->shape, in->shape, sizeof(uint64_t) * (size_t)in->ndim);
  } else { /* token targets: a row of tokens as the inputs */
    out->bytes = in->target_bytes;
    out->ndim = 1;
    out->shape[0] = in->itemsize ? in->target_bytes / in->itemsize : in->target_bytes;
  }
}

pm_status_t pm__dataset_read_fields(pm_dataset_t *ds, uint64_t epoch, uint64_t index,
                                    void *const *dsts, pm__scratch_t *scratch) {
  if (ds->read_fields) return ds->read_fields(ds, epoch, index, dsts, scratch);
  return ds->read(ds, epoch, index, dsts[0], ds->info.target_bytes ? dsts[1] : NULL, scratch);
}

pm_status_t pm_dataset_get_field(const pm_dataset_t *dataset, int field, pm_field_t *field_out) {
  const char *fn = "pm_dataset_get_field";
  if (!dataset || !field_out)
    return pm__set_error(PM_ERR_INVALID, "%s: %s is NULL", fn, !dataset ? "dataset" : "field_out");
  pm_status_t st = pm__handle_check(dataset, PM__HANDLE_DATASET, fn);
  if (st != PM_OK) return st;
  int n = pm__dataset_nfields(dataset);
  if (field < 0 || field >= n)
    return pm__set_error(PM_ERR_INVALID, "%s: field %d is not in 0..%d", fn, field, n - 1);
  pm__dataset_field(dataset, field, field_out);
  return PM_OK;
}

/* Every field into dsts, with a buffer of its own for each NULL entry (not a hot path). */
static pm_status_t read_with_temps(pm_dataset_t *ds, uint64_t epoch, uint64_t index,
                                   void *const *dsts, pm__scratch_t *scratch) {
  int n = pm__dataset_nfields(ds);
  void *all[PM_MAX_FIELDS], *tmp[PM_MAX_FIELDS] = {0};
  pm_status_t st = PM_OK;
  for (int k = 0; k < n && st == PM_OK; k++) {
    all[k] = dsts ? dsts[k] : NULL;
    if (all[k]) continue;
    pm_field_t f;
    pm__dataset_field(ds, k, &f);
    all[k] = tmp[k] = malloc(f.bytes ? f.bytes : 1);
    if (!all[k]) st = pm__set_error(PM_ERR_NOMEM, "buffer for field %d (%zu bytes)", k, f.bytes);
  }
  if (st == PM_OK) st = pm__dataset_read_fields(ds, epoch, index, all, scratch);
  for (int k = 0; k < n; k++) free(tmp[k]);
  return st;
}

pm_status_t pm_dataset_read_fields(pm_dataset_t *dataset, uint64_t epoch, uint64_t index,
                                   void *const *dsts) {
  const char *fn = "pm_dataset_read_fields";
  if (!dataset || !dsts)
    return pm__set_error(PM_ERR_INVALID, "%s: %s is NULL", fn, !dataset ? "dataset" : "dsts");
  pm_status_t st = pm__handle_check(dataset, PM__HANDLE_DATASET, fn);
  if (st != PM_OK) return st;
  if (index >= dataset->info.samples)
    return pm__set_error(PM_ERR_INVALID, "%s: index %llu out of range (%llu samples)", fn,
                         (unsigned long long)index, (unsigned long long)dataset->info.samples);
  pm__scratch_t scratch = {NULL, 0};
  st = read_with_temps(dataset, epoch, index, dsts, &scratch);
  pm__scratch_free(&scratch);
  return st;
}

/* The read function of the multi-field kinds for pm_dataset_read_sample: field 0 to dst, field
 * 1 to tdst, the others read and dropped. */
static pm_status_t read_first_two(pm_dataset_t *ds, uint64_t epoch, uint64_t index, void *dst,
                                  void *tdst, pm__scratch_t *scratch) {
  void *d[PM_MAX_FIELDS] = {dst, tdst};
  return read_with_temps(ds, epoch, index, d, scratch);
}

/* Info of a multi-field dataset: field 0 as the info of a one-field dataset, field 1 as
 * targets. */
static void info_from_fields(pm_dataset_t *ds, uint64_t samples, int n) {
  pm_dataset_info_t *in = &ds->info;
  const pm_field_t *f0 = &ds->fields_tab[0];
  in->samples = samples;
  in->sample_bytes = f0->bytes;
  in->target_bytes = n > 1 ? ds->fields_tab[1].bytes : 0;
  in->ndim = f0->ndim;
  memcpy(in->shape, f0->shape, sizeof(uint64_t) * (size_t)f0->ndim);
  in->dtype = f0->dtype;
  in->itemsize = f0->itemsize;
  snprintf(in->descr, sizeof in->descr, "%s", f0->descr);
  in->io = PM_IO_PREAD;
  in->fields = n;
}

/* ---- multi-field callbacks ----------------------------------------------------------------- */

static pm_status_t fcb_read(pm_dataset_t *ds, uint64_t epoch, uint64_t index, void *const *dsts,
                            pm__scratch_t *scratch) {
  (void)epoch;
  (void)scratch;
  const fields_cb_t *f = ds->impl;
  return pm__dataset_cb_status(f->cb.read(index, dsts, f->cb.user), index);
}

static void fcb_destroy(pm_dataset_t *ds) {
  fields_cb_t *f = ds->impl;
  if (f && f->cb.destroy) f->cb.destroy(f->cb.user); /* not under any lock */
  free(f);
  free(ds->fields_tab);
}

/* Check one spec and complete it (bytes, itemsize, descr). */
static pm_status_t check_field(const char *fn, int k, const pm_field_t *spec, pm_field_t *out) {
  *out = *spec;
  if ((unsigned)spec->dtype > PM_DTYPE_COMPLEX128)
    return pm__set_error(PM_ERR_INVALID, "%s: field %d: unknown dtype %d", fn, k, (int)spec->dtype);
  size_t code_size = spec->dtype == PM_DTYPE_OTHER ? 0 : pm__dtype_itemsize(spec->dtype);
  if (!out->itemsize) out->itemsize = code_size;
  if (!out->itemsize)
    return pm__set_error(PM_ERR_INVALID, "%s: field %d: PM_DTYPE_OTHER needs its itemsize", fn, k);
  if (code_size && out->itemsize != code_size)
    return pm__set_error(PM_ERR_INVALID, "%s: field %d: itemsize %zu, but %s has %zu", fn, k,
                         out->itemsize, pm_dtype_name(spec->dtype), code_size);
  if (spec->ndim < 0 || spec->ndim > PM_DATASET_MAX_DIMS)
    return pm__set_error(PM_ERR_INVALID, "%s: field %d: ndim %d is not in 0..%d", fn, k, spec->ndim,
                         PM_DATASET_MAX_DIMS);
  uint64_t prod = out->itemsize;
  for (int i = 0; i < spec->ndim; i++) {
    if (spec->shape[i] && prod > (uint64_t)(SIZE_MAX / 4) / spec->shape[i])
      return pm__set_error(PM_ERR_INVALID, "%s: field %d: shape overflows", fn, k);
    prod *= spec->shape[i];
  }
  if (prod == 0) return pm__set_error(PM_ERR_INVALID, "%s: field %d has 0 bytes per sample", fn, k);
  if (spec->bytes && spec->bytes != prod)
    return pm__set_error(PM_ERR_INVALID,
                         "%s: field %d: shape and itemsize give %llu bytes, bytes is %zu", fn, k,
                         (unsigned long long)prod, spec->bytes);
  out->bytes = (size_t)prod;
  if (!memchr(spec->descr, 0, sizeof spec->descr))
    return pm__set_error(PM_ERR_INVALID, "%s: field %d: descr is not NUL-terminated", fn, k);
  if (!spec->descr[0]) {
    if (spec->dtype == PM_DTYPE_OTHER)
      snprintf(out->descr, sizeof out->descr, "|V%zu", out->itemsize);
    else
      snprintf(out->descr, sizeof out->descr, "%s", pm__dtype_descr(spec->dtype));
  }
  return PM_OK;
}

/* What pm_dataset_create_fields and pm_dataset_create_rows share: the argument checks (the
 * read callback `read_name` present, samples, the field specs, each completed into a new
 * table) and the allocations (an impl of impl_bytes, the dataset, which then owns both, with
 * its info and multi-field read_sample set). The caller fills the impl and its read calls. */
pm_status_t pm__dataset_callback_new(const char *fn, const void *callbacks, bool have_read,
                                     const char *read_name, uint64_t samples, int nfields,
                                     const pm_field_t *fields, size_t impl_bytes,
                                     pm_dataset_t *const *dataset_out, pm_dataset_t **ds_out) {
  if (!callbacks || !dataset_out)
    return pm__set_error(PM_ERR_INVALID, "%s: %s is NULL", fn,
                         !callbacks ? "callbacks" : "dataset_out");
  if (!have_read) return pm__set_error(PM_ERR_INVALID, "%s: %s callback is NULL", fn, read_name);
  if (samples == 0) return pm__set_error(PM_ERR_INVALID, "%s: samples is 0", fn);
  if (nfields < 1 || nfields > PM_MAX_FIELDS)
    return pm__set_error(PM_ERR_INVALID, "%s: nfields %d is not in 1..%d", fn, nfields,
                         PM_MAX_FIELDS);
  if (!fields) return pm__set_error(PM_ERR_INVALID, "%s: fields is NULL", fn);
  pm_field_t *tab = calloc((size_t)nfields, sizeof *tab);
  if (!tab) return pm__set_error(PM_ERR_NOMEM, "%s: field table", fn);
  pm_status_t st = PM_OK;
  for (int k = 0; k < nfields && st == PM_OK; k++) st = check_field(fn, k, &fields[k], &tab[k]);
  void *impl = NULL;
  pm_dataset_t *ds = NULL;
  if (st == PM_OK && !(impl = malloc(impl_bytes)))
    st = pm__set_error(PM_ERR_NOMEM, "%s: callbacks", fn);
  if (st == PM_OK) st = pm__dataset_alloc(0, &ds);
  if (st != PM_OK) {
    if (ds) pm__dataset_free(ds);
    free(impl);
    free(tab);
    return st;
  }
  ds->impl = impl;
  ds->fields_tab = tab;
  ds->read = read_first_two;
  info_from_fields(ds, samples, nfields);
  *ds_out = ds;
  return PM_OK;
}

pm_status_t pm_dataset_create_fields(const pm_dataset_fields_callbacks_t *callbacks,
                                     pm_dataset_t **dataset_out) {
  const pm_dataset_fields_callbacks_t *c = callbacks;
  pm_dataset_t *ds;
  pm_status_t st = pm__dataset_callback_new(
      "pm_dataset_create_fields", c, c && c->read, "read", c ? c->samples : 0,
      c ? c->nfields : 0, c ? c->fields : NULL, sizeof(fields_cb_t), dataset_out, &ds);
  if (st != PM_OK) return st;
  fields_cb_t *f = ds->impl;
  f->cb = *c;
  f->cb.fields = ds->fields_tab;
  ds->read_fields = fcb_read;
  ds->destroy_impl = fcb_destroy;
  *dataset_out = ds;
  return PM_OK;
}

/* ---- zips ---------------------------------------------------------------------------------- */

static pm_status_t zip_read(pm_dataset_t *ds, uint64_t epoch, uint64_t index, void *const *dsts,
                            pm__scratch_t *scratch) {
  const zip_t *z = ds->impl;
  for (size_t j = 0; j < z->n; j++) {
    pm_status_t st =
        pm__dataset_read_fields(z->parts[j], epoch, index, dsts + z->first[j], scratch);
    if (st != PM_OK) return pm__wrap_error(st, "zipped dataset %zu", j);
  }
  return PM_OK;
}

static void zip_destroy(pm_dataset_t *ds) {
  zip_t *z = ds->impl;
  if (z) {
    for (size_t j = 0; j < z->n; j++) atomic_fetch_sub(&z->parts[j]->users, 1);
    free(z->parts);
    free(z->first);
    free(z);
  }
  free(ds->fields_tab);
}

pm_status_t pm_dataset_zip(pm_dataset_t *const *datasets, size_t n, pm_dataset_t **dataset_out) {
  const char *fn = "pm_dataset_zip";
  if (!datasets || !dataset_out)
    return pm__set_error(PM_ERR_INVALID, "%s: %s is NULL", fn,
                         !datasets ? "datasets" : "dataset_out");
  if (n == 0) return pm__set_error(PM_ERR_INVALID, "%s: no datasets", fn);
  int total = 0;
  for (size_t j = 0; j < n; j++) {
    if (!datasets[j]) return pm__set_error(PM_ERR_INVALID, "%s: datasets[%zu] is NULL", fn, j);
    pm_status_t hst = pm__handle_check(datasets[j], PM__HANDLE_DATASET, fn);
    if (hst != PM_OK) return hst;
    if (datasets[j]->info.samples != datasets[0]->info.samples)
      return pm__set_error(PM_ERR_INVALID,
                           "%s: datasets[%zu] has %llu samples, datasets[0] has %llu (a zip "
                           "needs the same number)",
                           fn, j, (unsigned long long)datasets[j]->info.samples,
                           (unsigned long long)datasets[0]->info.samples);
    total += pm__dataset_nfields(datasets[j]);
    if (total > PM_MAX_FIELDS)
      return pm__set_error(PM_ERR_INVALID, "%s: more than %d fields in all", fn, PM_MAX_FIELDS);
  }
  zip_t *z = calloc(1, sizeof *z);
  pm_field_t *tab = calloc((size_t)total, sizeof *tab);
  pm_dataset_t *ds = NULL;
  pm_status_t st = PM_OK;
  if (z) {
    z->parts = calloc(n, sizeof *z->parts);
    z->first = calloc(n, sizeof *z->first);
  }
  if (!z || !tab || !z->parts || !z->first) st = pm__set_error(PM_ERR_NOMEM, "%s: tables", fn);
  if (st == PM_OK) st = pm__dataset_alloc(0, &ds);
  if (st != PM_OK) {
    if (ds) pm__dataset_free(ds);
    if (z) {
      free(z->parts);
      free(z->first);
    }
    free(z);
    free(tab);
    return st;
  }
  int k = 0;
  for (size_t j = 0; j < n; j++) {
    pm_dataset_t *part = datasets[j];
    z->parts[j] = part;
    z->first[j] = k;
    for (int i = 0; i < pm__dataset_nfields(part); i++) pm__dataset_field(part, i, &tab[k++]);
    atomic_fetch_add(&part->users, 1);
    ds->info.files += part->info.files;
  }
  z->n = n;
  ds->impl = z;
  ds->fields_tab = tab;
  ds->read = read_first_two;
  ds->read_fields = zip_read;
  ds->destroy_impl = zip_destroy;
  info_from_fields(ds, datasets[0]->info.samples, total);
  ds->info.io = datasets[0]->info.io;
  for (size_t j = 0; j < n && !ds->info.note[0]; j++)
    snprintf(ds->info.note, sizeof ds->info.note, "%s", datasets[j]->info.note);
  *dataset_out = ds;
  return PM_OK;
}

