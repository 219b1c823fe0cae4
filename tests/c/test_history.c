/* The allocation history from C: recorded from the start (GPUPOOL_RECORD_HISTORY=1000:all, set
 * by CMake), a snapshot dumped in PyTorch's pickle (its protocol header, its keys and every
 * action of the calls made, found in the file), metadata and annotations, a snapshot without
 * traces, the settings changed and stopped, and the errors. On the simulated device, and on the GPU with GPUPOOL_TEST_DRIVER=cuda. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "gpupool.h"

static char file[1 << 20];
static size_t file_len;

/* Dumps a snapshot to `path`, with its traces or not, and reads it into `file`. */
static int dump_with(const char *path, int traces) {
  if (gpupool_dump_snapshot_with(path, traces) != GPUPOOL_SUCCESS) return 0;
  FILE *f = fopen(path, "rb");
  if (!f) return 0;
  file_len = fread(file, 1, sizeof file, f);
  fclose(f);
  return file_len > 2;
}

static int dump(const char *path) { return dump_with(path, 1); }

/* Whether the dumped file holds the string `s` (the pickle writes its strings as they are). */
static int has(const char *s) { return memmem(file, file_len, s, strlen(s)) != NULL; }

int main(void) {
  char path[] = "/tmp/gpupool-history-XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  close(fd);

  void *a = NULL, *b = NULL;
  CHECK_OK(gpupool_malloc(&a, 1000, 0, NULL));
  CHECK_OK(gpupool_malloc(&b, 3 << 20, 0, NULL));
  CHECK_OK(gpupool_free(a));
  CHECK(dump(path));
  /* Pickle protocol 4, as CPython's pickle writes it and PyTorch's viewer reads it. */
  CHECK(file_len < sizeof file && (unsigned char)file[0] == 0x80 && file[1] == 4 && file[file_len - 1] == '.');
  CHECK(has("segments") && has("device_traces") && has("allocator_settings") && has("blocks"));
  /* gpupool's default segments are expandable: they map pages (PyTorch's segment_map). */
  CHECK(has("segment_map") && has("alloc") && has("free_requested") && has("free_completed"));
  CHECK(has("active_allocated") && has("inactive") && has("snapshot"));
  CHECK(has("segment_pool_id") && has("frames") && has("time_us"));

  /* Metadata on this thread's events, an annotation of a live block, a snapshot without
   * traces (PyTorch's _set_memory_metadata, _annotate_memory, include_traces=False). */
  void *c = NULL;
  CHECK_OK(gpupool_set_memory_metadata("{\"phase\":\"from C\"}"));
  CHECK_OK(gpupool_malloc(&c, 4096, 0, NULL));
  CHECK(gpupool_set_memory_metadata("{\"phase\":") == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strstr(gpupool_last_error_message(), "not valid JSON") != NULL);
  CHECK_OK(gpupool_set_memory_metadata(NULL));
  CHECK_OK(gpupool_annotate_memory(c, "annotated from C"));
  CHECK(gpupool_annotate_memory((char *)c + 8, "inside") == GPUPOOL_ERROR_INVALID_POINTER);
  CHECK(dump(path));
  CHECK(has("user_metadata") && has("{\"phase\":\"from C\"}") && has("annotate") && has("annotated from C"));
  CHECK(dump_with(path, 0));
  CHECK(has("segments") && has("active_allocated") && !has("free_requested") && !has("annotated from C"));
  CHECK_OK(gpupool_free(c));
  CHECK(gpupool_annotate_memory(c, "freed") == GPUPOOL_ERROR_INVALID_POINTER);

  /* Fewer events, no stacks; then stopped: the trace is forgotten, the segments stay. */
  CHECK_OK(gpupool_record_history(1, 1, GPUPOOL_HISTORY_CONTEXT_NONE));
  CHECK(dump(path));
  CHECK(!has("segment_alloc") && has("snapshot"));
  CHECK_OK(gpupool_record_history(0, 0, 0));
  CHECK(dump(path));
  CHECK(!has("snapshot") && !has("free_requested") && has("active_allocated"));

  /* Errors change nothing. */
  CHECK(gpupool_record_history(1, 10, 4) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strstr(gpupool_last_error_message(), "gpupool_record_history: context 4") != NULL);
  CHECK(gpupool_dump_snapshot(NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_dump_snapshot("/nonexistent-dir/x.pickle") == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strstr(gpupool_last_error_message(), "/nonexistent-dir/x.pickle") != NULL);

  CHECK_OK(gpupool_free(b));
  unlink(path);
  return checks_report("test_history");
}
