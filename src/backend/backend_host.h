/*
 * The host backend's two halves, and what they share (internal to the backend; the contract is
 * backend.h). backend_host_memory.c: pinned memory (mlock), device and managed memory and their
 * tables, the one "device". backend_host_stream.c: streams as threads, events, copies, the timed
 * busy kernel, host functions, and the backend table that joins both. The stream engine calls
 * the memory half, never the reverse.
 */
#ifndef PINMEM_BACKEND_HOST_H
#define PINMEM_BACKEND_HOST_H

#include "internal.h"

enum { R_PIN_ALLOC, R_PIN_REGISTER, R_DEVICE, R_MANAGED };

typedef struct hb_range {
  uintptr_t base;
  size_t size; /* R_PIN_ALLOC: page-rounded mapping; others: the bytes asked for */
  unsigned char kind;
  bool pending; /* registration whose mlock has not finished: not pinned yet */
} hb_range_t;

typedef struct hb_side {
  pm__mem_t kind; /* PM__MEM_DEVICE or _MANAGED (device table), _PINNED (the whole span in one
                   * pinned range) or _PAGEABLE */
  bool fits;      /* device table: the whole span lies in that allocation */
  hb_range_t dev;
} hb_side_t;

static inline bool hb_in_dev(const hb_side_t *sd) {
  return sd->kind == PM__MEM_DEVICE || sd->kind == PM__MEM_MANAGED;
}

/* ---- backend_host_memory.c ------------------------------------------------------------------ */

/* The backend contract's memory calls (backend.h has their meaning). */
pm_status_t pm__hb_host_alloc(size_t bytes, unsigned flags, void **ptr_out);
pm_status_t pm__hb_host_free(void *ptr, size_t bytes);
pm_status_t pm__hb_host_register(void *ptr, size_t bytes, unsigned flags);
pm_status_t pm__hb_host_unregister(void *ptr, size_t bytes);
pm_status_t pm__hb_host_device_pointer(void *host_ptr, void **dptr_out);
pm_status_t pm__hb_device_alloc(size_t bytes, void **dptr_out);
pm_status_t pm__hb_managed_alloc(size_t bytes, void **ptr_out);
int pm__hb_pointer_kind(const void *ptr);
pm_status_t pm__hb_device_count(int *count_out);
pm_status_t pm__hb_device_info(int device, pm_device_info_t *info_out);
pm_status_t pm__hb_set_device(int device);
pm_status_t pm__hb_get_device(int *device_out);

/* Free the device or managed allocation that starts at ptr (the caller synchronized first). */
pm_status_t pm__hb_device_release(const char *fn, void *ptr);
/* [ptr, ptr+bytes) must lie in one device-table range (of `kind`, or any kind if kind < 0). */
pm_status_t pm__hb_check_device_span(const char *fn, const char *what, const void *ptr,
                                     size_t bytes, int kind);
/* Both sides of a copy, classified under one hold of the memory lock. */
void pm__hb_classify(const void *dst, const void *src, size_t bytes, hb_side_t *d, hb_side_t *s);
/* "pinned allocation", "registration", ...: a range's kind in messages. */
const char *pm__hb_range_desc(unsigned kind);
void pm__hb_memory_shutdown(void);
void pm__hb_memory_atfork(pm__fork_phase_t phase);

#endif /* PINMEM_BACKEND_HOST_H */
