/*
 * Entry points of the copy benchmarks (tools/bench_copy.c, tools/bench_overlap.c) for the CLI.
 *
 * Each takes the arguments that follow the benchmark's name: argv[0] is the name itself
 * ("copy" or "overlap") and is ignored; the options come after it. The CLI's global --json may
 * be passed on as one of them. Return value: the process exit code (0 success, 1 a pinmem
 * call or a verification failed, 2 bad arguments, with the usage on stderr).
 *
 *   pinmem bench copy [--json] [--sizes 4K,64K,1M,8M,64M,256M,1G] [--repeat N] [--cases LIST]
 *     (--cases: only these rows, e.g. plain_pageable,pinmem_pageable,batch_pinned_pinmem)
 *   pinmem bench overlap [--json] [--bytes 256M] [--repeat N]
 */
#ifndef PINMEM_TOOLS_BENCH_H
#define PINMEM_TOOLS_BENCH_H

int pm_cli_bench_copy(int argc, char **argv);
int pm_cli_bench_overlap(int argc, char **argv);
/* tools/bench_blocks.c: pinmem bench blocks [--json] [--sizes LIST] [--blocks LIST] [--arena SIZE] */
int pm_cli_bench_blocks(int argc, char **argv);

#endif /* PINMEM_TOOLS_BENCH_H */
