/*
 * libFuzzer target: the path from a .npy header to the buffer descriptor Python exports for a
 * loader batch. The header is parsed as pm_dataset_open_npy parses it (pm__npy_parse); the
 * batch the loader would make of it (rows of the file's samples: its dtype, [rows, sample
 * shape...], rows * sample_bytes bytes) goes through pmpy_batch_layout, the very function
 * pinmem._pinmem describes batches with. A described batch must stay inside its arrays and its
 * bytes: 1 <= ndim <= the arrays' size, C-order strides, shape * itemsize == the batch's bytes.
 * Raw records (a dtype without a pinmem code: '>f4', '<U10', records, datetime64) are rows of
 * bytes. For any header the parser accepts, the description must succeed.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "batch_layout.h"
#include "internal.h"

static void check_batch(const pm__npy_header_t *h, size_t rows, int scalar) {
  uint64_t shape[PMPY_LAYOUT_MAX_DIMS + 1];
  memset(shape, 0xa5, sizeof shape);
  shape[0] = rows;
  for (int i = 1; i < h->ndim; i++) shape[i] = h->shape[i];
  size_t nbytes = rows * h->sample_bytes; /* rows <= count: fits, as data_bytes does */
  size_t itemsize = h->dtype == PM_DTYPE_OTHER ? 0 : h->itemsize;
  pmpy_layout_t lay;
  memset(&lay, 0x5a, sizeof lay);
  const char *why = NULL;
  if (pmpy_batch_layout(itemsize, h->ndim, shape, rows, nbytes, scalar, &lay, &why) != 0) {
    /* Every batch of a header the parser accepts is described, except one that Python cannot
     * index (its bytes or a dimension past INT64_MAX, Py_ssize_t's range: a header may promise
     * that many rows, but no slot could hold them); that one is refused with a reason. */
    if (!why || !why[0]) abort();
    int huge = nbytes > (uint64_t)INT64_MAX;
    for (int i = 0; i < h->ndim; i++) huge |= shape[i] > (uint64_t)INT64_MAX;
    if (!huge) abort();
    return;
  }
  if (lay.ndim < 1 || lay.ndim > PMPY_LAYOUT_MAX_DIMS || lay.itemsize < 1) abort();
  if (itemsize && lay.itemsize != itemsize) abort();
  if (!itemsize && (lay.ndim != 2 || lay.itemsize != 1 || lay.shape[0] != (int64_t)rows)) abort();
  uint64_t n = lay.itemsize;
  for (int i = lay.ndim - 1; i >= 0; i--) {
    if (lay.shape[i] < 0 || lay.strides[i] != (int64_t)n) abort();
    n *= (uint64_t)lay.shape[i];
  }
  if (n != nbytes) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  pm__npy_header_t h;
  memset(&h, 0xa5, sizeof h);
  if (pm__npy_parse(data, size, &h) != PM_OK) {
    if (!pm_last_error()[0]) abort();
    return 0;
  }
  /* Batches of one row, of the whole file, and a partial one; as a scalar dataset too. */
  size_t rows[3] = {1, (size_t)h.count, (size_t)(h.count / 3 + 1)};
  for (int r = 0; r < 3; r++) {
    if (rows[r] == 0 || rows[r] > h.count) continue;
    check_batch(&h, rows[r], 0);
    check_batch(&h, rows[r], h.ndim == 1);
  }
  /* Bytes that do not fill whole rows, and a descriptor of too many dimensions, are refused. */
  if (h.dtype == PM_DTYPE_OTHER && h.sample_bytes > 1 && h.count >= 2) {
    uint64_t shape[1] = {2};
    pmpy_layout_t lay;
    const char *why = NULL;
    if (pmpy_batch_layout(0, 1, shape, 2, 2 * h.sample_bytes + 1, 0, &lay, &why) == 0) abort();
  }
  {
    uint64_t shape[PMPY_LAYOUT_MAX_DIMS + 1] = {1};
    for (int i = 1; i <= PMPY_LAYOUT_MAX_DIMS; i++) shape[i] = 1;
    pmpy_layout_t lay;
    const char *why = NULL;
    if (pmpy_batch_layout(4, PMPY_LAYOUT_MAX_DIMS + 1, shape, 1, 4, 0, &lay, &why) == 0) abort();
  }
  return 0;
}
