/* The storm of test_forced_unwind.c (forced_unwind_storm.c): waves of threads allocating and
 * freeing on shared streams, ended at random inside their segment observers. */
#ifndef GPUPOOL_FORCED_UNWIND_STORM_H
#define GPUPOOL_FORCED_UNWIND_STORM_H

#include <stdint.h>

/* Set on a storm thread: the segment observer ends it now and then (next_random). */
extern _Thread_local int storm_thread;
/* The storm thread's next random number. */
uint64_t next_random(void);
/* Counts an end asked for by the segment observer. */
void storm_count_end(void);
/* Runs `waves` waves of storm threads, then checks and frees what each ended thread held;
 * adds its checks' counts to `*failed` and `*passed`. */
void storm(int waves, int *failed, int *passed);

#endif
