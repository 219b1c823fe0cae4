/* The host's side of a pageable sleep and wake, without a GPU: how fast T threads copy S bytes
 * from resident memory (standing for the staging ring's pinned buffers) into
 *   fresh      a new anonymous mapping (transparent huge pages asked for), as a first sleep's
 *              host copy: every page faulted and zeroed by the kernel during the copy;
 *   resident   the same mapping again, its pages present: what a copy costs without faults
 *              (a wake's direction, host copy to staging, is this case);
 *   lazyfree   the same mapping after madvise(MADV_FREE), as a host copy given back at wake
 *              and written again by the next sleep before the kernel reclaimed it.
 * Prints GB/s (10^9 bytes a second) for each case and thread count; the pinned copy bandwidth
 * of test_sleep's benchmark on the same machine is what a sleep is measured against
 * (docs/sleep.md).
 *
 *   cc -O2 -pthread examples/c/host_copy_bw.c -o host_copy_bw && ./host_copy_bw [MiB] [threads...]
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#ifndef MADV_FREE
#define MADV_FREE 8
#endif

struct job {
    char *dst;
    const char *src;
    size_t len;
};

static void *copy(void *arg) {
    struct job *j = arg;
    /* In pieces of 2 MiB, as the sleep's crew copies a staging buffer's share. */
    for (size_t off = 0; off < j->len; off += 2u << 20) {
        size_t n = j->len - off < (2u << 20) ? j->len - off : (2u << 20);
        memcpy(j->dst + off, j->src + off, n);
    }
    return NULL;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* GB/s of one copy of `len` bytes by `threads` threads, each its own contiguous share. */
static double run(char *dst, const char *src, size_t len, int threads) {
    pthread_t tid[64];
    struct job jobs[64];
    size_t share = len / threads;
    double t0 = now();
    for (int i = 0; i < threads; i++) {
        jobs[i] = (struct job){dst + i * share, src + i * share, i == threads - 1 ? len - i * share : share};
        if (pthread_create(&tid[i], NULL, copy, &jobs[i]) != 0) {
            perror("pthread_create");
            exit(1);
        }
    }
    for (int i = 0; i < threads; i++) pthread_join(tid[i], NULL);
    return len / (now() - t0) / 1e9;
}

static char *map(size_t len) {
    char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    madvise(p, len, MADV_HUGEPAGE);
    return p;
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 4096;
    int counts[16] = {1, 4, 8, 16}, n = 4;
    if (argc > 2) {
        n = 0;
        for (int i = 2; i < argc && n < 16; i++) counts[n++] = atoi(argv[i]);
    }
    if (mib == 0) mib = 1;
    size_t len = mib << 20;
    char *src = map(len);
    memset(src, 0x5a, len);
    printf("host_copy_bw: %zu MiB, GB/s; fresh / resident / lazyfree\n", mib);
    for (int i = 0; i < n; i++) {
        int t = counts[i] < 1 ? 1 : counts[i] > 64 ? 64 : counts[i];
        char *dst = map(len);
        double fresh = run(dst, src, len, t);
        double resident = run(dst, src, len, t);
        if (madvise(dst, len, MADV_FREE) != 0) perror("madvise(MADV_FREE)");
        double lazy = run(dst, src, len, t);
        printf("threads %2d: %6.1f / %6.1f / %6.1f\n", t, fresh, resident, lazy);
        munmap(dst, len);
    }
    munmap(src, len);
    return 0;
}
