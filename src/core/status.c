/*
 * DESIGN: status codes and error detail. PM_STATUS_MAP (pinmem.h) is the single table; the
 * name and message lookups below are generated from it. The detail of the last failure lives in
 * a thread-local buffer so concurrent threads never see each other's messages and no call needs
 * to allocate to report an error (an allocation failure must still be reportable).
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

#define PM__DETAIL_MAX 1024

static _Thread_local char tl_detail[PM__DETAIL_MAX];
/* The detail that the last pm__clear_error() on this thread removed: a failure that reaches a
 * caller with no detail lost it to a clear on its way out, and this says what it was. */
static _Thread_local char tl_cleared[PM__DETAIL_MAX];

const char *pm_strerror(pm_status_t status) {
  switch (status) {
#define PM__CASE(name, value, msg) \
  case name:                       \
    return msg;
    PM_STATUS_MAP(PM__CASE)
#undef PM__CASE
  }
  return "unknown status";
}

const char *pm_status_name(pm_status_t status) {
  switch (status) {
#define PM__CASE(name, value, msg) \
  case name:                       \
    return #name;
    PM_STATUS_MAP(PM__CASE)
#undef PM__CASE
  }
  return "PM_STATUS_UNKNOWN";
}

const char *pm_last_error(void) { return tl_detail; }

const char *pm_version(void) {
#define PM__STR2(x) #x
#define PM__STR(x) PM__STR2(x)
  return PM__STR(PINMEM_VERSION_MAJOR) "." PM__STR(PINMEM_VERSION_MINOR) "." PM__STR(
      PINMEM_VERSION_PATCH);
}

pm_status_t pm__set_error(pm_status_t status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(tl_detail, sizeof tl_detail, fmt, ap);
  va_end(ap);
  return status;
}

pm_status_t pm__wrap_error(pm_status_t status, const char *fmt, ...) {
  char prefix[256];
  char old[PM__DETAIL_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(prefix, sizeof prefix, fmt, ap);
  va_end(ap);
  memcpy(old, tl_detail, sizeof old);
  /* Truncation of very long details is intended; the prefix always survives. */
  size_t n = strlen(prefix);
  memcpy(tl_detail, prefix, n + 1);
  if (n + 2 < sizeof tl_detail) {
    memcpy(tl_detail + n, ": ", 3);
    const char *rest = old[0] ? old : pm_strerror(status);
    size_t room = sizeof tl_detail - n - 3;
    size_t m = strlen(rest);
    if (m > room) m = room;
    memcpy(tl_detail + n + 2, rest, m);
    tl_detail[n + 2 + m] = '\0';
  }
  return status;
}

void pm__clear_error(void) {
  if (!tl_detail[0]) return;
  memcpy(tl_cleared, tl_detail, sizeof tl_cleared);
  tl_detail[0] = '\0';
}

const char *pm__cleared_error(void) { return tl_cleared; }
