/*
 * Entry point of the file benchmark (tools/bench_file.c) for the pinmem CLI.
 *
 * argv[0] is the benchmark's name ("file") and is ignored; the options follow. The CLI's global
 * --json may be passed on as one of them. Return value: the process exit code (0 success, 1 a
 * pinmem call or a verification failed, 2 bad arguments, with the usage on stderr).
 *
 *   pinmem bench file [--json] [--quiet] [--bytes SIZE] [--dir DIR] [--repeat N] [--chunk SIZE]
 *     [--threads N] [--cases LIST]   (--help lists them all)
 */
#ifndef PM_TOOLS_BENCH_FILE_H
#define PM_TOOLS_BENCH_FILE_H

int pm_cli_bench_file(int argc, char **argv);

#endif /* PM_TOOLS_BENCH_FILE_H */
