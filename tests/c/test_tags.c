/* Tags from C: nesting, the statistics of each tag (a block freed on another thread, under
 * another tag, counts to its own), the list of tags, the live report through an output
 * callback, and bad input. Run twice by CTest: plainly, and with GPUPOOL_LIVE_REPORT_AT_EXIT=1,
 * where the report of the block left allocated must reach stderr at exit. On the simulated
 * device, and on the GPU with GPUPOOL_TEST_DRIVER=cuda. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "gpupool.h"

static gpupool_tag_stats_t stats_of(const char *name) {
  gpupool_tag_stats_t s;
  memset(&s, 0xff, sizeof s);
  CHECK_OK(gpupool_tag_stats(name, &s));
  return s;
}

/* Frees `arg` on a thread of its own, under a tag of its own. */
static void *free_elsewhere(void *arg) {
  CHECK_OK(gpupool_push_tag("freeing-thread"));
  CHECK_OK(gpupool_free(arg));
  CHECK_OK(gpupool_pop_tag());
  return NULL;
}

struct listed {
  int count;
  int encoder_seen;
  long long encoder_current;
};

static void list_tag(const char *name, const gpupool_tag_stats_t *s, void *user) {
  struct listed *l = user;
  l->count++;
  if (strcmp(name, "encoder") == 0) {
    l->encoder_seen = 1;
    l->encoder_current = (long long)s->bytes.current;
  }
}

static char report[1 << 16];
static size_t report_len;
static int report_lines;

static void collect(const char *text, void *user) {
  (void)user;
  size_t n = strlen(text);
  if (report_len + n < sizeof report) {
    memcpy(report + report_len, text, n + 1);
    report_len += n;
  }
  report_lines++;
}

int main(void) {
  /* Bad input: a status, and nothing pushed. */
  CHECK(gpupool_pop_tag() == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strstr(gpupool_last_error_message(), "gpupool_pop_tag") != NULL);
  CHECK(gpupool_push_tag(NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_push_tag("\xff\xfe") == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strstr(gpupool_last_error_message(), "UTF-8") != NULL);
  CHECK(gpupool_push_tag("") == GPUPOOL_ERROR_INVALID_VALUE);
  /* A newline would forge a line of the live report. */
  CHECK(gpupool_push_tag("x\n  8.00 GiB in 999 blocks: tag fake") == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strstr(gpupool_last_error_message(), "at byte 1") != NULL);
  CHECK(gpupool_push_tag("tab\there") == GPUPOOL_ERROR_INVALID_VALUE);
  char longname[300];
  memset(longname, 'x', sizeof longname - 1);
  longname[sizeof longname - 1] = 0;
  CHECK(gpupool_push_tag(longname) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_pop_tag() == GPUPOOL_ERROR_INVALID_VALUE);

  /* Nesting: the innermost tag wins, and a pop restores the one before. */
  void *a = NULL, *b = NULL, *c = NULL, *d = NULL;
  CHECK_OK(gpupool_push_tag("encoder"));
  CHECK_OK(gpupool_malloc(&a, 1000, 0, NULL));
  CHECK_OK(gpupool_push_tag("attention"));
  CHECK_OK(gpupool_malloc(&b, 3 << 20, 0, NULL));
  CHECK_OK(gpupool_pop_tag());
  CHECK_OK(gpupool_malloc(&c, 2000, 0, NULL));
  CHECK_OK(gpupool_pop_tag());
  CHECK_OK(gpupool_malloc(&d, 512, 0, NULL));

  gpupool_tag_stats_t e = stats_of("encoder");
  CHECK(e.bytes.current == 1024 + 2048 && e.bytes.allocated == 1024 + 2048 && e.bytes.freed == 0);
  CHECK(e.blocks.current == 2 && e.blocks.peak == 2);
  gpupool_tag_stats_t at = stats_of("attention");
  CHECK(at.bytes.current == 3 << 20 && at.blocks.current == 1);

  /* Freed on another thread, under another tag: counts to the encoder. */
  pthread_t t;
  CHECK(pthread_create(&t, NULL, free_elsewhere, a) == 0);
  CHECK(pthread_join(t, NULL) == 0);
  e = stats_of("encoder");
  CHECK(e.bytes.current == 2048 && e.bytes.peak == 3072 && e.bytes.freed == 1024);
  CHECK(e.blocks.current == 1 && e.blocks.freed == 1);
  gpupool_tag_stats_t f = stats_of("freeing-thread");
  CHECK(f.bytes.allocated == 0 && f.bytes.freed == 0 && f.blocks.current == 0);

  /* Errors of gpupool_tag_stats leave *out untouched. */
  gpupool_tag_stats_t untouched;
  memset(&untouched, 0x5a, sizeof untouched);
  CHECK(gpupool_tag_stats("never-pushed", &untouched) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(strstr(gpupool_last_error_message(), "never-pushed") != NULL);
  CHECK(gpupool_tag_stats(NULL, &untouched) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(gpupool_tag_stats("encoder", NULL) == GPUPOOL_ERROR_INVALID_VALUE);
  CHECK(((unsigned char *)&untouched)[0] == 0x5a);

  /* The list: the three tags pushed, the encoder's figures as gpupool_tag_stats gives them. */
  struct listed l = {0, 0, 0};
  CHECK_OK(gpupool_for_each_tag(list_tag, &l));
  CHECK(l.count == 3 && l.encoder_seen && l.encoder_current == 2048);
  CHECK(gpupool_for_each_tag(NULL, NULL) == GPUPOOL_ERROR_INVALID_VALUE);

  /* The live report, line by line: the largest tag first, then the smaller, then the untagged
   * block. */
  CHECK_OK(gpupool_live_report(0, collect, NULL));
  const char *head = strstr(report, "gpupool live report, device 0: ");
  const char *attention = strstr(report, "3.00 MiB in 1 block: tag attention\n");
  const char *encoder = strstr(report, "2.00 KiB in 1 block: tag encoder\n");
  const char *untagged = strstr(report, "512 bytes in 1 block: no tag\n");
  CHECK(head == report && attention && encoder && untagged);
  CHECK(attention < encoder && encoder < untagged);
  CHECK(report_lines >= 7);
  CHECK(gpupool_live_report(99, collect, NULL) == GPUPOOL_ERROR_INVALID_VALUE);

  CHECK_OK(gpupool_free(c));
  CHECK_OK(gpupool_free(d));
  /* b stays allocated: with GPUPOOL_LIVE_REPORT_AT_EXIT=1 the exit report shows it. */
  (void)b;
  int rc = checks_report("test_tags");
  fflush(stdout); /* before the exit report, which CTest reads after it */
  return rc;
}
