/*
 * DESIGN: a token stream as a dataset (nanoGPT's train.bin: a raw array of little-endian uint16
 * or uint32 tokens). Sample i is a window of seq_len + 1 tokens starting at offset o(i), delivered
 * as inputs = tokens[o, o + seq_len) and targets = tokens[o + 1, o + seq_len + 1): the inputs
 * shifted by one, each in its own array so a batch is two plain [batch, seq_len] arrays.
 *
 * Window starts:
 * - strided: o(i) = i * stride, for every i whose window fits: (tokens - seq_len - 1) / stride + 1
 *   samples (the loader's sampler shuffles their order).
 * - random: o(epoch, i) = a hash of (seed, epoch, i) mapped onto [0, tokens - seq_len) with a
 *   multiply-high (bias below 2^-32 for any real file), so every epoch draws new windows, as
 *   nanoGPT's torch.randint does, yet a position is reproducible and a resumed job sees the same
 *   windows. `windows` samples per epoch (default: as many tokens as the file holds).
 *
 * Each of inputs and targets is one pm__file_read straight into its place in the slot (both come
 * from the page cache; a copy between them would cost as much and serialise the row).
 * Immutable after open; no locks.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct tok_impl {
  uint64_t tokens;
  size_t seq_len;
  size_t token_bytes;
  bool random;
  uint64_t stride;
  uint64_t starts; /* possible window starts: tokens - seq_len */
  uint64_t seed;
} tok_impl_t;

static uint64_t window_start(const tok_impl_t *t, uint64_t epoch, uint64_t index) {
  if (!t->random) return index * t->stride;
  uint64_t h = pm__mix64(t->seed ^ pm__mix64(epoch * 0x9E3779B97F4A7C15ull + index));
  return (uint64_t)(((unsigned __int128)h * t->starts) >> 64);
}

static pm_status_t tok_read(pm_dataset_t *ds, uint64_t epoch, uint64_t index, void *dst, void *tdst,
                            pm__scratch_t *scratch) {
  const tok_impl_t *t = ds->impl;
  uint64_t o = window_start(t, epoch, index);
  size_t bytes = t->seq_len * t->token_bytes;
  pm_status_t st = pm__file_read(&ds->files[0], o * t->token_bytes, dst, bytes, scratch);
  if (st == PM_OK && tdst)
    st = pm__file_read(&ds->files[0], (o + 1) * t->token_bytes, tdst, bytes, scratch);
  if (st != PM_OK)
    return pm__wrap_error(st, "token window %llu (tokens %llu..%llu)", (unsigned long long)index,
                          (unsigned long long)o, (unsigned long long)(o + t->seq_len));
  return PM_OK;
}

static void tok_destroy(pm_dataset_t *ds) {
  free(ds->impl);
}

void pm_tokens_options_init(pm_tokens_options_t *options) {
  if (!options) return;
  memset(options, 0, sizeof *options);
  options->token_bytes = 2;
  options->random = 1;
  options->io = PM_IO_PREAD;
}

pm_status_t pm_dataset_open_tokens(const char *path, const pm_tokens_options_t *options,
                                   pm_dataset_t **dataset_out) {
  const char *fn = "pm_dataset_open_tokens";
  if (!path || !options || !dataset_out)
    return pm__set_error(PM_ERR_INVALID, "%s: %s is NULL", fn,
                         !path      ? "path"
                         : !options ? "options (seq_len is required)"
                                    : "dataset_out");
  const pm_tokens_options_t *o = options;
  if (o->token_bytes != 2 && o->token_bytes != 4)
    return pm__set_error(PM_ERR_INVALID, "%s: token_bytes %d (2 for uint16, 4 for uint32)", fn,
                         o->token_bytes);
  if (o->seq_len == 0) return pm__set_error(PM_ERR_INVALID, "%s: seq_len is 0", fn);
  if (o->seq_len > ((size_t)1 << 40) / (size_t)o->token_bytes)
    return pm__set_error(PM_ERR_INVALID, "%s: seq_len %zu is too large", fn, o->seq_len);
  if ((unsigned)o->io > PM_IO_DIRECT)
    return pm__set_error(PM_ERR_INVALID, "%s: unknown io mode %d", fn, (int)o->io);

  pm_dataset_t *ds = NULL;
  pm_status_t st = pm__dataset_alloc(1, &ds);
  if (st != PM_OK) return st;
  tok_impl_t *t = calloc(1, sizeof *t);
  if (!t) {
    pm__dataset_free(ds);
    return pm__set_error(PM_ERR_NOMEM, "%s: dataset", fn);
  }
  ds->impl = t;
  ds->destroy_impl = tok_destroy;
  pm_dataset_info_t *in = &ds->info;
  st = pm__file_open(&ds->files[0], path, o->io, in->note, sizeof in->note);
  if (st != PM_OK) {
    pm__dataset_free(ds);
    return pm__wrap_error(st, "%s", fn);
  }
  uint64_t size = ds->files[0].size;
  size_t tb = (size_t)o->token_bytes;
  if (size % tb) {
    pm__dataset_free(ds);
    return pm__set_error(PM_ERR_FORMAT,
                         "%s(%s): %llu bytes is not a whole number of %zu-byte tokens (truncated, "
                         "or another token size?)",
                         fn, path, (unsigned long long)size, tb);
  }
  t->tokens = size / tb;
  t->seq_len = o->seq_len;
  t->token_bytes = tb;
  t->random = o->random != 0;
  t->stride = o->stride ? o->stride : o->seq_len;
  t->seed = o->seed;
  if (t->tokens < (uint64_t)o->seq_len + 1) {
    uint64_t have = t->tokens;
    pm__dataset_free(ds);
    return pm__set_error(PM_ERR_FORMAT, "%s(%s): %llu tokens, a window of seq_len %zu needs %zu",
                         fn, path, (unsigned long long)have, o->seq_len, o->seq_len + 1);
  }
  t->starts = t->tokens - o->seq_len;
  uint64_t samples;
  if (t->random)
    samples = o->windows ? o->windows : PM__MAX((t->tokens - 1) / o->seq_len, (uint64_t)1);
  else
    samples = (t->tokens - o->seq_len - 1) / t->stride + 1;
  in->samples = samples;
  in->sample_bytes = in->target_bytes = o->seq_len * tb;
  in->ndim = 1;
  in->shape[0] = o->seq_len;
  in->dtype = tb == 2 ? PM_DTYPE_UINT16 : PM_DTYPE_UINT32;
  in->itemsize = tb;
  snprintf(in->descr, sizeof in->descr, "%s", tb == 2 ? "<u2" : "<u4");
  in->files = 1;
  in->fields = 2; /* inputs, targets */
  in->io = ds->files[0].io;
  in->tokens = t->tokens;
  ds->read = tok_read;
  *dataset_out = ds;
  return PM_OK;
}
