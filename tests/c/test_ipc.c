/* Device memory shared between processes (gpupool_ipc.h), through the C API: a producer (this
 * process) and two consumers, forked before anything touches gpupool or CUDA (CUDA does not
 * survive fork), talking over socketpairs. The same program runs under CTest on the simulated
 * device and on a GPU (scripts/gpu.sh, section ipc: GPUPOOL_DRIVER=cuda), where it reads and
 * writes device memory through libcuda.so.1 (dlopen: no toolkit needed to build it).
 *
 *   1. a block crosses bit for bit, and the consumer's writes come back;
 *   2. GPUPOOL_IPC_CYCLES (default 10000) export/import/close cycles: the consumer's address
 *      space (VmSize), open descriptors and the device's free memory flat;
 *   3. the producer frees a block while it is imported: not reused until the close;
 *   4. a consumer killed with SIGKILL while holding a block: the producer gets it back;
 *   5. garbage handles; with two devices, a block of device 1 imported (for device 1) by the
 *      consumer, whose context is device 0's and which enables device 0's access to device 1's
 *      memory (gpupool_enable_peer_access(0, 1): an import of pages is mapped for its device
 *      and its enabled peers only, PyTorch's rule, docs/rules.md) after the import: bit for bit
 *      both ways, the owner's free waiting for the close; and the same handle imported as
 *      device 0's, refused.
 * Each prints PASS or FAIL lines with its figures. */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gpupool.h>
#include <gpupool_ipc.h>

#include "check.h"

#define MIB ((size_t)1 << 20)

/* ---- device memory access: host memory on the simulated device, libcuda on a GPU ---- */

static int on_gpu;
static int (*cu_memcpy_htod)(uint64_t, const void *, size_t);
static int (*cu_memcpy_dtoh)(void *, uint64_t, size_t);
static int (*cu_mem_get_info)(size_t *, size_t *);

/* Makes device `dev`'s primary context current (what gpupool allocates in). */
static void device_init(int dev) {
  const char *driver = getenv("GPUPOOL_DRIVER");
  on_gpu = driver && strcmp(driver, "cuda") == 0;
  if (!on_gpu) return;
  void *lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) {
    fprintf(stderr, "libcuda.so.1: %s\n", dlerror());
    exit(2);
  }
  /* POSIX's idiom for a function from dlsym (ISO C has no object-to-function conversion). */
#define LOAD(var, name) (*(void **)(&(var)) = dlsym(lib, name))
  int (*init)(unsigned) = NULL;
  int (*get)(int *, int) = NULL;
  int (*retain)(void **, int) = NULL;
  int (*set)(void *) = NULL;
  if (!LOAD(init, "cuInit") || !LOAD(get, "cuDeviceGet") || !LOAD(retain, "cuDevicePrimaryCtxRetain") ||
      !LOAD(set, "cuCtxSetCurrent") || !LOAD(cu_memcpy_htod, "cuMemcpyHtoD_v2") ||
      !LOAD(cu_memcpy_dtoh, "cuMemcpyDtoH_v2") || !LOAD(cu_mem_get_info, "cuMemGetInfo_v2")) {
    fprintf(stderr, "libcuda.so.1 lacks a function this test calls\n");
    exit(2);
  }
  int cudev = 0;
  void *ctx = NULL;
  if (init(0) || get(&cudev, dev) || retain(&ctx, cudev) || set(ctx)) {
    fprintf(stderr, "could not make device %d's primary context current\n", dev);
    exit(2);
  }
}

static void to_device(void *dst, const void *src, size_t n) {
  if (on_gpu)
    CHECK(cu_memcpy_htod((uint64_t)(uintptr_t)dst, src, n) == 0);
  else
    memcpy(dst, src, n);
}

static void from_device(void *dst, const void *src, size_t n) {
  if (on_gpu)
    CHECK(cu_memcpy_dtoh(dst, (uint64_t)(uintptr_t)src, n) == 0);
  else
    memcpy(dst, src, n);
}

/* Free device memory in MiB (0 on the simulated device, whose memory is the process's own). */
static long device_free_mib(void) {
  size_t free_b = 0, total = 0;
  if (on_gpu && cu_mem_get_info(&free_b, &total) == 0) return (long)(free_b / MIB);
  return 0;
}

static void pattern(unsigned char *buf, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++) buf[i] = (unsigned char)(i * 31 + seed + (i >> 8));
}

/* VmSize in KiB and open descriptors of this process. */
static void footprint(long *vm_kib, long *fds) {
  char line[256];
  FILE *f = fopen("/proc/self/status", "r");
  *vm_kib = -1;
  while (f && fgets(line, sizeof line, f))
    if (strncmp(line, "VmSize:", 7) == 0) *vm_kib = atol(line + 7);
  if (f) fclose(f);
  *fds = 0;
  DIR *d = opendir("/proc/self/fd");
  for (struct dirent *e; d && (e = readdir(d));) *fds += e->d_name[0] != '.';
  if (d) closedir(d);
}

/* ---- messages ---- */

enum { IMPORT, CHECK_FILL, CLOSE, CYCLE, STATE, GARBAGE, PEER, EXIT };
struct msg {
  int op, status, device;
  gpupool_ipc_handle_t handle;
  uint64_t ptr, len, seed, a, b, c;
  char text[512];
};

static void send_msg(int fd, struct msg *m) {
  if (write(fd, m, sizeof *m) != (ssize_t)sizeof *m) exit(3);
}
static void recv_msg(int fd, struct msg *m) {
  size_t got = 0;
  while (got < sizeof *m) {
    ssize_t n = read(fd, (char *)m + got, sizeof *m - got);
    if (n <= 0) exit(3);
    got += (size_t)n;
  }
}
static struct msg ask(int fd, struct msg m) {
  send_msg(fd, &m);
  recv_msg(fd, &m);
  return m;
}

/* The consumer: answers each message until EXIT. */
static void consumer(int fd) {
  device_init(0);
  struct msg m;
  for (;;) {
    recv_msg(fd, &m);
    m.status = 0;
    m.text[0] = 0;
    void *p = NULL;
    switch (m.op) {
      case IMPORT:
      case GARBAGE:
        m.status = gpupool_ipc_import(&m.handle, m.device, &p);
        m.ptr = (uint64_t)(uintptr_t)p;
        snprintf(m.text, sizeof m.text, "%s", m.status ? gpupool_last_error_message() : "");
        break;
      case CHECK_FILL: { /* compare with pattern(seed), then fill with pattern(seed + 1) */
        unsigned char *want = malloc(m.len), *got = malloc(m.len);
        pattern(want, m.len, (unsigned)m.seed);
        from_device(got, (void *)(uintptr_t)m.ptr, m.len);
        m.status = memcmp(want, got, m.len) != 0;
        pattern(want, m.len, (unsigned)m.seed + 1);
        to_device((void *)(uintptr_t)m.ptr, want, m.len);
        free(want);
        free(got);
        break;
      }
      case CLOSE:
        m.status = gpupool_ipc_close((void *)(uintptr_t)m.ptr);
        break;
      case PEER: /* device m.device gains access to device m.a's memory, imports included */
        m.status = gpupool_enable_peer_access(m.device, (int)m.a);
        snprintf(m.text, sizeof m.text, "%s", m.status ? gpupool_last_error_message() : "");
        break;
      case CYCLE: { /* import, compare the first bytes, close */
        unsigned char want[4096], got[4096];
        m.status = gpupool_ipc_import(&m.handle, 0, &p);
        if (m.status == 0) {
          pattern(want, sizeof want, (unsigned)m.seed);
          from_device(got, p, sizeof got);
          m.status = memcmp(want, got, sizeof got) != 0 ? 99 : gpupool_ipc_close(p);
        }
        break;
      }
      case STATE: {
        long vm, fds;
        footprint(&vm, &fds);
        m.a = (uint64_t)vm;
        m.b = (uint64_t)fds;
        m.c = (uint64_t)device_free_mib();
        break;
      }
      case EXIT:
        send_msg(fd, &m);
        exit(0);
    }
    send_msg(fd, &m);
  }
}

static pid_t start_consumer(int *fd) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) exit(2);
  pid_t pid = fork();
  if (pid == 0) {
    close(sv[0]);
    consumer(sv[1]);
  }
  close(sv[1]);
  *fd = sv[0];
  return pid;
}

static int64_t allocated_bytes(void) {
  gpupool_stats_t st = GPUPOOL_STATS_INIT;
  CHECK_OK(gpupool_stats(0, &st));
  return st.allocated_bytes.all.current;
}

static void report(const char *what, int ok, const char *figures) {
  printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", what, figures[0] ? ": " : "", figures);
  CHECK(ok);
}

int main(void) {
  int fd, fd_victim;
  /* Both consumers before this process touches gpupool or CUDA. */
  pid_t pid = start_consumer(&fd);
  pid_t victim = start_consumer(&fd_victim);
  device_init(0);
  /* Under Yama's ptrace_scope 1 a process may take descriptors only of its descendants: let
   * the consumers (children of this process) take this one's (docs/ipc.md). */
  prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  char fig[256];
  struct msg m;

  /* 1. bit for bit, both ways */
  size_t len = 5 * MIB + 12345;
  void *pad = NULL, *p = NULL;
  CHECK_OK(gpupool_malloc(&pad, 3 * MIB, 0, NULL));
  CHECK_OK(gpupool_malloc(&p, len, 0, NULL));
  unsigned char *buf = malloc(len), *back = malloc(len);
  pattern(buf, len, 7);
  to_device(p, buf, len);
  gpupool_ipc_handle_t h, h2;
  CHECK_OK(gpupool_ipc_export(p, &h));
  CHECK_OK(gpupool_ipc_export(p, &h2));
  report("same block exported twice gives the same bytes", memcmp(&h, &h2, sizeof h) == 0, "");
  m = ask(fd, (struct msg){.op = IMPORT, .handle = h, .device = 0});
  CHECK(m.status == 0);
  uint64_t q = m.ptr;
  m = ask(fd, (struct msg){.op = CHECK_FILL, .ptr = q, .len = len, .seed = 7});
  pattern(buf, len, 8);
  from_device(back, p, len);
  snprintf(fig, sizeof fig, "%zu bytes", len);
  report("bit for bit to the consumer and back", m.status == 0 && memcmp(buf, back, len) == 0, fig);
  CHECK(ask(fd, (struct msg){.op = CLOSE, .ptr = q}).status == 0);
  CHECK(ask(fd, (struct msg){.op = CLOSE, .ptr = q}).status == GPUPOOL_ERROR_INVALID_POINTER);
  CHECK_OK(gpupool_free(p));

  /* 2. cycles */
  const char *env = getenv("GPUPOOL_IPC_CYCLES");
  long cycles = env ? atol(env) : 10000, failures = 0;
  struct msg before = {0}, after;
  for (long i = 0; i < cycles; i++) {
    size_t n = (i % 3 == 0) ? MIB : (i % 3 == 1) ? 3 * MIB : 64 << 10;
    void *b = NULL;
    CHECK_OK(gpupool_malloc(&b, n, 0, NULL));
    pattern(buf, 4096, (unsigned)i);
    to_device(b, buf, 4096);
    CHECK_OK(gpupool_ipc_export(b, &h));
    m = ask(fd, (struct msg){.op = CYCLE, .handle = h, .seed = (unsigned)i & 0xff});
    failures += m.status != 0;
    CHECK_OK(gpupool_free(b));
    if (i == 99 || (cycles < 100 && i == 0)) before = ask(fd, (struct msg){.op = STATE});
  }
  after = ask(fd, (struct msg){.op = STATE});
  long dvm = (long)after.a - (long)before.a, dfd = (long)after.b - (long)before.b,
       dfree = (long)after.c - (long)before.c;
  snprintf(fig, sizeof fig,
           "%ld cycles, %ld failed; consumer VmSize %+ld KiB (%lu KiB), descriptors %+ld, device free %+ld MiB",
           cycles, failures, dvm, (unsigned long)after.a, dfd, dfree);
  report("export/import/close cycles flat", failures == 0 && dvm <= 16384 && dfd == 0 && labs(dfree) <= 16, fig);

  /* 3. freed while imported */
  CHECK_OK(gpupool_malloc(&p, 4 * MIB, 0, NULL));
  CHECK_OK(gpupool_ipc_export(p, &h));
  m = ask(fd, (struct msg){.op = IMPORT, .handle = h, .device = 0});
  CHECK(m.status == 0);
  q = m.ptr;
  int64_t held = allocated_bytes();
  CHECK_OK(gpupool_free(p));
  int reused = 0;
  for (int i = 0; i < 3; i++) {
    void *r = NULL;
    CHECK_OK(gpupool_malloc(&r, 4 * MIB, 0, NULL));
    reused |= r == p;
    CHECK_OK(gpupool_free(r));
  }
  size_t reclaimed = 9;
  CHECK_OK(gpupool_ipc_reclaim(&reclaimed));
  int kept = !reused && reclaimed == 0 && allocated_bytes() == held;
  CHECK(ask(fd, (struct msg){.op = CLOSE, .ptr = q}).status == 0);
  CHECK_OK(gpupool_ipc_reclaim(&reclaimed));
  snprintf(fig, sizeof fig, "reclaimed %zu after the close", reclaimed);
  report("a block freed while imported is not reused until the close", kept && reclaimed == 1, fig);

  /* 4. a consumer killed while holding a block */
  CHECK_OK(gpupool_malloc(&p, 2 * MIB, 0, NULL));
  CHECK_OK(gpupool_ipc_export(p, &h));
  CHECK(ask(fd_victim, (struct msg){.op = IMPORT, .handle = h, .device = 0}).status == 0);
  CHECK_OK(gpupool_free(p));
  CHECK_OK(gpupool_ipc_reclaim(&reclaimed));
  int held_while_alive = reclaimed == 0;
  kill(victim, SIGKILL);
  waitpid(victim, NULL, 0);
  CHECK_OK(gpupool_ipc_reclaim(&reclaimed));
  report("a SIGKILLed consumer's block comes back", held_while_alive && reclaimed == 1, "");

  /* 5. bad arguments and bad handles */
  void *x = NULL;
  CHECK_OK(gpupool_malloc(&p, MIB, 0, NULL));
  CHECK(gpupool_ipc_export(p, NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_ipc_export(NULL, &h) == GPUPOOL_ERROR_INVALID_POINTER);
  CHECK(gpupool_ipc_export((char *)p + 512, &h) == GPUPOOL_ERROR_INVALID_POINTER);
  CHECK_OK(gpupool_ipc_export(p, &h));
  CHECK(gpupool_ipc_import(NULL, 0, &x) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_ipc_import(&h, 0, NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_ipc_import(&h, 0, &x) == GPUPOOL_ERROR_INVALID_VALUE && x == NULL); /* its own */
  CHECK(gpupool_ipc_close(NULL) == GPUPOOL_ERROR_INVALID_POINTER);
  CHECK(gpupool_ipc_close(p) == GPUPOOL_ERROR_INVALID_POINTER);
  CHECK_OK(gpupool_ipc_reclaim(NULL));
  CHECK_OK(gpupool_free(p));

  gpupool_ipc_handle_t junk;
  for (size_t i = 0; i < sizeof junk.bytes; i++) junk.bytes[i] = (unsigned char)(i * 131 + 17);
  m = ask(fd, (struct msg){.op = GARBAGE, .handle = junk, .device = 0});
  report("a garbage handle is refused", m.status == GPUPOOL_ERROR_INVALID_VALUE && strstr(m.text, "magic"), m.text);
  int devices = 0;
  CHECK_OK(gpupool_device_count(&devices));
  if (devices >= 2) {
    /* A block of device 1, imported for device 1 by the consumer, whose context is device 0's,
     * which copies from it and back (the copies through unified addressing) once device 0 may
     * reach device 1's memory: gpupool maps an import of pages for its device and the peers
     * enabled on it (PyTorch's rule), and an import mapped before the peer is enabled gains it.
     * The producer copies with device 1's context current, as a program under PyTorch's rule
     * does (its device guard). The owner's free waits for the close. */
    void *d1 = NULL;
    size_t n1 = 3 * MIB + 4096;
    CHECK_OK(gpupool_malloc(&d1, n1, 1, NULL));
    pattern(buf, n1, 21);
    device_init(1);
    to_device(d1, buf, n1);
    device_init(0);
    CHECK_OK(gpupool_ipc_export(d1, &h));
    m = ask(fd, (struct msg){.op = IMPORT, .handle = h, .device = 1});
    int imported = m.status == 0;
    q = m.ptr;
    m = ask(fd, (struct msg){.op = PEER, .device = 0, .a = 1});
    report("the consumer enables device 0's access to device 1's memory after the import", m.status == 0,
           m.text);
    m = ask(fd, (struct msg){.op = CHECK_FILL, .ptr = q, .len = n1, .seed = 21});
    pattern(buf, n1, 22);
    device_init(1);
    from_device(back, d1, n1);
    device_init(0);
    snprintf(fig, sizeof fig, "%zu bytes", n1);
    report("a block of device 1 imported by a process on device 0, bit for bit both ways",
           imported && m.status == 0 && memcmp(buf, back, n1) == 0, fig);
    CHECK_OK(gpupool_free(d1));
    CHECK_OK(gpupool_ipc_reclaim(&reclaimed));
    int waited = reclaimed == 0;
    CHECK(ask(fd, (struct msg){.op = CLOSE, .ptr = q}).status == 0);
    CHECK_OK(gpupool_ipc_reclaim(&reclaimed));
    report("device 1's owner gets its block back only at the close", waited && reclaimed == 1, "");
    /* The same block's device named wrongly: refused, naming both. */
    CHECK_OK(gpupool_malloc(&d1, MIB, 1, NULL));
    CHECK_OK(gpupool_ipc_export(d1, &h));
    m = ask(fd, (struct msg){.op = GARBAGE, .handle = h, .device = 0});
    report("a block of device 1 imported as device 0's is refused",
           m.status == GPUPOOL_ERROR_INVALID_VALUE && strstr(m.text, "not device 0"), m.text);
    CHECK_OK(gpupool_free(d1));
  } else {
    printf("SKIP a block of device 1 imported by a process on device 0: one device\n");
  }

  ask(fd, (struct msg){.op = EXIT});
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK_OK(gpupool_free(pad));
  free(buf);
  free(back);
  return checks_report("test_ipc");
}
