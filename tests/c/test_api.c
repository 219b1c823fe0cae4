/* The C API end to end: run with GPUPOOL_DRIVER=sim (the memory is then host memory and the
 * test also writes it) or GPUPOOL_DRIVER=cuda on a GPU. Built against both libgpupool.so and
 * libgpupool.a with -Wall -Wextra -Wpedantic -Werror. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gpupool.h"
#include "gpupool_testing.h"
#include "gpupool_torch.h"
#include "check.h"

#define MIB ((size_t)1 << 20)

static int sim;

static gpupool_stats_t stats(int device) {
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_stats(device, &s));
  return s;
}

static int starts_with(const char *s, const char *prefix) { return strncmp(s, prefix, strlen(prefix)) == 0; }

/* Every message names the function that failed. */
static int message_from(const char *call) {
  const char *msg = gpupool_last_error_message();
  size_t n = strlen(call);
  return strncmp(msg, call, n) == 0 && msg[n] == ':' && msg[n + 1] == ' ';
}

static void test_strings(void) {
  CHECK(strcmp(gpupool_status_string(GPUPOOL_SUCCESS), "success") == 0);
  CHECK(strcmp(gpupool_status_string(GPUPOOL_ERROR_OUT_OF_MEMORY), "out of memory") == 0);
  CHECK(strcmp(gpupool_status_string(12345), "unknown gpupool_status") == 0);
  /* Each status has its own description; the value after the last is unknown. */
  for (uint32_t a = GPUPOOL_SUCCESS; a <= GPUPOOL_ERROR_STREAM_CAPTURE; a++) {
    CHECK(strcmp(gpupool_status_string(a), "unknown gpupool_status") != 0);
    for (uint32_t b = GPUPOOL_SUCCESS; b < a; b++) {
      CHECK(strcmp(gpupool_status_string(a), gpupool_status_string(b)) != 0);
    }
  }
  CHECK(strcmp(gpupool_status_string(GPUPOOL_ERROR_STREAM_CAPTURE + 1), "unknown gpupool_status") == 0);
  CHECK(strlen(gpupool_version()) >= 5);
}

static void test_malloc_free(void) {
  void *p = NULL, *q = NULL;
  CHECK_OK(gpupool_malloc(&p, 1000, 0, NULL));
  CHECK(p != NULL && (uintptr_t)p % 512 == 0);
  CHECK_OK(gpupool_malloc(&q, 1000, 0, NULL));
  CHECK((char *)q == (char *)p + 1024);
  if (sim) memset(p, 0x5a, 1000);
  gpupool_stats_t s = stats(0);
  CHECK(s.allocation.all.current == 2);
  CHECK(s.allocated_bytes.small_pool.current == 2048);
  CHECK(s.requested_bytes.all.current == 2000);
  CHECK(s.reserved_bytes.all.current >= (int64_t)(2 * MIB));
  CHECK_OK(gpupool_free(p));
  CHECK_OK(gpupool_free(q));
  void *r = NULL;
  CHECK_OK(gpupool_malloc(&r, 1000, 0, NULL));
  CHECK(r == p); /* the cached block comes back */
  CHECK_OK(gpupool_free(r));
  CHECK_OK(gpupool_free(NULL));
}

static void test_size_zero_and_null_out(void) {
  void *p = (void *)0x1;
  CHECK_OK(gpupool_malloc(&p, 0, 0, NULL));
  CHECK(p == NULL);
  CHECK(gpupool_malloc(NULL, 64, 0, NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strstr(gpupool_last_error_message(), "NULL") != NULL);
  CHECK(starts_with(gpupool_last_error_message(), "gpupool_malloc: ptr is NULL"));
  p = (void *)0x1;
  CHECK(gpupool_malloc(&p, SIZE_MAX - 7, 0, NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strstr(gpupool_last_error_message(), "overflows") != NULL);
  CHECK(message_from("gpupool_malloc"));
  CHECK(p == (void *)0x1); /* outputs are written only on success */
}

static void test_bad_pointers(void) {
  void *p = NULL, *q = NULL;
  int local = 0;
  CHECK_OK(gpupool_malloc(&p, 4096, 0, NULL));
  CHECK_OK(gpupool_malloc(&q, 4096, 0, NULL));
  CHECK_OK(gpupool_free(q));
  gpupool_stats_t before = stats(0);
  CHECK(gpupool_free(&local) == GPUPOOL_ERROR_INVALID_POINTER);
  CHECK(strstr(gpupool_last_error_message(), "not allocated by gpupool") != NULL);
  CHECK(message_from("gpupool_free"));
  CHECK(gpupool_free((char *)p + 8) == GPUPOOL_ERROR_INVALID_POINTER);
  CHECK(strstr(gpupool_last_error_message(), "8 bytes inside the block") != NULL);
  CHECK(gpupool_free(q) == GPUPOOL_ERROR_INVALID_POINTER);
  CHECK(strstr(gpupool_last_error_message(), "double free") != NULL);
  CHECK(gpupool_record_stream(q, NULL) == GPUPOOL_ERROR_INVALID_POINTER);
  CHECK(message_from("gpupool_record_stream"));
  gpupool_stats_t after = stats(0);
  CHECK(memcmp(&before.allocation, &after.allocation, sizeof before.allocation) == 0);
  CHECK(memcmp(&before.inactive_split, &after.inactive_split, sizeof before.inactive_split) == 0);
  CHECK_OK(gpupool_free(p));
}

static void test_devices(void) {
  int count = 0;
  CHECK_OK(gpupool_device_count(&count));
  CHECK(count >= 1);
  CHECK(gpupool_device_count(NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(starts_with(gpupool_last_error_message(), "gpupool_device_count: count is NULL"));
  void *p = NULL;
  CHECK(gpupool_malloc(&p, 64, count, NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strstr(gpupool_last_error_message(), "out of range") != NULL);
  CHECK(gpupool_malloc(&p, 64, -2, NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  CHECK(gpupool_stats(count, &s) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_empty_cache(count) == GPUPOOL_ERROR_INVALID_VALUE);

  int target = (sim && count > 1) ? 1 : 0;
  if (sim) CHECK_OK(gpupool_sim_set_device(target));
  int64_t before = stats(target).allocation.all.current;
  CHECK_OK(gpupool_malloc(&p, 3 * MIB, -1, NULL));
  CHECK(stats(target).allocation.all.current == before + 1);
  CHECK(stats(-1).allocation.all.current == before + 1);
  CHECK_OK(gpupool_free(p));
  if (sim) {
    CHECK_OK(gpupool_sim_set_device(0));
    CHECK(gpupool_sim_set_device(count) == GPUPOOL_ERROR_INVALID_VALUE);
    CHECK(message_from("gpupool_sim_set_device"));
  }
}

static void test_stats_struct(void) {
  gpupool_stats_t s;
  memset(&s, 0xab, sizeof s);
  s.size = 4;
  CHECK(gpupool_stats(0, &s) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_stats(0, NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(starts_with(gpupool_last_error_message(), "gpupool_stats: out is NULL"));
  /* The settle count: an out-pointer, a device in range; a new peak settles once. */
  int64_t settles = -1, later = -1;
  CHECK(gpupool_peak_settles(0, NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(starts_with(gpupool_last_error_message(), "gpupool_peak_settles: settles is NULL"));
  CHECK(gpupool_peak_settles(1 << 20, &settles) == GPUPOOL_ERROR_INVALID_VALUE && settles == -1);
  CHECK_OK(gpupool_peak_settles(0, &settles));
  CHECK(settles >= 0);
  void *big = NULL;
  CHECK_OK(gpupool_malloc(&big, (size_t)512 * MIB, 0, NULL));
  CHECK_OK(gpupool_peak_settles(0, &later));
  CHECK(later == settles + 1);
  CHECK_OK(gpupool_free(big));
  /* An older caller that knows only the header and `allocation`. */
  memset(&s, 0xab, sizeof s);
  s.size = (uint32_t)(offsetof(gpupool_stats_t, segment));
  CHECK_OK(gpupool_stats(0, &s));
  CHECK(s.size == offsetof(gpupool_stats_t, segment));
  CHECK(s.version == GPUPOOL_STATS_VERSION);
  CHECK(s.allocation.all.current >= 0);
  unsigned char *tail = (unsigned char *)&s.segment;
  CHECK(tail[0] == 0xab && tail[sizeof s.segment - 1] == 0xab); /* untouched */
  /* A caller built against version 1 of the struct, which ended at `max_split_size`. */
  memset(&s, 0xab, sizeof s);
  s.size = (uint32_t)(offsetof(gpupool_stats_t, unmapped_held_bytes));
  CHECK_OK(gpupool_stats(0, &s));
  CHECK(s.size == offsetof(gpupool_stats_t, unmapped_held_bytes) && s.max_split_size > 0);
  tail = (unsigned char *)&s.unmapped_held_bytes;
  CHECK(tail[0] == 0xab && tail[sizeof s.unmapped_held_bytes - 1] == 0xab); /* untouched */
  s = stats(0);
  CHECK(s.size == sizeof(gpupool_stats_t));
  CHECK(s.max_split_size > 0);
  CHECK(s.version == 4 && s.unmapped_held_bytes.current == 0 && s.sleeping_bytes.current == 0);
  CHECK(s.pool_limit == INT64_MAX);
}

static void test_summary(void) {
  size_t needed = 0;
  CHECK_OK(gpupool_memory_summary(0, NULL, 0, &needed));
  CHECK(needed > 1000);
  char small[16];
  memset(small, 'x', sizeof small);
  size_t small_needed = 0;
  CHECK(gpupool_memory_summary(0, small, sizeof small, &small_needed) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strstr(gpupool_last_error_message(), "needs") != NULL);
  CHECK(message_from("gpupool_memory_summary"));
  /* The one output written on failure: the size, as snprintf returns it. */
  CHECK(small_needed == needed);
  CHECK(small[0] == 'x' && small[sizeof small - 1] == 'x'); /* the buffer is untouched */
  /* snprintf's two-call idiom: a buffer too small, then one of the size asked for. */
  size_t want = 0;
  char one[1] = {'x'};
  CHECK(gpupool_memory_summary(0, one, sizeof one, &want) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(one[0] == 'x');
  char *exact = malloc(want);
  CHECK(exact != NULL);
  if (exact != NULL) {
    size_t again = 0;
    CHECK_OK(gpupool_memory_summary(0, exact, want, &again));
    CHECK(again == want && strlen(exact) + 1 == want);
    free(exact);
  }
  char *buf = malloc(needed + 256);
  CHECK_OK(gpupool_memory_summary(0, buf, needed + 256, &needed));
  CHECK(strstr(buf, "Allocated memory") != NULL);
  CHECK(strstr(buf, "GPU reserved memory") != NULL);
  CHECK(strlen(buf) + 1 == needed);
  free(buf);
  CHECK(gpupool_memory_summary(0, NULL, 0, NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(message_from("gpupool_memory_summary"));
}

static void test_record_stream_sim(void) {
  gpupool_stream_t a = (gpupool_stream_t)(uintptr_t)0x1000;
  gpupool_stream_t b = (gpupool_stream_t)(uintptr_t)0x2000;
  void *p = NULL, *q = NULL, *r = NULL;
  CHECK_OK(gpupool_malloc(&p, 2 * MIB, 0, a));
  CHECK_OK(gpupool_record_stream(p, b));
  CHECK_OK(gpupool_sim_hold_stream(b));
  CHECK_OK(gpupool_free(p));
  CHECK_OK(gpupool_malloc(&q, 2 * MIB, 0, a));
  CHECK(q != p); /* b may still be using p */
  CHECK_OK(gpupool_free(q));
  uint64_t waits = 99;
  CHECK_OK(gpupool_sim_stream_waits(b, &waits));
  CHECK(waits == 0); /* nothing waited for b's held work */
  CHECK(gpupool_sim_stream_waits(b, NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(message_from("gpupool_sim_stream_waits"));
  CHECK_OK(gpupool_sim_release_stream(b));
  CHECK_OK(gpupool_malloc(&r, 2 * MIB, 0, a));
  CHECK(r == p); /* b has passed the free */
  CHECK_OK(gpupool_free(r));
}

static void test_out_of_memory(void) {
  void *p = (void *)0x1;
  int64_t ooms = stats(0).num_ooms;
  CHECK(gpupool_malloc(&p, (size_t)1 << 50, 0, NULL) == GPUPOOL_ERROR_OUT_OF_MEMORY);
  const char *msg = gpupool_last_error_message();
  CHECK(starts_with(msg, "gpupool_malloc: CUDA out of memory. Tried to allocate"));
  CHECK(strstr(msg, "total capacity of") != NULL);
  CHECK(strstr(msg, "reserved by gpupool but unallocated") != NULL);
  CHECK(p == (void *)0x1);
  CHECK(stats(0).num_ooms == ooms + 1);
}

static void test_memory_fraction(void) {
  void *p = (void *)0x1;
  CHECK(gpupool_set_memory_fraction(1.5, 0) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strstr(gpupool_last_error_message(), "from 0 to 1") != NULL);
  CHECK(gpupool_set_memory_fraction(0.5, 99) == GPUPOOL_ERROR_INVALID_VALUE);
  /* Nothing more may be reserved: a new segment fails as out of memory, naming the limit. */
  CHECK_OK(gpupool_set_memory_fraction(0.0, 0));
  CHECK(gpupool_malloc(&p, 64 * MIB, 0, NULL) == GPUPOOL_ERROR_OUT_OF_MEMORY);
  CHECK(strstr(gpupool_last_error_message(), "memory fraction") != NULL);
  CHECK(p == (void *)0x1);
  CHECK_OK(gpupool_set_memory_fraction(1.0, 0));
  CHECK_OK(gpupool_malloc(&p, 64 * MIB, 0, NULL));
  CHECK_OK(gpupool_free(p));
}

/* The functions CUDAPluggableAllocator and its hooks call, with PyTorch's signatures. */
static void test_torch_hooks(void) {
  int devices = 0;
  CHECK_OK(gpupool_device_count(&devices));
  gpupool_torch_init(devices);
  int64_t live = stats(0).allocation.all.current;
  void *p = gpupool_torch_malloc(4096, 0, NULL);
  CHECK(p != NULL);
  CHECK(stats(0).allocation.all.current == live + 1);
  gpupool_torch_record_stream(p, NULL); /* the allocating stream: nothing to wait for */
  gpupool_torch_free(p, 4096, 0, NULL);
  CHECK(stats(0).allocation.all.current == live);
  CHECK(gpupool_torch_malloc(0, 0, NULL) == NULL);
  /* A failure cannot be returned: it goes to stderr and to the last error message. */
  gpupool_torch_free((void *)0x10, 16, 0, NULL);
  CHECK(strstr(gpupool_last_error_message(), "not allocated by gpupool") != NULL);
  CHECK(message_from("gpupool_torch_free"));
  gpupool_torch_set_memory_fraction(1.0, 0);
  gpupool_torch_empty_cache();
  CHECK(stats(0).reserved_bytes.all.current == 0);
}

/* Whether the configuration in force has expandable segments (gpupool's default). */
static int expandable(void) {
  char buf[1024];
  CHECK_OK(gpupool_config_string(buf, sizeof buf, NULL));
  return strstr(buf, "expandable_segments:True") != NULL;
}

static void test_empty_cache(void) {
  CHECK_OK(gpupool_empty_cache(-1));
  gpupool_stats_t s = stats(0);
  CHECK(s.reserved_bytes.all.current == 0);
  CHECK(s.active.all.current == 0);
  /* One free per segment allocated; an expandable segment's growths and unmaps need not pair
   * (PyTorch counts them as it maps and unmaps runs of pages). */
  if (!expandable()) CHECK(s.num_device_free == s.num_device_alloc);
  CHECK_OK(gpupool_reset_peak_stats(0));
  CHECK(stats(0).reserved_bytes.all.peak == 0);
}

/* The largest request that would succeed: bad arguments are refused and change nothing; on
 * the simulated device (1 GiB, nothing reserved now) the answer is exact. */
static void test_largest_allocatable(void) {
  int count = 0;
  CHECK_OK(gpupool_device_count(&count));
  gpupool_stats_t before = stats(0);
  size_t bytes = 12345;
  CHECK(gpupool_largest_allocatable(0, NULL, NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(starts_with(gpupool_last_error_message(), "gpupool_largest_allocatable: bytes is NULL"));
  CHECK(gpupool_largest_allocatable(count, NULL, &bytes) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(message_from("gpupool_largest_allocatable"));
  CHECK(strstr(gpupool_last_error_message(), "out of range") != NULL);
  CHECK(gpupool_largest_allocatable(-2, NULL, &bytes) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(bytes == 12345);
  CHECK_OK(gpupool_largest_allocatable(0, NULL, &bytes));
  CHECK(bytes > 0 && bytes % 512 == 0);
  gpupool_stats_t after = stats(0);
  CHECK(memcmp(&before, &after, sizeof before) == 0);
  if (!sim) return;
  void *p = NULL;
  if (expandable()) {
    /* A growth the device has no room for in 20 MiB pages is tried in 2 MiB ones last (the
     * page by rounding, docs/fragmentation.md): the whole 1 GiB maps, and one byte more does
     * not. */
    CHECK(bytes == (size_t)1 << 30);
    CHECK_OK(gpupool_malloc(&p, bytes, 0, NULL));
    CHECK_OK(gpupool_free(p));
    CHECK(gpupool_malloc(&p, bytes + 1, 0, NULL) == GPUPOOL_ERROR_OUT_OF_MEMORY);
    CHECK_OK(gpupool_empty_cache(0));
    /* 512 MiB live on the default stream in 26 pages of 20 MiB (in 2 MiB pages it would take
     * 256, past the 64 a growth maps of them): 504 MiB, 252 pages of 2 MiB, are left for
     * another stream. */
    CHECK_OK(gpupool_malloc(&p, 512 * MIB, 0, NULL));
    CHECK_OK(gpupool_largest_allocatable(0, (gpupool_stream_t)0x51, &bytes));
    CHECK(bytes == 504 * MIB);
    CHECK_OK(gpupool_free(p));
    CHECK_OK(gpupool_empty_cache(0));
    return;
  }
  CHECK(bytes == (size_t)1 << 30);
  CHECK_OK(gpupool_malloc(&p, bytes, 0, NULL));
  CHECK_OK(gpupool_free(p));
  CHECK(gpupool_malloc(&p, bytes + 1, 0, NULL) == GPUPOOL_ERROR_OUT_OF_MEMORY);
  /* Cached on the default stream: another stream counts it as what release-and-retry frees. */
  CHECK_OK(gpupool_malloc(&p, 512 * MIB, 0, NULL));
  CHECK_OK(gpupool_largest_allocatable(0, (gpupool_stream_t)0x51, &bytes));
  CHECK(bytes == 512 * MIB);
  CHECK_OK(gpupool_free(p));
  CHECK_OK(gpupool_largest_allocatable(0, (gpupool_stream_t)0x51, &bytes));
  CHECK(bytes == (size_t)1 << 30);
  CHECK_OK(gpupool_empty_cache(0));
}

int main(void) {
  const char *driver = getenv("GPUPOOL_DRIVER");
  sim = driver != NULL && strcmp(driver, "sim") == 0;
  test_strings();
  test_malloc_free();
  test_size_zero_and_null_out();
  test_bad_pointers();
  test_devices();
  test_stats_struct();
  test_summary();
  if (sim) test_record_stream_sim();
  test_out_of_memory();
  test_memory_fraction();
  test_torch_hooks();
  test_empty_cache();
  test_largest_allocatable();
  return checks_report(sim ? "test_api (sim)" : "test_api (cuda)");
}
