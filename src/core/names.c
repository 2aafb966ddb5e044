/*
 * DESIGN: names of enum values. Each enum is generated from one X-macro list, X(name, value,
 * text), in pinmem.h (public enums) or internal.h (internal ones), as PM_STATUS_MAP is; the
 * functions here are generated from the same lists, so a value added to a list has its name
 * everywhere (messages, `pinmem info`, the option parser's keywords) and none can be missed.
 * Status names stay in status.c beside the error detail.
 */
#include "internal.h"

#define PM__NAME_FN(fn, type, map, fallback) \
  const char *fn(type v) {                   \
    switch (v) { map(PM__NAME_CASE) }        \
    return fallback;                         \
  }

PM__NAME_FN(pm_dtype_name, pm_dtype_t, PM_DTYPE_MAP, "unknown")
PM__NAME_FN(pm__backend_kind_name, pm_backend_kind_t, PM_BACKEND_KIND_MAP, "?")
PM__NAME_FN(pm__copy_kind_name, pm_copy_kind_t, PM_COPY_KIND_MAP, "?")
PM__NAME_FN(pm__copy_path_name, pm_copy_path_t, PM_COPY_PATH_MAP, "?")
PM__NAME_FN(pm__memory_kind_name, pm_memory_kind_t, PM_MEMORY_KIND_MAP, "unknown")
PM__NAME_FN(pm__exhaust_policy_name, pm_exhaust_policy_t, PM_EXHAUST_POLICY_MAP, "?")
PM__NAME_FN(pm__io_mode_name, pm_io_mode_t, PM_IO_MODE_MAP, "?")
PM__NAME_FN(pm__file_io_name, pm_file_io_t, PM_FILE_IO_MAP, "?")
PM__NAME_FN(pm__delivery_name, pm_delivery_t, PM_DELIVERY_MAP, "?")
PM__NAME_FN(pm__option_source_name, pm_option_source_t, PM_OPTION_SOURCE_MAP, "unknown")

const char *pm__copy_kind_symbol(pm_copy_kind_t v) {
  switch (v) { PM_COPY_KIND_MAP(PM__SYMBOL_CASE) }
  return "?";
}
