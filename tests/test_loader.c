/*
 * The data loader: the sampler (permutations per epoch, sharding with and without padding,
 * drop_last), then loaders end to end over callback datasets whose samples are a pattern of
 * their index, so every delivered row is checked byte for byte (device batches are copied back):
 * 3 epochs shuffled on 2 ranks x 2 workers with each sample exactly once per epoch, padding,
 * host delivery, pageable slots, resume from a saved state, end of data, a read error at sample
 * k (the complete batches before it, then the error, every time), injected copy faults, slots
 * held by the caller, bad input, and destroying loaders mid-epoch. Then fields: a multi-field
 * callback dataset (one call per sample for all fields) and zips, delivered through one slot per
 * batch; two consumers in pm_loader_next at once; destroy with batches held (their slots freed
 * at release, pinned memory back in the pool) and use after destroy; a budget the loader's own
 * slots can never fit. A hang fails through alarm().
 */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "internal.h"
#include "loader_internal.h"

static int g_small; /* PINMEM_TEST_SMALL: fewer samples and epochs */

/* ---- a callback dataset: sample i is pm_test_fill(.., size, i + 1) -------------------------- */

typedef struct pat_ds {
  size_t size;
  long fail_at; /* index whose read fails, or -1 */
  int fail_rc;
  int sleep_us; /* per read, for the mid-epoch destroy tests */
  pm_test_gate_t *gate; /* when set, every read waits until it opens */
  atomic_long reads;
  atomic_int destroyed;
} pat_ds_t;

static int pat_read(uint64_t index, void *dst, void *user) {
  pat_ds_t *p = user;
  atomic_fetch_add(&p->reads, 1);
  if (p->sleep_us) {
    struct timespec ts = {0, (long)p->sleep_us * 1000L};
    nanosleep(&ts, NULL);
  }
  if (p->gate) pm_test_gate_wait(p->gate);
  if ((long)index == p->fail_at) return p->fail_rc;
  pm_test_fill(dst, p->size, index + 1);
  return 0;
}

static void pat_destroy(void *user) {
  pat_ds_t *p = user;
  atomic_fetch_add(&p->destroyed, 1);
}

static pm_dataset_t *make_ds(pat_ds_t *p, uint64_t samples, size_t size) {
  p->size = size;
  p->fail_at = -1;
  p->fail_rc = 0;
  p->sleep_us = 0;
  p->gate = NULL;
  atomic_init(&p->reads, 0);
  atomic_init(&p->destroyed, 0);
  pm_dataset_callbacks_t cb;
  memset(&cb, 0, sizeof cb);
  cb.samples = samples;
  cb.sample_bytes = size;
  cb.read = pat_read;
  cb.user = p;
  cb.destroy = pat_destroy;
  pm_dataset_t *ds = NULL;
  REQUIRE_OK(pm_dataset_create(&cb, &ds));
  return ds;
}

static bool row_ok(const unsigned char *row, size_t size, uint64_t index) {
  unsigned char want[4096];
  if (size > sizeof want) return false;
  pm_test_fill(want, size, index + 1);
  return memcmp(row, want, size) == 0;
}

/* Check every row of a delivered batch, in the host slot and (device delivery) in the device
 * buffer once its event completed. */
static void check_batch(const pm_batch_t *b, size_t size, bool device) {
  CHECK(b->samples > 0);
  CHECK_EQ_SIZE(b->inputs_bytes, b->samples * size);
  CHECK_EQ_SIZE(b->shape[0], b->samples);
  const unsigned char *rows = b->host_inputs;
  unsigned char *copy = NULL;
  if (device) {
    CHECK(b->event != NULL);
    CHECK(b->inputs != b->host_inputs);
    CHECK_OK(pm_event_synchronize(b->event));
    copy = malloc(b->inputs_bytes);
    REQUIRE(copy != NULL);
    memset(copy, 0, b->inputs_bytes);
    CHECK_OK(pm_memcpy(copy, b->inputs, b->inputs_bytes, PM_COPY_D2H));
    rows = copy;
  } else {
    CHECK(b->inputs == b->host_inputs);
  }
  int bad = 0;
  for (size_t r = 0; r < b->samples; r++) {
    if (!row_ok(rows + r * size, size, b->indices[r])) bad++;
    if (device && !row_ok((const unsigned char *)b->host_inputs + r * size, size, b->indices[r]))
      bad++;
  }
  CHECK_EQ_INT(bad, 0);
  free(copy);
}

static pm_loader_config_t base_config(size_t batch) {
  pm_loader_config_t c;
  pm_loader_config_init(&c);
  c.batch_size = batch;
  c.workers = 2;
  c.prefetch = 3;
  c.rank = 0;
  c.world_size = 1;
  return c;
}

/* ---- sampler ------------------------------------------------------------------------------- */

static void test_permute(void) {
  static const uint64_t ns[] = {1, 2, 3, 5, 64, 1000, 4097};
  for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
    uint64_t n = ns[k];
    unsigned char *seen = calloc(n, 1);
    REQUIRE(seen != NULL);
    int bad = 0;
    for (uint64_t i = 0; i < n; i++) {
      uint64_t p = pm__permute(i, n, 42);
      if (p >= n || seen[p]++) bad++;
      if (pm__permute(i, n, 42) != p) bad++; /* a function of its inputs */
    }
    CHECK_EQ_INT(bad, 0);
    free(seen);
  }
  /* Different keys (epochs) give different orders; not the identity. */
  int same = 0, fixed = 0;
  for (uint64_t i = 0; i < 1000; i++) {
    same += pm__permute(i, 1000, 1) == pm__permute(i, 1000, 2);
    fixed += pm__permute(i, 1000, 1) == i;
  }
  CHECK(same < 50);
  CHECK(fixed < 50);
}

static void test_sampler(void) {
  pm__sampler_t s;
  /* Reproducible and new per epoch. */
  REQUIRE_OK(pm__sampler_init(&s, 100, 10, true, 7, false, 0, 1));
  CHECK_EQ_SIZE(s.per_rank, 100);
  CHECK_EQ_SIZE(s.batches, 10);
  int diff = 0;
  for (uint64_t i = 0; i < 100; i++)
    diff += pm__sampler_index(&s, 0, i) != pm__sampler_index(&s, 1, i);
  CHECK(diff > 50);
  pm__sampler_t s2;
  REQUIRE_OK(pm__sampler_init(&s2, 100, 10, true, 7, false, 0, 1));
  int same = 1;
  for (uint64_t i = 0; i < 100; i++)
    same &= pm__sampler_index(&s, 3, i) == pm__sampler_index(&s2, 3, i);
  CHECK(same);
  REQUIRE_OK(pm__sampler_init(&s2, 100, 10, true, 8, false, 0, 1));
  diff = 0;
  for (uint64_t i = 0; i < 100; i++)
    diff += pm__sampler_index(&s, 0, i) != pm__sampler_index(&s2, 0, i);
  CHECK(diff > 50);
  /* Sequential. */
  REQUIRE_OK(pm__sampler_init(&s, 10, 4, false, 0, false, 0, 1));
  CHECK_EQ_SIZE(s.batches, 3);
  CHECK_EQ_SIZE(pm__sampler_rows(&s, 2), 2);
  for (uint64_t i = 0; i < 10; i++) CHECK_EQ_SIZE(pm__sampler_index(&s, 5, i), i);

  /* Sharding, divisible: every sample exactly once over the ranks. */
  for (int shuffle = 0; shuffle < 2; shuffle++) {
    int count[120] = {0};
    for (int r = 0; r < 4; r++) {
      REQUIRE_OK(pm__sampler_init(&s, 120, 7, shuffle, 3, false, r, 4));
      CHECK_EQ_SIZE(s.per_rank, 30);
      CHECK_EQ_SIZE(s.batches, 5);
      CHECK_EQ_SIZE(pm__sampler_rows(&s, 4), 2);
      for (uint64_t i = 0; i < s.per_rank; i++) count[pm__sampler_index(&s, 2, i)]++;
    }
    int bad = 0;
    for (int i = 0; i < 120; i++) bad += count[i] != 1;
    CHECK_EQ_INT(bad, 0);
  }
  /* Not divisible: padded with the start of the order (as DistributedSampler). */
  {
    int count[10] = {0};
    uint64_t order0 = 0, order1 = 0;
    for (int r = 0; r < 4; r++) {
      REQUIRE_OK(pm__sampler_init(&s, 10, 2, true, 9, false, r, 4));
      CHECK_EQ_SIZE(s.per_rank, 3);
      CHECK_EQ_SIZE(s.batches, 2);
      for (uint64_t i = 0; i < s.per_rank; i++) count[pm__sampler_index(&s, 0, i)]++;
      if (r == 0) order0 = pm__sampler_index(&s, 0, 0);
      if (r == 1) order1 = pm__sampler_index(&s, 0, 0);
    }
    /* positions 10 and 11 (rank 2 and 3, pos 2) repeat positions 0 and 1 */
    int twice = 0, bad = 0;
    for (int i = 0; i < 10; i++) {
      if (count[i] == 2) twice++;
      if (count[i] < 1 || count[i] > 2) bad++;
    }
    CHECK_EQ_INT(bad, 0);
    CHECK_EQ_INT(twice, 2);
    CHECK_EQ_INT(count[order0], 2);
    CHECK_EQ_INT(count[order1], 2);
    REQUIRE_OK(pm__sampler_init(&s, 10, 2, true, 9, false, 2, 4));
    CHECK_EQ_SIZE(pm__sampler_index(&s, 0, 2), order0);
  }
  /* drop_last: cut to a multiple of the world, partial batches dropped, nothing twice. */
  {
    int count[10] = {0};
    for (int r = 0; r < 4; r++) {
      REQUIRE_OK(pm__sampler_init(&s, 10, 2, true, 9, true, r, 4));
      CHECK_EQ_SIZE(s.per_rank, 2);
      CHECK_EQ_SIZE(s.batches, 1);
      for (uint64_t i = 0; i < s.per_rank; i++) count[pm__sampler_index(&s, 0, i)]++;
    }
    int total = 0, bad = 0;
    for (int i = 0; i < 10; i++) {
      total += count[i];
      bad += count[i] > 1;
    }
    CHECK_EQ_INT(total, 8);
    CHECK_EQ_INT(bad, 0);
    REQUIRE_OK(pm__sampler_init(&s, 100, 8, false, 0, true, 0, 1));
    CHECK_EQ_SIZE(s.batches, 12);
    CHECK_EQ_SIZE(pm__sampler_rows(&s, 11), 8);
  }
  /* Nothing to deliver, bad ranks. */
  CHECK_ERR_MSG(pm__sampler_init(&s, 3, 1, false, 0, true, 0, 4), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm__sampler_init(&s, 10, 11, false, 0, true, 0, 1), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm__sampler_init(&s, 10, 2, false, 0, false, 4, 4), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm__sampler_init(&s, 10, 2, false, 0, false, -1, 4), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm__sampler_init(&s, 0, 2, false, 0, false, 0, 1), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm__sampler_init(&s, 10, 0, false, 0, false, 0, 1), PM_ERR_INVALID);
  /* More ranks than samples without drop_last: everyone still gets one. */
  REQUIRE_OK(pm__sampler_init(&s, 3, 1, false, 0, false, 3, 4));
  CHECK_EQ_SIZE(s.per_rank, 1);
  CHECK_EQ_SIZE(pm__sampler_index(&s, 0, 0), 0);
}

/* ---- end to end ---------------------------------------------------------------------------- */

/* The CI target: 3 epochs, shuffled, 2 ranks x 2 workers, each sample exactly once per epoch
 * over the ranks, every byte checked. Then the same with padding (n not divisible). */
static void test_ranks(pm_delivery_t delivery, uint64_t n) {
  const size_t size = 777, batch = 16;
  const int epochs = g_small ? 2 : 3, world = 2;
  pat_ds_t p;
  pm_dataset_t *ds = make_ds(&p, n, size);
  pm_loader_t *ld[2];
  pm_stream_t st[2];
  for (int r = 0; r < world; r++) {
    pm_loader_config_t c = base_config(batch);
    c.shuffle = 1;
    c.seed = 1234;
    c.rank = r;
    c.world_size = world;
    c.workers = 2;
    c.epochs = (uint64_t)epochs;
    c.delivery = delivery;
    REQUIRE_OK(pm_loader_create(ds, &c, &ld[r]));
    REQUIRE_OK(pm_stream_create(&st[r]));
  }
  pm_loader_stats_t s0;
  CHECK_OK(pm_loader_get_stats(ld[0], &s0));
  uint64_t per_rank = (n + world - 1) / world;
  CHECK_EQ_SIZE(s0.samples_per_epoch, per_rank);
  CHECK_EQ_SIZE(s0.batches_per_epoch, (per_rank + batch - 1) / batch);
  CHECK_EQ_INT(s0.workers, 2);
  CHECK_EQ_INT(s0.prefetch, 3);
  CHECK_EQ_SIZE(s0.device_bytes, delivery == PM_DELIVER_DEVICE ? 3 * batch * size : 0);

  int *count = calloc(n, sizeof *count);
  REQUIRE(count != NULL);
  uint64_t first_order[2] = {UINT64_MAX, UINT64_MAX};
  int diff_epochs = 0;
  for (int e = 0; e < epochs; e++) {
    memset(count, 0, n * sizeof *count);
    for (uint64_t bi = 0; bi < s0.batches_per_epoch; bi++) {
      for (int r = 0; r < world; r++) {
        pm_batch_t b;
        REQUIRE_OK(pm_loader_next(ld[r], &b));
        CHECK_EQ_SIZE(b.epoch, (uint64_t)e);
        CHECK_EQ_SIZE(b.index, bi);
        CHECK_OK(pm_batch_wait_stream(&b, st[r]));
        check_batch(&b, size, delivery == PM_DELIVER_DEVICE);
        for (size_t i = 0; i < b.samples; i++) count[b.indices[i]]++;
        if (bi == 0 && r == 0) {
          if (e == 0) first_order[0] = b.indices[0] * n + b.indices[1];
          if (e == 1) first_order[1] = b.indices[0] * n + b.indices[1];
        }
        CHECK_OK(pm_batch_release(&b, st[r]));
      }
    }
    int bad = 0, twice = 0;
    for (uint64_t i = 0; i < n; i++) {
      if (count[i] < 1 || count[i] > 2) bad++;
      twice += count[i] == 2;
    }
    CHECK_EQ_INT(bad, 0);
    CHECK_EQ_INT(twice, (int)(per_rank * world - n));
  }
  diff_epochs = first_order[0] != first_order[1];
  CHECK(diff_epochs);
  for (int r = 0; r < world; r++) {
    pm_batch_t b;
    CHECK_ERR_MSG(pm_loader_next(ld[r], &b), PM_ERR_STATE); /* end of data, every time */
    CHECK_ST(pm_loader_next(ld[r], &b), PM_ERR_STATE);
    pm_loader_stats_t s;
    CHECK_OK(pm_loader_get_stats(ld[r], &s));
    CHECK_EQ_SIZE(s.batches, s0.batches_per_epoch * (uint64_t)epochs);
    CHECK_EQ_SIZE(s.samples, per_rank * (uint64_t)epochs);
    CHECK_EQ_SIZE(s.bytes, per_rank * (uint64_t)epochs * size);
    pm_loader_state_t ls;
    CHECK_OK(pm_loader_state(ld[r], &ls));
    CHECK_EQ_SIZE(ls.epoch, (uint64_t)epochs);
    CHECK_EQ_SIZE(ls.batch, 0);
    CHECK_OK(pm_stream_synchronize(st[r]));
    CHECK_OK(pm_loader_destroy(ld[r]));
    CHECK_OK(pm_stream_destroy(st[r]));
  }
  /* Every sample was read from the callback exactly as often as it was delivered. */
  CHECK_EQ_INT(atomic_load(&p.reads), (long)(per_rank * world * (uint64_t)epochs));
  free(count);
  CHECK_OK(pm_dataset_destroy(ds));
  CHECK_EQ_INT(atomic_load(&p.destroyed), 1);
}

/* Collect the delivered index sequence of a loader (from its current position to the end). */
static size_t drain(pm_loader_t *ld, uint64_t *out, size_t max, size_t size, bool device) {
  size_t k = 0;
  pm_batch_t b;
  pm_status_t st;
  while ((st = pm_loader_next(ld, &b)) == PM_OK) {
    check_batch(&b, size, device);
    for (size_t i = 0; i < b.samples && k < max; i++) out[k++] = b.indices[i];
    CHECK_OK(pm_batch_release(&b, NULL));
  }
  CHECK_ST(st, PM_ERR_STATE);
  return k;
}

static void test_resume(void) {
  const size_t size = 100, batch = 8;
  const uint64_t n = 203, epochs = 3;
  pat_ds_t p;
  pm_dataset_t *ds = make_ds(&p, n, size);
  pm_loader_config_t c = base_config(batch);
  c.shuffle = 1;
  c.seed = 99;
  c.epochs = epochs;
  size_t max = (size_t)(n * epochs);
  uint64_t *all = calloc(max, sizeof *all), *rest = calloc(max, sizeof *rest);
  REQUIRE(all && rest);

  pm_loader_t *ld;
  REQUIRE_OK(pm_loader_create(ds, &c, &ld));
  size_t total = drain(ld, all, max, size, true);
  CHECK_EQ_SIZE(total, max);
  CHECK_OK(pm_loader_destroy(ld));

  /* Stop mid-epoch 1 (with batches still in flight), save, resume: exactly the rest. */
  uint64_t bpe = (n + batch - 1) / batch, stop_after = bpe + 5;
  REQUIRE_OK(pm_loader_create(ds, &c, &ld));
  size_t k = 0;
  for (uint64_t i = 0; i < stop_after; i++) {
    pm_batch_t b;
    REQUIRE_OK(pm_loader_next(ld, &b));
    k += b.samples;
    CHECK_OK(pm_batch_release(&b, NULL));
  }
  pm_loader_state_t state;
  CHECK_OK(pm_loader_state(ld, &state));
  CHECK_EQ_SIZE(state.epoch, 1);
  CHECK_EQ_SIZE(state.batch, 5);
  CHECK_EQ_INT(state.magic, PM_LOADER_STATE_MAGIC);
  CHECK_OK(pm_loader_destroy(ld));

  c.resume = &state;
  REQUIRE_OK(pm_loader_create(ds, &c, &ld));
  size_t got = drain(ld, rest, max, size, true);
  CHECK_EQ_SIZE(k + got, max);
  CHECK(memcmp(rest, all + k, got * sizeof *rest) == 0);
  CHECK_OK(pm_loader_destroy(ld));

  /* A state that does not fit the config is refused with the reason. */
  pm_loader_state_t bad = state;
  c.resume = &bad;
  c.seed = 100;
  CHECK_ERR_MSG(pm_loader_create(ds, &c, &ld), PM_ERR_INVALID);
  c.seed = 99;
  bad.magic = 1;
  CHECK_ERR_MSG(pm_loader_create(ds, &c, &ld), PM_ERR_INVALID);
  bad = state;
  bad.batch = bpe;
  CHECK_ERR_MSG(pm_loader_create(ds, &c, &ld), PM_ERR_INVALID);
  bad = state;
  bad.world_size = 2;
  CHECK_ERR_MSG(pm_loader_create(ds, &c, &ld), PM_ERR_INVALID);
  bad = state;
  bad.samples = n + 1;
  CHECK_ERR_MSG(pm_loader_create(ds, &c, &ld), PM_ERR_INVALID);
  /* A state saved at the very end resumes to "end of data". */
  bad = state;
  bad.epoch = epochs;
  bad.batch = 0;
  REQUIRE_OK(pm_loader_create(ds, &c, &ld));
  CHECK_OK(pm_loader_destroy(ld));
  c.resume = &bad;
  REQUIRE_OK(pm_loader_create(ds, &c, &ld));
  pm_batch_t b;
  CHECK_ST(pm_loader_next(ld, &b), PM_ERR_STATE);
  CHECK_OK(pm_loader_destroy(ld));

  free(all);
  free(rest);
  CHECK_OK(pm_dataset_destroy(ds));
}

/* Host delivery, pageable slots, drop_last, a partial last batch, odd sizes. */
static void test_modes(void) {
  const size_t size = 1001;
  pat_ds_t p;
  pm_dataset_t *ds = make_ds(&p, 50, size);
  for (int mode = 0; mode < 4; mode++) {
    pm_loader_config_t c = base_config(7);
    c.delivery = mode == 1 ? PM_DELIVER_HOST : PM_DELIVER_DEVICE;
    c.pin_memory = mode == 2 ? 0 : 1;
    c.drop_last = mode == 3;
    c.workers = mode + 1;
    c.prefetch = mode + 1;
    c.epochs = 2;
    pm_loader_t *ld;
    REQUIRE_OK(pm_loader_create(ds, &c, &ld));
    uint64_t seq[200];
    size_t k = drain(ld, seq, 200, size, c.delivery == PM_DELIVER_DEVICE);
    CHECK_EQ_SIZE(k, mode == 3 ? 2 * 49 : 2 * 50);
    int bad = 0;
    for (size_t i = 0; i < k; i++) bad += seq[i] != i % (mode == 3 ? 49 : 50);
    CHECK_EQ_INT(bad, 0);
    pm_loader_stats_t s;
    CHECK_OK(pm_loader_get_stats(ld, &s));
    CHECK_EQ_SIZE(s.batches_per_epoch, mode == 3 ? 7 : 8);
    CHECK_EQ_SIZE(s.slot_bytes, 7 * size);
    CHECK_EQ_SIZE(s.host_bytes, (size_t)(mode + 1) * 7 * size);
    CHECK_EQ_SIZE(s.device_bytes, mode == 1 ? 0 : (size_t)(mode + 1) * 7 * size);
    CHECK_EQ_SIZE(s.batches, 2 * s.batches_per_epoch);
    CHECK(s.stall_seconds >= 0 && s.next_seconds >= s.stall_seconds * 0.999);
    CHECK_OK(pm_loader_destroy(ld));
  }
  /* The last batch of an epoch is partial, and says so in its shape. */
  pm_loader_config_t c = base_config(16);
  pm_loader_t *ld;
  REQUIRE_OK(pm_loader_create(ds, &c, &ld));
  pm_batch_t b;
  for (int i = 0; i < 4; i++) {
    REQUIRE_OK(pm_loader_next(ld, &b));
    CHECK_EQ_SIZE(b.samples, i < 3 ? 16 : 2);
    CHECK_EQ_SIZE(b.shape[0], b.samples);
    CHECK_EQ_INT(b.ndim, 2);
    CHECK_EQ_SIZE(b.shape[1], size);
    CHECK_EQ_INT(b.dtype, PM_DTYPE_OTHER);
    CHECK_OK(pm_batch_release(&b, NULL));
  }
  CHECK_ST(pm_loader_next(ld, &b), PM_ERR_STATE);
  CHECK_OK(pm_loader_destroy(ld));
  /* Endless (epochs 0): runs on past the first epochs. */
  c.epochs = 0;
  REQUIRE_OK(pm_loader_create(ds, &c, &ld));
  for (int i = 0; i < 13; i++) {
    REQUIRE_OK(pm_loader_next(ld, &b));
    CHECK_EQ_SIZE(b.epoch, (uint64_t)i / 4);
    CHECK_OK(pm_batch_release(&b, NULL));
  }
  CHECK_OK(pm_loader_destroy(ld));
  CHECK_OK(pm_dataset_destroy(ds));
}

/* A read fails at sample k: the whole batches before it arrive, then its batch reports the
 * error (never a short batch), on every later call too, and the state points at it. */
static void test_read_error(void) {
  const size_t size = 64, batch = 10;
  pat_ds_t p;
  pm_dataset_t *ds = make_ds(&p, 100, size);
  for (int variant = 0; variant < 3; variant++) {
    p.fail_at = variant == 2 ? 0 : 37;
    p.fail_rc = variant == 1 ? (int)PM_ERR_FORMAT : 5;
    pm_loader_config_t c = base_config(batch);
    c.workers = 3;
    c.prefetch = 4;
    c.delivery = variant == 1 ? PM_DELIVER_HOST : PM_DELIVER_DEVICE;
    pm_loader_t *ld;
    REQUIRE_OK(pm_loader_create(ds, &c, &ld));
    pm_batch_t b;
    uint64_t fail_batch = (uint64_t)p.fail_at / batch;
    for (uint64_t i = 0; i < fail_batch; i++) {
      REQUIRE_OK(pm_loader_next(ld, &b));
      CHECK_EQ_SIZE(b.samples, batch);
      check_batch(&b, size, c.delivery == PM_DELIVER_DEVICE);
      CHECK_OK(pm_batch_release(&b, NULL));
    }
    pm_status_t want = variant == 1 ? PM_ERR_FORMAT : PM_ERR_IO;
    memset(&b, 0x5a, sizeof b);
    CHECK_ERR_MSG(pm_loader_next(ld, &b), want);
    CHECK(strstr(pm_last_error(), variant == 2 ? "sample 0 " : "sample 37 ") != NULL);
    CHECK_EQ_INT(b.samples, 0x5a5a5a5a5a5a5a5a); /* output untouched */
    /* The sample the message names, for a binding to re-raise that sample's own error. */
    uint64_t bad = 12345;
    CHECK_OK(pm_loader_error_sample(ld, &bad));
    CHECK_EQ_SIZE(bad, (uint64_t)p.fail_at);
    CHECK_ERR_MSG(pm_loader_error_sample(ld, NULL), PM_ERR_INVALID);
    CHECK_ERR_MSG(pm_loader_next(ld, &b), want);
    pm_loader_state_t s;
    CHECK_OK(pm_loader_state(ld, &s));
    CHECK_EQ_SIZE(s.batch, fail_batch);
    CHECK_OK(pm_loader_destroy(ld));
  }
  p.fail_at = -1;
  pm_loader_config_t c = base_config(batch);
  pm_loader_t *ld;
  REQUIRE_OK(pm_loader_create(ds, &c, &ld));
  uint64_t bad = 12345;
  CHECK_ERR_MSG(pm_loader_error_sample(ld, &bad), PM_ERR_STATE); /* nothing failed */
  CHECK_EQ_SIZE(bad, 12345);
  CHECK_OK(pm_loader_destroy(ld));
  CHECK_OK(pm_dataset_destroy(ds));
}

/* Injected backend faults in the copy stage: the batch reports PM_ERR_BACKEND. */
static void test_copy_fault(void) {
  const size_t size = 128;
  pat_ds_t p;
  pm_dataset_t *ds = make_ds(&p, 40, size);
  for (int pinned = 0; pinned < 2; pinned++) {
    pm_loader_config_t c = base_config(4);
    c.pin_memory = pinned;
    c.workers = 1;
    pm_loader_t *ld;
    REQUIRE_OK(pm_loader_create(ds, &c, &ld));
    pm_batch_t b;
    REQUIRE_OK(pm_loader_next(ld, &b)); /* with pinned slots, 3 copies may be queued already */
    CHECK_OK(pm_batch_release(&b, NULL));
    REQUIRE_OK(pm__fault_set(PM__FAULT_MEMCPY, 1, 0));
    pm_status_t st = PM_OK;
    int delivered = 0;
    while ((st = pm_loader_next(ld, &b)) == PM_OK) {
      /* (the host slot only: a D2H check would count as a copy for the fault) */
      for (size_t r = 0; r < b.samples; r++)
        CHECK(row_ok((const unsigned char *)b.host_inputs + r * size, size, b.indices[r]));
      CHECK_OK(pm_batch_release(&b, NULL));
      delivered++;
    }
    CHECK_ST(st, PM_ERR_BACKEND);
    CHECK(strstr(pm_last_error(), "injected") != NULL);
    CHECK(delivered <= 3);
    pm__fault_reset();
    CHECK_ST(pm_loader_next(ld, &b), PM_ERR_BACKEND); /* sticky */
    CHECK_OK(pm_loader_destroy(ld));
  }
  CHECK_OK(pm_dataset_destroy(ds));
}

/* The caller holds slots; bad input; dataset in use. */
/* pm_loader_plan agrees with the loader pm_loader_create makes, over every combination of a
 * small grid, and gives the epochs without a batch that pm_loader_create refuses. */
static void test_loader_plan(pm_dataset_t *ds100) {
  pm_loader_config_t c;
  pm_loader_plan_t plan;
  int agree = 0;
  for (int world = 1; world <= 5; world++)
    for (int rank = 0; rank < world; rank++)
      for (size_t bs = 1; bs <= 40; bs += 13)
        for (int dl = 0; dl <= 1; dl++) {
          c = base_config(bs);
          c.rank = rank;
          c.world_size = world;
          c.drop_last = dl;
          REQUIRE_OK(pm_loader_plan(&c, 100, &plan));
          CHECK_EQ_INT(plan.rank, rank);
          CHECK_EQ_INT(plan.world_size, world);
          pm_loader_t *x = NULL;
          if (plan.batches_per_epoch == 0) {
            CHECK_ERR_MSG(pm_loader_create(ds100, &c, &x), PM_ERR_INVALID);
            continue;
          }
          REQUIRE_OK(pm_loader_create(ds100, &c, &x));
          pm_loader_stats_t s;
          CHECK_OK(pm_loader_get_stats(x, &s));
          CHECK_EQ_SIZE(plan.batches_per_epoch, s.batches_per_epoch);
          CHECK_EQ_SIZE(plan.samples_per_epoch, s.samples_per_epoch);
          CHECK_OK(pm_loader_destroy(x));
          agree++;
        }
  CHECK(agree > 50);
  c = base_config(8);
  REQUIRE_OK(pm_loader_plan(&c, 0, &plan)); /* an empty dataset: an epoch without a batch */
  CHECK_EQ_SIZE(plan.batches_per_epoch, 0);
  CHECK_EQ_SIZE(plan.samples_per_epoch, 0);
  c.drop_last = 1;
  c.world_size = 4;
  c.rank = 3;
  REQUIRE_OK(pm_loader_plan(&c, 30, &plan)); /* 7 per rank, no whole batch of 8 */
  CHECK_EQ_SIZE(plan.samples_per_epoch, 7);
  CHECK_EQ_SIZE(plan.batches_per_epoch, 0);
  c.drop_last = 0;
  REQUIRE_OK(pm_loader_plan(&c, 30, &plan)); /* padded to 32: 8 per rank */
  CHECK_EQ_SIZE(plan.samples_per_epoch, 8);
  CHECK_EQ_SIZE(plan.batches_per_epoch, 1);
  CHECK_ERR_MSG(pm_loader_plan(NULL, 30, &plan), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_loader_plan(&c, 30, NULL), PM_ERR_INVALID);
  c.rank = -2;
  CHECK_ERR_MSG(pm_loader_plan(&c, 30, &plan), PM_ERR_INVALID);
  c = base_config(8);
  c.batch_size = 0;
  CHECK_ERR_MSG(pm_loader_plan(&c, 30, &plan), PM_ERR_INVALID);
}

static void test_misuse(void) {
  const size_t size = 32;
  pat_ds_t p;
  pm_dataset_t *ds = make_ds(&p, 100, size);
  pm_loader_config_t c = base_config(5);
  c.prefetch = 2;
  pm_loader_t *ld;
  REQUIRE_OK(pm_loader_create(ds, &c, &ld));
  pm_batch_t b0, b1, b2;
  REQUIRE_OK(pm_loader_next(ld, &b0));
  REQUIRE_OK(pm_loader_next(ld, &b1));
  CHECK_ERR_MSG(pm_loader_next(ld, &b2), PM_ERR_BUSY); /* both slots held */
  CHECK_OK(pm_batch_release(&b1, NULL));
  CHECK_ERR_MSG(pm_loader_next(ld, &b2), PM_ERR_BUSY); /* batch 2 needs batch 0's slot */
  pm_batch_t copy = b0;
  CHECK_OK(pm_batch_release(&b0, NULL));
  CHECK_ERR_MSG(pm_batch_release(&b0, NULL), PM_ERR_INVALID);   /* cleared */
  CHECK_ERR_MSG(pm_batch_release(&copy, NULL), PM_ERR_INVALID); /* not held any more */
  CHECK_ERR_MSG(pm_batch_wait_stream(&b0, NULL), PM_ERR_INVALID);
  REQUIRE_OK(pm_loader_next(ld, &b2));
  CHECK_EQ_SIZE(b2.index, 2);
  check_batch(&b2, size, true);
  CHECK_ERR_MSG(pm_dataset_destroy(ds), PM_ERR_BUSY);
  CHECK_ERR_MSG(pm_batch_release(NULL, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_loader_next(ld, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_loader_next(NULL, &b0), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_loader_state(ld, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_loader_get_stats(NULL, NULL), PM_ERR_INVALID);
  CHECK_OK(pm_batch_release(&b2, NULL));
  CHECK_OK(pm_loader_destroy(ld));
  CHECK_ERR_MSG(pm_loader_destroy(NULL), PM_ERR_INVALID);

  /* Configs. */
  pm_loader_t *x = NULL;
  c = base_config(0);
  CHECK_ERR_MSG(pm_loader_create(ds, &c, &x), PM_ERR_INVALID);
  c = base_config(5);
  c.rank = 2;
  c.world_size = 2;
  CHECK_ERR_MSG(pm_loader_create(ds, &c, &x), PM_ERR_INVALID);
  c = base_config(5);
  c.workers = -1;
  CHECK_ERR_MSG(pm_loader_create(ds, &c, &x), PM_ERR_INVALID);
  c = base_config(5);
  c.slot_bytes = 5 * size - 1; /* a batch does not fit the slot */
  CHECK_ERR_MSG(pm_loader_create(ds, &c, &x), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "slot_bytes") != NULL);
  c.slot_bytes = 8 * size;
  REQUIRE_OK(pm_loader_create(ds, &c, &x));
  pm_loader_stats_t s;
  CHECK_OK(pm_loader_get_stats(x, &s));
  CHECK_EQ_SIZE(s.slot_bytes, 8 * size);
  CHECK_OK(pm_loader_destroy(x));
  c = base_config(200);
  c.drop_last = 1; /* no whole batch */
  CHECK_ERR_MSG(pm_loader_create(ds, &c, &x), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_loader_create(NULL, &c, &x), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_loader_create(ds, NULL, &x), PM_ERR_INVALID);
  CHECK(x == NULL || 1);

  /* RANK / WORLD_SIZE from the environment. */
  c = base_config(5);
  c.rank = -1;
  c.world_size = -1;
  setenv("WORLD_SIZE", "4", 1);
  setenv("RANK", "3", 1);
  REQUIRE_OK(pm_loader_create(ds, &c, &x));
  pm_loader_state_t ls;
  CHECK_OK(pm_loader_state(x, &ls));
  CHECK_EQ_INT(ls.rank, 3);
  CHECK_EQ_INT(ls.world_size, 4);
  CHECK_OK(pm_loader_get_stats(x, &s));
  CHECK_EQ_SIZE(s.samples_per_epoch, 25);
  CHECK_OK(pm_loader_destroy(x));
  pm_loader_plan_t plan, untouched = {-7, -7, 7, 7};
  REQUIRE_OK(pm_loader_plan(&c, 100, &plan)); /* the same environment, no loader */
  CHECK_EQ_INT(plan.rank, 3);
  CHECK_EQ_INT(plan.world_size, 4);
  CHECK_EQ_SIZE(plan.samples_per_epoch, 25);
  CHECK_EQ_SIZE(plan.batches_per_epoch, 5);
  setenv("RANK", "x1", 1);
  CHECK_ERR_MSG(pm_loader_create(ds, &c, &x), PM_ERR_CONFIG);
  plan = untouched;
  CHECK_ERR_MSG(pm_loader_plan(&c, 100, &plan), PM_ERR_CONFIG);
  CHECK(memcmp(&plan, &untouched, sizeof plan) == 0);
  setenv("RANK", "4", 1);
  CHECK_ERR_MSG(pm_loader_create(ds, &c, &x), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_loader_plan(&c, 100, &plan), PM_ERR_INVALID);
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  test_loader_plan(ds);

  /* Callback dataset checks. */
  pm_dataset_callbacks_t cb;
  memset(&cb, 0, sizeof cb);
  pm_dataset_t *d2;
  CHECK_ERR_MSG(pm_dataset_create(&cb, &d2), PM_ERR_INVALID);
  cb.read = pat_read;
  cb.samples = 10;
  CHECK_ERR_MSG(pm_dataset_create(&cb, &d2), PM_ERR_INVALID); /* sample_bytes 0 */
  cb.sample_bytes = 10;
  cb.dtype = PM_DTYPE_FLOAT32;
  CHECK_ERR_MSG(pm_dataset_create(&cb, &d2), PM_ERR_INVALID); /* not whole floats */
  cb.sample_bytes = 24;
  cb.ndim = 2;
  cb.shape[0] = 2;
  cb.shape[1] = 4;
  CHECK_ERR_MSG(pm_dataset_create(&cb, &d2), PM_ERR_INVALID); /* 32 bytes */
  cb.shape[1] = 3;
  REQUIRE_OK(pm_dataset_create(&cb, &d2));
  pm_dataset_info_t in;
  CHECK_OK(pm_dataset_get_info(d2, &in));
  CHECK_EQ_INT(in.ndim, 2);
  CHECK_EQ_SIZE(in.itemsize, 4);
  CHECK(strcmp(in.descr, "<f4") == 0);
  CHECK_ERR_MSG(pm_dataset_read_sample(d2, 0, 10, &s, NULL), PM_ERR_INVALID);
  CHECK_OK(pm_dataset_destroy(d2));
  CHECK_ERR_MSG(pm_dataset_destroy(NULL), PM_ERR_INVALID);
  CHECK(strcmp(pm_dtype_name(PM_DTYPE_UINT16), "uint16") == 0);
  CHECK_OK(pm_dataset_destroy(ds));
}

/* Destroy while workers are busy, while a batch is held, before any next(). */
static void test_destroy_midway(void) {
  const size_t size = 256;
  pat_ds_t p;
  pm_dataset_t *ds = make_ds(&p, 400, size);
  p.sleep_us = 200;
  for (int variant = 0; variant < 4; variant++) {
    pm_loader_config_t c = base_config(8);
    c.workers = 3;
    c.prefetch = 4;
    c.shuffle = 1;
    c.delivery = variant == 3 ? PM_DELIVER_HOST : PM_DELIVER_DEVICE;
    c.pin_memory = variant != 2;
    pm_loader_t *ld;
    REQUIRE_OK(pm_loader_create(ds, &c, &ld));
    pm_batch_t b;
    if (variant >= 1) {
      REQUIRE_OK(pm_loader_next(ld, &b));
      check_batch(&b, size, c.delivery == PM_DELIVER_DEVICE);
      if (variant == 1) CHECK_OK(pm_batch_release(&b, NULL));
    }
    CHECK_OK(pm_loader_destroy(ld)); /* variant 2, 3: a batch still held */
    if (variant >= 2) {
      check_batch(&b, size, c.delivery == PM_DELIVER_DEVICE); /* still valid */
      CHECK_OK(pm_batch_release(&b, NULL));                   /* frees the slot and the loader */
    }
  }
  long reads = atomic_load(&p.reads);
  CHECK(reads < 4 * 400); /* stopped early, not after reading everything */
  CHECK_OK(pm_dataset_destroy(ds));
}

/* ---- fields --------------------------------------------------------------------------------- */

/* Three fields from one random draw per call: an image [3][5] of u8 (all = the draw's low byte),
 * a float32 label (the draw), an int64 pair (index, draw). A field from another call than the
 * others would not match. */
typedef struct multi_ds {
  atomic_long calls;
  atomic_ulong rng;
} multi_ds_t;

static int multi_read(uint64_t index, void *const *dsts, void *user) {
  multi_ds_t *m = user;
  atomic_fetch_add(&m->calls, 1);
  uint64_t draw = pm__mix64(atomic_fetch_add(&m->rng, 1) + 12345) & 0xffffff;
  memset(dsts[0], (int)(draw & 0xff), 15);
  float label = (float)draw;
  memcpy(dsts[1], &label, sizeof label);
  int64_t pair[2] = {(int64_t)index, (int64_t)draw};
  memcpy(dsts[2], pair, sizeof pair);
  return 0;
}

static void test_fields(pm_delivery_t delivery) {
  const uint64_t n = 203;
  multi_ds_t m;
  atomic_init(&m.calls, 0);
  atomic_init(&m.rng, 7);
  pm_field_t f[3];
  memset(f, 0, sizeof f);
  f[0].dtype = PM_DTYPE_UINT8;
  f[0].ndim = 2;
  f[0].shape[0] = 3;
  f[0].shape[1] = 5;
  f[1].dtype = PM_DTYPE_FLOAT32; /* ndim 0: a scalar */
  f[2].dtype = PM_DTYPE_INT64;
  f[2].ndim = 1;
  f[2].shape[0] = 2;
  pm_dataset_fields_callbacks_t cb;
  memset(&cb, 0, sizeof cb);
  cb.samples = n;
  cb.nfields = 3;
  cb.fields = f;
  cb.read = multi_read;
  cb.user = &m;
  pm_dataset_t *ds;
  REQUIRE_OK(pm_dataset_create_fields(&cb, &ds));
  pm_dataset_info_t in;
  CHECK_OK(pm_dataset_get_info(ds, &in));
  CHECK_EQ_INT(in.fields, 3);
  CHECK_EQ_SIZE(in.sample_bytes, 15);
  CHECK_EQ_SIZE(in.target_bytes, 4);
  pm_field_t got;
  CHECK_OK(pm_dataset_get_field(ds, 2, &got));
  CHECK_EQ_SIZE(got.bytes, 16);
  CHECK(strcmp(got.descr, "<i8") == 0);
  CHECK_OK(pm_dataset_get_field(ds, 1, &got));
  CHECK_EQ_INT(got.ndim, 0);
  CHECK_ERR_MSG(pm_dataset_get_field(ds, 3, &got), PM_ERR_INVALID);

  pm_loader_config_t c = base_config(16);
  c.shuffle = 1;
  c.epochs = 2;
  c.delivery = delivery;
  c.workers = 3;
  pm_loader_t *ld;
  REQUIRE_OK(pm_loader_create(ds, &c, &ld));
  pm_batch_t b;
  uint64_t rows = 0;
  int bad = 0;
  while (pm_loader_next(ld, &b) == PM_OK) {
    CHECK_EQ_INT(b.nfields, 3);
    CHECK(b.fields[0].data == b.inputs && b.fields[1].data == b.targets);
    CHECK_EQ_SIZE(b.inputs_bytes, b.samples * 15);
    CHECK_EQ_SIZE(b.targets_bytes, b.samples * 4);
    CHECK_EQ_INT(b.fields[0].ndim, 3);
    CHECK_EQ_SIZE(b.fields[0].shape[2], 5);
    CHECK_EQ_INT(b.fields[1].ndim, 1); /* [samples]: scalar labels */
    CHECK_EQ_SIZE(b.fields[2].shape[1], 2);
    CHECK(b.fields[2].info->dtype == PM_DTYPE_INT64);
    if (b.event) CHECK_OK(pm_event_synchronize(b.event));
    unsigned char *f0 = malloc(b.fields[0].bytes), *f1 = malloc(b.fields[1].bytes),
                  *f2 = malloc(b.fields[2].bytes);
    REQUIRE(f0 && f1 && f2);
    const pm_copy_kind_t k = delivery == PM_DELIVER_DEVICE ? PM_COPY_D2H : PM_COPY_H2H;
    CHECK_OK(pm_memcpy(f0, b.fields[0].data, b.fields[0].bytes, k));
    CHECK_OK(pm_memcpy(f1, b.fields[1].data, b.fields[1].bytes, k));
    CHECK_OK(pm_memcpy(f2, b.fields[2].data, b.fields[2].bytes, k));
    for (size_t r = 0; r < b.samples; r++) {
      int64_t pair[2];
      float label;
      memcpy(pair, f2 + r * 16, 16);
      memcpy(&label, f1 + r * 4, 4);
      if ((uint64_t)pair[0] != b.indices[r]) bad++;
      if ((float)pair[1] != label) bad++;
      for (int i = 0; i < 15; i++)
        if (f0[r * 15 + (size_t)i] != (unsigned char)(pair[1] & 0xff)) bad++;
    }
    free(f0);
    free(f1);
    free(f2);
    rows += b.samples;
    CHECK_OK(pm_batch_release(&b, NULL));
  }
  CHECK_EQ_INT(bad, 0);
  CHECK_EQ_SIZE(rows, 2 * n);
  CHECK_OK(pm_loader_destroy(ld));
  CHECK_EQ_INT(atomic_load(&m.calls), 2 * n); /* one call per sample for all its fields */

  /* Read outside a loader, with a field skipped. */
  unsigned char img[15];
  int64_t pair[2];
  void *dsts[3] = {img, NULL, pair};
  CHECK_OK(pm_dataset_read_fields(ds, 0, 9, dsts));
  CHECK_EQ_INT(pair[0], 9);
  CHECK_EQ_INT(img[4], pair[1] & 0xff);
  CHECK_ERR_MSG(pm_dataset_read_fields(ds, 0, n, dsts), PM_ERR_INVALID);

  /* Bad specs. */
  pm_dataset_t *x = NULL;
  cb.nfields = 0;
  CHECK_ERR_MSG(pm_dataset_create_fields(&cb, &x), PM_ERR_INVALID);
  cb.nfields = PM_MAX_FIELDS + 1;
  CHECK_ERR_MSG(pm_dataset_create_fields(&cb, &x), PM_ERR_INVALID);
  cb.nfields = 3;
  f[2].bytes = 15; /* shape says 16 */
  CHECK_ERR_MSG(pm_dataset_create_fields(&cb, &x), PM_ERR_INVALID);
  f[2].bytes = 0;
  f[2].dtype = PM_DTYPE_OTHER; /* no itemsize */
  CHECK_ERR_MSG(pm_dataset_create_fields(&cb, &x), PM_ERR_INVALID);
  f[2].itemsize = 16;
  f[2].ndim = 0;
  snprintf(f[2].descr, sizeof f[2].descr, ">c16");
  REQUIRE_OK(pm_dataset_create_fields(&cb, &x));
  CHECK_OK(pm_dataset_get_field(x, 2, &got));
  CHECK(strcmp(got.descr, ">c16") == 0); /* carried through as given */
  CHECK_EQ_SIZE(got.bytes, 16);
  CHECK_OK(pm_dataset_destroy(x));
  CHECK_OK(pm_dataset_destroy(ds));
}

static void test_zip(void) {
  const size_t sx = 48, sy = 8;
  pat_ds_t px, py;
  pm_dataset_t *dx = make_ds(&px, 150, sx), *dy = make_ds(&py, 150, sy), *dz = NULL, *bad = NULL;
  pat_ds_t pb;
  pm_dataset_t *dshort = make_ds(&pb, 149, 8);
  pm_dataset_t *parts[3] = {dx, dy, dshort};
  CHECK_ERR_MSG(pm_dataset_zip(parts, 3, &bad), PM_ERR_INVALID); /* 150 against 149 samples */
  CHECK(strstr(pm_last_error(), "149") != NULL);
  CHECK_ERR_MSG(pm_dataset_zip(parts, 0, &bad), PM_ERR_INVALID);
  REQUIRE_OK(pm_dataset_zip(parts, 2, &dz));
  CHECK_ERR_MSG(pm_dataset_destroy(dx), PM_ERR_BUSY); /* the zip uses it */
  for (int delivery = 0; delivery < 2; delivery++) {
    pm_loader_config_t c = base_config(7);
    c.shuffle = 1;
    c.delivery = delivery ? PM_DELIVER_HOST : PM_DELIVER_DEVICE;
    pm_loader_t *ld;
    REQUIRE_OK(pm_loader_create(dz, &c, &ld));
    pm_batch_t b;
    uint64_t rows = 0;
    int badrows = 0;
    while (pm_loader_next(ld, &b) == PM_OK) {
      CHECK_EQ_INT(b.nfields, 2);
      if (b.event) CHECK_OK(pm_event_synchronize(b.event));
      for (size_t r = 0; r < b.samples; r++) {
        if (!row_ok((unsigned char *)b.fields[0].host + r * sx, sx, b.indices[r])) badrows++;
        if (!row_ok((unsigned char *)b.fields[1].host + r * sy, sy, b.indices[r])) badrows++;
      }
      unsigned char dev[8 * 7];
      CHECK_OK(pm_memcpy(dev, b.targets, b.targets_bytes, delivery ? PM_COPY_H2H : PM_COPY_D2H));
      for (size_t r = 0; r < b.samples; r++)
        if (!row_ok(dev + r * sy, sy, b.indices[r])) badrows++;
      rows += b.samples;
      CHECK_OK(pm_batch_release(&b, NULL));
    }
    CHECK_EQ_INT(badrows, 0);
    CHECK_EQ_SIZE(rows, 150);
    CHECK_OK(pm_loader_destroy(ld));
  }
  CHECK_OK(pm_dataset_destroy(dz));
  CHECK_OK(pm_dataset_destroy(dx));
  CHECK_OK(pm_dataset_destroy(dy));
  CHECK_OK(pm_dataset_destroy(dshort));
}

/* ---- two consumers, destroy with batches held, budget -------------------------------------- */

typedef struct consumer {
  pm_loader_t *ld;
  pm_status_t st;
  pm_batch_t b;
  atomic_bool done;
} consumer_t;

static void *consume_one(void *arg) {
  consumer_t *c = arg;
  c->st = pm_loader_next(c->ld, &c->b);
  atomic_store(&c->done, true);
  return NULL;
}

/* Whether a thread is inside pm_loader_next of ld (after its check of the handle). */
static bool in_next(pm_loader_t *ld) {
  pthread_mutex_lock(&ld->mu);
  bool in = ld->in_next;
  pthread_mutex_unlock(&ld->mu);
  return in;
}

static void test_two_consumers(void) {
  const size_t size = 64;
  pat_ds_t p;
  pm_dataset_t *ds = make_ds(&p, 40, size);
  p.sleep_us = 2000; /* both threads reach the wait */
  int rounds = g_small ? 3 : 10;
  for (int round = 0; round < rounds; round++) {
    pm_loader_config_t c = base_config(4);
    c.workers = 1;
    c.delivery = round % 2 ? PM_DELIVER_HOST : PM_DELIVER_DEVICE;
    pm_loader_t *ld;
    REQUIRE_OK(pm_loader_create(ds, &c, &ld));
    consumer_t a = {ld, PM_OK, {0}, false}, b2 = {ld, PM_OK, {0}, false};
    pthread_t ta, tb;
    REQUIRE(pthread_create(&ta, NULL, consume_one, &a) == 0);
    REQUIRE(pthread_create(&tb, NULL, consume_one, &b2) == 0);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    /* One got batch 0 and the other PM_ERR_BUSY, or (when the first was already out) both
     * got a batch each, in order: never the same batch, never a hang. */
    int ok = (a.st == PM_OK) + (b2.st == PM_OK);
    int busy = (a.st == PM_ERR_BUSY) + (b2.st == PM_ERR_BUSY);
    CHECK_EQ_INT(ok + busy, 2);
    CHECK(ok >= 1);
    if (ok == 2) CHECK(a.b.index != b2.b.index);
    if (a.st == PM_OK) CHECK_OK(pm_batch_release(&a.b, NULL));
    if (b2.st == PM_OK) CHECK_OK(pm_batch_release(&b2.b, NULL));
    CHECK_OK(pm_loader_destroy(ld));
  }
  CHECK_OK(pm_dataset_destroy(ds));
}

/* A consumer waiting in pm_loader_next while another thread destroys the loader: the wait
 * ends with PM_ERR_STATE (it used to wait on, or wake in freed memory), and destroy returns
 * only after the consumer left (the loader is freed afterwards, by destroy itself). */
static void test_destroy_while_next_waits(void) {
  const size_t size = 64;
  pat_ds_t p;
  pm_dataset_t *ds = make_ds(&p, 40, size);
  p.sleep_us = 200000; /* the first batch takes 0.8 s: the consumer is waiting */
  for (int round = 0; round < (g_small ? 1 : 3); round++) {
    pm_loader_config_t c = base_config(4);
    c.workers = 1;
    c.delivery = round % 2 ? PM_DELIVER_HOST : PM_DELIVER_DEVICE;
    pm_loader_t *ld;
    REQUIRE_OK(pm_loader_create(ds, &c, &ld));
    consumer_t a = {ld, PM_OK, {0}, false};
    pthread_t ta;
    REQUIRE(pthread_create(&ta, NULL, consume_one, &a) == 0);
    /* Until the consumer is inside pm_loader_next (or, on a slow machine, got its batch), not
     * a fixed sleep: a consumer that started late called it on a destroyed loader
     * (PM_ERR_INVALID), which is not the case tested. */
    for (int i = 0; i < 60000 && !in_next(ld) && !atomic_load(&a.done); i++) pm_test_sleep_ms(1);
    CHECK(in_next(ld) || atomic_load(&a.done));
    CHECK_OK(pm_loader_destroy(ld));
    pthread_join(ta, NULL);
    if (a.st == PM_OK) CHECK_OK(pm_batch_release(&a.b, NULL)); /* (a slow machine: it won) */
    else
      CHECK_EQ_INT(a.st, PM_ERR_STATE);
  }
  CHECK_OK(pm_dataset_destroy(ds));
}

/* lease_slots: every batch of two epochs held at once with 2 slots; each keeps its bytes (the
 * ring took new slots), released in another order than delivered, some only after destroy. */
static void test_lease_slots(void) {
  const size_t size = 96;
  enum { N = 40, B = 4 };
  pat_ds_t p;
  pm_dataset_t *ds = make_ds(&p, N, size);
  for (int variant = 0; variant < 2; variant++) {
    pm_loader_config_t c = base_config(B);
    c.prefetch = 2;
    c.epochs = 2;
    c.lease_slots = 1;
    c.delivery = variant ? PM_DELIVER_HOST : PM_DELIVER_DEVICE;
    pm_loader_t *ld;
    REQUIRE_OK(pm_loader_create(ds, &c, &ld));
    pm_batch_t held[2 * N / B];
    int n = 0;
    while (n < 2 * N / B && pm_loader_next(ld, &held[n]) == PM_OK) n++;
    CHECK_EQ_INT(n, 2 * N / B);
    for (int i = 0; i < n; i++) {
      CHECK_EQ_INT((int)held[i].index, i % (N / B));
      check_batch(&held[i], size, c.delivery == PM_DELIVER_DEVICE);
    }
    CHECK_EQ_INT(pm_loader_next(ld, &held[0]) == PM_ERR_STATE, 1); /* (held[0] untouched) */
    for (int i = n - 1; i >= n / 2; i--) CHECK_OK(pm_batch_release(&held[i], NULL));
    CHECK_OK(pm_loader_destroy(ld));
    for (int i = 0; i < n / 2; i++) {
      check_batch(&held[i], size, c.delivery == PM_DELIVER_DEVICE); /* still valid */
      CHECK_OK(pm_batch_release(&held[i], NULL)); /* the last frees the loader */
    }
  }
  pm_loader_config_t c = base_config(B);
  c.lease_slots = 2;
  pm_loader_t *ld = NULL;
  CHECK_EQ_INT(pm_loader_create(ds, &c, &ld), PM_ERR_INVALID);
  /* Flags other than 0 and 1, and a slot size with no size class (it was divided by: SIGFPE),
   * are refused by name. */
  static const char *const names[] = {"shuffle", "drop_last", "pin_memory"};
  for (int k = 0; k < 3; k++) {
    c = base_config(B);
    *(k == 0 ? &c.shuffle : k == 1 ? &c.drop_last : &c.pin_memory) = 7;
    CHECK_ERR_MSG(pm_loader_create(ds, &c, &ld), PM_ERR_INVALID);
    CHECK(strstr(pm_last_error(), names[k]) != NULL);
  }
  for (int k = 0; k < 2; k++) {
    c = base_config(B);
    c.slot_bytes = k ? SIZE_MAX / 2 : SIZE_MAX;
    CHECK_ERR_MSG(pm_loader_create(ds, &c, &ld), PM_ERR_INVALID);
    CHECK(strstr(pm_last_error(), "slot_bytes") != NULL);
  }
  /* pm_loader_next_timed: a batch not ready in time is PM_OK with ready 0 and nothing changed
   * (not PM_ERR_TIMEOUT, a loader's own error); a later call delivers that same batch. The
   * reads wait for a gate, so batch 0 is surely not ready at the first call (reads of a fixed
   * time were, where the caller was preempted for longer); one worker. */
  {
    pat_ds_t slow;
    pm_dataset_t *sds = make_ds(&slow, 8, 64);
    pm_test_gate_t gate;
    pm_test_gate_init(&gate);
    slow.gate = &gate;
    pm_loader_config_t sc = base_config(2);
    sc.workers = 1;
    sc.prefetch = 1;
    sc.delivery = PM_DELIVER_HOST;
    pm_loader_t *sl = NULL;
    REQUIRE_OK(pm_loader_create(sds, &sc, &sl));
    pm_batch_t b;
    int ready = -1;
    CHECK_OK(pm_loader_next_timed(sl, &b, 0.01, &ready));
    CHECK_EQ_INT(ready, 0);
    CHECK_ERR_MSG(pm_loader_next_timed(sl, &b, -1, &ready), PM_ERR_INVALID);
    CHECK_ERR_MSG(pm_loader_next_timed(sl, &b, 1, NULL), PM_ERR_INVALID);
    pm_test_gate_open(&gate);
    CHECK_OK(pm_loader_next_timed(sl, &b, 30, &ready));
    CHECK_EQ_INT(ready, 1);
    CHECK_EQ_SIZE(b.index, 0);
    CHECK_EQ_SIZE(b.samples, 2);
    CHECK_OK(pm_batch_release(&b, NULL));
    CHECK_OK(pm_loader_next(sl, &b));
    CHECK_EQ_SIZE(b.index, 1);
    CHECK_OK(pm_batch_release(&b, NULL));
    CHECK_OK(pm_loader_destroy(sl));
    CHECK_OK(pm_dataset_destroy(sds));
    pm_test_gate_destroy(&gate);
  }
  /* A dataset a loader holds names what holds it. */
  c = base_config(B);
  REQUIRE_OK(pm_loader_create(ds, &c, &ld));
  CHECK_ERR_MSG(pm_dataset_destroy(ds), PM_ERR_BUSY);
  CHECK(strstr(pm_last_error(), "1 user (loaders, zips, selects) still holds") != NULL);
  CHECK_OK(pm_loader_destroy(ld));
  CHECK_OK(pm_dataset_destroy(ds));
}

static void test_destroy_held(void) {
  const size_t size = 4000;
  pat_ds_t p;
  pm_dataset_t *ds = make_ds(&p, 64, size);
  pm_pool_t *pool;
  REQUIRE_OK(pm_pool_default(&pool));
  pm_pool_stats_t before, held, after;
  REQUIRE_OK(pm_pool_get_stats(pool, &before));
  pm_loader_config_t c = base_config(8);
  c.prefetch = 4;
  pm_loader_t *ld;
  REQUIRE_OK(pm_loader_create(ds, &c, &ld));
  pm_batch_t b0, b1;
  REQUIRE_OK(pm_loader_next(ld, &b0));
  REQUIRE_OK(pm_loader_next(ld, &b1));
  pm_batch_t stale = b1;
  CHECK_OK(pm_loader_destroy(ld)); /* two batches held: not an error */
  CHECK_OK(pm_pool_get_stats(pool, &held));
  CHECK_EQ_SIZE(held.in_use_bytes - before.in_use_bytes, 2 * pm__size_class(8 * size));
  /* The loader is destroyed: every call on it is refused, the held batches still work. */
  CHECK_ERR_MSG(pm_loader_next(ld, &b0), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_loader_destroy(ld), PM_ERR_INVALID);
  pm_loader_state_t ls;
  CHECK_ERR_MSG(pm_loader_state(ld, &ls), PM_ERR_INVALID);
  check_batch(&b0, size, true);
  CHECK_OK(pm_batch_wait_stream(&b1, NULL));
  CHECK_OK(pm_batch_release(&b0, NULL));
  CHECK_OK(pm_dataset_destroy(ds)); /* the loader no longer uses it */
  check_batch(&b1, size, true);
  CHECK_OK(pm_batch_release(&b1, NULL)); /* the last one: frees the loader */
  CHECK_OK(pm_pool_get_stats(pool, &after));
  CHECK_EQ_SIZE(after.in_use_bytes, before.in_use_bytes);
  /* Everything is gone now: stale handles are refused, not dereferenced (ASan). */
  CHECK_ERR_MSG(pm_batch_release(&stale, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_loader_destroy(ld), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_loader_next(ld, &b0), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_loader_get_stats(ld, &(pm_loader_stats_t){0}), PM_ERR_INVALID);

  /* Destroy with nothing held frees at once; a second destroy is refused. */
  ds = make_ds(&p, 64, size);
  REQUIRE_OK(pm_loader_create(ds, &c, &ld));
  CHECK_OK(pm_loader_destroy(ld));
  CHECK_ERR_MSG(pm_loader_destroy(ld), PM_ERR_INVALID);
  CHECK_OK(pm_pool_get_stats(pool, &after));
  CHECK_EQ_SIZE(after.in_use_bytes, before.in_use_bytes);
  CHECK_OK(pm_dataset_destroy(ds));
}

static void test_budget_wait(void) {
  const size_t size = 4096;
  pat_ds_t p;
  pm_dataset_t *ds = make_ds(&p, 64, size);
  pm_pool_config_t pc;
  pm_pool_config_init(&pc);
  pc.budget = 3 * pm__size_class(4 * size) + 4096; /* room for 3 slots of 4 samples, not 4 */
  pc.exhaust_policy = PM_EXHAUST_WAIT;
  pc.wait_timeout_s = 1e6; /* a wait would outlast the test's alarm */
  pm_pool_t *pool;
  REQUIRE_OK(pm_pool_create(&pc, &pool));
  pm_loader_config_t c = base_config(4);
  c.pool = pool;
  c.prefetch = 4;
  pm_loader_t *ld = NULL;
  CHECK_ERR_MSG(pm_loader_create(ds, &c, &ld), PM_ERR_BUDGET);
  CHECK(strstr(pm_last_error(), "whole budget") != NULL);
  c.prefetch = 3; /* fits: created, and works */
  REQUIRE_OK(pm_loader_create(ds, &c, &ld));
  pm_batch_t b;
  REQUIRE_OK(pm_loader_next(ld, &b));
  check_batch(&b, size, true);
  CHECK_OK(pm_batch_release(&b, NULL));
  CHECK_OK(pm_loader_destroy(ld));
  CHECK_OK(pm_pool_destroy(pool));
  CHECK_OK(pm_dataset_destroy(ds));
}

/* ---- a slot's copy in parts (option loader_piece) ------------------------------------------- */

/* Three fields of odd sizes, each a pattern of (index, field): a large first field, a small one
 * (labels) and a large later one, so parts cover field boundaries, rows cut in two and the
 * 256-byte padding between fields. */
static const size_t part_fb[3] = {1001, 7, 2503};

static int part_read(uint64_t index, void *const *dsts, void *user) {
  (void)user;
  for (int k = 0; k < 3; k++) pm_test_fill(dsts[k], part_fb[k], index * 3 + (uint64_t)k + 1);
  return 0;
}

static pm_dataset_t *make_part_ds(uint64_t n) {
  pm_field_t f[3];
  memset(f, 0, sizeof f);
  for (int k = 0; k < 3; k++) {
    f[k].dtype = PM_DTYPE_UINT8;
    f[k].ndim = 1;
    f[k].shape[0] = part_fb[k];
  }
  pm_dataset_fields_callbacks_t cb;
  memset(&cb, 0, sizeof cb);
  cb.samples = n;
  cb.nfields = 3;
  cb.fields = f;
  cb.read = part_read;
  pm_dataset_t *ds = NULL;
  REQUIRE_OK(pm_dataset_create_fields(&cb, &ds));
  return ds;
}

/* Bad rows of a delivered batch: its host slot, and (device) its device buffer read back. */
static int part_check(const pm_batch_t *b, bool device) {
  int bad = 0;
  unsigned char want[4096];
  CHECK_EQ_INT(b->nfields, 3);
  if (device) CHECK_OK(pm_event_synchronize(b->event));
  for (int k = 0; k < 3; k++) {
    const pm_batch_field_t *f = &b->fields[k];
    CHECK_EQ_SIZE(f->bytes, b->samples * part_fb[k]);
    const unsigned char *rows = f->host;
    unsigned char *copy = NULL;
    if (device) {
      copy = malloc(f->bytes);
      REQUIRE(copy != NULL);
      CHECK_OK(pm_memcpy(copy, f->data, f->bytes, PM_COPY_D2H));
    }
    for (size_t r = 0; r < b->samples; r++) {
      pm_test_fill(want, part_fb[k], b->indices[r] * 3 + (uint64_t)k + 1);
      if (memcmp(rows + r * part_fb[k], want, part_fb[k]) != 0) bad++;
      if (copy && memcmp(copy + r * part_fb[k], want, part_fb[k]) != 0) bad++;
    }
    free(copy);
  }
  return bad;
}

/* Parts of the copy of a batch, as the loader cuts it: the copied bytes run from field 0 to the
 * end of the last field's rows; parts of `piece` bytes, at most 1024 for a full batch. */
static uint64_t expected_parts(const pm_batch_t *b, size_t piece, size_t full) {
  const unsigned char *h0 = b->fields[0].host, *h2 = b->fields[2].host;
  size_t total = (size_t)(h2 - h0) + b->samples * part_fb[2];
  if (piece && full / piece >= 1024) piece = (full + 1023) / 1024;
  if (!piece || total <= piece) return 1;
  return (total + piece - 1) / piece;
}

/* Every part setting delivers every byte of every field, on the host and on the device,
 * shuffled, with a partial last batch; the number of copies is the number of parts. */
static void test_parts(void) {
  const uint64_t n = 97, batch = 13; /* 8 batches an epoch, the last one of 6 rows */
  pm_dataset_t *ds = make_part_ds(n);
  static const char *pieces[] = {"0", "1000", "777", "4096", "1", "1M"};
  for (size_t i = 0; i < sizeof pieces / sizeof pieces[0]; i++) {
    REQUIRE_OK(pm_option_set("loader_piece", pieces[i]));
    size_t piece = (size_t)pm__opt_size(PM__OPT_LOADER_PIECE);
    for (int count = 0; count < 2; count++) {
      /* count 1: the backend's copies are counted (host slots checked only, so that every
       * copy counted is the loader's); count 0: the device buffers are read back too. */
      pm_loader_config_t c = base_config(batch);
      c.shuffle = 1;
      c.seed = 5 + i;
      c.epochs = 2;
      c.workers = 1 + (int)(i % 4);
      c.prefetch = 2 + (int)(i % 3);
      if (count) REQUIRE_OK(pm__fault_set(PM__FAULT_MEMCPY, 0, 0)); /* counts, injects none */
      pm_loader_t *ld;
      REQUIRE_OK(pm_loader_create(ds, &c, &ld));
      pm_batch_t b;
      int bad = 0;
      uint64_t rows = 0, parts = 0, batches = 0;
      size_t full = 0;
      pm_status_t st;
      while ((st = pm_loader_next(ld, &b)) == PM_OK) {
        bad += part_check(&b, !count);
        if (!full)
          full = (size_t)((const unsigned char *)b.fields[2].host -
                          (const unsigned char *)b.fields[0].host) +
                 (size_t)batch * part_fb[2];
        parts += expected_parts(&b, piece, full);
        rows += b.samples;
        batches++;
        CHECK_OK(pm_batch_release(&b, NULL));
      }
      CHECK_ST(st, PM_ERR_STATE);
      CHECK_EQ_INT(bad, 0);
      CHECK_EQ_SIZE(rows, 2 * n);
      CHECK_EQ_SIZE(batches, 16);
      if (count) {
        pm__fault_counts_t fc;
        pm__fault_counts(&fc);
        pm__fault_reset();
        CHECK_EQ_SIZE(fc.calls[PM__FAULT_MEMCPY], parts);
        if (piece == 1000) CHECK(parts > 16 * 20); /* rows were cut: many parts a batch */
      }
      pm_loader_stats_t ls;
      CHECK_OK(pm_loader_get_stats(ld, &ls));
      CHECK(ls.copy_seconds >= 0);
      CHECK_OK(pm_loader_destroy(ld));
    }
  }
  /* A bad value is refused and leaves the option as it was. */
  CHECK_ERR_MSG(pm_option_set("loader_piece", "4Q"), PM_ERR_CONFIG);
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_LOADER_PIECE), 1u << 20);
  REQUIRE_OK(pm_option_set("loader_piece", NULL));
  CHECK_OK(pm_dataset_destroy(ds));
}

/* A copy fails in the middle of a batch's parts: the batches before it arrive whole (host and
 * device bytes), then that batch reports the error, every time, and the state points at it;
 * never a short or torn batch. The parts go to the stream in order, so the Kth copy after
 * arming is part K mod P of batch K / P. */
static void test_part_fault(void) {
  const uint64_t n = 120, batch = 10;
  pm_dataset_t *ds = make_part_ds(n);
  REQUIRE_OK(pm_option_set("loader_piece", "3000"));
  for (int variant = 0; variant < 3; variant++) {
    pm_loader_config_t c = base_config(batch);
    c.shuffle = 1;
    c.workers = 3;
    c.prefetch = 6;
    /* slot: 10 x 1001 -> pad to 10240, + 10 x 7 -> pad to 10496, + 10 x 2503 = 35526 bytes:
     * 12 parts of 3000 bytes. */
    const uint64_t P = 12, fail_batch = variant == 0 ? 2 : variant == 1 ? 0 : 3;
    const uint64_t part = variant == 0 ? 5 : variant == 1 ? 1 : P; /* 1-based */
    REQUIRE_OK(pm__fault_set(PM__FAULT_MEMCPY, fail_batch * P + part, 0));
    pm_loader_t *ld;
    REQUIRE_OK(pm_loader_create(ds, &c, &ld));
    pm_batch_t held[6];
    for (uint64_t i = 0; i < fail_batch; i++) {
      REQUIRE_OK(pm_loader_next(ld, &held[i]));
      CHECK_EQ_SIZE(held[i].samples, batch);
      CHECK_EQ_SIZE(held[i].index, i);
      CHECK_EQ_INT(part_check(&held[i], false), 0);
    }
    pm_batch_t b;
    memset(&b, 0x5a, sizeof b);
    CHECK_ERR_MSG(pm_loader_next(ld, &b), PM_ERR_BACKEND);
    CHECK(strstr(pm_last_error(), "injected") != NULL);
    char want[64];
    snprintf(want, sizeof want, "(part %llu of %llu)", (unsigned long long)part,
             (unsigned long long)P);
    CHECK(strstr(pm_last_error(), want) != NULL);
    CHECK_EQ_INT(b.samples, 0x5a5a5a5a5a5a5a5a); /* output untouched */
    pm__fault_reset();
    CHECK_ERR_MSG(pm_loader_next(ld, &b), PM_ERR_BACKEND); /* sticky */
    uint64_t bad = 12345; /* a copy failed: no sample to name */
    CHECK_ERR_MSG(pm_loader_error_sample(ld, &bad), PM_ERR_STATE);
    CHECK_EQ_SIZE(bad, 12345);
    pm_loader_state_t s;
    CHECK_OK(pm_loader_state(ld, &s));
    CHECK_EQ_SIZE(s.batch, fail_batch);
    /* The batches delivered before it are whole on the device too. */
    for (uint64_t i = 0; i < fail_batch; i++) {
      CHECK_EQ_INT(part_check(&held[i], true), 0);
      CHECK_OK(pm_batch_release(&held[i], NULL));
    }
    CHECK_OK(pm_loader_destroy(ld));
  }
  REQUIRE_OK(pm_option_set("loader_piece", NULL));
  CHECK_OK(pm_dataset_destroy(ds));
}

int main(void) {
  g_small = pm_test_small();
  pm_test_init();
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  test_permute();
  test_sampler();
  test_ranks(PM_DELIVER_DEVICE, 320);
  test_ranks(PM_DELIVER_HOST, 317);
  test_ranks(PM_DELIVER_DEVICE, g_small ? 61 : 251);
  test_resume();
  test_modes();
  test_read_error();
  test_copy_fault();
  test_misuse();
  test_destroy_midway();
  alarm(240); /* the tests below hung on the old code: a hang fails */
  test_fields(PM_DELIVER_DEVICE);
  test_fields(PM_DELIVER_HOST);
  test_zip();
  test_two_consumers();
  test_destroy_while_next_waits();
  test_lease_slots();
  test_destroy_held();
  test_budget_wait();
  test_parts();
  test_part_fault();
  alarm(0);
  CHECK_OK(pm_finalize());
  return pm_test_finish("test_loader");
}
