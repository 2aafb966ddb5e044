/*
 * Helpers shared by pinmem's C test programs (tests/helpers.c, linked into each of them and
 * into the fuzz targets): start and finish a test, the PINMEM_TEST_SMALL switch, deterministic
 * bytes and their check, one random generator, a gate for host callbacks, the locked memory the
 * kernel reports, a scratch directory, a child process without the right to lock memory, and the
 * way a forked child leaves.
 * The assertion macros are in check.h, which includes this header.
 */
#ifndef PINMEM_TEST_HELPERS_H
#define PINMEM_TEST_HELPERS_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pinmem.h"

/* The counts check.h's macros keep, and the checks skipped (pm_test_skip): one set per program. */
extern int pm_test_failures;
extern int pm_test_checks;
extern int pm_test_skips;

/* Exit code for a skipped test (CTest's SKIP_RETURN_CODE). */
#define PM_TEST_SKIP 77

/* If the test was asked to run on the cuda backend (PINMEM_BACKEND=cuda) and no device is
 * usable, print why and exit with the skip code. Otherwise initialise and go on. */
void pm_test_init(void);
/* Print the counts; the exit code of the program (1 when a check failed). Skipped checks are
 * counted and named in that last line, never passed off as passed. */
int pm_test_finish(const char *name);

/* A check that cannot run here: prints "SKIPPED: <why>" on its own line (make test gathers
 * these lines from every suite's log) and counts it for pm_test_finish. */
void pm_test_skip(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* PINMEM_TEST_SMALL is set (and not "0"): the valgrind run, fewer and smaller cases. */
bool pm_test_small(void);

/* Deterministic bytes that are never all zero: xorshift64* seeded per buffer. */
void pm_test_fill(void *p, size_t n, uint64_t seed);
/* The first offset where p differs from pm_test_fill(seed)'s bytes, or n when none does; and
 * whether none does. */
size_t pm_test_fill_mismatch(const void *p, size_t n, uint64_t seed);
bool pm_test_fill_ok(const void *p, size_t n, uint64_t seed);

/* splitmix64: the next number of the sequence in *state (any seed, zero included). */
uint64_t pm_test_rand(uint64_t *state);

void pm_test_sleep_ms(int ms);

/* A gate a host callback waits on until the test opens it: stream work held in place. */
typedef struct pm_test_gate {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool open;
} pm_test_gate_t;

void pm_test_gate_init(pm_test_gate_t *g);
void pm_test_gate_wait(void *gate); /* a pm_host_fn_t */
void pm_test_gate_open(pm_test_gate_t *g);
void pm_test_gate_destroy(pm_test_gate_t *g);

/* A thread that opens a gate once the fault table has counted a call of one of ops (pm__fault_op_t
 * values; arm them to count first: pm__fault_set(op, 0, 0)), or once stopped: a test that waits
 * for something to happen in a call lets the gated stream go when it does, instead of hanging
 * when it wrongly does. pm_test_opener_stop joins it and says whether it opened the gate. */
typedef struct pm_test_opener {
  pm_test_gate_t *gate;
  int ops[4];
  int nops;
  atomic_bool stop, opened;
  pthread_t thread;
} pm_test_opener_t;

void pm_test_opener_start(pm_test_opener_t *o, pm_test_gate_t *g, const int *ops, int nops);
bool pm_test_opener_stop(pm_test_opener_t *o);

/* Bytes this process has locked (VmLck of /proc/self/status), or -1 when that cannot be read
 * or mlock does not show there (then the locked-memory checks are reported skipped, once). */
long long pm_test_vm_locked(void);

/* A new empty directory <TMPDIR or /tmp>/pinmem-<name>.XXXXXX into dir; false on failure. */
bool pm_test_tmpdir(char *dir, size_t len, const char *name);
/* Remove the directory and what it holds (a note on stderr if that fails). */
void pm_test_rmtree(const char *dir);

/* In a child process: limit RLIMIT_MEMLOCK to `bytes` and, when root, become nobody, which drops
 * CAP_IPC_LOCK (it would make the limit moot). False when the limit cannot be made to hold here:
 * the child should then exit with PM_TEST_SKIP. */
bool pm_test_limit_memlock(size_t bytes);

/* In a forked child: turn off valgrind's leak check at its exit (nothing outside valgrind).
 * A child of a multi-threaded parent has only the forking thread; a block that another thread
 * of the parent held at that moment (an operation allocated and not yet queued, a batch in a
 * worker's hands) is pointed at only from that thread's stack, which the child's leak check does
 * not scan, so it would be counted as lost although it is the parent's live memory, freed in the
 * parent. The parent's own leak check covers pinmem's memory; the child's memory errors still
 * count towards valgrind's exit code. */
void pm_test_child_no_leak_check(void);
/* Leave a forked child with `code`: pm_test_child_no_leak_check, then _exit. */
_Noreturn void pm_test_child_exit(int code);

#endif /* PINMEM_TEST_HELPERS_H */
