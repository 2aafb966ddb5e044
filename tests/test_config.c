/* The option table: defaults, PINMEM_* environment overrides, explicit values winning, bad values
 * (ignored with the reason shown for the environment, refused for pm_option_set), and
 * pm_parse_size. */
#include <ctype.h>
#include <pthread.h>

#include "check.h"
#include "internal.h"

static const char *const option_envs[] = {"PINMEM_DEVICE",        "PINMEM_BUDGET",
                                          "PINMEM_BUDGET_POLICY", "PINMEM_BUDGET_TIMEOUT",
                                          "PINMEM_PIN_THREADS",   "PINMEM_FAST_PIN_MIN",
                                          "PINMEM_HUGE_PAGES",    "PINMEM_HOST_DEVICE_MEMORY",
                                          "PINMEM_COPY_CHUNK",    "PINMEM_COPY_SLOTS",
                                          "PINMEM_COPY_THREADS",  "PINMEM_COPY_STAGE_MIN",
                                          "PINMEM_COPY_PIECE"};

static pm_option_info_t find(const char *name) {
  pm_option_info_t info;
  memset(&info, 0, sizeof info);
  pm_status_t st = pm_option_find(name, &info);
  if (st != PM_OK) fprintf(stderr, "pm_option_find(%s): %s\n", name, pm_last_error());
  REQUIRE(st == PM_OK);
  return info;
}

static void test_table_rows(void) {
  int n = pm_option_count();
  CHECK_EQ_INT(n, PM__OPT_COUNT);
  for (int i = 0; i < n; i++) {
    pm_option_info_t info;
    REQUIRE_OK(pm_option_get(i, &info));
    CHECK(info.name && info.name[0]);
    CHECK(info.doc && strlen(info.doc) > 10);
    CHECK(info.default_value && info.default_value[0]);
    /* env is PINMEM_ + the name in capitals */
    char want[64] = "PINMEM_";
    for (size_t k = 0; info.name[k] && k < 50; k++)
      want[7 + k] = (char)toupper((unsigned char)info.name[k]), want[8 + k] = '\0';
    CHECK(strcmp(info.env, want) == 0);
    /* find by name gives the same row; every default is itself a valid explicit value */
    pm_option_info_t again = find(info.name);
    CHECK(strcmp(again.env, info.env) == 0);
    CHECK_OK(pm_option_set(info.name, info.default_value));
    CHECK_EQ_INT(find(info.name).source, PM_OPTION_SET);
    CHECK_OK(pm_option_set(info.name, NULL));
    for (int j = 0; j < i; j++) {
      pm_option_info_t other;
      REQUIRE_OK(pm_option_get(j, &other));
      CHECK(strcmp(other.name, info.name) != 0);
    }
  }
  pm_option_info_t info;
  CHECK_ERR_MSG(pm_option_get(-1, &info), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_option_get(n, &info), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_option_get(0, NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_option_find(NULL, &info), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_option_find("budget", NULL), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_option_find("no_such_option", &info), PM_ERR_CONFIG);
  CHECK(strstr(pm_last_error(), "no_such_option") != NULL);
  /* The message lists every option, the last one of the table too, whole and ending the list
   * (it was cut in the middle of the 21st name). */
  char want[96];
  CHECK(pm_option_get(n - 1, &info) == PM_OK);
  snprintf(want, sizeof want, ", %s)", info.name);
  CHECK_ERR_MSG(pm_option_set("no_such_option", "1"), PM_ERR_CONFIG);
  const char *msg = pm_last_error();
  size_t len = strlen(msg), wl = strlen(want);
  if (len < wl || strcmp(msg + len - wl, want) != 0)
    fprintf(stderr, "want the list to end with '%s': %s\n", want, msg);
  CHECK(len >= wl && strcmp(msg + len - wl, want) == 0);
}

static void test_defaults(void) {
  static const struct {
    const char *name, *value;
  } defaults[] = {{"device", "0"},          {"budget", "auto"},           {"budget_policy", "fail"},
                  {"budget_timeout", "10"}, {"pin_threads", "0"},         {"fast_pin_min", "4M"},
                  {"huge_pages", "1"},      {"host_device_memory", "4G"}, {"copy_chunk", "4M"},
                  {"copy_slots", "32"},     {"copy_threads", "0"},        {"copy_stage_min", "8M"},
                  {"copy_memcpy", "auto"},  {"copy_batch", "auto"},        {"copy_bounce", "auto"},
                  {"copy_ramp", "1"},         {"copy_piece", "256K"},
                  {"copy_piece_slots", "8"}};
  for (size_t i = 0; i < sizeof defaults / sizeof defaults[0]; i++) {
    pm_option_info_t info = find(defaults[i].name);
    CHECK_EQ_INT(info.source, PM_OPTION_DEFAULT);
    CHECK(strcmp(info.default_value, defaults[i].value) == 0);
    CHECK(strcmp(info.value, defaults[i].value) == 0);
  }
  CHECK_EQ_INT(pm__opt_int(PM__OPT_DEVICE), 0);
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_BUDGET), 0); /* auto: the pool resolves it */
  CHECK_EQ_INT(pm__opt_int(PM__OPT_BUDGET_POLICY), PM_EXHAUST_FAIL);
  CHECK(pm__opt_double(PM__OPT_BUDGET_TIMEOUT) == 10.0);
  int cpus = pm__cpu_count();
  CHECK(cpus >= 1);
  CHECK_EQ_INT(pm__opt_int(PM__OPT_PIN_THREADS), cpus < 16 ? cpus : 16);
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_FAST_PIN_MIN), 4u << 20);
  CHECK_EQ_INT(pm__opt_int(PM__OPT_HUGE_PAGES), 1);
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_HOST_DEVICE_MEMORY), (size_t)4 << 30);
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_COPY_CHUNK), 4u << 20);
  CHECK_EQ_INT(pm__opt_int(PM__OPT_COPY_SLOTS), 32);
  CHECK_EQ_INT(pm__opt_int(PM__OPT_COPY_THREADS), cpus < 12 ? cpus : 12); /* auto, resolved */
  CHECK_EQ_INT(pm__opt_int(PM__OPT_LOADER_WORKERS), cpus < 16 ? cpus : 16);
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_COPY_STAGE_MIN), 8u << 20);
  CHECK_EQ_INT(pm__opt_int(PM__OPT_COPY_RAMP), 1);
  /* Under CTest PINMEM_BACKEND is set: that option comes from the environment, and names the
   * backend that started (auto would not). */
  const char *env_backend = getenv("PINMEM_BACKEND");
  if (env_backend && (strcmp(env_backend, "host") == 0 || strcmp(env_backend, "cuda") == 0)) {
    pm_option_info_t b = find("backend");
    CHECK_EQ_INT(b.source, PM_OPTION_ENV);
    CHECK(strcmp(b.value, pm_backend_name()) == 0);
    char text[16];
    pm__opt_text(PM__OPT_BACKEND, text, sizeof text);
    CHECK(strcmp(text, pm_backend_name()) == 0);
  }
}

/* The environment is read at the first lookup after a change: a test that changes it makes the
 * library read it again, as a new process would. */
static void set_env(const char *name, const char *value, int overwrite) {
  setenv(name, value, overwrite);
  pm__opt_reload();
}
static void unset_env(const char *name) {
  unsetenv(name);
  pm__opt_reload();
}
static void unset_all_env(void) {
  for (size_t i = 0; i < sizeof option_envs / sizeof option_envs[0]; i++) unsetenv(option_envs[i]);
  pm__opt_reload();
}

static void test_env_and_explicit(void) {
  /* environment over the default, read at lookup time */
  set_env("PINMEM_BUDGET", "2G", 1);
  pm_option_info_t info = find("budget");
  CHECK_EQ_INT(info.source, PM_OPTION_ENV);
  CHECK(strcmp(info.value, "2G") == 0);
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_BUDGET), (size_t)2 << 30);

  /* explicit over the environment */
  CHECK_OK(pm_option_set("budget", "1.5G"));
  info = find("budget");
  CHECK_EQ_INT(info.source, PM_OPTION_SET);
  CHECK(strcmp(info.value, "1.5G") == 0);
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_BUDGET), (size_t)3 << 29);
  /* a refused value leaves the explicit one in force */
  CHECK_ERR_MSG(pm_option_set("budget", "lots"), PM_ERR_CONFIG);
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_BUDGET), (size_t)3 << 29);
  /* clearing it brings the environment back */
  CHECK_OK(pm_option_set("budget", NULL));
  CHECK_EQ_INT(find("budget").source, PM_OPTION_ENV);
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_BUDGET), (size_t)2 << 30);
  unset_env("PINMEM_BUDGET");
  CHECK_EQ_INT(find("budget").source, PM_OPTION_DEFAULT);

  /* one of each type through the environment */
  set_env("PINMEM_BUDGET_POLICY", "WAIT", 1);
  CHECK_EQ_INT(pm__opt_int(PM__OPT_BUDGET_POLICY), PM_EXHAUST_WAIT);
  CHECK(strcmp(find("budget_policy").value, "wait") == 0); /* canonical spelling */
  set_env("PINMEM_BUDGET_TIMEOUT", "0.25", 1);
  CHECK(pm__opt_double(PM__OPT_BUDGET_TIMEOUT) == 0.25);
  set_env("PINMEM_PIN_THREADS", "3", 1);
  CHECK_EQ_INT(pm__opt_int(PM__OPT_PIN_THREADS), 3);
  set_env("PINMEM_FAST_PIN_MIN", "64k", 1);
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_FAST_PIN_MIN), 65536);
  set_env("PINMEM_HUGE_PAGES", " 0 ", 1); /* white space is forgiven */
  CHECK_EQ_INT(pm__opt_int(PM__OPT_HUGE_PAGES), 0);
  set_env("PINMEM_HOST_DEVICE_MEMORY", "0", 1); /* 0 = unlimited is a valid value */
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_HOST_DEVICE_MEMORY), 0);
  CHECK_EQ_INT(find("host_device_memory").source, PM_OPTION_ENV);
  set_env("PINMEM_DEVICE", "2", 1);
  CHECK_EQ_INT(pm__opt_int(PM__OPT_DEVICE), 2);
  unset_all_env();
}

/* A value is parsed once: a later change of the environment is not seen until something
 * empties the cache (pm_option_set of that option, with a value or NULL, or pm__opt_reload). */
static void test_cache(void) {
  CHECK_EQ_INT(pm__opt_int(PM__OPT_COPY_SLOTS), 32);
  setenv("PINMEM_COPY_SLOTS", "7", 1);
  CHECK_EQ_INT(pm__opt_int(PM__OPT_COPY_SLOTS), 32); /* cached */
  CHECK_EQ_INT(find("copy_slots").source, PM_OPTION_DEFAULT); /* info shows the value in force */
  CHECK_OK(pm_option_set("copy_slots", NULL)); /* invalidates: the environment is read again */
  CHECK_EQ_INT(pm__opt_int(PM__OPT_COPY_SLOTS), 7);
  CHECK_EQ_INT(find("copy_slots").source, PM_OPTION_ENV);
  CHECK_OK(pm_option_set("copy_slots", "9"));
  CHECK_EQ_INT(pm__opt_int(PM__OPT_COPY_SLOTS), 9);
  CHECK_OK(pm_option_set("copy_slots", NULL));
  CHECK_EQ_INT(pm__opt_int(PM__OPT_COPY_SLOTS), 7);
  unsetenv("PINMEM_COPY_SLOTS");
  CHECK_EQ_INT(pm__opt_int(PM__OPT_COPY_SLOTS), 7);
  pm__opt_reload();
  CHECK_EQ_INT(pm__opt_int(PM__OPT_COPY_SLOTS), 32);
  /* every typed lookup of every option reads the same cached value as the first */
  for (int o = 0; o < PM__OPT_COUNT; o++) {
    long i1 = pm__opt_int((pm__opt_t)o);
    size_t s1 = pm__opt_size((pm__opt_t)o);
    CHECK_EQ_INT(pm__opt_int((pm__opt_t)o), i1);
    CHECK_EQ_SIZE(pm__opt_size((pm__opt_t)o), s1);
  }
}

static void test_bad_env(void) {
  static const struct {
    const char *env, *name, *value;
  } bad[] = {{"PINMEM_BUDGET", "budget", "xyz"},
             {"PINMEM_BUDGET", "budget", "0"},
             {"PINMEM_BUDGET", "budget", "-1G"},
             {"PINMEM_BUDGET_POLICY", "budget_policy", "sometimes"},
             {"PINMEM_BUDGET_TIMEOUT", "budget_timeout", "nan"},
             {"PINMEM_BUDGET_TIMEOUT", "budget_timeout", "-1"},
             {"PINMEM_PIN_THREADS", "pin_threads", "-3"},
             {"PINMEM_PIN_THREADS", "pin_threads", "4x"},
             {"PINMEM_FAST_PIN_MIN", "fast_pin_min", "99999999999999T"},
             {"PINMEM_HUGE_PAGES", "huge_pages", "2"},
             {"PINMEM_DEVICE", "device", "gpu0"},
             {"PINMEM_HOST_DEVICE_MEMORY", "host_device_memory", ""},
             {"PINMEM_COPY_SLOTS", "copy_slots", "0"},
             {"PINMEM_COPY_CHUNK", "copy_chunk", "big"}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    set_env(bad[i].env, bad[i].value, 1);
    pm_option_info_t info = find(bad[i].name);
    CHECK_EQ_INT(info.source, PM_OPTION_DEFAULT);
    /* the value shown is the default, with why the environment was ignored */
    char want[128];
    snprintf(want, sizeof want, "%s='%s' ignored", bad[i].env, bad[i].value);
    if (!strstr(info.value, want)) fprintf(stderr, "value shown: %s\n", info.value);
    CHECK(strstr(info.value, want) != NULL);
    CHECK(strncmp(info.value, info.default_value, strlen(info.default_value)) == 0);
    unset_env(bad[i].env);
  }
  set_env("PINMEM_BUDGET", "xyz", 1);
  CHECK(strstr(find("budget").value, "not a size") != NULL);
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_BUDGET), 0); /* the default (auto) is used */
  set_env("PINMEM_PIN_THREADS", "-3", 1);
  CHECK(pm__opt_int(PM__OPT_PIN_THREADS) >= 1);
  set_env("PINMEM_BUDGET_TIMEOUT", "inf", 1);
  CHECK(pm__opt_double(PM__OPT_BUDGET_TIMEOUT) == 10.0);
  /* a long bad value is cut short in the note, never overflowing the value field */
  char longv[400];
  memset(longv, 'q', sizeof longv - 1);
  longv[sizeof longv - 1] = '\0';
  set_env("PINMEM_HOST_DEVICE_MEMORY", longv, 1);
  pm_option_info_t info = find("host_device_memory");
  CHECK(strlen(info.value) < sizeof info.value);
  CHECK(strstr(info.value, "...") != NULL);
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_HOST_DEVICE_MEMORY), (size_t)4 << 30);
  /* pm__opt_text gives the value in force without the note */
  char text[64];
  pm__opt_text(PM__OPT_HOST_DEVICE_MEMORY, text, sizeof text);
  CHECK(strcmp(text, "4G") == 0);
  unset_all_env();
}

static void test_bad_set(void) {
  static const struct {
    const char *name, *value;
  } bad[] = {{"budget", "-1G"},
             {"budget", "0"},
             {"budget", "12 apples"},
             {"budget_policy", "maybe"},
             {"budget_timeout", "-2"},
             {"budget_timeout", "soon"},
             {"pin_threads", "-1"},
             {"pin_threads", "1.5"},
             {"pin_threads", "100000"},
             {"fast_pin_min", "0"},
             {"huge_pages", "yes please"},
             {"device", "-1"},
             {"backend", "opencl"},
             {"host_device_memory", "1.5"},
             /* chunk sizes stop at 1 TiB: nearer 2^64 the roundings that cut a copy or a file
              * transfer into units wrapped, to plans that moved nothing or ran past a buffer */
             {"copy_chunk", "18446744073709551515"},
             {"copy_chunk", "1025G"},
             {"copy_piece", "2T"},
             {"loader_piece", "16E"},
             {"file_chunk", "18446744073709551615"},
             {"file_write_chunk", "18446744073709547520"},
             {"file_direct_chunk", "4P"},
             {"file_part", "2T"},
             {"blocks_chunk", "2T"}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    pm_option_info_t before = find(bad[i].name);
    pm_status_t st = pm_option_set(bad[i].name, bad[i].value);
    CHECK_ST(st, PM_ERR_CONFIG);
    /* the reason names the option and repeats the value */
    CHECK(strstr(pm_last_error(), bad[i].name) != NULL);
    CHECK(strstr(pm_last_error(), bad[i].value) != NULL);
    /* and nothing changed */
    pm_option_info_t after = find(bad[i].name);
    CHECK_EQ_INT(after.source, before.source);
    CHECK(strcmp(after.value, before.value) == 0);
  }
  CHECK_ERR_MSG(pm_option_set("no_such_option", "1"), PM_ERR_CONFIG);
  CHECK_ERR_MSG(pm_option_set(NULL, "1"), PM_ERR_INVALID);
  char longv[300];
  memset(longv, '1', sizeof longv - 1);
  longv[sizeof longv - 1] = '\0';
  CHECK_ERR_MSG(pm_option_set("budget", longv), PM_ERR_CONFIG);

  /* good explicit values, case-insensitive where it is a word */
  CHECK_OK(pm_option_set("Budget_Policy", "Wait"));
  CHECK_EQ_INT(pm__opt_int(PM__OPT_BUDGET_POLICY), PM_EXHAUST_WAIT);
  CHECK(strcmp(find("budget_policy").value, "wait") == 0);
  CHECK_OK(pm_option_set("pin_threads", "5"));
  CHECK_EQ_INT(pm__opt_int(PM__OPT_PIN_THREADS), 5);
  CHECK_OK(pm_option_set("budget", "AUTO"));
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_BUDGET), 0);
  CHECK_OK(pm_option_set("huge_pages", "off"));
  CHECK_EQ_INT(pm__opt_int(PM__OPT_HUGE_PAGES), 0);
  CHECK_OK(pm_option_set("copy_chunk", "1T"));
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_COPY_CHUNK), (size_t)1 << 40);
  CHECK_OK(pm_option_set("file_write_chunk", "0"));
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_FILE_WRITE_CHUNK), 0);
  /* explicit beats the environment */
  set_env("PINMEM_PIN_THREADS", "7", 1);
  CHECK_EQ_INT(pm__opt_int(PM__OPT_PIN_THREADS), 5);
  unset_env("PINMEM_PIN_THREADS");
  for (int i = 0; i < pm_option_count(); i++) {
    pm_option_info_t info;
    REQUIRE_OK(pm_option_get(i, &info));
    if (strcmp(info.name, "backend") != 0) CHECK_OK(pm_option_set(info.name, NULL));
  }
}

static void test_parse_size(void) {
  static const struct {
    const char *text;
    size_t bytes;
  } good[] = {{"0", 0},
              {"1", 1},
              {"4096", 4096},
              {"64K", 64 << 10},
              {"64k", 64 << 10},
              {"1.5M", 3 << 19},
              {"1.25M", 1310720},
              {"0.5K", 512},
              {".5K", 512},
              {"0.1K", 102}, /* fractions of a unit are truncated to whole bytes */
              {"2G", (size_t)2 << 30},
              {"1T", (size_t)1 << 40},
              {"4KB", 4096},
              {"4KiB", 4096},
              {"4kib", 4096},
              {"4 MiB", 4 << 20},
              {" 8M ", 8 << 20},
              {"1B", 1},
              {"100b", 100},
              {"+16", 16},
              {"1.0", 1},
              {"16777215T", (size_t)16777215 << 40},
              {"18446744073709551615", (size_t)18446744073709551615ull}};
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
    size_t v = 12345;
    pm_status_t st = pm_parse_size(good[i].text, &v);
    if (st != PM_OK || v != good[i].bytes)
      fprintf(stderr, "pm_parse_size('%s') -> %s %zu\n", good[i].text, pm_status_name(st), v);
    CHECK_OK(st);
    CHECK_EQ_SIZE(v, good[i].bytes);
  }
  static const char *const bad[] = {"",
                                    "   ",
                                    "-1",
                                    "-1K",
                                    "abc",
                                    "K",
                                    "1X",
                                    "1KK",
                                    "1.5",
                                    "1..5M",
                                    "1.5.3K",
                                    "1e3",
                                    "0x10",
                                    "1 2",
                                    "nan",
                                    "inf",
                                    "4 KB extra",
                                    "18446744073709551616",
                                    "99999999999999999999999",
                                    "16777216T",
                                    "17179869184G"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    size_t v = 12345;
    pm_status_t st = pm_parse_size(bad[i], &v);
    if (st != PM_ERR_CONFIG) fprintf(stderr, "pm_parse_size('%s') accepted: %zu\n", bad[i], v);
    CHECK_ERR_MSG(st, PM_ERR_CONFIG);
    CHECK_EQ_SIZE(v, 12345); /* untouched */
  }
  size_t v = 0;
  CHECK_ERR_MSG(pm_parse_size("16777216T", &v), PM_ERR_CONFIG);
  CHECK(strstr(pm_last_error(), "too large") != NULL);
  CHECK_ERR_MSG(pm_parse_size("-5", &v), PM_ERR_CONFIG);
  CHECK(strstr(pm_last_error(), "negative") != NULL);
  CHECK_ERR_MSG(pm_parse_size(NULL, &v), PM_ERR_INVALID);
  CHECK_ERR_MSG(pm_parse_size("1", NULL), PM_ERR_INVALID);
}

/* Concurrent explicit sets and lookups (run under TSan). The CHECK counters are not
 * thread-safe, so each thread returns its failure count. */
static void *hammer(void *arg) {
  long id = (long)(intptr_t)arg;
  char val[32];
  intptr_t failures = 0;
  for (int i = 0; i < 300; i++) {
    snprintf(val, sizeof val, "%ldK", id * 1000 + i + 1);
    if (pm_option_set("fast_pin_min", val) != PM_OK) failures++;
    size_t s = pm__opt_size(PM__OPT_FAST_PIN_MIN);
    if (s < 1024 || s % 1024 != 0) failures++;
    pm_option_info_t info;
    if (pm_option_find("fast_pin_min", &info) != PM_OK || info.value[0] == '\0' ||
        info.source != PM_OPTION_SET)
      failures++;
  }
  return (void *)failures;
}

static void test_threads(void) {
  pthread_t t[4];
  for (long i = 0; i < 4; i++)
    REQUIRE(pthread_create(&t[i], NULL, hammer, (void *)(intptr_t)i) == 0);
  for (int i = 0; i < 4; i++) {
    void *ret = NULL;
    pthread_join(t[i], &ret);
    CHECK_EQ_INT((intptr_t)ret, 0);
  }
  CHECK_OK(pm_option_set("fast_pin_min", NULL));
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_FAST_PIN_MIN), 4u << 20);
}

/* copy_piece cuts a copy_chunk slot into pieces: a piece not below the chunk is refused where it
 * comes in, whichever of the two is set last, with a message that names both; it used to be taken
 * and quietly meant no pieces. */
static bool names_both(void) {
  return strstr(pm_last_error(), "copy_piece") && strstr(pm_last_error(), "copy_chunk");
}
static void test_piece_below_chunk(void) {
  unset_all_env();
  /* The piece first, then a chunk lowered to it or under it: the chunk is refused. */
  CHECK_OK(pm_option_set("copy_piece", "1M"));
  CHECK_ERR_MSG(pm_option_set("copy_chunk", "1M"), PM_ERR_CONFIG);
  CHECK(names_both());
  CHECK_ERR_MSG(pm_option_set("copy_chunk", "512K"), PM_ERR_CONFIG);
  CHECK(names_both());
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_COPY_CHUNK), 4u << 20); /* unchanged */
  CHECK_OK(pm_option_set("copy_chunk", "2M"));
  /* The chunk first, then a piece as large or larger: the piece is refused. */
  CHECK_ERR_MSG(pm_option_set("copy_piece", "2M"), PM_ERR_CONFIG);
  CHECK(names_both());
  CHECK_ERR_MSG(pm_option_set("copy_piece", "3M"), PM_ERR_CONFIG);
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_COPY_PIECE), 1u << 20); /* unchanged */
  /* A larger pair: chunk raised first, then the piece. 0 (no pieces) goes with any chunk. */
  CHECK_OK(pm_option_set("copy_chunk", "16M"));
  CHECK_OK(pm_option_set("copy_piece", "8M"));
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_COPY_PIECE), 8u << 20);
  CHECK_OK(pm_option_set("copy_piece", "0"));
  CHECK_OK(pm_option_set("copy_chunk", "4K"));
  CHECK_OK(pm_option_set("copy_piece", NULL));
  CHECK_OK(pm_option_set("copy_chunk", NULL));

  /* The chunk from the environment counts as well. */
  set_env("PINMEM_COPY_CHUNK", "512K", 1);
  CHECK_ERR_MSG(pm_option_set("copy_piece", "1M"), PM_ERR_CONFIG);
  CHECK(names_both() && strstr(pm_last_error(), "512K"));
  unset_env("PINMEM_COPY_CHUNK");

  /* PINMEM_COPY_PIECE not below the chunk in force is ignored, with the reason shown... */
  set_env("PINMEM_COPY_PIECE", "4M", 1);
  pm_option_info_t info = find("copy_piece");
  CHECK_EQ_INT(info.source, PM_OPTION_DEFAULT);
  if (!strstr(info.value, "PINMEM_COPY_PIECE='4M' ignored: not below copy_chunk 4M"))
    fprintf(stderr, "value shown: %s\n", info.value);
  CHECK(strstr(info.value, "PINMEM_COPY_PIECE='4M' ignored: not below copy_chunk 4M") != NULL);
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_COPY_PIECE), 256u << 10);
  /* ...and taken once the chunk is above it (a new chunk is seen by the cached piece). */
  CHECK_OK(pm_option_set("copy_chunk", "8M"));
  CHECK_EQ_INT(find("copy_piece").source, PM_OPTION_ENV);
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_COPY_PIECE), 4u << 20);
  /* An explicit chunk under a piece that only the environment gives is not refused: the
   * environment's piece is ignored again. */
  CHECK_OK(pm_option_set("copy_chunk", "2M"));
  CHECK_EQ_INT(find("copy_piece").source, PM_OPTION_DEFAULT);
  CHECK_EQ_SIZE(pm__opt_size(PM__OPT_COPY_PIECE), 256u << 10);
  CHECK_OK(pm_option_set("copy_chunk", NULL));
  set_env("PINMEM_COPY_CHUNK", "8M", 1);
  CHECK_EQ_INT(find("copy_piece").source, PM_OPTION_ENV);
  unset_all_env();
}

int main(void) {
  unset_all_env();
  pm_test_init();
  test_table_rows();
  test_defaults();
  test_env_and_explicit();
  test_cache();
  test_bad_env();
  test_bad_set();
  test_parse_size();
  test_threads();
  test_piece_below_chunk();
  return pm_test_finish("test_config");
}
