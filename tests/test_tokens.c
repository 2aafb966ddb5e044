/*
 * Token-stream datasets: strided and random windows over uint16 and uint32 files, targets equal
 * to the inputs shifted by one, windows inside the file (the last token included, never past
 * it), random windows reproducible per (seed, epoch) and new every epoch, the read modes, bad
 * files and options, and a loader delivering [batch, seq_len] inputs and targets to the device
 * (checked after a copy back).
 *
 * Token t of the files here is a function of t that never repeats within the file (uint32: t
 * itself; uint16: t mod 65521 over fewer tokens than that), so a window's values tell where it
 * starts.
 */
#include <unistd.h>

#include "check.h"
#include "internal.h"

static char g_dir[256];

static uint32_t tok(uint64_t t, int tb) {
  return tb == 4 ? (uint32_t)(t * 3 + 1) : (uint32_t)((t * 7 + 1) % 65521);
}

static const char *write_tokens(const char *name, uint64_t n, int tb, size_t extra_bytes) {
  static char path[4][512];
  static int k;
  char *p = path[k++ % 4];
  snprintf(p, 512, "%s/%s", g_dir, name);
  FILE *f = fopen(p, "wb");
  REQUIRE(f != NULL);
  for (uint64_t t = 0; t < n; t++) {
    uint32_t v = tok(t, tb);
    unsigned char b[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16),
                          (unsigned char)(v >> 24)};
    REQUIRE(fwrite(b, 1, (size_t)tb, f) == (size_t)tb);
  }
  for (size_t i = 0; i < extra_bytes; i++) fputc(0x11, f);
  fclose(f);
  return p;
}

static uint32_t get(const void *p, size_t i, int tb) {
  if (tb == 2) {
    uint16_t v;
    memcpy(&v, (const char *)p + 2 * i, 2);
    return v;
  }
  uint32_t v;
  memcpy(&v, (const char *)p + 4 * i, 4);
  return v;
}

/* Where the window starting with `first` starts (the token functions are invertible here). */
static uint64_t start_of(uint32_t first, int tb, uint64_t n) {
  for (uint64_t t = 0; t < n; t++)
    if (tok(t, tb) == first) return t;
  return UINT64_MAX;
}

/* inputs = tokens[o, o+L), targets = tokens[o+1, o+L+1), o + L < n. Returns o. */
static uint64_t check_window(const void *in, const void *tg, size_t L, int tb, uint64_t n) {
  uint64_t o = tb == 4 ? (get(in, 0, 4) - 1) / 3 : start_of(get(in, 0, 2), 2, n);
  int bad = 0;
  if (o == UINT64_MAX || o + L >= n) bad++;
  for (size_t i = 0; i < L && !bad; i++) {
    if (get(in, i, tb) != tok(o + i, tb)) bad++;
    if (get(tg, i, tb) != tok(o + i + 1, tb)) bad++;
    if (i + 1 < L && get(tg, i, tb) != get(in, i + 1, tb)) bad++; /* shifted by one */
  }
  CHECK_EQ_INT(bad, 0);
  return o;
}

static void test_strided(void) {
  for (int tb = 2; tb <= 4; tb += 2) {
    const uint64_t n = 1000;
    const size_t L = 16;
    const char *p = write_tokens(tb == 2 ? "s16.bin" : "s32.bin", n, tb, 0);
    for (int io = 0; io < 3; io++) {
      pm_tokens_options_t o;
      pm_tokens_options_init(&o);
      o.seq_len = L;
      o.token_bytes = tb;
      o.random = 0;
      o.io = (pm_io_mode_t)io;
      pm_dataset_t *ds = NULL;
      REQUIRE_OK(pm_dataset_open_tokens(p, &o, &ds));
      pm_dataset_info_t in;
      CHECK_OK(pm_dataset_get_info(ds, &in));
      CHECK_EQ_SIZE(in.tokens, n);
      CHECK_EQ_SIZE(in.samples, (n - L - 1) / L + 1);
      CHECK_EQ_SIZE(in.sample_bytes, L * (size_t)tb);
      CHECK_EQ_SIZE(in.target_bytes, L * (size_t)tb);
      CHECK_EQ_INT(in.dtype, tb == 2 ? PM_DTYPE_UINT16 : PM_DTYPE_UINT32);
      CHECK_EQ_INT(in.io, io);
      CHECK_EQ_INT(in.ndim, 1);
      CHECK_EQ_SIZE(in.shape[0], L);
      unsigned char a[64], t[64];
      for (uint64_t i = 0; i < in.samples; i++) {
        CHECK_OK(pm_dataset_read_sample(ds, 0, i, a, t));
        CHECK_EQ_SIZE(check_window(a, t, L, tb, n), i * L);
      }
      CHECK_ERR_MSG(pm_dataset_read_sample(ds, 0, in.samples, a, t), PM_ERR_INVALID);
      CHECK_OK(pm_dataset_destroy(ds));
    }
    /* A stride that ends exactly on the last token: the last window uses it. */
    pm_tokens_options_t o;
    pm_tokens_options_init(&o);
    o.seq_len = 10;
    o.token_bytes = tb;
    o.random = 0;
    o.stride = 3;
    pm_dataset_t *ds = NULL;
    REQUIRE_OK(pm_dataset_open_tokens(p, &o, &ds));
    pm_dataset_info_t in;
    CHECK_OK(pm_dataset_get_info(ds, &in));
    CHECK_EQ_SIZE(in.samples, (n - 11) / 3 + 1);
    unsigned char a[64], t[64];
    uint64_t last = in.samples - 1;
    CHECK_OK(pm_dataset_read_sample(ds, 0, last, a, t));
    uint64_t st = check_window(a, t, 10, tb, n);
    CHECK_EQ_SIZE(st, last * 3);
    CHECK(st + 11 <= n);
    CHECK(st + 3 + 11 > n); /* one more would not fit */
    CHECK_OK(pm_dataset_destroy(ds));
  }
}

static void test_random(void) {
  const uint64_t n = 5000;
  const size_t L = 32;
  const char *p = write_tokens("r32.bin", n, 4, 0);
  pm_tokens_options_t o;
  pm_tokens_options_init(&o);
  o.seq_len = L;
  o.token_bytes = 4;
  o.seed = 77;
  CHECK_EQ_INT(o.random, 1);
  pm_dataset_t *ds = NULL;
  REQUIRE_OK(pm_dataset_open_tokens(p, &o, &ds));
  pm_dataset_info_t in;
  CHECK_OK(pm_dataset_get_info(ds, &in));
  CHECK_EQ_SIZE(in.samples, (n - 1) / L);
  unsigned char a[256], t[256];
  uint64_t e0[200], e1[200];
  uint64_t lo = UINT64_MAX, hi = 0;
  for (uint64_t i = 0; i < in.samples; i++) {
    CHECK_OK(pm_dataset_read_sample(ds, 0, i, a, t));
    e0[i] = check_window(a, t, L, 4, n);
    CHECK_OK(pm_dataset_read_sample(ds, 1, i, a, t));
    e1[i] = check_window(a, t, L, 4, n);
    lo = PM__MIN(lo, e0[i]);
    hi = PM__MAX(hi, e0[i]);
  }
  int same = 0;
  for (uint64_t i = 0; i < in.samples; i++) same += e0[i] == e1[i];
  CHECK(same < 10);                      /* new windows every epoch */
  CHECK(lo < n / 10 && hi > n - n / 10); /* spread over the file */
  /* Reproducible: the same (seed, epoch, index) gives the same window. */
  CHECK_OK(pm_dataset_read_sample(ds, 0, 17, a, t));
  CHECK_EQ_SIZE(check_window(a, t, L, 4, n), e0[17]);
  CHECK_OK(pm_dataset_destroy(ds));
  /* Another seed, other windows; `windows` sets the count. */
  o.seed = 78;
  o.windows = 1234;
  REQUIRE_OK(pm_dataset_open_tokens(p, &o, &ds));
  CHECK_OK(pm_dataset_get_info(ds, &in));
  CHECK_EQ_SIZE(in.samples, 1234);
  same = 0;
  for (uint64_t i = 0; i < 100; i++) {
    CHECK_OK(pm_dataset_read_sample(ds, 0, i, a, t));
    same += check_window(a, t, L, 4, n) == e0[i];
  }
  CHECK(same < 10);
  CHECK_OK(pm_dataset_destroy(ds));
  /* Windows as long as the file allows: every start is 0. */
  const char *q = write_tokens("tiny.bin", L + 1, 4, 0);
  o.windows = 50;
  REQUIRE_OK(pm_dataset_open_tokens(q, &o, &ds));
  for (uint64_t i = 0; i < 50; i++) {
    CHECK_OK(pm_dataset_read_sample(ds, i, i, a, t));
    CHECK_EQ_SIZE(check_window(a, t, L, 4, L + 1), 0);
  }
  CHECK_OK(pm_dataset_destroy(ds));
}

static void test_bad(void) {
  pm_tokens_options_t o;
  pm_tokens_options_init(&o);
  o.seq_len = 8;
  pm_dataset_t *ds = (pm_dataset_t *)(uintptr_t)1;
  const char *odd = write_tokens("odd.bin", 100, 2, 1);
  CHECK_ERR_MSG(pm_dataset_open_tokens(odd, &o, &ds), PM_ERR_FORMAT);
  CHECK(strstr(pm_last_error(), "whole number") != NULL);
  const char *few = write_tokens("few.bin", 8, 2, 0);
  CHECK_ERR_MSG(pm_dataset_open_tokens(few, &o, &ds), PM_ERR_FORMAT);
  CHECK(strstr(pm_last_error(), "needs 9") != NULL);
  const char *empty = write_tokens("empty.bin", 0, 2, 0);
  CHECK_ERR_MSG(pm_dataset_open_tokens(empty, &o, &ds), PM_ERR_FORMAT);
  char missing[300];
  snprintf(missing, sizeof missing, "%s/none.bin", g_dir);
  CHECK_ERR_MSG(pm_dataset_open_tokens(missing, &o, &ds), PM_ERR_IO);
  CHECK(strstr(pm_last_error(), "none.bin") != NULL);
  CHECK(ds == (pm_dataset_t *)(uintptr_t)1);
  const char *good = write_tokens("good.bin", 100, 2, 0);
  o.token_bytes = 3;
  CHECK_ERR_MSG(pm_dataset_open_tokens(good, &o, &ds), PM_ERR_INVALID);
  o.token_bytes = 2;
  o.seq_len = 0;
  CHECK_ERR_MSG(pm_dataset_open_tokens(good, &o, &ds), PM_ERR_INVALID);
  o.seq_len = 8;
  CHECK_ERR_MSG(pm_dataset_open_tokens(good, NULL, &ds), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_dataset_open_tokens(NULL, &o, &ds), PM_ERR_INVALID);
  o.io = (pm_io_mode_t)9;
  CHECK_ERR_MSG(pm_dataset_open_tokens(good, &o, &ds), PM_ERR_INVALID);
  /* The same file read as uint32 has half the tokens. */
  o.io = PM_IO_PREAD;
  o.token_bytes = 4;
  REQUIRE_OK(pm_dataset_open_tokens(good, &o, &ds));
  pm_dataset_info_t in;
  CHECK_OK(pm_dataset_get_info(ds, &in));
  CHECK_EQ_SIZE(in.tokens, 50);
  CHECK_OK(pm_dataset_destroy(ds));
}

/* The loader: [batch, seq_len] inputs and targets in device buffers, shuffled strided windows,
 * each exactly once per epoch; random windows with host delivery. */
static void test_loader(void) {
  const uint64_t n = 4096;
  const size_t L = 24;
  const char *p = write_tokens("l16.bin", n, 2, 0);
  for (int variant = 0; variant < 2; variant++) {
    pm_tokens_options_t o;
    pm_tokens_options_init(&o);
    o.seq_len = L;
    o.random = variant;
    o.seed = 3;
    pm_dataset_t *ds = NULL;
    REQUIRE_OK(pm_dataset_open_tokens(p, &o, &ds));
    pm_dataset_info_t in;
    CHECK_OK(pm_dataset_get_info(ds, &in));
    pm_loader_config_t c;
    pm_loader_config_init(&c);
    c.batch_size = 12;
    c.workers = 3;
    c.shuffle = 1;
    c.epochs = 2;
    c.rank = 0;
    c.world_size = 1;
    c.delivery = variant ? PM_DELIVER_HOST : PM_DELIVER_DEVICE;
    pm_loader_t *ld;
    REQUIRE_OK(pm_loader_create(ds, &c, &ld));
    pm_loader_stats_t s;
    CHECK_OK(pm_loader_get_stats(ld, &s));
    size_t tb = 2;
    unsigned char *hin = malloc(s.slot_bytes), *htg = malloc(s.slot_bytes);
    int *seen = calloc(in.samples, sizeof *seen);
    REQUIRE(hin && htg && seen);
    pm_batch_t b;
    uint64_t batches = 0, epoch = 0;
    while (pm_loader_next(ld, &b) == PM_OK) {
      if (b.epoch != epoch) {
        int wrong = 0;
        for (uint64_t i = 0; i < in.samples; i++) wrong += seen[i] != 1;
        CHECK_EQ_INT(wrong, 0);
        memset(seen, 0, in.samples * sizeof *seen);
        epoch = b.epoch;
      }
      CHECK(b.targets != NULL && b.host_targets != NULL);
      CHECK_EQ_SIZE(b.inputs_bytes, b.samples * L * tb);
      CHECK_EQ_SIZE(b.targets_bytes, b.inputs_bytes);
      CHECK_EQ_INT(b.ndim, 2);
      CHECK_EQ_SIZE(b.shape[1], L);
      CHECK_EQ_INT(b.dtype, PM_DTYPE_UINT16);
      if (b.event) {
        CHECK_OK(pm_event_synchronize(b.event));
        CHECK_OK(pm_memcpy(hin, b.inputs, b.inputs_bytes, PM_COPY_D2H));
        CHECK_OK(pm_memcpy(htg, b.targets, b.targets_bytes, PM_COPY_D2H));
      } else {
        memcpy(hin, b.inputs, b.inputs_bytes);
        memcpy(htg, b.targets, b.targets_bytes);
      }
      unsigned char want_in[64], want_tg[64];
      int bad = 0;
      for (size_t r = 0; r < b.samples; r++) {
        const unsigned char *ri = hin + r * L * tb, *rt = htg + r * L * tb;
        check_window(ri, rt, L, 2, n);
        CHECK_OK(pm_dataset_read_sample(ds, b.epoch, b.indices[r], want_in, want_tg));
        if (memcmp(ri, want_in, L * tb) || memcmp(rt, want_tg, L * tb)) bad++;
        seen[b.indices[r]]++;
      }
      CHECK_EQ_INT(bad, 0);
      CHECK_OK(pm_batch_release(&b, NULL));
      batches++;
    }
    CHECK_EQ_SIZE(batches, 2 * ((in.samples + 11) / 12));
    free(hin);
    free(htg);
    free(seen);
    CHECK_OK(pm_loader_destroy(ld));
    CHECK_OK(pm_dataset_destroy(ds));
  }
}

int main(void) {
  pm_test_init();
  REQUIRE(pm_test_tmpdir(g_dir, sizeof g_dir, "tok"));
  test_strided();
  test_random();
  test_bad();
  test_loader();
  pm_test_rmtree(g_dir);
  CHECK_OK(pm_finalize());
  return pm_test_finish("test_tokens");
}
