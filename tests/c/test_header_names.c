/* gpupool's headers beside a program's own names: the names of gpupool's Rust core, and
 * common words, defined by the program before and after the headers. A header that declared
 * any of them (a typedef of another type, a macro) would fail to compile here under -Wall
 * -Wextra -Wpedantic -Werror. Compiled as C11, and as C++17 by test_header_names.cpp. Each
 * header is included twice, and the others include gpupool.h again. */

/* Before the headers: the core's names, as they were once exported by mistake. */
typedef int BlockId;
#define NIL 0
#define MIN_BLOCK_SIZE 0
#define SMALL_SIZE 0
#define SMALL_BUFFER 0
#define LARGE_BUFFER 0
#define MIN_LARGE_ALLOC 0
#define ROUND_LARGE 0
typedef int Stat;
typedef int StatArray;
typedef int DeviceStats;
typedef int Allocator;
typedef int Error;
typedef int Config;
#define HEADER 0

#include "gpupool.h"
#include "gpupool_testing.h"
#include "gpupool_torch.h"
#include "gpupool_plugins.h"
#include "gpupool_ipc.h"
#include "gpupool.h"
#include "gpupool_testing.h"
#include "gpupool_torch.h"
#include "gpupool_plugins.h"
#include "gpupool_ipc.h"

/* After the headers: names a program may well use for itself. */
typedef int Block;
typedef int Segment;
typedef int Pool;
typedef int Arena;
typedef int Runtime;
typedef int Out;
#define MESSAGE_CAPACITY 0
#define TRUNCATED 0
#define SUCCESS 0
#define INVALID_VALUE 0
#define OUT_OF_MEMORY 0

int main(void) {
  BlockId block = NIL;
  Stat stat = MIN_BLOCK_SIZE + SMALL_SIZE + SMALL_BUFFER + LARGE_BUFFER + MIN_LARGE_ALLOC + ROUND_LARGE + HEADER;
  Block b = MESSAGE_CAPACITY + TRUNCATED + SUCCESS + INVALID_VALUE + OUT_OF_MEMORY;
  gpupool_stats_t s = GPUPOOL_STATS_INIT;
  gpupool_host_stats_t hs = GPUPOOL_HOST_STATS_INIT;
  gpupool_status status = GPUPOOL_SUCCESS;
  /* Every function of the four headers is named, so a missing declaration fails too
   * (void (*)(void) is the type a function pointer may be cast to without a warning). */
  typedef void (*any_fn)(void);
  any_fn fns[] = {
      (any_fn)gpupool_malloc,
      (any_fn)gpupool_free,
      (any_fn)gpupool_record_stream,
      (any_fn)gpupool_stream_retire,
      (any_fn)gpupool_empty_cache,
      (any_fn)gpupool_device_count,
      (any_fn)gpupool_set_memory_fraction,
      (any_fn)gpupool_largest_allocatable,
      (any_fn)gpupool_attach_oom_observer,
      (any_fn)gpupool_detach_oom_observer,
      (any_fn)gpupool_oom_retry,
      (any_fn)gpupool_attach_segment_observer,
      (any_fn)gpupool_detach_segment_observer,
      (any_fn)gpupool_record_history,
      (any_fn)gpupool_dump_snapshot,
      (any_fn)gpupool_push_tag,
      (any_fn)gpupool_pop_tag,
      (any_fn)gpupool_tag_stats,
      (any_fn)gpupool_for_each_tag,
      (any_fn)gpupool_live_report,
      (any_fn)gpupool_stats,
      (any_fn)gpupool_reset_peak_stats,
      (any_fn)gpupool_peak_settles,
      (any_fn)gpupool_memory_summary,
      (any_fn)gpupool_host_malloc,
      (any_fn)gpupool_host_free,
      (any_fn)gpupool_host_record_event,
      (any_fn)gpupool_host_empty_cache,
      (any_fn)gpupool_host_stats,
      (any_fn)gpupool_host_reset_peak_stats,
      (any_fn)gpupool_set_config,
      (any_fn)gpupool_config_string,
      (any_fn)gpupool_last_error_message,
      (any_fn)gpupool_status_string,
      (any_fn)gpupool_version,
      (any_fn)gpupool_pool_create,
      (any_fn)gpupool_pool_create_with_allocator,
      (any_fn)gpupool_pool_create_with_allocator_aligned,
      (any_fn)gpupool_begin_allocate_to_pool,
      (any_fn)gpupool_begin_allocate_to_pool_thread,
      (any_fn)gpupool_begin_allocate_to_pool_filter,
      (any_fn)gpupool_end_allocate_to_pool,
      (any_fn)gpupool_release_pool,
      (any_fn)gpupool_pool_stats,
      (any_fn)gpupool_sim_hold_stream,
      (any_fn)gpupool_sim_release_stream,
      (any_fn)gpupool_sim_stream_waits,
      (any_fn)gpupool_sim_set_device,
      (any_fn)gpupool_sim_host_pinned,
      (any_fn)gpupool_sim_begin_capture,
      (any_fn)gpupool_sim_end_capture,
      (any_fn)gpupool_sim_invalidate_capture,
      (any_fn)gpupool_torch_malloc,
      (any_fn)gpupool_cupy_malloc,
      (any_fn)gpupool_cupy_free,
      (any_fn)gpupool_cupy_hook_malloc,
      (any_fn)gpupool_cupy_hook_free,
      (any_fn)gpupool_ort_alloc,
      (any_fn)gpupool_ort_free,
      (any_fn)gpupool_ort_empty_cache,
      (any_fn)gpupool_ort_set_stream,
      (any_fn)gpupool_ipc_export,
      (any_fn)gpupool_ipc_import,
      (any_fn)gpupool_ipc_close,
      (any_fn)gpupool_ipc_reclaim,
      (any_fn)gpupool_pool_create_sleepable,
      (any_fn)gpupool_sleep,
      (any_fn)gpupool_wake,
      (any_fn)gpupool_sleep_host_bytes,
      (any_fn)gpupool_sleep_release_kept,
      (any_fn)gpupool_torch_free,
      (any_fn)gpupool_torch_record_stream,
      (any_fn)gpupool_torch_empty_cache,
      (any_fn)gpupool_torch_set_memory_fraction,
      (any_fn)gpupool_torch_init,
      (any_fn)gpupool_annotate_memory,
      (any_fn)gpupool_dump_snapshot_with,
      (any_fn)gpupool_enable_peer_access,
      (any_fn)gpupool_get_memory_metadata,
      (any_fn)gpupool_pool_get_limit,
      (any_fn)gpupool_pool_set_limit,
      (any_fn)gpupool_set_memory_metadata,
      (any_fn)gpupool_sleep_prepare,
      (any_fn)gpupool_pool_create_ex,
  };
  int present = 0;
  for (unsigned i = 0; i < sizeof fns / sizeof fns[0]; i++) present += fns[i] != 0;
  return (block + stat + b + (int)status + (s.size == sizeof s ? 0 : 1) + (hs.size == sizeof hs ? 0 : 1) + (present == (int)(sizeof fns / sizeof fns[0]) ? 0 : 1)) != 0;
}
