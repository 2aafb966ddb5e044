/*
 * Entry point of the loader benchmark (tools/bench_loader.c) for the pinmem CLI.
 *
 * argv[0] is the benchmark's name ("loader") and is ignored; the options follow. The CLI's
 * global --json may be passed on as one of them. Return value: the process exit code (0
 * success, 1 a pinmem call or a verification failed, 2 bad arguments, with the usage on stderr).
 *
 *   pinmem bench loader [--json] [--data FILE.npy[,FILE...] | --tokens FILE.bin --seq-len N]
 *     [--batch N] [--workers N] [--prefetch N] [--epochs N] [--busy SECONDS] [--world N]
 *     [--pin on|off|both] [--io pread|mmap|direct] [--verify] ...   (--help lists them all)
 */
#ifndef PINMEM_TOOLS_BENCH_LOADER_H
#define PINMEM_TOOLS_BENCH_LOADER_H

int pm_cli_bench_loader(int argc, char **argv);

#endif /* PINMEM_TOOLS_BENCH_LOADER_H */
