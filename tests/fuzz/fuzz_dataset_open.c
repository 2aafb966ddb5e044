/*
 * libFuzzer target: the loader's dataset open path on arbitrary file contents. Byte 0 picks the
 * opener and its options (bit 0: token file instead of .npy; bits 1-2: io mode; bit 3: uint32
 * tokens; bit 4: random windows), byte 1 the token window length; the rest is written to a file
 * that pm_dataset_open_npy / pm_dataset_open_tokens open. An open that succeeds must describe a
 * dataset whose first, middle and last samples can be read; one that fails must say why
 * (PM_ERR_FORMAT or PM_ERR_IO with a detail).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "helpers.h"
#include "pinmem.h"

static char g_dir[256], g_path[300];

static void cleanup(void) {
  unlink(g_path);
  rmdir(g_dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  if (!pm_test_tmpdir(g_dir, sizeof g_dir, "fuzz")) abort();
  snprintf(g_path, sizeof g_path, "%s/input", g_dir);
  atexit(cleanup);
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 2 || size > (1u << 20)) return 0;
  unsigned mode = data[0];
  FILE *f = fopen(g_path, "wb");
  if (!f) abort();
  if (size > 2 && fwrite(data + 2, 1, size - 2, f) != size - 2) abort();
  fclose(f);

  pm_io_mode_t io = (pm_io_mode_t)((mode >> 1) & 3);
  if (io > PM_IO_DIRECT) io = PM_IO_PREAD;
  pm_dataset_t *ds = NULL;
  pm_status_t st;
  if (mode & 1) {
    pm_tokens_options_t o;
    pm_tokens_options_init(&o);
    o.seq_len = 1 + data[1] % 64;
    o.token_bytes = (mode & 8) ? 4 : 2;
    o.random = (mode & 16) ? 1 : 0;
    o.io = io;
    st = pm_dataset_open_tokens(g_path, &o, &ds);
  } else {
    pm_npy_options_t o;
    pm_npy_options_init(&o);
    o.io = io;
    const char *paths[1] = {g_path};
    st = pm_dataset_open_npy(paths, 1, &o, &ds);
  }
  if (st != PM_OK) {
    if ((st != PM_ERR_FORMAT && st != PM_ERR_IO) || !pm_last_error()[0]) abort();
    return 0;
  }
  pm_dataset_info_t info;
  if (pm_dataset_get_info(ds, &info) != PM_OK) abort();
  if (info.samples == 0 || info.sample_bytes == 0) abort();
  if (info.sample_bytes + info.target_bytes <= ((size_t)4 << 20)) {
    char *buf = malloc(info.sample_bytes + 1), *tgt = malloc(info.target_bytes + 1);
    if (!buf || !tgt) abort();
    uint64_t idx[3] = {0, info.samples / 2, info.samples - 1};
    for (int i = 0; i < 3; i++)
      if (pm_dataset_read_sample(ds, 0, idx[i], buf, info.target_bytes ? tgt : NULL) != PM_OK)
        abort(); /* opened, so every sample is there */
    if (pm_dataset_read_sample(ds, 0, info.samples, buf, NULL) == PM_OK) abort();
    free(buf);
    free(tgt);
  }
  if (pm_dataset_destroy(ds) != PM_OK) abort();
  return 0;
}
