/*
 * libFuzzer target: the .npy header parser (pm__npy_preamble, pm__npy_parse) on arbitrary bytes,
 * and the dtype normaliser on arbitrary text. A parsed header must be self-consistent: at least
 * one dimension, samples of more than 0 bytes, data_bytes = count * sample_bytes without
 * overflow, the data offset where the preamble said, a non-empty NUL-terminated descr.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  size_t total = 0;
  pm_status_t st = pm__npy_preamble(data, size, &total);
  if (st != PM_OK) {
    if (st != PM_ERR_FORMAT || !pm_last_error()[0]) abort();
  } else {
    if (total < 10 || total > PM__NPY_HEADER_MAX + 12) abort();
  }
  pm__npy_header_t h;
  memset(&h, 0xa5, sizeof h);
  st = pm__npy_parse(data, size, &h);
  if (st == PM_OK) {
    if (total == 0 || h.data_offset != total || total > size) abort();
    if (h.ndim < 1 || h.ndim > PM_DATASET_MAX_DIMS + 1) abort();
    if (h.itemsize == 0 || h.sample_bytes == 0 || h.count != h.shape[0]) abort();
    if (h.count && h.data_bytes / h.count != h.sample_bytes) abort();
    if (!memchr(h.descr, '\0', sizeof h.descr) || !h.descr[0]) abort();
    /* The normalised descr of a simple type normalises to itself. */
    if (h.descr[0] != '[' && h.descr[0] != '(' && h.descr[0] != '{') {
      char again[128];
      if (pm__npy_normalize_descr(h.descr, again, sizeof again) == PM_OK &&
          strcmp(again, h.descr) != 0)
        abort();
    }
  } else if (st != PM_ERR_FORMAT || !pm_last_error()[0]) {
    abort();
  }
  if (size <= 256) {
    char text[257], out[128];
    memcpy(text, data, size);
    text[size] = '\0';
    st = pm__npy_normalize_descr(text, out, sizeof out);
    if (st == PM_OK && !memchr(out, '\0', sizeof out)) abort();
    if (st != PM_OK && !pm_last_error()[0]) abort();
  }
  return 0;
}
