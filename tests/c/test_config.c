/* gpupool_set_config and gpupool_config_string: the configuration in PyTorch's syntax, set
 * before the first allocation and read back. Its own process, so that it runs before any other
 * call has started a device. Run with GPUPOOL_DRIVER=sim (or cuda on a GPU) and no
 * GPUPOOL_CONF. */
#include <stdlib.h>
#include <string.h>

#include "gpupool.h"
#include "check.h"

#define KIB ((size_t)1 << 10)

static int message_has(const char *word) { return strstr(gpupool_last_error_message(), word) != NULL; }

/* The configuration string in force, in a buffer the caller frees. */
static char *config_string(void) {
  size_t needed = 0;
  CHECK_OK(gpupool_config_string(NULL, 0, &needed));
  char *buf = malloc(needed);
  CHECK(buf != NULL);
  if (buf == NULL) return NULL;
  size_t again = 0;
  CHECK_OK(gpupool_config_string(buf, needed, &again));
  CHECK(again == needed && strlen(buf) + 1 == needed);
  return buf;
}

static void test_buffer(void) {
  size_t needed = 0;
  CHECK(gpupool_config_string(NULL, 0, NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK_OK(gpupool_config_string(NULL, 0, &needed));
  CHECK(needed > 1);
  /* Too small: *needed is written, the buffer is untouched, the message gives the size. */
  char small[8];
  memset(small, 'x', sizeof small);
  size_t told = 0;
  CHECK(gpupool_config_string(small, sizeof small, &told) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(told == needed);
  CHECK(small[0] == 'x' && small[sizeof small - 1] == 'x');
  CHECK(message_has("gpupool_config_string: ") && message_has("needs"));
  /* Without `needed`, a buffer that fits is enough. */
  char *buf = malloc(needed);
  CHECK_OK(gpupool_config_string(buf, needed, NULL));
  CHECK(strncmp(buf, "backend:native,large_segment_size_mb:20,max_split_size_mb:17592186044415,", 73) == 0);
  CHECK(strstr(buf, ",roundup_power2_divisions:[1:0,>:0],") != NULL);
  CHECK(strstr(buf, ",expandable_segments:True,") != NULL); /* gpupool's default, not PyTorch's */
  printf("default configuration: %s\n", buf);
  free(buf);
}

static void test_bad_strings_change_nothing(void) {
  char *before = config_string();
  struct {
    const char *conf;
    const char *named[2];
  } bad[] = {
      {"expandable_segments:true", {"expandable_segments:true", "True or False"}},
      {"max_split_size_mb:19", {"max_split_size_mb:19", "at least large_segment_size_mb (20)"}},
      {"max_split_size_mb:64,foo:1", {"\"foo\"", "unknown key"}},
      {"backend:cudaMallocAsync", {"backend:cudaMallocAsync", "native"}},
      {"roundup_power2_divisions:3", {"roundup_power2_divisions:3", "power of two"}},
      {"garbage_collection_threshold:1", {"garbage_collection_threshold:1", "under 1"}},
      {"max_split_size_mb,64", {"max_split_size_mb", "':'"}},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    CHECK(gpupool_set_config(bad[i].conf) == GPUPOOL_ERROR_INVALID_VALUE);
    CHECK(message_has("gpupool_set_config: "));
    CHECK(message_has(bad[i].named[0]));
    CHECK(message_has(bad[i].named[1]));
  }
  CHECK(gpupool_set_config(NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(message_has("conf is NULL"));
  CHECK(gpupool_set_config("expandable_segments:\xff") == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(message_has("UTF-8"));
  char *after = config_string();
  CHECK(strcmp(before, after) == 0);
  free(before);
  free(after);
}

int main(void) {
  /* The first call: nothing has started a device. */
  test_buffer();
  int count = 0;
  CHECK_OK(gpupool_device_count(&count));
  CHECK(count >= 1);
  test_bad_strings_change_nothing();

  /* A good string, spaces and a list included, after gpupool_device_count started the
   * allocator (but no device). */
  CHECK_OK(gpupool_set_config(" roundup_power2_divisions : [1:4,>:8] , max_split_size_mb:64, expandable_segments:False"));
  char *set = config_string();
  CHECK(strstr(set, ",max_split_size_mb:64,") != NULL);
  CHECK(strstr(set, ",roundup_power2_divisions:[1:4,>:8],") != NULL);
  /* The string reads back to the same configuration. */
  CHECK_OK(gpupool_set_config(set));
  char *again = config_string();
  CHECK(strcmp(set, again) == 0);
  printf("set: %s\n", set);

  /* The devices start with it: 1200 KiB lies in the first interval (4 divisions) and takes a
   * 1280 KiB block; 100 MiB (8 divisions, steps of 8 MiB) a 104 MiB one. */
  void *p = NULL, *q = NULL;
  CHECK_OK(gpupool_malloc(&p, 1200 * KIB, 0, NULL));
  CHECK_OK(gpupool_malloc(&q, 100 * 1024 * KIB, 0, NULL));
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_stats(0, &s));
  CHECK(s.allocated_bytes.all.current == (int64_t)(1280 * KIB + 104 * 1024 * KIB));
  CHECK(s.max_split_size == (int64_t)(64 * 1024 * KIB));

  /* After the first allocation: refused, with a message that says so, and nothing changes. */
  CHECK(gpupool_set_config("") == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(message_has("gpupool_set_config: ") && message_has("before the first allocation"));
  CHECK(gpupool_set_config("max_split_size_mb:128") == GPUPOOL_ERROR_INVALID_VALUE);
  char *after = config_string();
  CHECK(strcmp(set, after) == 0);

  CHECK_OK(gpupool_free(p));
  CHECK_OK(gpupool_free(q));
  free(set);
  free(again);
  free(after);
  return checks_report("test_config");
}
