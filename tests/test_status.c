/* Status codes and error detail: one table, distinct names and messages, unknown values handled,
 * and the last-error text kept per thread. */
#include <pthread.h>

#include "check.h"
#include "internal.h"

static const struct {
  pm_status_t status;
  const char *name;
  int value;
} all_statuses[] = {
#define ROW(name, value, msg) {name, #name, value},
    PM_STATUS_MAP(ROW)
#undef ROW
};
#define N_STATUSES (sizeof all_statuses / sizeof all_statuses[0])

static void test_table(void) {
  CHECK(N_STATUSES >= 20);
  for (size_t i = 0; i < N_STATUSES; i++) {
    pm_status_t s = all_statuses[i].status;
    CHECK_EQ_INT(s, all_statuses[i].value);
    const char *name = pm_status_name(s), *msg = pm_strerror(s);
    CHECK(name != NULL && msg != NULL);
    CHECK(strcmp(name, all_statuses[i].name) == 0);
    CHECK(msg[0] != '\0');
    CHECK(strcmp(msg, "unknown status") != 0);
    for (size_t j = 0; j < i; j++) {
      pm_status_t t = all_statuses[j].status;
      CHECK(s != t);
      if (strcmp(pm_status_name(s), pm_status_name(t)) == 0)
        fprintf(stderr, "duplicate name %s\n", pm_status_name(s));
      CHECK(strcmp(pm_status_name(s), pm_status_name(t)) != 0);
      CHECK(strcmp(pm_strerror(s), pm_strerror(t)) != 0);
    }
  }
  /* Conventions: success is 0, "not ready" is a positive answer, errors are negative. */
  CHECK_EQ_INT(PM_OK, 0);
  CHECK(PM_NOT_READY > 0);
  for (size_t i = 0; i < N_STATUSES; i++)
    if (strncmp(all_statuses[i].name, "PM_ERR_", 7) == 0) CHECK(all_statuses[i].status < 0);
}

static void test_unknown(void) {
  const pm_status_t odd[] = {(pm_status_t)12345, (pm_status_t)-12345, (pm_status_t)-20,
                             (pm_status_t)2};
  for (size_t i = 0; i < sizeof odd / sizeof odd[0]; i++) {
    const char *name = pm_status_name(odd[i]), *msg = pm_strerror(odd[i]);
    CHECK(name != NULL && msg != NULL);
    CHECK(name && name[0] != '\0');
    CHECK(msg && msg[0] != '\0');
    /* An unknown value must not be mistaken for a real one. */
    for (size_t j = 0; j < N_STATUSES; j++) CHECK(strcmp(name, all_statuses[j].name) != 0);
  }
}

static void test_version(void) {
  char want[32];
  snprintf(want, sizeof want, "%d.%d.%d", PINMEM_VERSION_MAJOR, PINMEM_VERSION_MINOR,
           PINMEM_VERSION_PATCH);
  CHECK(strcmp(pm_version(), want) == 0);
}

/* ---- last error per thread ---- */

typedef struct {
  char seen_at_start[256];
  char own_error[256];
  pm_status_t own_status;
  pthread_barrier_t *main_has_set, *thread_has_set;
} thread_ctx_t;

static void *other_thread(void *arg) {
  thread_ctx_t *c = arg;
  pthread_barrier_wait(c->main_has_set);
  /* The main thread's failure happened; this thread has had none. */
  snprintf(c->seen_at_start, sizeof c->seen_at_start, "%s", pm_last_error());
  size_t v;
  c->own_status = pm_parse_size("twelve", &v);
  snprintf(c->own_error, sizeof c->own_error, "%s", pm_last_error());
  pthread_barrier_wait(c->thread_has_set);
  return NULL;
}

static void test_last_error_per_thread(void) {
  pthread_barrier_t b1, b2;
  pthread_barrier_init(&b1, NULL, 2);
  pthread_barrier_init(&b2, NULL, 2);
  thread_ctx_t c = {.main_has_set = &b1, .thread_has_set = &b2};
  pthread_t t;
  REQUIRE(pthread_create(&t, NULL, other_thread, &c) == 0);

  CHECK_ERR_MSG(pm_option_set("no_such_option", "1"), PM_ERR_CONFIG);
  char mine[1024];
  snprintf(mine, sizeof mine, "%s", pm_last_error());
  CHECK(strstr(mine, "no_such_option") != NULL);
  pthread_barrier_wait(&b1);
  pthread_barrier_wait(&b2); /* the other thread has now failed too */
  pthread_join(t, NULL);

  CHECK(c.seen_at_start[0] == '\0');
  CHECK_ST(c.own_status, PM_ERR_CONFIG);
  CHECK(strstr(c.own_error, "twelve") != NULL);
  /* The other thread's failure did not touch this thread's detail. */
  CHECK(strcmp(pm_last_error(), mine) == 0);
  CHECK(strstr(pm_last_error(), "twelve") == NULL);
  pthread_barrier_destroy(&b1);
  pthread_barrier_destroy(&b2);
}

/* A failing public call leaves a detail naming what failed; a success does not invent one. */
static void test_detail_content(void) {
  size_t v = 77;
  CHECK_ERR_MSG(pm_parse_size("5 parsecs", &v), PM_ERR_CONFIG);
  CHECK(strstr(pm_last_error(), "5 parsecs") != NULL);
  CHECK_EQ_SIZE(v, 77); /* outputs untouched on failure */
  CHECK_ERR_MSG(pm_device_alloc(0, NULL), PM_ERR_INVALID);
  CHECK(strstr(pm_last_error(), "pm_device_alloc") != NULL);
}

/* The enum names come from the same X-macro lists as the enums: every value has its text, the
 * values are the documented ones, and a value outside the list gets the fallback. */
static void test_enum_names(void) {
#define CHECK_NAME(fn, name, value, text)         \
  do {                                            \
    CHECK_EQ_INT((int)(name), (value));           \
    CHECK(strcmp(fn(name), (text)) == 0);         \
  } while (0);
#define DTYPE(name, value, text, ...) CHECK_NAME(pm_dtype_name, name, value, text)
  PM_DTYPE_MAP(DTYPE)
#define COPY_KIND(name, value, text, ...) CHECK_NAME(pm__copy_kind_name, name, value, text)
  PM_COPY_KIND_MAP(COPY_KIND)
#define COPY_PATH(name, value, text, ...) CHECK_NAME(pm__copy_path_name, name, value, text)
  PM_COPY_PATH_MAP(COPY_PATH)
#define MEMORY_KIND(name, value, text, ...) CHECK_NAME(pm__memory_kind_name, name, value, text)
  PM_MEMORY_KIND_MAP(MEMORY_KIND)
#define IO_MODE(name, value, text, ...) CHECK_NAME(pm__io_mode_name, name, value, text)
  PM_IO_MODE_MAP(IO_MODE)
#define SOURCE(name, value, text, ...) CHECK_NAME(pm__option_source_name, name, value, text)
  PM_OPTION_SOURCE_MAP(SOURCE)
  CHECK(strcmp(pm_dtype_name(PM_DTYPE_FLOAT32), "float32") == 0);
  CHECK(strcmp(pm_dtype_name((pm_dtype_t)99), "unknown") == 0);
  CHECK(strcmp(pm__copy_kind_symbol(PM_COPY_D2H), "PM_COPY_D2H") == 0);
  CHECK(strcmp(pm__copy_kind_name((pm_copy_kind_t)7), "?") == 0);
  CHECK(strcmp(pm__memory_kind_name((pm_memory_kind_t)-1), "unknown") == 0);
  CHECK(strcmp(pm__backend_kind_name(PM_BACKEND_HOST), "host") == 0);
  CHECK(strcmp(pm__exhaust_policy_name(PM_EXHAUST_WAIT), "wait") == 0);
  CHECK(strcmp(pm__delivery_name(PM_DELIVER_HOST), "host") == 0);
  CHECK_EQ_INT(PM_COPY_H2H, 4); /* the public values are unchanged */
  CHECK_EQ_INT(PM_DTYPE_COMPLEX128, 14);
  CHECK_EQ_INT(PM_MEMORY_DEVICE, 4);
  CHECK_EQ_INT(PM_PATH_REGISTER, 3);
}

int main(void) {
  pm_test_init();
  test_enum_names();
  test_table();
  test_unknown();
  test_version();
  test_last_error_per_thread();
  test_detail_content();
  return pm_test_finish("test_status");
}
