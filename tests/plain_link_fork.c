/*
 * A program linked against the plain libpinmem.a, as `cc app.c libpinmem.a -lpthread -lm -ldl`
 * links it: no pkg-config, no CMake target, so no `-u pm__fork_install`. The fork rule of
 * pinmem.h must hold there too: the child of a process that used pinmem starts afresh (the
 * parent's registration reads as pageable) and its copies complete. With an archive of separate
 * objects the linker dropped fork.c (nothing references it), the child inherited the parent's
 * tables and threads that do not exist, and its copy hung. The child runs under alarm(); the
 * parent checks how it ended. Self-contained on purpose: tests/helpers.c links the CMake target.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "pinmem.h"
#include "tsan_fork.h"

static int failures;

#define EXPECT(cond)                                                                   \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      failures++;                                                                      \
      fprintf(stderr, "%s:%d: FAIL: %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
              pm_last_error());                                                        \
    }                                                                                  \
  } while (0)

/* In the child: 0 when every part of the rule held, else the number that did not. */
static int child(char *registered, void *dev) {
  int bad = 0;
  pm_pointer_info_t info;
  if (pm_pointer_query(registered, &info) != PM_OK || info.kind != PM_MEMORY_PAGEABLE) {
    fprintf(stderr, "child: the parent's registration is kind %d, not pageable\n", (int)info.kind);
    bad++;
  }
  char out[100];
  memset(out, 0, sizeof out);
  pm_fence_t fence = NULL;
  pm_status_t st = pm_copy_async(out, dev, sizeof out, NULL, NULL, &fence);
  if (st == PM_OK) st = pm_fence_wait(fence);
  if (fence) pm_fence_release(fence);
  if (st != PM_OK || out[0] != 7 || out[99] != 7) {
    fprintf(stderr, "child: copy from the device: %s, bytes %d %d\n", pm_status_name(st), out[0],
            out[99]);
    bad++;
  }
  return bad;
}

int main(void) {
  static char registered[1 << 16];
  memset(registered, 7, sizeof registered);
  EXPECT(pm_register(registered, sizeof registered, 0) == PM_OK);
  void *dev = NULL;
  EXPECT(pm_device_alloc(sizeof registered, &dev) == PM_OK);
  /* A copy starts the threads a child does not inherit. */
  EXPECT(pm_memcpy(dev, registered, sizeof registered, PM_COPY_H2D) == PM_OK);

  fflush(NULL);
  pid_t pid = fork();
  EXPECT(pid >= 0);
  if (pid == 0) {
    alarm(30);
    _exit(child(registered, dev));
  }
  int ws = 0;
  EXPECT(waitpid(pid, &ws, 0) == pid);
  if (WIFSIGNALED(ws)) fprintf(stderr, "child killed by signal %d (a hang)\n", WTERMSIG(ws));
  EXPECT(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);

  EXPECT(pm_unregister(registered) == PM_OK);
  EXPECT(pm_device_free(dev) == PM_OK);
  if (failures) fprintf(stderr, "plain_link_fork: %d failures\n", failures);
  return failures ? 1 : 0;
}
