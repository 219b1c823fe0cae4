/* hello: allocate, free, read the statistics and print the summary.
 *
 *   GPUPOOL_DRIVER=sim ./hello      on any machine (the simulated device)
 *   ./hello                         on a machine with an NVIDIA GPU
 */
#include <stdio.h>
#include <stdlib.h>

#include "gpupool.h"

#define TRY(call)                                                                            \
  do {                                                                                       \
    gpupool_status s_ = (call);                                                              \
    if (s_ != GPUPOOL_SUCCESS) {                                                             \
      fprintf(stderr, "%s failed: %s: %s\n", #call, gpupool_status_string(s_),               \
              gpupool_last_error_message());                                                 \
      return 1;                                                                              \
    }                                                                                        \
  } while (0)

int main(void) {
  int devices = 0;
  TRY(gpupool_device_count(&devices));
  printf("gpupool %s, %d device(s)\n", gpupool_version(), devices);

  /* A few allocations of different sizes on the default stream of the current device. */
  size_t sizes[] = {1000, 64 << 10, 3 << 20, 40 << 20};
  void *ptrs[4];
  for (int i = 0; i < 4; i++) TRY(gpupool_malloc(&ptrs[i], sizes[i], -1, NULL));
  for (int i = 0; i < 4; i++) TRY(gpupool_free(ptrs[i]));
  /* The same sizes again: every one a cache hit, no driver call. */
  for (int i = 0; i < 4; i++) TRY(gpupool_malloc(&ptrs[i], sizes[i], -1, NULL));

  gpupool_stats_t st = GPUPOOL_STATS_INIT;
  TRY(gpupool_stats(-1, &st));
  printf("allocated %lld bytes in %lld blocks; reserved %lld bytes in %lld segments; "
         "%lld device allocations\n",
         (long long)st.allocated_bytes.all.current, (long long)st.allocation.all.current,
         (long long)st.reserved_bytes.all.current, (long long)st.segment.all.current,
         (long long)st.num_device_alloc);

  size_t needed = 0;
  TRY(gpupool_memory_summary(-1, NULL, 0, &needed));
  char *text = malloc(needed + 256);
  TRY(gpupool_memory_summary(-1, text, needed + 256, NULL));
  fputs(text, stdout);
  free(text);

  for (int i = 0; i < 4; i++) TRY(gpupool_free(ptrs[i]));
  TRY(gpupool_empty_cache(-1));
  TRY(gpupool_stats(-1, &st));
  printf("after empty_cache: reserved %lld bytes\n", (long long)st.reserved_bytes.all.current);
  return st.reserved_bytes.all.current == 0 ? 0 : 1;
}
