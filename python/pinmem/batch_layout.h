/*
 * DESIGN: the buffer descriptor of one array of a loader batch, as pinmem._pinmem exports it
 * (buffer protocol, DLPack): from what the C loader says of the batch (element size, dimensions,
 * rows, bytes) to ndim, itemsize, shape and C-order strides. Plain C without Python.h, so the
 * libFuzzer target tests/fuzz/fuzz_npy_buffer.c drives the very code Python runs, from .npy
 * headers.
 *
 * Invariants of a described batch: 1 <= ndim <= PMPY_LAYOUT_MAX_DIMS (the arrays hold exactly
 * that many), itemsize >= 1, C-order strides, and shape * itemsize == the batch's bytes (never
 * more: a descriptor past the slot would let a reader run off it). Records without an element
 * type of pinmem's are exported as their bytes: (rows, bytes per row) of uint8.
 */
#ifndef PINMEM_PY_BATCH_LAYOUT_H
#define PINMEM_PY_BATCH_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "pinmem.h"

#define PMPY_LAYOUT_MAX_DIMS (PM_DATASET_MAX_DIMS + 1)

typedef struct pmpy_layout {
  int ndim;
  size_t itemsize;
  int64_t shape[PMPY_LAYOUT_MAX_DIMS];
  int64_t strides[PMPY_LAYOUT_MAX_DIMS]; /* bytes */
} pmpy_layout_t;

/* itemsize: the element size of the batch's dtype, 0 for raw records (PM_DTYPE_OTHER). ndim and
 * shape: the batch's ([rows, sample shape...]). scalar: one element per sample (the batch is
 * 1-D even where the library says [rows, 1]). Returns 0, or -1 with the reason in *why. */
static inline int pmpy_batch_layout(size_t itemsize, int ndim, const uint64_t *shape, size_t rows,
                                    size_t nbytes, int scalar, pmpy_layout_t *out,
                                    const char **why) {
  const uint64_t lim = (uint64_t)INT64_MAX;
  if (itemsize) {
    if (ndim < 1 || ndim > PMPY_LAYOUT_MAX_DIMS) {
      *why = "the batch has a number of dimensions outside 1..PM_DATASET_MAX_DIMS+1";
      return -1;
    }
    out->ndim = ndim;
    out->itemsize = itemsize;
    for (int i = 0; i < ndim; i++) {
      if (shape[i] > lim) {
        *why = "a dimension of the batch is too large";
        return -1;
      }
      out->shape[i] = (int64_t)shape[i];
    }
    if (scalar && ndim == 2 && shape[1] == 1) out->ndim = 1;
  } else {
    /* Records without a dtype of their own: bytes, one row per sample. */
    if (rows > lim || (rows && nbytes % rows)) {
      *why = "the batch's bytes are not a whole number of rows";
      return -1;
    }
    out->ndim = 2;
    out->itemsize = 1;
    out->shape[0] = (int64_t)rows;
    out->shape[1] = rows ? (int64_t)(nbytes / rows) : 0;
  }
  uint64_t n = out->itemsize;
  for (int i = out->ndim - 1; i >= 0; i--) {
    out->strides[i] = (int64_t)n;
    uint64_t d = (uint64_t)out->shape[i];
    if (d && n > lim / d) {
      *why = "the batch's shape is too large for memory";
      return -1;
    }
    n *= d;
  }
  if (n != (uint64_t)nbytes) {
    *why = "the batch's shape does not match its bytes";
    return -1;
  }
  return 0;
}

#endif /* PINMEM_PY_BATCH_LAYOUT_H */
