/*
 * Shared pieces of the pinmem command-line tool: output (JSON lines and aligned text tables),
 * failure reporting and the commands themselves. The tool links the static library and may use
 * the internal headers, because its benchmarks compare pinmem with raw backend calls.
 */
#ifndef PINMEM_CLI_H
#define PINMEM_CLI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "pinmem.h"

#define CLI_EXIT_FAILURE 1
#define CLI_EXIT_USAGE 2

/* ---- output.c ---------------------------------------------------------------------------- */

/* One JSON object written as one line. Keys are added in order; strings are escaped (control
 * characters, quotes, backslashes, invalid UTF-8 replaced by U+FFFD); non-finite doubles are
 * written as null so every line stays valid JSON. */
typedef struct cli_json {
  char *buf;
  size_t len, cap;
  int fields;
} cli_json_t;

void cli_json_begin(cli_json_t *j);
/* Begin a benchmark result row with the keys every row has, in this order: bench, case, bytes,
 * seconds, gbps (NaN is written as null). */
void cli_json_row(cli_json_t *j, const char *bench, const char *name, unsigned long long bytes,
                  double seconds, double gbps);
void cli_json_str(cli_json_t *j, const char *key, const char *value); /* NULL -> null */
void cli_json_int(cli_json_t *j, const char *key, long long value);
void cli_json_uint(cli_json_t *j, const char *key, unsigned long long value);
void cli_json_double(cli_json_t *j, const char *key, double value);
void cli_json_bool(cli_json_t *j, const char *key, bool value);
void cli_json_null(cli_json_t *j, const char *key);
/* Print the line to stdout and release the buffer. */
void cli_json_end(cli_json_t *j);

/* A text table whose columns are as wide as their widest cell. */
typedef struct cli_table {
  int ncols;
  size_t nrows, cap;
  char **cells; /* nrows * ncols, owned */
} cli_table_t;

void cli_table_init(cli_table_t *t, int ncols);
/* Add a row of exactly ncols cells (copied; NULL prints as empty). */
void cli_table_row(cli_table_t *t, ...);
/* Print with `indent` spaces before each row and two spaces between columns; frees the table. */
void cli_table_print(cli_table_t *t, int indent);

/* One field of a flat JSON object read back from a results file. */
typedef struct cli_jfield {
  char key[64];
  int type; /* 's' string, 'n' number, 'b' bool, 'z' null */
  char str[512];
  double num;
  bool b;
} cli_jfield_t;

/* Parse one line holding a flat JSON object (no nested objects or arrays) into at most `max`
 * fields. Returns the number of fields, or -1 if the line is not such an object. */
int cli_json_parse_flat(const char *line, cli_jfield_t *fields, int max);
const cli_jfield_t *cli_json_get(const cli_jfield_t *fields, int n, const char *key);

/* "1.50 GiB", "64.0 MiB", "4.00 KiB", "512 B". */
const char *cli_fmt_bytes(size_t bytes, char *buf, size_t len);

/* Print "pinmem: <status name>: <pm_last_error()>" to stderr and exit 1. */
_Noreturn void cli_fail(pm_status_t status);
/* cli_fail unless st is PM_OK: for benchmark set-up calls that must not fail. */
void cli_check(pm_status_t st);
/* qsort comparator for doubles, and the median of v[0..n) (sorts v). */
int cli_cmp_double(const void *a, const void *b);
double cli_median(double *v, int n);
/* Bad command lines, all in one style on stderr: "pinmem: <message>", the usage of the command
 * in at most three lines, then "see pinmem CMD --help". The command is the one last named with
 * cli_usage_context (each command names itself before parsing its options; none: the tool).
 * cli_usage_error exits 2; cli_usage_fail returns 2 for the caller to return. */
void cli_usage_context(const char *cmd, const char *usage);
_Noreturn void cli_usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int cli_usage_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* The known name nearest to `word` (its --name=value part without the value), when it is close
 * enough to be a typo, else NULL. `known` ends with NULL. */
const char *cli_suggest(const char *word, const char *const *known);
/* cli_usage_fail("unknown <what> '<word>' (did you mean '<nearest>'?)"). */
int cli_unknown(const char *what, const char *word, const char *const *known);
/* The full help of the tool (`pinmem --help`). */
void cli_print_usage(FILE *out);

/* One set of size flags across the benches: --sizes LIST, with --bytes and --size as other
 * names for it. cli_is_size_flag: is name[0..len) one of them. cli_parse_sizes: "4K,64M,1G" into
 * out[0..max) (each > 0); 0, or the usage exit code after saying which rule `text` broke. */
bool cli_is_size_flag(const char *name, size_t len);
int cli_parse_sizes(const char *opt, const char *text, size_t *out, int max, int *n);
/* `text` as a size into *out: true, or false with why the parser refused it and examples of
 * sizes it takes in why (for messages: "'1.5' is not a size: not a whole number of bytes (want
 * e.g. 4096, 64K, ...)"). The reason comes from the parser itself, not from its message's text. */
bool cli_parse_size(const char *text, size_t *out, char *why, size_t n);

void *cli_xmalloc(size_t bytes);
char *cli_xstrdup(const char *s);

/* 0 when every comma-separated item of `text` is non-empty, else the 1-based position of the
 * first empty one ("1M,,2M" -> 2, "1M," -> 2, "" -> 1). */
int cli_list_empty_item(const char *text);

/* One walk over a command's options, the same rules for every bench: an option is one of
 * `valued` (takes a value, after '=' or as the next argument) or of `flags` (takes none; "-h" is
 * "--help"); --bytes and --size are read as --sizes; a name is checked before its value is taken
 * (`--jsn` is unknown, with a did-you-mean, not a flag that lacks a value); an option given twice
 * is refused rather than the last one silently winning; a bare word is refused. Each list ends
 * with NULL; 64 names at most in all. */
typedef struct cli_opts {
  const char *cmd; /* "bench file", for "bench file takes no argument 'x'" */
  int argc, i;
  char **argv;
  const char *const *valued, *const *flags;
  unsigned long long seen; /* a bit per name, valued first then flags */
  char name[32];           /* the option just read, "--sizes" for its other names */
} cli_opts_t;
void cli_opts_init(cli_opts_t *o, const char *cmd, int argc, char **argv, const char *const *valued,
                   const char *const *flags);
/* 1: o->name holds the next option and *value its value (NULL for a flag); 0: none left; or
 * the usage exit code (2) after saying which rule the command line broke. */
int cli_opts_next(cli_opts_t *o, const char **value);
/* A whole number from lo to hi as option `name`'s value; 0, or the usage exit code (2) with
 * "<name> must be a whole number from <lo> to <hi>, not '<v>'". */
int cli_opt_int(const char *name, const char *v, long long lo, long long hi, long long *out);

/* The one-time note of the host backend, for every bench: on stdout with the text table's
 * header, on stderr with --json (stdout stays JSON lines), there at the end beside the TARGET
 * lines, so a run that fails early leaves only its error on stderr. */
void cli_host_note(bool json, const char *what);
/* One TARGET line on `out` (stdout beside a table, stderr with --json): "not measured in this
 * run" when !measured; the figure with "(speed targets apply to the cuda backend only)" when
 * !applies (the host backend); else the figure and PASS or MISS. */
void cli_target(FILE *out, const char *what, bool measured, bool applies, bool met,
                const char *fig);

/* Progress on stderr while a benchmark runs, unless --quiet: on a terminal one line rewritten
 * with \r, at most ten times a second; on a pipe or a log one line per case ("pinmem: [3/20]
 * h2d 4.00 KiB  (2.1 s)"), so a long run is never silent there. The line is cleared before anything
 * else is printed (cli_progress_clear, called by the printing functions above and by each benchmark
 * before its own lines). */
void cli_progress_init(bool quiet);
bool cli_progress_enabled(void);
bool cli_progress_lines(void); /* the one-line-per-case mode */
void cli_progress(unsigned long long done, unsigned long long total, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void cli_progress_clear(void);

/* ---- info.c ------------------------------------------------------------------------------ */

/* What `pinmem info` shows: everything; --summary: a few lines (backend, devices with their
 * link and NUMA node, limits), as `make bench` prints before its benchmark; --options: the
 * option table alone. */
enum { CLI_INFO_ALL, CLI_INFO_SUMMARY, CLI_INFO_OPTIONS };
int cli_cmd_info(bool json, int what);

/* ---- bench_alloc.c ----------------------------------------------------------------------- */

typedef struct cli_bench_alloc_args {
  bool json;
  bool quiet; /* no progress on stderr */
  size_t sizes[32];
  int nsizes;
  int repeat;            /* 0: 5 runs, 3 for sizes of 1 GiB and more */
  int threads;           /* pin threads of the pools measured; 0: option "pin_threads" */
  size_t overhead_total; /* bytes requested in the overhead measurement */
  const char *summarize; /* print the table of a results file instead of measuring ("-": stdin) */
} cli_bench_alloc_args_t;

int cli_cmd_bench_alloc(const cli_bench_alloc_args_t *args);
/* `pinmem bench alloc --help`: its cases and options with their defaults on this backend. */
int cli_bench_alloc_help(void);

#endif /* PINMEM_CLI_H */
