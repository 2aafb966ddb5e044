/*
 * Rows datasets, selects and ordered workers. A rows dataset here writes three fields per row
 * (a byte pattern of the index, a pair (call id, a draw of the calling worker's own random
 * state), three floats of the index) and logs every read_rows call (rows, indices, where row 0
 * of field 0 went, worker), so each delivered row is traced back to the one call that wrote it:
 * the bytes of every field are checked, and each call is shown to be exactly one claim of
 * consecutive rows of one slot with a worker index in range. Then: per-sample reads outside a
 * loader (n = 1, worker -1) and inside a zip; claim_rows; ordered workers (the rows of each
 * worker follow claim k -> worker k % workers, identical across two shuffled runs, and so are
 * batches that use per-worker random state); selects over .npy, callback and rows datasets
 * (base[indices[i]], repeats, one read_rows call per claim on the rows base with the indices
 * mapped, bad indices, base busy); an error in read_rows at its batch; destroy and errors while
 * workers wait for their turn. A hang fails through alarm().
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "internal.h"

static int g_small; /* PINMEM_TEST_SMALL: fewer samples and epochs */

#define F0 37 /* field 0: uint8 [37], pm_test_fill(index + 1) */
#define MAXW 8

/* ---- a logging rows dataset -------------------------------------------------------------- */

typedef struct call_rec {
  uint64_t epoch, n;
  uint64_t idx_off; /* the call's indices in rows_ds_t.idx (UINT64_MAX: no room) */
  const void *dst0; /* where row 0 of field 0 went */
  int worker;
  uint64_t batch, row; /* the claim's place in the loader's order (UINT64_MAX outside one) */
} call_rec_t;

typedef struct rows_ds {
  long fail_at; /* index whose read fails, or -1 */
  int fail_rc;
  int jitter; /* sleep a little per call, differently per call: shakes the schedule */
  pm_test_gate_t *gate;
  int gate_worker; /* whose first call waits at the gate */
  atomic_int at_gate;
  atomic_ulong ncalls;
  call_rec_t *log;
  size_t log_cap;
  uint64_t *idx;
  atomic_ulong idx_used;
  size_t idx_cap;
  uint64_t rng[MAXW]; /* rng[w] is touched by worker w alone */
  atomic_int destroyed;
} rows_ds_t;

static int rows_read(const pm_rows_request_t *q, void *user) {
  rows_ds_t *d = user;
  uint64_t id = atomic_fetch_add(&d->ncalls, 1);
  if (id < d->log_cap) {
    call_rec_t *c = &d->log[id];
    c->epoch = q->epoch;
    c->n = q->n;
    c->dst0 = q->dsts[0];
    c->worker = q->worker;
    c->batch = q->batch;
    c->row = q->row;
    uint64_t off = atomic_fetch_add(&d->idx_used, q->n);
    c->idx_off = UINT64_MAX;
    if (off + q->n <= d->idx_cap) {
      memcpy(d->idx + off, q->indices, q->n * sizeof *q->indices);
      c->idx_off = off;
    }
  }
  if (d->jitter) pm_test_sleep_ms((int)(pm__mix64(id) % 3));
  if (d->gate && q->worker == d->gate_worker && atomic_fetch_add(&d->at_gate, 1) == 0)
    pm_test_gate_wait(d->gate);
  for (uint64_t r = 0; r < q->n; r++) {
    uint64_t i = q->indices[r];
    if ((long)i == d->fail_at) return d->fail_rc;
    pm_test_fill((char *)q->dsts[0] + r * F0, F0, i + 1);
    int64_t pair[2] = {(int64_t)id, 0};
    if (q->worker >= 0 && q->worker < MAXW)
      pair[1] = (int64_t)(pm_test_rand(&d->rng[q->worker]) >> 1);
    memcpy((char *)q->dsts[1] + r * sizeof pair, pair, sizeof pair);
    float f[3] = {(float)i * 0.5f, (float)i + 1, -(float)i};
    memcpy((char *)q->dsts[2] + r * sizeof f, f, sizeof f);
  }
  return 0;
}

static void rows_destroy_cb(void *user) {
  rows_ds_t *d = user;
  atomic_fetch_add(&d->destroyed, 1);
}

static void rows_reset(rows_ds_t *d) {
  d->fail_at = -1;
  d->fail_rc = 0;
  d->jitter = 0;
  d->gate = NULL;
  d->gate_worker = -2;
  atomic_store(&d->at_gate, 0);
  atomic_store(&d->ncalls, 0);
  atomic_store(&d->idx_used, 0);
  for (int w = 0; w < MAXW; w++) d->rng[w] = 1000 + (uint64_t)w;
}

static pm_field_t g_fields[3];

static void fields_init(void) {
  memset(g_fields, 0, sizeof g_fields);
  g_fields[0].dtype = PM_DTYPE_UINT8;
  g_fields[0].ndim = 1;
  g_fields[0].shape[0] = F0;
  g_fields[1].dtype = PM_DTYPE_INT64;
  g_fields[1].ndim = 1;
  g_fields[1].shape[0] = 2;
  g_fields[2].dtype = PM_DTYPE_FLOAT32;
  g_fields[2].ndim = 1;
  g_fields[2].shape[0] = 3;
}

static pm_dataset_t *make_rows(rows_ds_t *d, uint64_t samples, size_t max_calls) {
  memset(d, 0, sizeof *d);
  d->log_cap = max_calls;
  d->idx_cap = max_calls * 64;
  d->log = calloc(d->log_cap, sizeof *d->log);
  d->idx = calloc(d->idx_cap, sizeof *d->idx);
  REQUIRE(d->log && d->idx);
  rows_reset(d);
  pm_dataset_rows_callbacks_t cb;
  memset(&cb, 0, sizeof cb);
  cb.samples = samples;
  cb.nfields = 3;
  cb.fields = g_fields;
  cb.read_rows = rows_read;
  cb.user = d;
  cb.destroy = rows_destroy_cb;
  pm_dataset_t *ds = NULL;
  REQUIRE_OK(pm_dataset_create_rows(&cb, &ds));
  return ds;
}

static void rows_free(rows_ds_t *d) {
  free(d->log);
  free(d->idx);
}

static bool row_fields_ok(const unsigned char *f0, const unsigned char *f2, uint64_t i) {
  float want[3] = {(float)i * 0.5f, (float)i + 1, -(float)i};
  return pm_test_fill_ok(f0, F0, i + 1) && memcmp(f2, want, sizeof want) == 0;
}

/* ---- checking a batch of the rows dataset ------------------------------------------------ */

typedef struct run_check {
  rows_ds_t *d;
  const uint64_t *map; /* a select's indices (the base index of row index i), or NULL */
  int workers;
  uint64_t claim;  /* 0: learnt from the calls (the largest n) */
  uint64_t claims; /* claims the batches so far needed (for claim != 0) */
  uint64_t rows;
  unsigned char *seen; /* per call id: its rows were seen */
  uint64_t bpe;        /* batches per epoch: a call's batch is epoch * bpe + index */
  int bad_bytes, bad_calls;
} run_check_t;

/* The field arrays of a delivered batch as host bytes (device batches copied back). */
static void batch_fields(const pm_batch_t *b, unsigned char *out[3]) {
  if (b->event) CHECK_OK(pm_event_synchronize(b->event));
  for (int k = 0; k < 3; k++) {
    out[k] = malloc(b->fields[k].bytes);
    REQUIRE(out[k] != NULL);
    CHECK_OK(pm_memcpy(out[k], b->fields[k].data, b->fields[k].bytes,
                       b->event ? PM_COPY_D2H : PM_COPY_H2H));
  }
}

static void check_rows_batch(run_check_t *rc, const pm_batch_t *b) {
  unsigned char *f[3];
  CHECK_EQ_INT(b->nfields, 3);
  batch_fields(b, f);
  uint64_t rows = b->samples;
  for (uint64_t r = 0; r < rows; r++) {
    uint64_t i = rc->map ? rc->map[b->indices[r]] : b->indices[r];
    if (!row_fields_ok(f[0] + r * F0, f[2] + r * 12, i)) rc->bad_bytes++;
    int64_t pair[2];
    memcpy(pair, f[1] + r * 16, 16);
    uint64_t id = (uint64_t)pair[0];
    if (id >= rc->d->log_cap) {
      rc->bad_calls++;
      continue;
    }
    const call_rec_t *c = &rc->d->log[id];
    ptrdiff_t off = (const unsigned char *)c->dst0 - (const unsigned char *)b->fields[0].host;
    uint64_t r0 = (uint64_t)(off / F0);
    /* The call wrote consecutive rows of this slot, from r0, with this row's base index. */
    if (off < 0 || off % F0 || r0 > r || r >= r0 + c->n || c->idx_off == UINT64_MAX ||
        rc->d->idx[c->idx_off + (r - r0)] != i || c->worker < 0 || c->worker >= rc->workers) {
      rc->bad_calls++;
      continue;
    }
    if (c->batch != b->epoch * rc->bpe + b->index || c->row != r0) rc->bad_calls++;
    if (r == r0) {
      rc->seen[id] = 1;
      if (rc->claim && (r0 % rc->claim || c->n != PM__MIN(rc->claim, rows - r0))) rc->bad_calls++;
    }
  }
  if (rc->claim) rc->claims += (rows + rc->claim - 1) / rc->claim;
  rc->rows += rows;
  for (int k = 0; k < 3; k++) free(f[k]);
}

/* Calls made == claims needed, and each call's rows were delivered (one call per claim). */
static void check_calls(run_check_t *rc, uint64_t want_claims) {
  uint64_t calls = atomic_load(&rc->d->ncalls), seen = 0;
  REQUIRE(calls <= rc->d->log_cap);
  for (uint64_t id = 0; id < calls; id++) seen += rc->seen[id];
  CHECK_EQ_SIZE(calls, want_claims);
  CHECK_EQ_SIZE(seen, calls);
  CHECK_EQ_INT(rc->bad_bytes, 0);
  CHECK_EQ_INT(rc->bad_calls, 0);
}

static pm_loader_config_t base_config(size_t batch, int workers) {
  pm_loader_config_t c;
  pm_loader_config_init(&c);
  c.batch_size = batch;
  c.workers = workers;
  c.prefetch = 3;
  c.rank = 0;
  c.world_size = 1;
  return c;
}

/* Claims a run of batches needs: every batch of every epoch cut into claims. */
static uint64_t claims_for(uint64_t samples, uint64_t batch, uint64_t epochs, uint64_t claim) {
  uint64_t full = samples / batch, last = samples % batch;
  uint64_t per = full * ((batch + claim - 1) / claim) + (last ? (last + claim - 1) / claim : 0);
  return per * epochs;
}

/* ---- a rows dataset end to end ----------------------------------------------------------- */

static void test_rows_loader(pm_delivery_t delivery, uint64_t claim_rows) {
  const uint64_t n = g_small ? 61 : 203, batch = 16, epochs = 2;
  const int workers = 3;
  rows_ds_t d;
  pm_dataset_t *ds = make_rows(&d, n, 4 * n * epochs);
  pm_loader_config_t c = base_config(batch, workers);
  c.shuffle = 1;
  c.epochs = epochs;
  c.delivery = delivery;
  c.claim_rows = claim_rows;
  pm_loader_t *ld;
  REQUIRE_OK(pm_loader_create(ds, &c, &ld));
  run_check_t rc;
  memset(&rc, 0, sizeof rc);
  rc.d = &d;
  rc.workers = workers;
  rc.claim = claim_rows ? PM__MIN(claim_rows, batch) : 0;
  rc.bpe = (n + batch - 1) / batch;
  rc.seen = calloc(d.log_cap, 1);
  REQUIRE(rc.seen != NULL);
  pm_batch_t b;
  while (pm_loader_next(ld, &b) == PM_OK) {
    check_rows_batch(&rc, &b);
    CHECK_OK(pm_batch_release(&b, NULL));
  }
  CHECK_ST(pm_loader_next(ld, &b), PM_ERR_STATE);
  CHECK_OK(pm_loader_destroy(ld));
  CHECK_EQ_SIZE(rc.rows, n * epochs);
  uint64_t claim = rc.claim;
  if (!claim) /* automatic: the largest call is a whole claim */
    for (uint64_t id = 0; id < atomic_load(&d.ncalls) && id < d.log_cap; id++)
      claim = PM__MAX(claim, d.log[id].n);
  CHECK(claim >= 1);
  if (claim_rows) CHECK_EQ_SIZE(claim, PM__MIN(claim_rows, batch));
  check_calls(&rc, claims_for(n, batch, epochs, claim));
  free(rc.seen);
  CHECK_OK(pm_dataset_destroy(ds));
  CHECK_EQ_INT(atomic_load(&d.destroyed), 1);
  rows_free(&d);
}

/* Per-sample reads: outside a loader (n = 1, worker -1), and inside a zip in a loader. */
static void test_rows_single(void) {
  const uint64_t n = 50;
  rows_ds_t d;
  pm_dataset_t *ds = make_rows(&d, n, 1000);
  pm_dataset_info_t in;
  CHECK_OK(pm_dataset_get_info(ds, &in));
  CHECK_EQ_INT(in.fields, 3);
  CHECK_EQ_SIZE(in.samples, n);
  CHECK_EQ_SIZE(in.sample_bytes, F0);
  CHECK_EQ_SIZE(in.target_bytes, 16);
  pm_field_t f;
  CHECK_OK(pm_dataset_get_field(ds, 2, &f));
  CHECK_EQ_SIZE(f.bytes, 12);
  CHECK(strcmp(f.descr, "<f4") == 0);

  unsigned char f0[F0], f2[12];
  int64_t pair[2];
  void *dsts[3] = {f0, pair, f2};
  CHECK_OK(pm_dataset_read_fields(ds, 4, 17, dsts));
  CHECK(row_fields_ok(f0, f2, 17));
  void *skip[3] = {f0, NULL, NULL}; /* fields without a place still get one to write to */
  memset(f0, 0, sizeof f0);
  CHECK_OK(pm_dataset_read_fields(ds, 0, 3, skip));
  CHECK(pm_test_fill_ok(f0, F0, 4));
  int64_t t[2];
  memset(f0, 0, sizeof f0);
  CHECK_OK(pm_dataset_read_sample(ds, 0, 49, f0, t));
  CHECK(pm_test_fill_ok(f0, F0, 50));
  CHECK_EQ_SIZE(atomic_load(&d.ncalls), 3);
  for (int id = 0; id < 3; id++) {
    CHECK_EQ_SIZE(d.log[id].n, 1);
    CHECK_EQ_INT(d.log[id].worker, -1);
    CHECK_EQ_SIZE(d.log[id].batch, UINT64_MAX); /* no loader: no place in one */
    CHECK_EQ_SIZE(d.log[id].row, UINT64_MAX);
  }
  CHECK_EQ_SIZE(d.log[0].epoch, 4);
  CHECK_EQ_SIZE(d.idx[d.log[0].idx_off], 17);
  CHECK_EQ_SIZE(d.idx[d.log[2].idx_off], 49);
  CHECK_ERR_MSG(pm_dataset_read_fields(ds, 0, n, dsts), PM_ERR_INVALID);

  /* A read_rows failure outside a loader: its status, the sample named. */
  d.fail_at = 7;
  d.fail_rc = (int)PM_ERR_FORMAT;
  CHECK_ERR_MSG(pm_dataset_read_fields(ds, 0, 7, dsts), PM_ERR_FORMAT);
  CHECK(strstr(pm_last_error(), "sample 7") != NULL);
  d.fail_rc = 3;
  CHECK_ERR_MSG(pm_dataset_read_fields(ds, 0, 7, dsts), PM_ERR_IO);
  rows_reset(&d);

  /* A zip of the rows dataset and itself: one call per sample and part, the loader's worker. */
  pm_dataset_t *parts[2] = {ds, ds}, *z = NULL;
  REQUIRE_OK(pm_dataset_zip(parts, 2, &z));
  CHECK_ERR_MSG(pm_dataset_destroy(ds), PM_ERR_BUSY);
  pm_loader_config_t c = base_config(8, 2);
  c.shuffle = 1;
  c.delivery = PM_DELIVER_HOST;
  pm_loader_t *ld;
  REQUIRE_OK(pm_loader_create(z, &c, &ld));
  pm_batch_t b;
  uint64_t rows = 0;
  int bad = 0;
  while (pm_loader_next(ld, &b) == PM_OK) {
    CHECK_EQ_INT(b.nfields, 6);
    for (uint64_t r = 0; r < b.samples; r++)
      for (int part = 0; part < 2; part++) {
        const unsigned char *a = (const unsigned char *)b.fields[3 * part].host + r * F0;
        const unsigned char *c2 = (const unsigned char *)b.fields[3 * part + 2].host + r * 12;
        if (!row_fields_ok(a, c2, b.indices[r])) bad++;
      }
    rows += b.samples;
    CHECK_OK(pm_batch_release(&b, NULL));
  }
  CHECK_OK(pm_loader_destroy(ld));
  CHECK_EQ_INT(bad, 0);
  CHECK_EQ_SIZE(rows, n);
  uint64_t calls = atomic_load(&d.ncalls);
  CHECK_EQ_SIZE(calls, 2 * n);
  int bad_calls = 0;
  for (uint64_t id = 0; id < calls; id++)
    if (d.log[id].n != 1 || d.log[id].worker < 0 || d.log[id].worker >= 2) bad_calls++;
  CHECK_EQ_INT(bad_calls, 0);
  CHECK_OK(pm_dataset_destroy(z));

  /* Bad specs, checked as pm_dataset_create_fields does. */
  pm_dataset_rows_callbacks_t cb;
  memset(&cb, 0, sizeof cb);
  cb.samples = 10;
  cb.nfields = 3;
  cb.fields = g_fields;
  cb.read_rows = rows_read;
  cb.user = &d;
  pm_dataset_t *x = NULL;
  CHECK_ERR_MSG(pm_dataset_create_rows(NULL, &x), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_dataset_create_rows(&cb, NULL), PM_ERR_INVALID);
  cb.read_rows = NULL;
  CHECK_ERR_MSG(pm_dataset_create_rows(&cb, &x), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "read_rows") != NULL);
  cb.read_rows = rows_read;
  cb.samples = 0;
  CHECK_ERR_MSG(pm_dataset_create_rows(&cb, &x), PM_ERR_INVALID);
  cb.samples = 10;
  cb.nfields = 0;
  CHECK_ERR_MSG(pm_dataset_create_rows(&cb, &x), PM_ERR_INVALID);
  cb.nfields = PM_MAX_FIELDS + 1;
  CHECK_ERR_MSG(pm_dataset_create_rows(&cb, &x), PM_ERR_INVALID);
  cb.nfields = 3;
  cb.fields = NULL;
  CHECK_ERR_MSG(pm_dataset_create_rows(&cb, &x), PM_ERR_INVALID);
  pm_field_t badf[3];
  memcpy(badf, g_fields, sizeof badf);
  badf[2].bytes = 11; /* shape says 12 */
  cb.fields = badf;
  CHECK_ERR_MSG(pm_dataset_create_rows(&cb, &x), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "field 2") != NULL);
  badf[2].bytes = 0;
  badf[2].dtype = PM_DTYPE_OTHER; /* no itemsize */
  CHECK_ERR_MSG(pm_dataset_create_rows(&cb, &x), PM_ERR_INVALID);
  CHECK(x == NULL);
  CHECK_EQ_INT(atomic_load(&d.destroyed), 0);
  CHECK_OK(pm_dataset_destroy(ds));
  CHECK_EQ_INT(atomic_load(&d.destroyed), 1);
  rows_free(&d);
}

/* ---- ordered workers ---------------------------------------------------------------------- */

typedef struct ordered_run {
  uint64_t *seq[MAXW]; /* per worker: the (epoch << 32 | index) of its rows, in its call order */
  uint64_t len[MAXW];
  int64_t *draws; /* field 1's draw of every delivered row, in delivery order */
  uint64_t ndraws;
  int bad;                /* rows whose bytes were wrong */
  uint64_t *expect[MAXW]; /* per worker, from the delivered batches and claim k -> k % W */
  uint64_t elen[MAXW];
} ordered_run_t;

static void ordered_free(ordered_run_t *o) {
  for (int w = 0; w < MAXW; w++) {
    free(o->seq[w]);
    free(o->expect[w]);
  }
  free(o->draws);
}

static void ordered_run(pm_dataset_t *ds, rows_ds_t *d, uint64_t n, uint64_t batch, uint64_t epochs,
                        int workers, uint64_t claim, pm_delivery_t delivery, ordered_run_t *o) {
  memset(o, 0, sizeof *o);
  rows_reset(d);
  d->jitter = 1;
  uint64_t total = n * epochs;
  for (int w = 0; w < workers; w++) {
    o->seq[w] = calloc(total, sizeof(uint64_t));
    o->expect[w] = calloc(total, sizeof(uint64_t));
    REQUIRE(o->seq[w] && o->expect[w]);
  }
  o->draws = calloc(total, sizeof(int64_t));
  REQUIRE(o->draws != NULL);
  pm_loader_config_t c = base_config(batch, workers);
  c.shuffle = 1;
  c.seed = 42;
  c.epochs = epochs;
  c.delivery = delivery;
  c.prefetch = 4;
  c.ordered_workers = 1;
  c.claim_rows = claim;
  pm_loader_t *ld;
  REQUIRE_OK(pm_loader_create(ds, &c, &ld));
  pm_batch_t b;
  uint64_t k = 0; /* claims so far */
  while (pm_loader_next(ld, &b) == PM_OK) {
    unsigned char *f[3];
    batch_fields(&b, f);
    for (uint64_t r = 0; r < b.samples; r++) {
      if (r % claim == 0) k++;
      int w = (int)((k - 1) % (uint64_t)workers);
      o->expect[w][o->elen[w]++] = b.epoch << 32 | b.indices[r];
      if (!row_fields_ok(f[0] + r * F0, f[2] + r * 12, b.indices[r])) o->bad++;
      int64_t pair[2];
      memcpy(pair, f[1] + r * 16, 16);
      o->draws[o->ndraws++] = pair[1];
    }
    for (int j = 0; j < 3; j++) free(f[j]);
    CHECK_OK(pm_batch_release(&b, NULL));
  }
  CHECK_OK(pm_loader_destroy(ld));
  CHECK_EQ_SIZE(o->ndraws, total);
  /* The calls in id order are each worker's calls in its own order. */
  uint64_t calls = atomic_load(&d->ncalls);
  REQUIRE(calls <= d->log_cap);
  CHECK_EQ_SIZE(calls, claims_for(n, batch, epochs, claim));
  for (uint64_t id = 0; id < calls; id++) {
    const call_rec_t *cr = &d->log[id];
    REQUIRE(cr->worker >= 0 && cr->worker < workers && cr->idx_off != UINT64_MAX);
    for (uint64_t r = 0; r < cr->n; r++)
      o->seq[cr->worker][o->len[cr->worker]++] = cr->epoch << 32 | d->idx[cr->idx_off + r];
  }
}

static void test_ordered(pm_delivery_t delivery) {
  const uint64_t n = g_small ? 47 : 97, batch = 10, epochs = g_small ? 2 : 3, claim = 3;
  const int workers = 4;
  rows_ds_t d;
  pm_dataset_t *ds = make_rows(&d, n, 2 * n * epochs);
  ordered_run_t a, b;
  ordered_run(ds, &d, n, batch, epochs, workers, claim, delivery, &a);
  ordered_run(ds, &d, n, batch, epochs, workers, claim, delivery, &b);
  int bad = 0;
  for (int w = 0; w < workers; w++) {
    CHECK_EQ_SIZE(a.len[w], a.elen[w]);
    CHECK_EQ_SIZE(a.len[w], b.len[w]);
    CHECK(a.len[w] > 0);
    for (uint64_t i = 0; i < a.len[w] && i < a.elen[w] && i < b.len[w]; i++) {
      if (a.seq[w][i] != a.expect[w][i]) bad++; /* claim k went to worker k % workers */
      if (a.seq[w][i] != b.seq[w][i]) bad++;    /* the same on the second run */
    }
  }
  CHECK_EQ_INT(bad, 0);
  /* Per-worker random state: the same batches, bytes for bytes, on both runs. */
  CHECK_EQ_INT(a.bad, 0);
  CHECK_EQ_INT(b.bad, 0);
  CHECK_EQ_SIZE(a.ndraws, b.ndraws);
  CHECK(memcmp(a.draws, b.draws, a.ndraws * sizeof *a.draws) == 0);
  ordered_free(&a);
  ordered_free(&b);

  /* Bad values and an ordered loader over a dataset read row by row (still every sample). */
  pm_loader_config_t c = base_config(batch, workers);
  pm_loader_t *ld = NULL;
  c.ordered_workers = 2;
  CHECK_ERR_MSG(pm_loader_create(ds, &c, &ld), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "ordered_workers") != NULL);
  CHECK_OK(pm_dataset_destroy(ds));
  rows_free(&d);
}

/* A dataset read one row at a time (a zip), ordered: every sample once per epoch, no hang. */
static void test_ordered_per_row(void) {
  const uint64_t n = 57;
  rows_ds_t d;
  pm_dataset_t *ds = make_rows(&d, n, 4 * n);
  pm_dataset_t *z = NULL;
  REQUIRE_OK(pm_dataset_zip(&ds, 1, &z));
  pm_loader_config_t c = base_config(8, 3);
  c.shuffle = 1;
  c.epochs = 2;
  c.ordered_workers = 1;
  c.claim_rows = 2;
  pm_loader_t *ld;
  REQUIRE_OK(pm_loader_create(z, &c, &ld));
  unsigned char seen[2][57];
  memset(seen, 0, sizeof seen);
  pm_batch_t b;
  int bad = 0;
  while (pm_loader_next(ld, &b) == PM_OK) {
    unsigned char *f[3];
    batch_fields(&b, f);
    for (uint64_t r = 0; r < b.samples; r++) {
      seen[b.epoch][b.indices[r]]++;
      if (!row_fields_ok(f[0] + r * F0, f[2] + r * 12, b.indices[r])) bad++;
    }
    for (int j = 0; j < 3; j++) free(f[j]);
    CHECK_OK(pm_batch_release(&b, NULL));
  }
  CHECK_OK(pm_loader_destroy(ld));
  for (int e = 0; e < 2; e++)
    for (uint64_t i = 0; i < n; i++)
      if (seen[e][i] != 1) bad++;
  CHECK_EQ_INT(bad, 0);
  CHECK_OK(pm_dataset_destroy(z));
  CHECK_OK(pm_dataset_destroy(ds));
  rows_free(&d);
}

/* ---- claim_rows --------------------------------------------------------------------------- */

static void test_claim_rows(void) {
  test_rows_loader(PM_DELIVER_HOST, 4); /* claims of 4 rows, the last of a batch shorter */
  test_rows_loader(PM_DELIVER_DEVICE, 5);
  test_rows_loader(PM_DELIVER_HOST, 1);      /* one row per call */
  test_rows_loader(PM_DELIVER_DEVICE, 1000); /* capped at the batch: one call per batch */
}

/* ---- selects ------------------------------------------------------------------------------ */

/* A callback dataset: sample i is pm_test_fill(24 bytes, i + 1). */
static int pat_read(uint64_t index, void *dst, void *user) {
  (void)user;
  pm_test_fill(dst, 24, index + 1);
  return 0;
}

/* A .npy file of `n` samples of 24 bytes, sample i = pm_test_fill(i + 1). */
static void write_npy(const char *path, uint64_t n) {
  char dict[128];
  snprintf(dict, sizeof dict, "{'descr': '|u1', 'fortran_order': False, 'shape': (%llu, 24), }",
           (unsigned long long)n);
  size_t dl = strlen(dict), total = pm__align_up(10 + dl + 1, 64);
  unsigned char head[256];
  REQUIRE(total <= sizeof head);
  memcpy(head, "\x93NUMPY\x01\x00", 8);
  head[8] = (unsigned char)(total - 10);
  head[9] = (unsigned char)((total - 10) >> 8);
  memcpy(head + 10, dict, dl);
  memset(head + 10 + dl, ' ', total - 10 - dl);
  head[total - 1] = '\n';
  FILE *f = fopen(path, "wb");
  REQUIRE(f != NULL);
  REQUIRE(fwrite(head, 1, total, f) == total);
  for (uint64_t i = 0; i < n; i++) {
    unsigned char row[24];
    pm_test_fill(row, 24, i + 1);
    REQUIRE(fwrite(row, 1, 24, f) == 24);
  }
  fclose(f);
}

/* Deliver a select over a one-field dataset of 24-byte pattern samples; every row must be
 * base[sel[index]]. */
static void check_select_24(pm_dataset_t *sel, const uint64_t *map, uint64_t n,
                            pm_delivery_t delivery) {
  pm_loader_config_t c = base_config(7, 3);
  c.shuffle = 1;
  c.epochs = 2;
  c.delivery = delivery;
  pm_loader_t *ld;
  REQUIRE_OK(pm_loader_create(sel, &c, &ld));
  pm_batch_t b;
  uint64_t rows = 0;
  int bad = 0;
  while (pm_loader_next(ld, &b) == PM_OK) {
    CHECK_EQ_SIZE(b.inputs_bytes, b.samples * 24);
    unsigned char buf[7 * 24];
    if (b.event) CHECK_OK(pm_event_synchronize(b.event));
    CHECK_OK(pm_memcpy(buf, b.inputs, b.inputs_bytes, b.event ? PM_COPY_D2H : PM_COPY_H2H));
    for (uint64_t r = 0; r < b.samples; r++)
      if (!pm_test_fill_ok(buf + r * 24, 24, map[b.indices[r]] + 1)) bad++;
    rows += b.samples;
    CHECK_OK(pm_batch_release(&b, NULL));
  }
  CHECK_OK(pm_loader_destroy(ld));
  CHECK_EQ_INT(bad, 0);
  CHECK_EQ_SIZE(rows, 2 * n);
}

static void test_select(void) {
  const uint64_t base_n = 20;
  /* repeats, a reordering, more samples than the base */
  const uint64_t sel[] = {5, 0,  5, 19, 3, 3,  7,  11, 19, 2,  2, 2, 13, 0, 8, 14,
                          6, 18, 1, 4,  9, 10, 12, 15, 16, 17, 5, 5, 19, 0, 7};
  const uint64_t n = sizeof sel / sizeof sel[0];
  char dir[256], path[300];
  REQUIRE(pm_test_tmpdir(dir, sizeof dir, "rows"));
  snprintf(path, sizeof path, "%s/x.npy", dir);
  write_npy(path, base_n);
  const char *paths[1] = {path};
  pm_dataset_t *npy = NULL, *cbd = NULL, *s1 = NULL, *s2 = NULL, *bad = NULL;
  REQUIRE_OK(pm_dataset_open_npy(paths, 1, NULL, &npy));
  pm_dataset_callbacks_t cb;
  memset(&cb, 0, sizeof cb);
  cb.samples = base_n;
  cb.sample_bytes = 24;
  cb.read = pat_read;
  REQUIRE_OK(pm_dataset_create(&cb, &cbd));

  pm_dataset_t *bases[2] = {npy, cbd};
  for (int j = 0; j < 2; j++) {
    REQUIRE_OK(pm_dataset_select(bases[j], sel, n, &s1));
    pm_dataset_info_t in;
    CHECK_OK(pm_dataset_get_info(s1, &in));
    CHECK_EQ_SIZE(in.samples, n);
    CHECK_EQ_SIZE(in.sample_bytes, 24);
    CHECK_EQ_INT(in.fields, 1);
    unsigned char one[24];
    CHECK_OK(pm_dataset_read_sample(s1, 0, 3, one, NULL));
    CHECK(pm_test_fill_ok(one, 24, sel[3] + 1));
    void *d1[1] = {one};
    CHECK_OK(pm_dataset_read_fields(s1, 0, n - 1, d1));
    CHECK(pm_test_fill_ok(one, 24, sel[n - 1] + 1));
    CHECK_ERR_MSG(pm_dataset_read_sample(s1, 0, n, one, NULL), PM_ERR_INVALID);
    CHECK_ERR_MSG(pm_dataset_destroy(bases[j]), PM_ERR_BUSY); /* the select uses it */
    check_select_24(s1, sel, n, PM_DELIVER_DEVICE);
    check_select_24(s1, sel, n, PM_DELIVER_HOST);
    /* A select of the select: sample i is sel[sel2[i]]. */
    const uint64_t sel2[] = {30, 0, 4, 4, 12};
    uint64_t map2[5];
    for (int i = 0; i < 5; i++) map2[i] = sel[sel2[i]];
    REQUIRE_OK(pm_dataset_select(s1, sel2, 5, &s2));
    CHECK_ERR_MSG(pm_dataset_destroy(s1), PM_ERR_BUSY);
    check_select_24(s2, map2, 5, PM_DELIVER_HOST);
    CHECK_OK(pm_dataset_destroy(s2));
    CHECK_OK(pm_dataset_destroy(s1));
  }

  /* Bad input. */
  const uint64_t out_of_range[] = {1, 2, base_n, 3};
  CHECK_ERR_MSG(pm_dataset_select(npy, out_of_range, 4, &bad), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "indices[2]") != NULL);
  CHECK(strstr(pm_last_error(), "is 20") != NULL);
  const uint64_t huge[] = {UINT64_MAX};
  CHECK_ERR_MSG(pm_dataset_select(npy, huge, 1, &bad), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_dataset_select(npy, sel, 0, &bad), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_dataset_select(npy, NULL, 3, &bad), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_dataset_select(NULL, sel, 3, &bad), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_dataset_select(npy, sel, 3, NULL), PM_ERR_INVALID);
  CHECK(bad == NULL);
  /* The indices are copied: changing the caller's array changes nothing. */
  uint64_t mine[3] = {4, 9, 4};
  REQUIRE_OK(pm_dataset_select(cbd, mine, 3, &s1));
  mine[0] = mine[1] = mine[2] = 0;
  unsigned char one[24];
  CHECK_OK(pm_dataset_read_sample(s1, 0, 1, one, NULL));
  CHECK(pm_test_fill_ok(one, 24, 10));
  CHECK_OK(pm_dataset_destroy(s1));
  CHECK_OK(pm_dataset_destroy(npy)); /* no longer busy */
  CHECK_OK(pm_dataset_destroy(cbd));
  pm_test_rmtree(dir);
}

/* A select over a rows dataset: a claim is still one read_rows call on the base, with the
 * indices mapped; a select of that select too. */
static void test_select_rows(pm_delivery_t delivery) {
  const uint64_t base_n = 40;
  uint64_t sel[71];
  uint64_t st = 9;
  for (int i = 0; i < 71; i++) sel[i] = pm_test_rand(&st) % base_n; /* repeats */
  rows_ds_t d;
  pm_dataset_t *ds = make_rows(&d, base_n, 4 * 71 * 2);
  pm_dataset_t *s1 = NULL, *s2 = NULL;
  REQUIRE_OK(pm_dataset_select(ds, sel, 71, &s1));
  pm_dataset_info_t in;
  CHECK_OK(pm_dataset_get_info(s1, &in));
  CHECK_EQ_INT(in.fields, 3);
  CHECK_EQ_SIZE(in.samples, 71);
  pm_field_t f;
  CHECK_OK(pm_dataset_get_field(s1, 1, &f));
  CHECK_EQ_SIZE(f.bytes, 16);
  uint64_t sel2[50], map2[50];
  for (int i = 0; i < 50; i++) {
    sel2[i] = (uint64_t)(i * 7 % 71);
    map2[i] = sel[sel2[i]];
  }
  REQUIRE_OK(pm_dataset_select(s1, sel2, 50, &s2));
  for (int level = 0; level < 2; level++) {
    rows_reset(&d);
    uint64_t n = level ? 50 : 71, claim = 3, batch = 8;
    pm_loader_config_t c = base_config(batch, 3);
    c.shuffle = 1;
    c.epochs = 2;
    c.delivery = delivery;
    c.claim_rows = claim;
    pm_loader_t *ld;
    REQUIRE_OK(pm_loader_create(level ? s2 : s1, &c, &ld));
    run_check_t rc;
    memset(&rc, 0, sizeof rc);
    rc.d = &d;
    rc.map = level ? map2 : sel;
    rc.workers = 3;
    rc.claim = claim;
    rc.bpe = (n + batch - 1) / batch;
    rc.seen = calloc(d.log_cap, 1);
    REQUIRE(rc.seen != NULL);
    pm_batch_t b;
    while (pm_loader_next(ld, &b) == PM_OK) {
      check_rows_batch(&rc, &b);
      CHECK_OK(pm_batch_release(&b, NULL));
    }
    CHECK_OK(pm_loader_destroy(ld));
    CHECK_EQ_SIZE(rc.rows, 2 * n);
    check_calls(&rc, rc.claims);
    CHECK_EQ_SIZE(rc.claims, claims_for(n, batch, 2, claim));
    free(rc.seen);
  }
  /* One sample outside a loader: the base's index, n = 1, worker -1. */
  rows_reset(&d);
  unsigned char f0[F0], f2[12];
  int64_t pair[2];
  void *dsts[3] = {f0, pair, f2};
  CHECK_OK(pm_dataset_read_fields(s2, 0, 3, dsts));
  CHECK(row_fields_ok(f0, f2, map2[3]));
  CHECK_EQ_SIZE(atomic_load(&d.ncalls), 1);
  CHECK_EQ_SIZE(d.log[0].n, 1);
  CHECK_EQ_INT(d.log[0].worker, -1);
  CHECK_EQ_SIZE(d.idx[d.log[0].idx_off], map2[3]);
  CHECK_ERR_MSG(pm_dataset_destroy(ds), PM_ERR_BUSY);
  CHECK_ERR_MSG(pm_dataset_destroy(s1), PM_ERR_BUSY);
  CHECK_OK(pm_dataset_destroy(s2));
  CHECK_OK(pm_dataset_destroy(s1));
  CHECK_EQ_INT(atomic_load(&d.destroyed), 0);
  CHECK_OK(pm_dataset_destroy(ds));
  CHECK_EQ_INT(atomic_load(&d.destroyed), 1);
  rows_free(&d);
}

/* ---- errors and destroy ------------------------------------------------------------------- */

/* A read_rows failure at sample 37 (batch 3 without shuffling): batches 0..2, then the error at
 * batch 3 on every call, naming the batch and the claim's first row. */
static void test_rows_error(void) {
  const uint64_t batch = 10;
  rows_ds_t d;
  pm_dataset_t *ds = make_rows(&d, 100, 1000);
  for (int variant = 0; variant < 3; variant++) {
    rows_reset(&d);
    d.fail_at = 37;
    d.fail_rc = variant == 1 ? 5 : (int)PM_ERR_FORMAT;
    pm_loader_config_t c = base_config(batch, 3);
    c.prefetch = 4;
    c.claim_rows = 5;
    c.ordered_workers = variant == 2;
    c.delivery = variant == 1 ? PM_DELIVER_HOST : PM_DELIVER_DEVICE;
    pm_loader_t *ld;
    REQUIRE_OK(pm_loader_create(ds, &c, &ld));
    pm_batch_t b;
    for (uint64_t i = 0; i < 3; i++) {
      REQUIRE_OK(pm_loader_next(ld, &b));
      CHECK_EQ_SIZE(b.samples, batch);
      CHECK_EQ_SIZE(b.index, i);
      CHECK_OK(pm_batch_release(&b, NULL));
    }
    pm_status_t want = variant == 1 ? PM_ERR_IO : PM_ERR_FORMAT;
    CHECK_ERR_MSG(pm_loader_next(ld, &b), want);
    CHECK(strstr(pm_last_error(), "epoch 0, batch 3, row 5 (a claim of 5 rows)") != NULL);
    CHECK(strstr(pm_last_error(), "from sample 35") != NULL);
    CHECK_ERR_MSG(pm_loader_next(ld, &b), want);
    pm_loader_state_t s;
    CHECK_OK(pm_loader_state(ld, &s));
    CHECK_EQ_SIZE(s.batch, 3);
    CHECK_OK(pm_loader_destroy(ld));
  }
  CHECK_OK(pm_dataset_destroy(ds));
  rows_free(&d);
}

typedef struct opener {
  pm_test_gate_t *gate;
  int ms;
} opener_t;

static void *open_later(void *arg) {
  opener_t *o = arg;
  pm_test_sleep_ms(o->ms);
  pm_test_gate_open(o->gate);
  return NULL;
}

/* Worker 0 is held inside its first call; the others take their claims and then wait for worker
 * 0's next turn. Destroy (variant 0), or an error in another worker's read (variant 1), must
 * wake them all: no hang (alarm). */
static void test_destroy_waiting(void) {
  const int workers = 4;
  rows_ds_t d;
  pm_dataset_t *ds = make_rows(&d, 400, 1000);
  for (int variant = 0; variant < 2; variant++) {
    rows_reset(&d);
    pm_test_gate_t gate;
    pm_test_gate_init(&gate);
    d.gate = &gate;
    d.gate_worker = 0;
    if (variant == 1) {
      d.fail_at = 6; /* claim 3 (rows 6, 7 of batch 0): worker 3's, the last before 0's turn */
      d.fail_rc = (int)PM_ERR_FORMAT;
    }
    pm_loader_config_t c = base_config(8, workers);
    c.ordered_workers = 1;
    c.claim_rows = 2;
    pm_loader_t *ld;
    REQUIRE_OK(pm_loader_create(ds, &c, &ld));
    /* Workers 1..3 make their one call each; then every claim waits for worker 0. */
    for (int i = 0; i < 5000 && (atomic_load(&d.ncalls) < (unsigned long)workers ||
                                 atomic_load(&d.at_gate) == 0);
         i++)
      pm_test_sleep_ms(1);
    CHECK_EQ_SIZE(atomic_load(&d.ncalls), workers);
    pm_test_sleep_ms(20);
    CHECK_EQ_SIZE(atomic_load(&d.ncalls), workers); /* nobody took worker 0's turn */
    if (variant == 1) {
      pm_batch_t b;
      CHECK_ERR_MSG(pm_loader_next(ld, &b), PM_ERR_FORMAT); /* the error wakes the consumer */
    }
    opener_t o = {&gate, 50};
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, open_later, &o) == 0);
    CHECK_OK(pm_loader_destroy(ld)); /* joins every worker: they all woke */
    pthread_join(t, NULL);
    pm_test_gate_destroy(&gate);
  }
  CHECK_OK(pm_dataset_destroy(ds));
  rows_free(&d);
}

int main(void) {
  g_small = pm_test_small();
  pm_test_init();
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  fields_init();
  alarm(240); /* a hang fails */
  test_rows_single();
  test_rows_loader(PM_DELIVER_DEVICE, 0);
  test_rows_loader(PM_DELIVER_HOST, 0);
  test_claim_rows();
  test_ordered(PM_DELIVER_DEVICE);
  test_ordered(PM_DELIVER_HOST);
  test_ordered_per_row();
  test_select();
  test_select_rows(PM_DELIVER_DEVICE);
  test_select_rows(PM_DELIVER_HOST);
  test_rows_error();
  test_destroy_waiting();
  alarm(0);
  CHECK_OK(pm_finalize());
  return pm_test_finish("test_rows");
}
