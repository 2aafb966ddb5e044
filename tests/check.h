/*
 * A small assertion helper for pinmem's C tests: each CHECK prints the expression, both values
 * and pm_last_error() on failure, counts it, and the test goes on so one run shows every
 * failure. pm_test_finish() turns the counts into the program's exit code (pm_test_init() exits
 * 77, skipped with the reason printed, for CTest's SKIP_RETURN_CODE). The functions tests share,
 * and the counts themselves, are in helpers.{c,h}.
 */
#ifndef PINMEM_TEST_CHECK_H
#define PINMEM_TEST_CHECK_H

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "pinmem.h"

#define PM_TEST_FAIL_AT(file, line, ...)                                        \
  do {                                                                          \
    pm_test_failures++;                                                         \
    fprintf(stderr, "%s:%d: FAIL: ", file, line);                               \
    fprintf(stderr, __VA_ARGS__);                                               \
    fprintf(stderr, "\n    last error: %s\n", pm_last_error());                 \
  } while (0)

#define CHECK(cond)                                                             \
  do {                                                                          \
    pm_test_checks++;                                                           \
    if (!(cond)) PM_TEST_FAIL_AT(__FILE__, __LINE__, "%s", #cond);              \
  } while (0)

#define CHECK_EQ_INT(a, b)                                                      \
  do {                                                                          \
    long long va_ = (long long)(a), vb_ = (long long)(b);                       \
    pm_test_checks++;                                                           \
    if (va_ != vb_)                                                             \
      PM_TEST_FAIL_AT(__FILE__, __LINE__, "%s == %s: %lld != %lld", #a, #b, va_, vb_); \
  } while (0)

#define CHECK_EQ_SIZE(a, b)                                                     \
  do {                                                                          \
    unsigned long long va_ = (unsigned long long)(a), vb_ = (unsigned long long)(b); \
    pm_test_checks++;                                                           \
    if (va_ != vb_)                                                             \
      PM_TEST_FAIL_AT(__FILE__, __LINE__, "%s == %s: %llu != %llu", #a, #b, va_, vb_); \
  } while (0)

#define CHECK_LE_SIZE(a, b)                                                     \
  do {                                                                          \
    unsigned long long va_ = (unsigned long long)(a), vb_ = (unsigned long long)(b); \
    pm_test_checks++;                                                           \
    if (!(va_ <= vb_))                                                          \
      PM_TEST_FAIL_AT(__FILE__, __LINE__, "%s <= %s: %llu > %llu", #a, #b, va_, vb_); \
  } while (0)

/* Status equality, printing names. */
#define CHECK_ST(expr, want)                                                    \
  do {                                                                          \
    pm_status_t got_ = (expr), want_ = (want);                                  \
    pm_test_checks++;                                                           \
    if (got_ != want_)                                                          \
      PM_TEST_FAIL_AT(__FILE__, __LINE__, "%s: got %s, want %s", #expr,         \
                      pm_status_name(got_), pm_status_name(want_));             \
  } while (0)

#define CHECK_OK(expr) CHECK_ST(expr, PM_OK)

/* A failing status must come with a detail message. */
#define CHECK_ERR_MSG(expr, want)                                               \
  do {                                                                          \
    CHECK_ST(expr, want);                                                       \
    pm_test_checks++;                                                           \
    if (pm_last_error()[0] == '\0')                                             \
      PM_TEST_FAIL_AT(__FILE__, __LINE__, "%s: no pm_last_error() detail", #expr); \
  } while (0)

/* Stop the test now (for setup failures that make the rest meaningless). */
#define REQUIRE(cond)                                                           \
  do {                                                                          \
    pm_test_checks++;                                                           \
    if (!(cond)) {                                                              \
      PM_TEST_FAIL_AT(__FILE__, __LINE__, "required: %s", #cond);               \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

#define REQUIRE_OK(expr)                                                        \
  do {                                                                          \
    pm_status_t st_ = (expr);                                                   \
    pm_test_checks++;                                                           \
    if (st_ != PM_OK) {                                                         \
      PM_TEST_FAIL_AT(__FILE__, __LINE__, "required: %s: got %s", #expr, pm_status_name(st_)); \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

#endif
