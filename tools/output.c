/*
 * Output helpers of the pinmem tool: JSON lines (one object per line, so results files can be
 * appended to and read with any line-oriented tool) and aligned text tables for people.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "internal.h"

void *cli_xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) {
    fprintf(stderr, "pinmem: out of memory (%zu bytes)\n", bytes);
    exit(CLI_EXIT_FAILURE);
  }
  return p;
}

char *cli_xstrdup(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = cli_xmalloc(n);
  memcpy(d, s, n);
  return d;
}

/* ---- JSON ---------------------------------------------------------------------------------- */

static void json_put(cli_json_t *j, const char *s, size_t n) {
  if (j->len + n + 1 > j->cap) {
    size_t cap = j->cap ? j->cap : 256;
    while (j->len + n + 1 > cap) cap *= 2;
    char *nb = realloc(j->buf, cap);
    if (!nb) {
      fprintf(stderr, "pinmem: out of memory\n");
      exit(CLI_EXIT_FAILURE);
    }
    j->buf = nb;
    j->cap = cap;
  }
  memcpy(j->buf + j->len, s, n);
  j->len += n;
  j->buf[j->len] = '\0';
}

static void json_puts(cli_json_t *j, const char *s) {
  json_put(j, s, strlen(s));
}

/* Length of the valid UTF-8 sequence starting at s, or 0 if it is not one. */
static size_t utf8_seq_len(const unsigned char *s) {
  size_t n;
  unsigned cp;
  if (s[0] < 0x80) return 1;
  if ((s[0] & 0xe0) == 0xc0)
    n = 2, cp = s[0] & 0x1f;
  else if ((s[0] & 0xf0) == 0xe0)
    n = 3, cp = s[0] & 0x0f;
  else if ((s[0] & 0xf8) == 0xf0)
    n = 4, cp = s[0] & 0x07;
  else
    return 0;
  for (size_t i = 1; i < n; i++) {
    if ((s[i] & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (s[i] & 0x3f);
  }
  /* Reject overlong forms, surrogates and values past U+10FFFF. */
  if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000)) return 0;
  if ((cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff) return 0;
  return n;
}

static void json_string(cli_json_t *j, const char *s) {
  json_put(j, "\"", 1);
  const unsigned char *p = (const unsigned char *)s;
  while (*p) {
    char esc[8];
    switch (*p) {
      case '"':
        json_puts(j, "\\\"");
        p++;
        continue;
      case '\\':
        json_puts(j, "\\\\");
        p++;
        continue;
      case '\n':
        json_puts(j, "\\n");
        p++;
        continue;
      case '\r':
        json_puts(j, "\\r");
        p++;
        continue;
      case '\t':
        json_puts(j, "\\t");
        p++;
        continue;
      default:
        break;
    }
    if (*p < 0x20 || *p == 0x7f) {
      snprintf(esc, sizeof esc, "\\u%04x", *p);
      json_puts(j, esc);
      p++;
      continue;
    }
    size_t n = utf8_seq_len(p);
    if (n == 0) {
      json_puts(j, "\\ufffd");
      p++;
    } else {
      json_put(j, (const char *)p, n);
      p += n;
    }
  }
  json_put(j, "\"", 1);
}

static void json_key(cli_json_t *j, const char *key) {
  if (j->fields++) json_put(j, ",", 1);
  json_string(j, key);
  json_put(j, ":", 1);
}

void cli_json_begin(cli_json_t *j) {
  memset(j, 0, sizeof *j);
  json_put(j, "{", 1);
}

void cli_json_row(cli_json_t *j, const char *bench, const char *name, unsigned long long bytes,
                  double seconds, double gbps) {
  cli_json_begin(j);
  cli_json_str(j, "bench", bench);
  cli_json_str(j, "case", name);
  cli_json_uint(j, "bytes", bytes);
  cli_json_double(j, "seconds", seconds);
  cli_json_double(j, "gbps", gbps);
}

void cli_json_str(cli_json_t *j, const char *key, const char *value) {
  json_key(j, key);
  if (value)
    json_string(j, value);
  else
    json_puts(j, "null");
}

void cli_json_int(cli_json_t *j, const char *key, long long value) {
  char num[32];
  snprintf(num, sizeof num, "%lld", value);
  json_key(j, key);
  json_puts(j, num);
}

void cli_json_uint(cli_json_t *j, const char *key, unsigned long long value) {
  char num[32];
  snprintf(num, sizeof num, "%llu", value);
  json_key(j, key);
  json_puts(j, num);
}

void cli_json_double(cli_json_t *j, const char *key, double value) {
  char num[40];
  json_key(j, key);
  if (!isfinite(value)) {
    json_puts(j, "null");
    return;
  }
  snprintf(num, sizeof num, "%.9g", value);
  json_puts(j, num);
}

void cli_json_bool(cli_json_t *j, const char *key, bool value) {
  json_key(j, key);
  json_puts(j, value ? "true" : "false");
}

void cli_json_null(cli_json_t *j, const char *key) {
  json_key(j, key);
  json_puts(j, "null");
}

void cli_json_end(cli_json_t *j) {
  json_put(j, "}\n", 2);
  cli_progress_clear();
  fputs(j->buf, stdout);
  fflush(stdout);
  free(j->buf);
  memset(j, 0, sizeof *j);
}

/* ---- tables -------------------------------------------------------------------------------- */

void cli_table_init(cli_table_t *t, int ncols) {
  memset(t, 0, sizeof *t);
  t->ncols = ncols;
}

void cli_table_row(cli_table_t *t, ...) {
  if (t->nrows == t->cap) {
    t->cap = t->cap ? t->cap * 2 : 16;
    char **nc = realloc(t->cells, t->cap * (size_t)t->ncols * sizeof *nc);
    if (!nc) {
      fprintf(stderr, "pinmem: out of memory\n");
      exit(CLI_EXIT_FAILURE);
    }
    t->cells = nc;
  }
  va_list ap;
  va_start(ap, t);
  for (int c = 0; c < t->ncols; c++) {
    const char *s = va_arg(ap, const char *);
    t->cells[t->nrows * (size_t)t->ncols + (size_t)c] = cli_xstrdup(s ? s : "");
  }
  va_end(ap);
  t->nrows++;
}

void cli_table_print(cli_table_t *t, int indent) {
  size_t width[16] = {0};
  cli_progress_clear();
  int ncols = t->ncols < 16 ? t->ncols : 16;
  for (size_t r = 0; r < t->nrows; r++)
    for (int c = 0; c < ncols; c++) {
      size_t w = strlen(t->cells[r * (size_t)t->ncols + (size_t)c]);
      if (w > width[c]) width[c] = w;
    }
  for (size_t r = 0; r < t->nrows; r++) {
    /* The last non-empty cell is not padded, so lines carry no trailing blanks. */
    int last = ncols - 1;
    while (last > 0 && t->cells[r * (size_t)t->ncols + (size_t)last][0] == '\0') last--;
    printf("%*s", indent, "");
    for (int c = 0; c <= last; c++) {
      const char *cell = t->cells[r * (size_t)t->ncols + (size_t)c];
      if (c == last)
        printf("%s", cell);
      else
        printf("%-*s  ", (int)width[c], cell);
    }
    printf("\n");
  }
  for (size_t i = 0; i < t->nrows * (size_t)t->ncols; i++) free(t->cells[i]);
  free(t->cells);
  memset(t, 0, sizeof *t);
}

const char *cli_fmt_bytes(size_t bytes, char *buf, size_t len) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = (double)bytes;
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    u++;
  }
  if (u == 0)
    snprintf(buf, len, "%zu B", bytes);
  else if (v >= 100.0)
    snprintf(buf, len, "%.0f %s", v, units[u]);
  else if (v >= 10.0)
    snprintf(buf, len, "%.1f %s", v, units[u]);
  else
    snprintf(buf, len, "%.2f %s", v, units[u]);
  return buf;
}

int cli_list_empty_item(const char *text) {
  int item = 1;
  const char *start = text;
  for (const char *p = text;; p++) {
    if (*p == ',' || *p == '\0') {
      if (p == start) return item;
      if (*p == '\0') return 0;
      item++;
      start = p + 1;
    }
  }
}

void cli_target(FILE *out, const char *what, bool measured, bool applies, bool met,
                const char *fig) {
  if (!measured)
    fprintf(out, "TARGET %s: not measured in this run\n", what);
  else if (!applies)
    fprintf(out, "TARGET %s: %s  (speed targets apply to the cuda backend only)\n", what, fig);
  else
    fprintf(out, "TARGET %s: %s  %s\n", what, fig, met ? "PASS" : "MISS");
}

void cli_host_note(bool json, const char *what) {
  if (pm_backend_kind() != PM_BACKEND_HOST) return;
  cli_progress_clear();
  fprintf(json ? stderr : stdout,
          "host backend: the CPU plays the device, so %s prove correctness, not speed.\n", what);
  fflush(json ? stderr : stdout);
}

/* ---- progress ------------------------------------------------------------------------------ */

static struct {
  bool on, shown;
  bool lines; /* stderr is not a terminal: one line per case instead of a rewritten line */
  double t0, last;
  char key[120]; /* the case of the last line printed */
} g_progress;

static double mono_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void cli_progress_init(bool quiet) {
  g_progress.on = !quiet && isatty(STDERR_FILENO);
  g_progress.lines = !quiet && !g_progress.on;
  g_progress.key[0] = '\0';
  g_progress.shown = false;
  g_progress.t0 = mono_now();
  g_progress.last = -1.0;
}

bool cli_progress_enabled(void) {
  return g_progress.on;
}

/* A log or a pipe gets one line when a new case starts: the case is the text before its first
 * ':' or ',' ("h2d 4.00 KiB: plain_pinned, round 2/5" -> "h2d 4.00 KiB"), so the runs and
 * rounds within it print nothing more. */
static void progress_line(unsigned long long done, unsigned long long total, const char *fmt,
                          va_list ap) {
  char text[200];
  vsnprintf(text, sizeof text, fmt, ap);
  size_t klen = strcspn(text, ":,");
  if (klen >= sizeof g_progress.key) klen = sizeof g_progress.key - 1;
  if (strlen(g_progress.key) == klen && !strncmp(g_progress.key, text, klen)) return;
  memcpy(g_progress.key, text, klen);
  g_progress.key[klen] = '\0';
  fflush(stdout);
  if (total)
    fprintf(stderr, "pinmem: [%llu/%llu] %s  (%.1f s)\n", done + 1 > total ? total : done + 1,
            total, g_progress.key, mono_now() - g_progress.t0);
  else
    fprintf(stderr, "pinmem: %s  (%.1f s)\n", g_progress.key, mono_now() - g_progress.t0);
  fflush(stderr);
}

bool cli_progress_lines(void) {
  return g_progress.lines;
}

void cli_progress(unsigned long long done, unsigned long long total, const char *fmt, ...) {
  if (g_progress.lines) {
    va_list ap;
    va_start(ap, fmt);
    progress_line(done, total, fmt, ap);
    va_end(ap);
    return;
  }
  if (!g_progress.on) return;
  double now = mono_now();
  if (g_progress.shown && now - g_progress.last < 0.1) return;
  g_progress.last = now;
  char text[200];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  /* stdout first, so a row buffered there is not printed over the progress line later. */
  fflush(stdout);
  if (total)
    fprintf(stderr, "\r  [%llu/%llu] %s  (%.1f s)\033[K", done, total, text, now - g_progress.t0);
  else
    fprintf(stderr, "\r  %s  (%.1f s)\033[K", text, now - g_progress.t0);
  fflush(stderr);
  g_progress.shown = true;
}

void cli_progress_clear(void) {
  if (!g_progress.shown) return;
  fputs("\r\033[K", stderr);
  fflush(stderr);
  g_progress.shown = false;
  g_progress.last = -1.0;
}

/* ---- failures ------------------------------------------------------------------------------ */

void cli_fail(pm_status_t status) {
  const char *detail = pm_last_error();
  cli_progress_clear();
  fflush(stdout);
  fprintf(stderr, "pinmem: %s: %s\n", pm_status_name(status),
          detail && detail[0] ? detail : pm_strerror(status));
  exit(CLI_EXIT_FAILURE);
}

/* The command whose usage an error shows; set by each command before it parses its options. */
static struct {
  const char *cmd;   /* "bench copy"; NULL: the tool as a whole */
  const char *usage; /* at most three lines, each starting "pinmem ..." */
} g_usage;

static const char *top_usage =
    "pinmem [--json] info [--summary | --options]\n"
    "pinmem [--json] bench alloc|copy|overlap|loader|file|blocks [--sizes LIST] [options]\n"
    "pinmem help | --version";

void cli_usage_context(const char *cmd, const char *usage) {
  g_usage.cmd = cmd;
  g_usage.usage = usage;
}

static void vusage(const char *fmt, va_list ap) {
  cli_progress_clear();
  fflush(stdout);
  fprintf(stderr, "pinmem: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  const char *u = g_usage.usage ? g_usage.usage : top_usage;
  /* "usage: " before the first line, as many blanks before the others. */
  for (int line = 0; *u; line++) {
    const char *nl = strchr(u, '\n');
    int len = nl ? (int)(nl - u) : (int)strlen(u);
    fprintf(stderr, "%s%.*s\n", line ? "       " : "usage: ", len, u);
    u += len + (nl != NULL);
  }
  if (g_usage.cmd)
    fprintf(stderr, "see pinmem %s --help\n", g_usage.cmd);
  else
    fprintf(stderr, "see pinmem --help\n");
}

void cli_usage_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vusage(fmt, ap);
  va_end(ap);
  exit(CLI_EXIT_USAGE);
}

int cli_usage_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vusage(fmt, ap);
  va_end(ap);
  return CLI_EXIT_USAGE;
}

/* Edit distance (insert, delete, substitute, swap of neighbours) between a and b, at most 64
 * characters each; longer words count as far apart. */
static int edit_distance(const char *a, const char *b) {
  size_t n = strlen(a), m = strlen(b);
  if (n > 64 || m > 64) return 1000;
  int d[65][65];
  for (size_t i = 0; i <= n; i++) d[i][0] = (int)i;
  for (size_t j = 0; j <= m; j++) d[0][j] = (int)j;
  for (size_t i = 1; i <= n; i++)
    for (size_t j = 1; j <= m; j++) {
      int best = d[i - 1][j - 1] + (a[i - 1] != b[j - 1]);
      if (d[i - 1][j] + 1 < best) best = d[i - 1][j] + 1;
      if (d[i][j - 1] + 1 < best) best = d[i][j - 1] + 1;
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] &&
          d[i - 2][j - 2] + 1 < best)
        best = d[i - 2][j - 2] + 1;
      d[i][j] = best;
    }
  return d[n][m];
}

const char *cli_suggest(const char *word, const char *const *known) {
  /* Compare without the value of --name=value. */
  char w[65];
  const char *eq = strncmp(word, "--", 2) == 0 ? strchr(word, '=') : NULL;
  size_t len = eq ? (size_t)(eq - word) : strlen(word);
  if (len > 64) return NULL;
  memcpy(w, word, len);
  w[len] = '\0';
  const char *best = NULL;
  int best_d = 1000;
  for (int i = 0; known[i]; i++) {
    int d = edit_distance(w, known[i]);
    if (d < best_d) best_d = d, best = known[i];
  }
  /* Close enough to be a typo: a third of the word's letters (dashes aside), at least one. */
  size_t letters = len;
  for (size_t i = 0; i < len && w[i] == '-'; i++) letters--;
  int limit = (int)(letters / 3) > 1 ? (int)(letters / 3) : 1;
  return best && best_d <= limit ? best : NULL;
}

int cli_unknown(const char *what, const char *word, const char *const *known) {
  const char *s = cli_suggest(word, known);
  if (s) return cli_usage_fail("unknown %s '%s' (did you mean '%s'?)", what, word, s);
  return cli_usage_fail("unknown %s '%s'", what, word);
}

bool cli_is_size_flag(const char *name, size_t len) {
  return (len == 7 && !strncmp(name, "--sizes", 7)) || (len == 7 && !strncmp(name, "--bytes", 7)) ||
         (len == 6 && !strncmp(name, "--size", 6));
}

void cli_opts_init(cli_opts_t *o, const char *cmd, int argc, char **argv, const char *const *valued,
                   const char *const *flags) {
  memset(o, 0, sizeof *o);
  o->cmd = cmd;
  o->argc = argc;
  o->argv = argv;
  o->i = 1;
  o->valued = valued;
  o->flags = flags;
}

/* The index of name[0..len) among valued then flags (-1: neither); *takes_value says which. */
static int opt_index(const cli_opts_t *o, const char *name, size_t len, bool *takes_value) {
  int k = 0;
  for (int pass = 0; pass < 2; pass++) {
    const char *const *list = pass ? o->flags : o->valued;
    for (int j = 0; list && list[j]; j++, k++)
      if (strlen(list[j]) == len && !strncmp(list[j], name, len)) {
        *takes_value = pass == 0;
        return k;
      }
  }
  return -1;
}

int cli_opts_next(cli_opts_t *o, const char **value) {
  *value = NULL;
  if (o->i >= o->argc) return 0;
  const char *a = o->argv[o->i++];
  if (!strcmp(a, "-h")) a = "--help";
  if (strncmp(a, "--", 2) != 0) return cli_usage_fail("%s takes no argument '%s'", o->cmd, a);
  const char *eq = strchr(a, '=');
  size_t len = eq ? (size_t)(eq - a) : strlen(a);
  bool sizes = cli_is_size_flag(a, len);
  bool takes_value = false;
  int k = sizes ? opt_index(o, "--sizes", 7, &takes_value) : opt_index(o, a, len, &takes_value);
  if (k < 0 || len >= sizeof o->name) {
    /* Every name, for the nearest one. */
    const char *known[65];
    int n = 0;
    for (int pass = 0; pass < 2; pass++) {
      const char *const *list = pass ? o->flags : o->valued;
      for (int j = 0; list && list[j] && n < 64; j++) known[n++] = list[j];
    }
    known[n] = NULL;
    return cli_unknown("option", a, known);
  }
  snprintf(o->name, sizeof o->name, "%s", sizes ? "--sizes" : a);
  if (!sizes) o->name[len] = '\0';
  if (k < 64) {
    if (o->seen & (1ull << k)) {
      if (sizes)
        return cli_usage_fail("--sizes given twice (--bytes and --size are other names for it)");
      return cli_usage_fail("%s given twice", o->name);
    }
    o->seen |= 1ull << k;
  }
  if (!takes_value) {
    if (eq) return cli_usage_fail("%s takes no value, not '%s'", o->name, eq + 1);
    return 1;
  }
  if (eq) {
    *value = eq + 1;
  } else {
    if (o->i >= o->argc) return cli_usage_fail("%s needs a value", o->name);
    *value = o->argv[o->i++];
  }
  return 1;
}

int cli_opt_int(const char *name, const char *v, long long lo, long long hi, long long *out) {
  char *end;
  errno = 0;
  long long n = strtoll(v, &end, 10);
  if (errno || end == v || *end || n < lo || n > hi)
    return cli_usage_fail("%s must be a whole number from %lld to %lld, not '%s'", name, lo, hi, v);
  *out = n;
  return 0;
}

bool cli_parse_size(const char *text, size_t *out, char *why, size_t n) {
  char reason[96];
  if (pm__size_parse(text, out, reason, sizeof reason)) return true;
  snprintf(why, n, "%s (want e.g. " PM__SIZE_EXAMPLES ")", reason);
  return false;
}

int cli_parse_sizes(const char *opt, const char *text, size_t *out, int max, int *n) {
  int empty = cli_list_empty_item(text);
  if (empty) return cli_usage_fail("%s: item %d of '%s' is empty", opt, empty, text);
  *n = 0;
  for (const char *p = text; *p;) {
    const char *c = strchr(p, ',');
    size_t len = c ? (size_t)(c - p) : strlen(p);
    char item[64];
    snprintf(item, sizeof item, "%.*s", (int)(len < 63 ? len : 63), p);
    size_t v;
    char why[160];
    if (*n == max) return cli_usage_fail("%s: at most %d sizes, in '%s'", opt, max, text);
    if (!cli_parse_size(item, &v, why, sizeof why))
      return cli_usage_fail("%s: '%s' is not a size: %s", opt, item, why);
    if (v == 0) return cli_usage_fail("%s: sizes must be > 0, not '%s'", opt, item);
    out[(*n)++] = v;
    p += len + (c != NULL);
  }
  return 0;
}

/* ---- reading JSON lines back (bench --summarize) ------------------------------------------ */

static const char *skip_ws(const char *p) {
  while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n') p++;
  return p;
}

static void put_utf8(char *out, size_t cap, size_t *n, unsigned cp) {
  char tmp[4];
  size_t k;
  if (cp < 0x80)
    tmp[0] = (char)cp, k = 1;
  else if (cp < 0x800)
    tmp[0] = (char)(0xc0 | (cp >> 6)), tmp[1] = (char)(0x80 | (cp & 0x3f)), k = 2;
  else if (cp < 0x10000)
    tmp[0] = (char)(0xe0 | (cp >> 12)), tmp[1] = (char)(0x80 | ((cp >> 6) & 0x3f)),
    tmp[2] = (char)(0x80 | (cp & 0x3f)), k = 3;
  else
    tmp[0] = (char)(0xf0 | (cp >> 18)), tmp[1] = (char)(0x80 | ((cp >> 12) & 0x3f)),
    tmp[2] = (char)(0x80 | ((cp >> 6) & 0x3f)), tmp[3] = (char)(0x80 | (cp & 0x3f)), k = 4;
  for (size_t i = 0; i < k; i++)
    if (*n + 1 < cap) out[(*n)++] = tmp[i];
}

static int hex4(const char *p, unsigned *v) {
  *v = 0;
  for (int i = 0; i < 4; i++) {
    char c = p[i];
    unsigned d;
    if (c >= '0' && c <= '9')
      d = (unsigned)(c - '0');
    else if (c >= 'a' && c <= 'f')
      d = (unsigned)(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F')
      d = (unsigned)(c - 'A' + 10);
    else
      return -1;
    *v = *v * 16 + d;
  }
  return 0;
}

/* A JSON string at p (at the opening quote) into out (truncated to cap). NULL on bad input. */
static const char *parse_string(const char *p, char *out, size_t cap) {
  size_t n = 0;
  if (*p++ != '"') return NULL;
  while (*p && *p != '"') {
    if ((unsigned char)*p < 0x20) return NULL;
    if (*p != '\\') {
      if (n + 1 < cap) out[n++] = *p;
      p++;
      continue;
    }
    p++;
    switch (*p) {
      case '"':
      case '\\':
      case '/':
        if (n + 1 < cap) out[n++] = *p;
        break;
      case 'b':
        if (n + 1 < cap) out[n++] = '\b';
        break;
      case 'f':
        if (n + 1 < cap) out[n++] = '\f';
        break;
      case 'n':
        if (n + 1 < cap) out[n++] = '\n';
        break;
      case 'r':
        if (n + 1 < cap) out[n++] = '\r';
        break;
      case 't':
        if (n + 1 < cap) out[n++] = '\t';
        break;
      case 'u': {
        unsigned cp, lo;
        if (hex4(p + 1, &cp)) return NULL;
        p += 4;
        if (cp >= 0xd800 && cp <= 0xdbff && p[1] == '\\' && p[2] == 'u' && !hex4(p + 3, &lo) &&
            lo >= 0xdc00 && lo <= 0xdfff) {
          cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          p += 6;
        } else if (cp >= 0xd800 && cp <= 0xdfff) {
          cp = 0xfffd;
        }
        put_utf8(out, cap, &n, cp);
        break;
      }
      default:
        return NULL;
    }
    p++;
  }
  if (*p != '"') return NULL;
  if (cap) out[n < cap ? n : cap - 1] = '\0';
  return p + 1;
}

int cli_json_parse_flat(const char *line, cli_jfield_t *fields, int max) {
  const char *p = skip_ws(line);
  int n = 0;
  if (*p++ != '{') return -1;
  p = skip_ws(p);
  if (*p == '}') return skip_ws(p + 1)[0] ? -1 : 0;
  for (;;) {
    cli_jfield_t scratch, *f = n < max ? &fields[n] : &scratch;
    memset(f, 0, sizeof *f);
    p = parse_string(skip_ws(p), f->key, sizeof f->key);
    if (!p) return -1;
    p = skip_ws(p);
    if (*p++ != ':') return -1;
    p = skip_ws(p);
    if (*p == '"') {
      f->type = 's';
      p = parse_string(p, f->str, sizeof f->str);
      if (!p) return -1;
    } else if (strncmp(p, "true", 4) == 0 || strncmp(p, "false", 5) == 0) {
      f->type = 'b';
      f->b = *p == 't';
      p += f->b ? 4 : 5;
    } else if (strncmp(p, "null", 4) == 0) {
      f->type = 'z';
      p += 4;
    } else {
      char *end;
      f->num = strtod(p, &end);
      if (end == p || (*p != '-' && (*p < '0' || *p > '9'))) return -1;
      f->type = 'n';
      p = end;
    }
    if (n < max) n++;
    p = skip_ws(p);
    if (*p == ',') {
      p++;
      continue;
    }
    if (*p++ != '}') return -1;
    return skip_ws(p)[0] ? -1 : n;
  }
}

const cli_jfield_t *cli_json_get(const cli_jfield_t *fields, int n, const char *key) {
  for (int i = 0; i < n; i++)
    if (strcmp(fields[i].key, key) == 0) return &fields[i];
  return NULL;
}

void cli_check(pm_status_t st) {
  if (st != PM_OK) cli_fail(st);
}

int cli_cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

double cli_median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cli_cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
