/*
 * libFuzzer target: pm_parse_size on arbitrary text. Besides "no crash, no leak, no UB" it
 * checks the result against an independent reading of the grammar: a plain integer with an
 * optional K/M/G/T[i][B] or B suffix must give exactly whole << shift (or "too large" when that
 * does not fit), a fraction with a suffix must land between whole << shift and
 * (whole + 1) << shift, a fraction without a suffix and text outside the grammar must fail, and
 * every failure is PM_ERR_CONFIG with a detail.
 */
#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pinmem.h"

typedef struct ref {
  int matches;         /* 1: the text is in the grammar */
  int has_frac;        /* a nonzero fraction */
  int whole_overflow;  /* the integer part does not fit in 64 bits */
  unsigned __int128 whole;
  unsigned shift;
} ref_t;

static int is_ws(char c) {
  return isspace((unsigned char)c);
}

static ref_t reference(const char *s) {
  ref_t r = {0};
  const char *p = s;
  while (is_ws(*p)) p++;
  if (*p == '+') p++;
  int digits = 0;
  for (; isdigit((unsigned char)*p); p++, digits++) {
    r.whole = r.whole * 10 + (unsigned)(*p - '0');
    if (r.whole > UINT64_MAX) r.whole_overflow = 1, r.whole = (unsigned __int128)UINT64_MAX + 1;
  }
  if (*p == '.') {
    if (!digits && !isdigit((unsigned char)p[1])) return r;
    p++;
    /* pm_parse_size reads 17 fraction digits and ignores the rest, so "1.000000000000000001"
     * is 1 byte: only the first 17 digits decide whether there is a fraction. */
    for (int fd = 0; isdigit((unsigned char)*p); p++, fd++) {
      digits++;
      if (*p != '0' && fd < 17) r.has_frac = 1;
    }
  }
  if (!digits) return r;
  while (is_ws(*p)) p++;
  switch (toupper((unsigned char)*p)) {
    case 'K': r.shift = 10; break;
    case 'M': r.shift = 20; break;
    case 'G': r.shift = 30; break;
    case 'T': r.shift = 40; break;
    default: break;
  }
  if (r.shift) {
    p++;
    if (toupper((unsigned char)p[0]) == 'I' && toupper((unsigned char)p[1]) == 'B')
      p += 2;
    else if (toupper((unsigned char)*p) == 'B')
      p++;
  } else if (toupper((unsigned char)*p) == 'B') {
    p++;
  }
  while (is_ws(*p)) p++;
  r.matches = *p == '\0';
  return r;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size > 4096) return 0;
  char *s = malloc(size + 1);
  if (!s) return 0;
  memcpy(s, data, size);
  s[size] = '\0';

  size_t v = 12345;
  pm_status_t st = pm_parse_size(s, &v);
  if (st != PM_OK) {
    if (st != PM_ERR_CONFIG || pm_last_error()[0] == '\0' || v != 12345) abort();
  }
  ref_t r = reference(s);
  const unsigned __int128 max = SIZE_MAX;
  if (!r.matches) {
    if (st == PM_OK) {
      fprintf(stderr, "accepted text outside the grammar: '%s' -> %zu\n", s, v);
      abort();
    }
  } else if (!r.has_frac) {
    unsigned __int128 want = r.whole << r.shift;
    int fits = !r.whole_overflow && r.whole <= (UINT64_MAX >> r.shift) && want <= max;
    if (fits != (st == PM_OK) || (fits && v != (size_t)want)) {
      fprintf(stderr, "'%s': got %s %zu, want %s\n", s, pm_status_name(st), v,
              fits ? "that value" : "an error");
      abort();
    }
  } else if (!r.shift) {
    if (st == PM_OK) abort(); /* a fraction of a byte */
  } else if (st == PM_OK) {
    unsigned __int128 lo = r.whole << r.shift, hi = (r.whole + 1) << r.shift;
    if (v < lo || v > hi) {
      fprintf(stderr, "'%s': %zu outside [%llu, %llu]\n", s, v, (unsigned long long)lo,
              (unsigned long long)hi);
      abort();
    }
  }
  /* What was accepted prints back as a plain integer that parses to the same value. */
  if (st == PM_OK) {
    char buf[32];
    size_t w = 0;
    snprintf(buf, sizeof buf, "%zu", v);
    if (pm_parse_size(buf, &w) != PM_OK || w != v) abort();
  }
  free(s);
  return 0;
}
