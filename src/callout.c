/* Calls out of gpupool into code that may end the calling thread: a program's callback (an
 * observer, a stream filter, a pool's allocator), CPython (PyGILState_Ensure ends a thread that
 * waits for the GIL while the interpreter finalises). See src/callout.rs for the design.
 *
 * glibc ends a thread (pthread_exit, or cancellation acted on) with a forced unwind, which runs
 * each frame's cleanups and never stops at a catch. Rust's catch_unwind catches it all the same
 * and, unable to rethrow it, aborts ("FATAL: exception not rethrown"), and gpupool's C entry
 * points catch panics with catch_unwind. So the unwind is stopped here, on its way out of the
 * callee, the way glibc itself stops it in C code without exceptions (pthread_cleanup_push's
 * jump buffer, registered with __pthread_register_cancel: the unwinder jumps to the innermost
 * one registered once it has unwound the frames below it), and gpupool finishes its call before
 * the unwind goes on (gpupool_continue_exit) from the entry point, outside every catch_unwind.
 *
 * Compiled with -fexceptions: a foreign exception that is no forced unwind (a C++ exception out
 * of a callback, which the header forbids) passes this frame with its buffer unregistered. */
#include <pthread.h>
#include <setjmp.h>

/* Exported by glibc (GLIBC_2.3.3) for pthread_cleanup_push in C without exceptions; declared by
 * <pthread.h> only when that macro needs them. */
extern void __pthread_register_cancel(__pthread_unwind_buf_t *buf);
extern void __pthread_unregister_cancel(__pthread_unwind_buf_t *buf);
extern void __pthread_unwind_next(__pthread_unwind_buf_t *buf) __attribute__((__noreturn__));

/* A frame of its own between the jump buffer and the callee: the unwinder jumps back once it
 * reaches a frame whose canonical frame address is the buffer's stack pointer, before running
 * that frame's cleanups, which are then this function's (none) and not the callee's. */
__attribute__((noinline)) static void call(void (*body)(void *), void *data) {
  body(data);
  __asm__ volatile("" ::: "memory"); /* no tail call: this frame must exist */
}

static void unregister(__pthread_unwind_buf_t **buf) { __pthread_unregister_cancel(*buf); }

/* Calls body(data). Returns 0 when it returned, 1 when the calling thread's exit or cancellation
 * left it: its frames' cleanups have run, and the exit waits for gpupool_continue_exit. */
int gpupool_callout(void (*body)(void *), void *data) {
  __pthread_unwind_buf_t buf;
  /* As pthread_cleanup_push does: the buffer is shorter than a jmp_buf, and with no signal
   * mask saved (0) only their common start is written, which GCC 11 and later cannot tell. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#endif
  int stopped = __sigsetjmp((struct __jmp_buf_tag *)(void *)buf.__cancel_jmp_buf, 0);
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
  if (stopped) {
    __pthread_unregister_cancel(&buf);
    return 1;
  }
  __pthread_register_cancel(&buf);
  {
    __pthread_unwind_buf_t *registered __attribute__((cleanup(unregister))) = &buf;
    call(body, data);
  }
  return 0;
}

/* Goes on with the exit gpupool_callout stopped, from the caller's frame: the unwind runs the
 * cleanups of every frame from here out (gpupool's entry point, the program's) to the jump
 * buffer registered before the stopped one (a pthread_cleanup_push of the program's, or the
 * thread's start), as it would have without the stop. Never returns. */
void gpupool_continue_exit(void) {
  __pthread_unwind_buf_t buf;
  /* Registered and unregistered at once: that leaves the thread as it was, and `buf` holding
   * the buffer registered before it, which is all __pthread_unwind_next reads. */
  __pthread_register_cancel(&buf);
  __pthread_unregister_cancel(&buf);
  __pthread_unwind_next(&buf);
}

/* Disables cancellation for the calling thread; returns its state before (for
 * gpupool_cancel_restore): gpupool's own code reaches cancellation points that an unwind must
 * not cross. */
int gpupool_cancel_disable(void) {
  int old = PTHREAD_CANCEL_ENABLE;
  pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &old);
  return old;
}

/* Sets the calling thread's cancellation state back to `old` (from gpupool_cancel_disable). */
void gpupool_cancel_restore(int old) {
  int ignored;
  pthread_setcancelstate(old, &ignored);
}
