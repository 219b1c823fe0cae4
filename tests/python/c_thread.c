/* For tests/python/test_python_frames.py: calls an allocation function on a thread that C
 * started and Python never saw (no Python thread state), as a C++ engine's thread would. Takes
 * gpupool_malloc's address from the caller, so that it needs no header and no link. */
#include <pthread.h>
#include <stddef.h>

typedef int (*malloc_fn)(void **out, size_t size, int device, void *stream);

struct call {
  malloc_fn fn;
  void **out;
  size_t size;
  int status;
};

static void *run(void *arg) {
  struct call *c = arg;
  c->status = c->fn(c->out, c->size, 0, NULL);
  return NULL;
}

/* fn(out, size, 0, NULL) on a new thread, joined; its status, or -1 when no thread started. */
int alloc_on_c_thread(void *fn, size_t size, void **out) {
  struct call c = {0};
  pthread_t t;
  *(void **)&c.fn = fn;
  c.out = out;
  c.size = size;
  c.status = -1;
  if (pthread_create(&t, NULL, run, &c) != 0) return -1;
  pthread_join(t, NULL);
  return c.status;
}
