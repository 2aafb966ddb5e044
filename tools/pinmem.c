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
      "  info                 version, backend, devices, memory limits, NUMA, the option table\n"
      "  info --summary       a few lines: backend, devices, link, NUMA, limits\n"
      "  info --options       the option table alone (value in force, source, default)\n"
      "  bench alloc          cold pinning (pinmem vs cudaHostAlloc vs malloc+cudaHostRegister),\n"
      "                       cached alloc+free latency and the pool's memory overhead\n"
      "  bench copy           host<->device bandwidth by path: plain vs pinmem, pageable vs\n"
      "                       pinned, write-combined, zero-copy, managed, batched\n"
      "  bench overlap        a copy beside a kernel of equal length: serial vs two streams\n"
      "  bench loader         the data loader feeding a simulated training loop, pinned vs\n"
      "                       pageable batches\n"
      "  bench file           file <-> device through pinmem vs a plain pread + copy loop and\n"
      "                       the disk's own O_DIRECT rate, page cache hot and cold\n"
      "  bench blocks         KV-cache blocks device <-> pinned blocks: pinmem vs copy loop vs\n"
      "                       batched DMA, and the arena's pinning time\n"
      "  help                 this text\n"
      "  --version            the version\n"
      "\n"
      "options of every command:\n"
      "  --json               one JSON object per line instead of tables\n"
      "  --quiet              benchmarks: no progress on stderr (a line rewritten in place on a\n"
      "                       terminal, one line per case on a pipe or a log)\n"
      "  --sizes LIST         benchmarks: the sizes, K/M/G suffixes, e.g. 4K,64M,1G (--bytes\n"
      "                       and --size are other names for it)\n"
      "  `pinmem bench NAME --help` lists each benchmark's cases, options and defaults.\n"
      "\n"
      "Options of the library come from PINMEM_<NAME> environment variables (`pinmem info\n"
      "--options`); PINMEM_BACKEND=auto|cuda|host selects the backend.\n");
}

static int parse_int_arg(const char *opt, const char *text, int lo, int hi) {
  char *end;
  errno = 0;
  long v = strtol(text, &end, 10);
  if (errno || end == text || *end || v < lo || v > hi)
    cli_usage_error("%s must be a whole number from %d to %d, not '%s'", opt, lo, hi, text);
  return (int)v;
}

static size_t parse_size_arg(const char *opt, const char *text) {
  size_t bytes;
  pm_status_t st = pm_parse_size(text, &bytes);
  if (st != PM_OK) cli_usage_error("%s: '%s' is not a size: %s", opt, text, pm_last_error());
  if (bytes == 0) cli_usage_error("%s: the size must be > 0, not '%s'", opt, text);
  return bytes;
}

/* `pinmem bench alloc [options]` (argv[0] is "alloc"). */
static int bench_alloc_main(int argc, char **argv) {
  static const char *const known[] = {"--sizes",     "--bytes",          "--size",  "--repeat",
                                      "--threads",   "--json",           "--quiet", "--help",
                                      "--summarize", "--overhead-total", NULL};
  cli_usage_context("bench alloc",
                    "pinmem bench alloc [--json] [--quiet] [--sizes LIST] [--repeat N] "
                    "[--threads N]\npinmem bench alloc --summarize FILE");
  cli_bench_alloc_args_t args;
  memset(&args, 0, sizeof args);
  const char *sizes = NULL, *sizes_name = NULL, *repeat = NULL, *threads = NULL, *overhead = NULL,
             *summ = NULL;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--json")) {
      args.json = true;
      continue;
    }
    if (!strcmp(a, "--quiet")) {
      args.quiet = true;
      continue;
    }
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) return cli_bench_alloc_help();
    if (strncmp(a, "--", 2) != 0) cli_usage_error("bench alloc takes no argument '%s'", a);
    const char *eq = strchr(a, '=');
    size_t nl = eq ? (size_t)(eq - a) : strlen(a);
    const char **slot = NULL;
    if (cli_is_size_flag(a, nl))
      slot = &sizes;
    else if (nl == 8 && !strncmp(a, "--repeat", 8))
      slot = &repeat;
    else if (nl == 9 && !strncmp(a, "--threads", 9))
      slot = &threads;
    else if (nl == 16 && !strncmp(a, "--overhead-total", 16))
      slot = &overhead;
    else if (nl == 11 && !strncmp(a, "--summarize", 11))
      slot = &summ;
    if (!slot) exit(cli_unknown("option", a, known));
    if (*slot) {
      if (slot == &sizes && strncmp(sizes_name, a, nl) != 0)
        cli_usage_error("--sizes given twice (--bytes and --size are other names for it)");
      cli_usage_error("%.*s given twice", (int)nl, a);
    }
    if (slot == &sizes) sizes_name = a;
    if (eq) {
      *slot = eq + 1;
    } else {
      if (i + 1 >= argc) cli_usage_error("%.*s needs a value", (int)nl, a);
      *slot = argv[++i];
    }
  }
  if (summ && (sizes || repeat || threads || overhead || args.json))
    cli_usage_error("--summarize reads a results file: it takes no other option");
  if (sizes) {
    int rc = cli_parse_sizes("--sizes", sizes, args.sizes,
                             (int)(sizeof args.sizes / sizeof args.sizes[0]), &args.nsizes);
    if (rc) return rc;
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

/* The benchmarks: a new one is one row. Each entry point takes the arguments that follow
 * `bench`, its own name first, with a --json or --quiet given before `bench` passed on. */
typedef int (*cli_bench_fn)(int argc, char **argv);
static const struct {
  const char *name;
  cli_bench_fn fn;
} benches[] = {
    {"alloc", bench_alloc_main},     {"copy", pm_cli_bench_copy}, {"overlap", pm_cli_bench_overlap},
    {"loader", pm_cli_bench_loader}, {"file", pm_cli_bench_file}, {"blocks", pm_cli_bench_blocks},
};
enum { NBENCH = sizeof benches / sizeof benches[0] };

static const char *bench_names(void) {
  static char buf[256];
  if (buf[0]) return buf;
  size_t len = 0;
  for (int b = 0; b < NBENCH; b++)
    len += (size_t)snprintf(buf + len, sizeof buf - len, "%s%s", b ? ", " : "", benches[b].name);
  return buf;
}

static int bench_main(int argc, char **argv, bool json, bool quiet) {
  cli_usage_context("bench",
                    "pinmem [--json] bench NAME [options]   (NAME: alloc, copy, "
                    "overlap, loader, file, blocks)");
  if (argc < 1 || !strcmp(argv[0], "--help") || !strcmp(argv[0], "-h")) {
    if (argc >= 1) {
      cli_print_usage(stdout);
      return 0;
    }
    cli_usage_error("bench needs a benchmark name: %s", bench_names());
  }
  const char *known[NBENCH + 1];
  for (int b = 0; b < NBENCH; b++) {
    known[b] = benches[b].name;
    if (strcmp(argv[0], benches[b].name) != 0) continue;
    char *sub[64];
    int n = 0;
    sub[n++] = argv[0];
    if (json) sub[n++] = (char *)"--json";
    if (quiet) sub[n++] = (char *)"--quiet";
    for (int i = 1; i < argc; i++) {
      if (n == (int)(sizeof sub / sizeof sub[0]) - 1) cli_usage_error("too many arguments");
      sub[n++] = argv[i];
    }
    sub[n] = NULL;
    return benches[b].fn(n, sub);
  }
  known[NBENCH] = NULL;
  const char *s = cli_suggest(argv[0], known);
  if (s) cli_usage_error("unknown benchmark '%s' (did you mean '%s'?)", argv[0], s);
  cli_usage_error("unknown benchmark '%s' (known: %s)", argv[0], bench_names());
}

/* `pinmem info [--summary | --options]`. */
static int info_main(int argc, char **argv, bool json) {
  static const char *const known[] = {"--summary", "--options", "--json", "--help", NULL};
  cli_usage_context("info", "pinmem [--json] info [--summary | --options]");
  int what = CLI_INFO_ALL;
  for (int i = 0; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--json")) {
      if (json) cli_usage_error("--json given twice");
      json = true;
    } else if (!strcmp(a, "--summary") || !strcmp(a, "--options")) {
      int w = a[2] == 's' ? CLI_INFO_SUMMARY : CLI_INFO_OPTIONS;
      if (what == w) cli_usage_error("%s given twice", a);
      if (what != CLI_INFO_ALL) cli_usage_error("--summary and --options exclude each other");
      what = w;
    } else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      printf(
          "usage: pinmem [--json] info [--summary | --options]\n"
          "  (none)      version, backend and why, system, memory limits, devices, NUMA, the\n"
          "              default pool and the option table in force\n"
          "  --summary   a few lines: backend, devices with their link and NUMA node, limits\n"
          "  --options   the option table alone: name, variable, value in force, where it came\n"
          "              from, default, and what each option does\n"
          "  --json      one JSON object per line\n");
      return 0;
    } else if (!strcmp(a, "--quiet"))
      cli_usage_error("--quiet belongs to the benchmarks");
    else if (a[0] == '-')
      return cli_unknown("option", a, known);
    else
      cli_usage_error("info takes no arguments, not '%s'", a);
  }
  return cli_cmd_info(json, what);
}

int main(int argc, char **argv) {
  /* Rows reach a pipe or a file as they are produced, not when a buffer fills or at exit. */
  setvbuf(stdout, NULL, _IOLBF, 0);
  static const char *const global[] = {"--json", "--quiet", "--help", "--version", NULL};
  static const char *const commands[] = {"info", "bench", "help", "version", NULL};
  bool json = false, quiet = false, help = false, version = false;
  int k = 1;
  /* The options before the command; those after it belong to the command. */
  for (; k < argc && argv[k][0] == '-'; k++) {
    const char *a = argv[k];
    bool *flag = !strcmp(a, "--json")                          ? &json
                 : !strcmp(a, "--quiet")                       ? &quiet
                 : !strcmp(a, "--help") || !strcmp(a, "-h")    ? &help
                 : !strcmp(a, "--version") || !strcmp(a, "-V") ? &version
                                                               : NULL;
    if (!flag) return cli_unknown("option", a, global);
    /* A repeated option is refused here as after a command (`bench copy --json --json`). */
    if (*flag) cli_usage_error("%s given twice", a);
    *flag = true;
  }
  const char *cmd = k < argc ? argv[k] : NULL;
  if (help && !cmd) {
    /* As `pinmem --json help`: a caller that asked for JSON parses stdout. */
    if (json) cli_usage_error("help prints text; there is no --json form of it");
    cli_print_usage(stdout);
    return 0;
  }
  if (version || (cmd && !strcmp(cmd, "version"))) {
    if ((version && cmd) || (cmd && k + 1 < argc))
      cli_usage_error("--version takes no command or argument");
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
  if (!cmd) cli_usage_error("no command given");
  char **rest = argv + k + 1;
  int nrest = argc - k - 1;
  if (!strcmp(cmd, "bench")) {
    if (help && nrest >= 1) {
      /* pinmem --help bench NAME: the bench's own help. */
      char *sub[3] = {rest[0], (char *)"--help", NULL};
      return bench_main(2, sub, false, false);
    }
    /* pinmem --help bench: what `pinmem bench --help` prints (it said a name was missing). */
    if (help) return bench_main(1, (char *[]){(char *)"--help", NULL}, false, false);
    return bench_main(nrest, rest, json, quiet);
  }
  if (quiet) cli_usage_error("--quiet belongs to the benchmarks");
  if (!strcmp(cmd, "info")) {
    if (help) return info_main(1, (char *[]){(char *)"--help", NULL}, json);
    return info_main(nrest, rest, json);
  }
  if (!strcmp(cmd, "help")) {
    if (nrest) cli_usage_error("help takes no arguments");
    /* A caller that asked for JSON parses stdout: the usage text would be a parse error. */
    if (json) cli_usage_error("help prints text; there is no --json form of it");
    cli_print_usage(stdout);
    return 0;
  }
  const char *s = cli_suggest(cmd, commands);
  if (s) cli_usage_error("unknown command '%s' (did you mean '%s'?)", cmd, s);
  cli_usage_error("unknown command '%s' (known: info, bench, help, version)", cmd);
}
