/* For tests whose forked children start threads (streams, completion, a pinned mapping starts
 * the backend there): ThreadSanitizer ends such a child unless told not to. Include once, in
 * the test's main file. */
#ifndef PINMEM_TESTS_TSAN_FORK_H
#define PINMEM_TESTS_TSAN_FORK_H

#if defined(__SANITIZE_THREAD__)
#define PM_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define PM_TEST_TSAN 1
#endif
#endif
#ifdef PM_TEST_TSAN
const char *__tsan_default_options(void);
const char *__tsan_default_options(void) { return "die_after_fork=0"; }
#endif

#endif
