/*
 * libFuzzer target: option setting with arbitrary names and values, through pm_option_set and
 * through the environment (PINMEM_<NAME>), then every typed lookup. Input: "name=value"; a first
 * byte below 0x20 picks a known option by index instead of a name. Accepted values must read
 * back (pm_option_find shows them, source PM_OPTION_SET); refused ones must give PM_ERR_CONFIG
 * or PM_ERR_INVALID with a detail and leave the option as it was.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static void lookups(void) {
  char buf[160];
  for (int o = 0; o < PM__OPT_COUNT; o++) {
    (void)pm__opt_size((pm__opt_t)o);
    (void)pm__opt_int((pm__opt_t)o);
    (void)pm__opt_double((pm__opt_t)o);
    pm__opt_text((pm__opt_t)o, buf, sizeof buf);
    pm_option_info_t info;
    if (pm_option_get(o, &info) != PM_OK) abort();
    if (!info.name || !info.env || memchr(info.value, '\0', sizeof info.value) == NULL) abort();
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size > 1024) return 0;
  char *s = malloc(size + 1);
  if (!s) return 0;
  memcpy(s, data, size);
  s[size] = '\0';
  const char *name, *value;
  char known[64];
  if (size > 0 && data[0] < 0x20) {
    pm_option_info_t info;
    if (pm_option_get(data[0] % pm_option_count(), &info) != PM_OK) abort();
    snprintf(known, sizeof known, "%s", info.name);
    name = known;
    value = s + 1;
  } else {
    char *eq = strchr(s, '=');
    name = s;
    value = eq ? eq + 1 : "";
    if (eq) *eq = '\0';
  }

  pm_option_info_t before, after;
  int exists = pm_option_find(name, &before) == PM_OK;
  pm_status_t st = pm_option_set(name, value);
  if (st == PM_OK) {
    if (!exists) abort(); /* an unknown name was accepted */
    if (pm_option_find(name, &after) != PM_OK || after.source != PM_OPTION_SET) abort();
    lookups();
    if (pm_option_set(name, NULL) != PM_OK) abort();
  } else {
    if ((st != PM_ERR_CONFIG && st != PM_ERR_INVALID) || pm_last_error()[0] == '\0') abort();
    if (exists) {
      if (pm_option_find(name, &after) != PM_OK) abort();
      if (after.source != before.source || strcmp(after.value, before.value) != 0) abort();
    }
  }
  /* The same value from the environment: never refused, never fatal, shown with the reason. */
  if (exists && strlen(value) < 200) {
    pm_option_info_t info;
    if (pm_option_find(name, &info) != PM_OK) abort();
    setenv(info.env, value, 1);
    pm__opt_reload(); /* the environment is read at the first lookup after a reload */
    lookups();
    unsetenv(info.env);
    pm__opt_reload();
  }
  free(s);
  return 0;
}
