/* A deterministic soak of the C API on the simulated device (GPUPOOL_DRIVER=sim, whose device
 * memory is host memory: every pointer can be written and read back).
 *
 *   test_soak [OPS [THREADS]]         (or GPUPOOL_SOAK_OPS, GPUPOOL_SOAK_THREADS, GPUPOOL_SOAK_SEED)
 *
 * OPS operations in all (default 1000000), spread over THREADS worker threads (default 8). Each
 * worker draws its operations from its own seeded generator, so the sequence of each thread
 * is the same from run to run (the interleaving is not). A worker allocates on its own three
 * streams and on four shared side streams, on every simulated device; writes a cookie into
 * the first and last bytes of every block and checks it when the block is freed; calls
 * gpupool_record_stream onto other threads' streams, the side streams and the NULL stream;
 * hands blocks to other threads to free; holds and releases side streams
 * (gpupool_sim_hold_stream), so that blocks freed after being used there await their events;
 * frees each block once, and mixes in double frees, frees and record_stream calls of interior
 * and freed pointers and of a stack address, which must all return
 * GPUPOOL_ERROR_INVALID_POINTER and change nothing.
 *
 * Workers also allocate and free pinned host memory (gpupool_host_*): cookies checked at each
 * free, blocks freed by other threads, events named, frees inside a block refused; the pinned
 * statistics are checked with the device's, and at the end every pinned block is free and,
 * after gpupool_host_empty_cache, given back.
 *
 * A shared index of address ranges (a sorted array under a mutex) holds every live block and
 * every freed block whose record_stream events cannot have completed (used on a held side
 * stream, not yet released): a block handed out that overlaps either is an error.
 *
 * Each worker also routes its allocations on one device to a private pool of its own for a
 * while (gpupool_begin_allocate_to_pool_thread, PyTorch's use_mem_pool), ends the route, and
 * now and then releases the pool with blocks of it still live (some in other threads'
 * mailboxes), which then go back to the driver as they are freed, and takes a new pool.
 *
 * With expandable segments (whose growths and shrinks need not pair up, so that the check of
 * segments allocated against freed holds only without them), a sleeper thread keeps a few
 * blocks of its own in a sleepable private pool on device 0, and
 * puts the pool to sleep and wakes it in a loop while the workers run (gpupool_sleep with
 * offload three times in four, once of them into the pinned copy the pool keeps, discard the
 * fourth), while another thread frees a block of the pool at a moment anywhere in the sleep
 * and empties the cache: allocating from the sleeping pool must be
 * refused, and after an offload every byte of its blocks must be back (a wake the device
 * cannot serve yet is retried).
 *
 * Workers ask for the mapped range around a byte of a live block now and then, as a transport
 * does to register it (gpupool_segment_mapped_range, a dma-buf one time in four): the block
 * must lie in it, whatever other threads allocate, free and release meanwhile.
 *
 * A concurrent thread reads gpupool_stats of every device in a loop and checks each snapshot
 * (current <= peak, allocated - freed == current, all == small + large, all.peak <=
 * small.peak + large.peak), and calls gpupool_reset_peak_stats, gpupool_memory_summary,
 * gpupool_largest_allocatable and gpupool_empty_cache; the workers take and check a snapshot
 * every 64 operations too.
 *
 * At the end: everything freed, the cache emptied, every device's reserved, allocation,
 * active and requested figures are 0, and every statistic's allocated - freed == current.
 * Prints "soak: N ops, M threads: E errors" and exits 1 if E > 0 (77, skipped, when another
 * driver than the simulated one is selected). soak/soak.h lists the files of its parts. */
#define _POSIX_C_SOURCE 200809L

#include "soak/soak.h"

/* ---- main -------------------------------------------------------------------------------- */

static long arg_or_env(int argc, char **argv, int i, const char *env, long dflt) {
  const char *v = argc > i ? argv[i] : getenv(env);
  if (!v || !*v) return dflt;
  char *end;
  long n = strtol(v, &end, 10);
  if (*end || n <= 0) {
    fprintf(stderr, "soak: %s=%s is not a positive number\n", env, v);
    exit(2);
  }
  return n;
}

int main(int argc, char **argv) {
  const char *driver = getenv("GPUPOOL_DRIVER");
  if (driver && *driver && strcmp(driver, "sim") != 0) {
    printf("soak: skipped: needs the simulated device (GPUPOOL_DRIVER=sim), not %s\n", driver);
    return 77;
  }
  /* Defaults for the simulated device unless the caller set them: the soak's blocks and
   * caches fit many times over (pages are committed only where the cookies are written), so
   * no allocation runs out of memory and takes the release-and-retry path. */
  setenv("GPUPOOL_DRIVER", "sim", 1);
  setenv("GPUPOOL_SIM_CAPACITY", "64GiB", 0);
  setenv("GPUPOOL_SIM_DEVICES", "2", 0);

  long ops = arg_or_env(argc, argv, 1, "GPUPOOL_SOAK_OPS", 1000000);
  nthreads = (int)arg_or_env(argc, argv, 2, "GPUPOOL_SOAK_THREADS", 8);
  seed = (uint64_t)arg_or_env(argc, argv, 3, "GPUPOOL_SOAK_SEED", 1);
  if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
  ops_per_thread = (ops + nthreads - 1) / nthreads;

  int count = 0;
  if (gpupool_device_count(&count) != GPUPOOL_SUCCESS) {
    fprintf(stderr, "soak: gpupool_device_count: %s\n", gpupool_last_error_message());
    return 1;
  }
  ndevices = count < 2 ? count : 2;

  for (int t = 0; t < nthreads; t++) pthread_mutex_init(&mailboxes[t].lock, NULL);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  pthread_t workers[MAX_THREADS], stats, sleep_thread;
  char conf0[1024];
  size_t needed0 = 0;
  EXPECT_STATUS(gpupool_config_string(conf0, sizeof conf0, &needed0), GPUPOOL_SUCCESS);
  collects = strstr(conf0, "garbage_collection_threshold") != NULL;
  const int sleeps = strstr(conf0, "expandable_segments:True") != NULL;
  if (pthread_create(&stats, NULL, stats_thread, NULL) != 0) return 2;
  if (sleeps && pthread_create(&sleep_thread, NULL, sleeper, NULL) != 0) return 2;
  for (int t = 0; t < nthreads; t++)
    if (pthread_create(&workers[t], NULL, worker, (void *)(intptr_t)t) != 0) return 2;
  for (int t = 0; t < nthreads; t++) pthread_join(workers[t], NULL);
  pthread_join(stats, NULL);
  if (sleeps) pthread_join(sleep_thread, NULL);
  for (int t = 0; t < nthreads; t++) drain_mailbox(t);
  for (int k = 0; k < SIDE_STREAMS; k++) release_side(k);
  for (int i = 0; i < npinned_box; i++) pinned_free(&pinned_box[i]);
  npinned_box = 0;
  clock_gettime(CLOCK_MONOTONIC, &t1);

  /* Everything is freed: after empty_cache nothing may be left. */
  empty_cache(-1);
  char conf[1024];
  size_t needed = 0;
  EXPECT_STATUS(gpupool_config_string(conf, sizeof conf, &needed), GPUPOOL_SUCCESS);
  const int expandable = strstr(conf, "expandable_segments:True") != NULL;
  if (index_size() != 0) fail("%zu ranges left in the index after everything was freed", index_size());
  for (int d = 0; d < ndevices; d++) {
    gpupool_stats_t s = check_snapshot(d);
    const struct {
      const char *name;
      int64_t current;
    } zero[] = {
        {"reserved_bytes.all", s.reserved_bytes.all.current},
        {"segment.all", s.segment.all.current},
        {"allocation.all", s.allocation.all.current},
        {"allocated_bytes.all", s.allocated_bytes.all.current},
        {"active.all", s.active.all.current},
        {"active_bytes.all", s.active_bytes.all.current},
        {"requested_bytes.all", s.requested_bytes.all.current},
        {"inactive_split.all", s.inactive_split.all.current},
        {"oversize_allocations", s.oversize_allocations.current},
    };
    for (size_t i = 0; i < sizeof zero / sizeof zero[0]; i++)
      if (zero[i].current != 0)
        fail("device %d: %s.current is %" PRId64 " after everything was freed and the cache emptied", d,
             zero[i].name, zero[i].current);
    if (s.num_alloc_retries != 0 || s.num_ooms != 0)
      fail("device %d: %" PRId64 " retries and %" PRId64 " out-of-memory errors: raise GPUPOOL_SIM_CAPACITY", d,
           s.num_alloc_retries, s.num_ooms);
    /* Every byte obtained from the driver went back. With ordinary segments, also every
     * segment; an expandable segment's growths and shrinks (num_device_alloc, num_device_free,
     * as PyTorch counts them) need not pair up. */
    if (s.reserved_bytes.all.allocated != s.reserved_bytes.all.freed)
      fail("device %d: %" PRId64 " bytes reserved but %" PRId64 " given back", d, s.reserved_bytes.all.allocated,
           s.reserved_bytes.all.freed);
    if (!expandable && s.num_device_alloc != s.num_device_free)
      fail("device %d: %" PRId64 " segments allocated but %" PRId64 " freed", d, s.num_device_alloc,
           s.num_device_free);
  }
  /* Every pinned block freed: after the host's empty_cache (which polls the events of those a
   * stream was named for) none is in use, and none is held but the reserve segment's. */
  EXPECT_STATUS(gpupool_host_empty_cache(), GPUPOOL_SUCCESS);
  gpupool_host_stats_t h = GPUPOOL_HOST_STATS_INIT;
  EXPECT_STATUS(gpupool_host_stats(&h), GPUPOOL_SUCCESS);
  if (h.active_requests.current != 0 || h.active_bytes.current != 0)
    fail("host: %" PRId64 " blocks (%" PRId64 " bytes) still in use after everything was freed",
         h.active_requests.current, h.active_bytes.current);
  if (!strstr(conf, "pinned_reserve_segment_size_mb") && (h.allocations.current != 0 || h.allocated_bytes.current != 0))
    fail("host: %" PRId64 " blocks (%" PRId64 " bytes) still pinned after gpupool_host_empty_cache",
         h.allocations.current, h.allocated_bytes.current);
  double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
  printf("soak: %ld mallocs (%ld from private pools, %ld pools released), %ld frees (%ld by another thread), "
         "%ld record_stream, %ld holds/releases, %ld refused bad pointers, %ld statistics snapshots, %.2f s\n",
         atomic_load(&n_malloc), atomic_load(&n_pooled), atomic_load(&n_pool_releases), atomic_load(&n_free),
         atomic_load(&n_handed), atomic_load(&n_record), atomic_load(&n_hold), atomic_load(&n_bad),
         atomic_load(&snapshots), secs);
  printf("soak: %ld mapped ranges asked for\n", atomic_load(&n_ranges));
  printf("soak: %ld pinned mallocs (%ld freed by another thread, %ld with an event)\n", atomic_load(&n_pinned),
         atomic_load(&n_pinned_handed), atomic_load(&n_pinned_events));
  /* Every kind of operation ran, however few the operations (CTest runs the variants and
   * valgrind with fewer than the default): a count of 0 means a kind went untested. */
  const struct {
    const char *what;
    long n;
  } kinds[] = {
      {"mallocs", atomic_load(&n_malloc)},
      {"mallocs from private pools", atomic_load(&n_pooled)},
      {"pools released", atomic_load(&n_pool_releases)},
      {"frees", atomic_load(&n_free)},
      {"frees by another thread", atomic_load(&n_handed)},
      {"record_stream calls", atomic_load(&n_record)},
      {"holds and releases of side streams", atomic_load(&n_hold)},
      {"bad pointers refused", atomic_load(&n_bad)},
      {"mapped ranges asked", atomic_load(&n_ranges)},
      {"statistics snapshots", atomic_load(&snapshots)},
      {"pinned mallocs", atomic_load(&n_pinned)},
      {"pinned blocks freed by another thread", atomic_load(&n_pinned_handed)},
      {"pinned blocks with an event", atomic_load(&n_pinned_events)},
  };
  for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
    if (kinds[i].n == 0) fail("no %s: too few operations to cover every kind", kinds[i].what);
  printf("soak: %ld sleeps and wakes of a pool (%ld wakes retried for memory)\n", atomic_load(&n_sleeps),
         atomic_load(&n_wake_retries));
  /* Each of the sleeper's modes (offload, pinned, offload, discard) at least once. */
  if (sleeps && atomic_load(&n_sleeps) < 4) fail("the sleeper slept its pool %ld times, not every mode", atomic_load(&n_sleeps));
  long e = atomic_load(&errors);
  printf("soak: %ld ops, %d threads: %ld errors\n", ops_per_thread * nthreads, nthreads, e);
  index_destroy();
  return e == 0 ? 0 : 1;
}
