/*
 * pinmem: the command-line tool. `pinmem info` shows what this machine offers for pinned memory
 * (backend, devices, limits, the option table in force); `pinmem bench alloc` measures what
 * pinmem's pool buys over the plain backend calls, side by side in one run.
 *
 * Exit codes: 0 success, 1 a pinmem call failed ("pinmem: <status name>: <detail>" on stderr),
 * 2 bad command line (the usage on stderr).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "bench_file.h"
#include "bench_loader.h"
#include "cli.h"

void cli_print_usage(FILE *out) {
  fprintf(
      out,
      "usage: pinmem [--json] <command> [options]\n"
      "\n"
      "commands:\n"
      "  info                 version, backend, devices, memory limits, the option table\n"
      "  bench alloc          cold pinning (pinmem vs cudaHostAlloc vs malloc+cudaHostRegister),\n"
      "                       cached alloc+free latency and the pool's memory overhead\n"
      "  bench copy           host<->device bandwidth by path: plain vs pinmem, pageable vs\n"
      "                       pinned, write-combined, zero-copy, managed, batched (--help)\n"
      "  bench overlap        a copy beside a kernel of equal length: serial vs two streams\n"
      "  bench loader         the data loader feeding a simulated training loop, pinned vs\n"
      "                       pageable batches (--help)\n"
      "  bench file           file <-> device through pinmem vs a plain pread + copy loop and\n"
      "                       the disk's own O_DIRECT rate, page cache hot and cold (--help)\n"
      "  bench blocks         KV-cache blocks device <-> pinned blocks: pinmem vs copy loop vs\n"
      "                       batched DMA, and the arena's pinning time (--help)\n"
      "  help                 this text\n"
      "  --version            the version\n"
      "\n"
      "options:\n"
      "  --json               one JSON object per line instead of tables (every command)\n"
      "  --quiet              no progress line on stderr while a benchmark runs (it is shown\n"
      "                       only when stderr is a terminal)\n"
      "  --sizes LIST         bench alloc: sizes with K/M/G suffixes (default 16M,256M,1G)\n"
      "  --repeat N           bench alloc: runs per size, the median is reported\n"
      "                       (default 5, and 3 for sizes of 1 GiB and more)\n"
      "  --threads N          bench alloc: first-touch threads of pinmem's cold pinning\n"
      "                       (default or 0: the option pin_threads)\n"
      "  --overhead-total SIZE\n"
      "                       bench alloc: bytes requested in the overhead measurement\n"
      "                       (default 1G)\n"
      "  --summarize FILE     bench alloc: print the table and TARGET lines of a results\n"
      "                       file written with --json ('-': standard input)\n"
      "  (`pinmem bench NAME --help` lists each benchmark's cases and options; an option with\n"
      "  a value may be given once, a switch like --json more than once)\n"
      "\n"
      "Options of the library come from PINMEM_<NAME> environment variables (see `pinmem\n"
      "info`); PINMEM_BACKEND=auto|cuda|host selects the backend.\n");
}

static int parse_int_arg(const char *opt, const char *text, int lo, int hi) {
  char *end;
  errno = 0;
  long v = strtol(text, &end, 10);
  if (errno || end == text || *end || v < lo || v > hi)
    cli_usage_error("%s wants a whole number from %d to %d, not '%s'", opt, lo, hi, text);
  return (int)v;
}

static size_t parse_size_arg(const char *opt, const char *text) {
  size_t bytes;
  pm_status_t st = pm_parse_size(text, &bytes);
  if (st != PM_OK) cli_usage_error("%s: bad size '%s': %s", opt, text, pm_last_error());
  if (bytes == 0) cli_usage_error("%s: size must be above 0, not '%s'", opt, text);
  return bytes;
}

static void parse_sizes(const char *text, cli_bench_alloc_args_t *args) {
  int empty = cli_list_empty_item(text);
  if (empty) cli_usage_error("--sizes: item %d of '%s' is empty", empty, text);
  char *copy = cli_xstrdup(text), *save = NULL;
  args->nsizes = 0;
  for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    if (args->nsizes == (int)(sizeof args->sizes / sizeof args->sizes[0])) {
      free(copy);
      cli_usage_error("--sizes: at most %zu sizes", sizeof args->sizes / sizeof args->sizes[0]);
    }
    args->sizes[args->nsizes++] = parse_size_arg("--sizes", tok);
  }
  free(copy);
  if (args->nsizes == 0) cli_usage_error("--sizes: no sizes in '%s'", text);
}

/* Benchmarks with their own option parsers: `pinmem [--json] bench NAME [options]` hands
 * NAME and everything after it (plus a --json given before) to the benchmark's entry point. */
typedef int (*cli_bench_fn)(int argc, char **argv);

static int dispatch_own_parser(int argc, char **argv, int *handled) {
  static const struct {
    const char *name;
    cli_bench_fn fn;
  } benches[] = {
      {"copy", pm_cli_bench_copy},
      {"overlap", pm_cli_bench_overlap},
      {"loader", pm_cli_bench_loader},
      {"file", pm_cli_bench_file},
      {"blocks", pm_cli_bench_blocks},
  };
  *handled = 0;
  int k = 1;
  bool json_before = false, quiet_before = false;
  while (k < argc && argv[k][0] == '-') {
    if (strcmp(argv[k], "--json") == 0) json_before = true;
    if (strcmp(argv[k], "--quiet") == 0) quiet_before = true;
    k++;
  }
  if (k + 1 >= argc || strcmp(argv[k], "bench") != 0) return 0;
  for (size_t b = 0; b < sizeof benches / sizeof benches[0]; b++) {
    if (strcmp(argv[k + 1], benches[b].name) != 0) continue;
    char *sub[64];
    int n = 0;
    sub[n++] = argv[k + 1];
    if (json_before) sub[n++] = (char *)"--json";
    if (quiet_before) sub[n++] = (char *)"--quiet";
    for (int i = k + 2; i < argc; i++) {
      if (n == (int)(sizeof sub / sizeof sub[0]) - 1) cli_usage_error("too many arguments");
      sub[n++] = argv[i];
    }
    sub[n] = NULL;
    *handled = 1;
    return benches[b].fn(n, sub);
  }
  return 0;
}

int main(int argc, char **argv) {
  /* Rows reach a pipe or a file as they are produced, not when a buffer fills or at exit. */
  setvbuf(stdout, NULL, _IOLBF, 0);
  int handled = 0;
  int rc = dispatch_own_parser(argc, argv, &handled);
  if (handled) return rc;
  bool json = false, quiet = false, help = false;
  const char *words[4];
  int nwords = 0;
  bool version = false;
  const char *sizes = NULL, *repeat = NULL, *threads = NULL, *overhead = NULL, *summ = NULL;

  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char **slot = NULL;
    const char *name = a;
    size_t namelen = strlen(a);
    const char *eq = strchr(a, '=');
    if (strncmp(a, "--", 2) == 0 && eq) namelen = (size_t)(eq - a);

    if (strcmp(a, "--json") == 0) {
      json = true;
      continue;
    }
    if (strcmp(a, "--version") == 0 || strcmp(a, "-V") == 0) {
      version = true;
      continue;
    }
    if (strcmp(a, "--quiet") == 0) {
      quiet = true;
      continue;
    }
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      help = true;
      continue;
    }
    if (namelen == 7 && strncmp(name, "--sizes", 7) == 0)
      slot = &sizes;
    else if (namelen == 8 && strncmp(name, "--repeat", 8) == 0)
      slot = &repeat;
    else if (namelen == 9 && strncmp(name, "--threads", 9) == 0)
      slot = &threads;
    else if (namelen == 16 && strncmp(name, "--overhead-total", 16) == 0)
      slot = &overhead;
    else if (namelen == 11 && strncmp(name, "--summarize", 11) == 0)
      slot = &summ;
    if (slot) {
      if (*slot) cli_usage_error("%.*s given twice", (int)namelen, name);
      if (strncmp(a, "--", 2) == 0 && eq) {
        *slot = eq + 1;
      } else {
        if (i + 1 >= argc) cli_usage_error("%s needs a value", a);
        *slot = argv[++i];
      }
      continue;
    }
    if (a[0] == '-') cli_usage_error("unknown option '%s'", a);
    if (nwords == (int)(sizeof words / sizeof words[0])) cli_usage_error("too many arguments");
    words[nwords++] = a;
  }

  if (help) {
    if (nwords == 2 && strcmp(words[0], "bench") == 0 && strcmp(words[1], "alloc") == 0)
      return cli_bench_alloc_help();
    cli_print_usage(stdout);
    return 0;
  }
  if (version || (nwords == 1 && strcmp(words[0], "version") == 0)) {
    if (nwords > 1 || (version && nwords > 0)) cli_usage_error("--version takes no command");
    if (json) {
      cli_json_t j;
      cli_json_begin(&j);
      cli_json_str(&j, "version", pm_version());
      cli_json_end(&j);
    } else {
      printf("pinmem %s\n", pm_version());
    }
    return 0;
  }
  if (nwords == 0) cli_usage_error("no command given");

  bool bench_alloc =
      nwords == 2 && strcmp(words[0], "bench") == 0 && strcmp(words[1], "alloc") == 0;
  if (quiet && !bench_alloc) cli_usage_error("--quiet belongs to the benchmarks");
  if (!bench_alloc && (sizes || repeat || threads || overhead || summ))
    cli_usage_error(
        "--sizes, --repeat, --threads, --overhead-total and --summarize belong to "
        "'bench alloc'");
  if (summ && (sizes || repeat || threads || overhead || json))
    cli_usage_error("--summarize reads a results file: it takes no other option");

  if (strcmp(words[0], "help") == 0) {
    if (nwords > 1) cli_usage_error("help takes no arguments");
    cli_print_usage(stdout);
    return 0;
  }
  if (strcmp(words[0], "info") == 0) {
    if (nwords > 1) cli_usage_error("info takes no arguments");
    return cli_cmd_info(json);
  }
  if (strcmp(words[0], "bench") == 0) {
    if (nwords < 2) cli_usage_error("bench needs a benchmark name: alloc, copy, overlap, loader or file");
    if (!bench_alloc)
      cli_usage_error("unknown benchmark '%s' (known: alloc, copy, overlap, loader, file)", words[1]);
    cli_bench_alloc_args_t args;
    memset(&args, 0, sizeof args);
    args.json = json;
    args.quiet = quiet;
    if (sizes) {
      parse_sizes(sizes, &args);
    } else {
      args.sizes[0] = (size_t)16 << 20;
      args.sizes[1] = (size_t)256 << 20;
      args.sizes[2] = (size_t)1 << 30;
      args.nsizes = 3;
    }
    args.repeat = repeat ? parse_int_arg("--repeat", repeat, 1, 10000) : 0;
    args.threads = threads ? parse_int_arg("--threads", threads, 0, 1024) : 0;
    args.overhead_total = overhead ? parse_size_arg("--overhead-total", overhead) : (size_t)1 << 30;
    args.summarize = summ;
    return cli_cmd_bench_alloc(&args);
  }
  cli_usage_error("unknown command '%s'", words[0]);
}
