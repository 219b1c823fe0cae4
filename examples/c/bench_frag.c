/* bench's fragmentation table (bench.h): each configuration in a child process. */
#define _POSIX_C_SOURCE 200809L
#include "bench.h"

/* --- fragmentation: each configuration in a child process --- */
static const char *frag_specs[] = {
    "gpupool",
    "gpupool:expandable_segments:False",
    "gpupool;GPUPOOL_EXPANDABLE_LARGE_PAGES=0",
    "gpupool;GPUPOOL_EXPANDABLE_LARGE_PAGES=0;GPUPOOL_EXPANDABLE_RECLAIM=1",
    "gpupool;GPUPOOL_EXPANDABLE_RECLAIM=1",
#ifdef GPUPOOL_BENCH_TORCH
    "pytorch",
    "pytorch:expandable_segments:True",
#endif
    "cudaMallocAsync",
};
#define NFRAG ((int)(sizeof frag_specs / sizeof frag_specs[0]))

/* The environment variable holding ALLOCATOR's configuration; NULL for one without any. */
static const char *conf_var(const char *allocator) {
  if (strcmp(allocator, "gpupool") == 0) return "GPUPOOL_CONF";
  if (strcmp(allocator, "pytorch") == 0) return "PYTORCH_CUDA_ALLOC_CONF";
  return NULL;
}

/* Splits SPEC (ALLOCATOR[:CONF][;VAR=VALUE...]): the allocator's name into name, CONF into conf
 * (empty when there is none), and returns the settings after the first ';' (gpupool's own
 * environment variables, which GPUPOOL_CONF does not hold), "" when there are none. */
static const char *split_spec(const char *spec, char *name, size_t len, char *conf, size_t conf_len) {
  size_t end = strcspn(spec, ";");
  size_t n = strcspn(spec, ":");
  if (n > end) n = end;
  snprintf(name, len, "%.*s", (int)n, spec);
  size_t from = n < end ? n + 1 : end;
  snprintf(conf, conf_len, "%.*s", (int)(end - from), spec + from);
  return spec[end] == ';' ? spec + end + 1 : "";
}

/* The next VAR=VALUE of a settings list (split_spec's result) into var and value; returns
 * the rest of the list, NULL when the list is done. */
static const char *next_setting(const char *list, char *var, size_t var_len, char *value, size_t value_len) {
  if (*list == '\0') return NULL;
  size_t n = strcspn(list, ";");
  const char *eq = memchr(list, '=', n);
  size_t v = eq ? (size_t)(eq - list) : n;
  snprintf(var, var_len, "%.*s", (int)v, list);
  snprintf(value, value_len, "%.*s", eq ? (int)(n - v - 1) : 0, eq ? eq + 1 : "");
  return list[n] == ';' ? list + n + 1 : list + n;
}

/* Whether environment entry env ("VAR=VALUE") sets a variable that some configuration's
 * settings set: the parent's value must not leak into the configurations that leave it
 * at its default. */
static int set_by_specs(const char *env) {
  char var[128], value[128];
  for (size_t i = 0; i < sizeof frag_specs / sizeof frag_specs[0]; i++) {
    char name[32], conf[512];
    for (const char *l = split_spec(frag_specs[i], name, sizeof name, conf, sizeof conf);
         (l = next_setting(l, var, sizeof var, value, sizeof value)) != NULL;) {
      size_t n = strlen(var);
      if (strncmp(env, var, n) == 0 && env[n] == '=') return 1;
    }
  }
  return 0;
}

/* Gives VAR the value VALUE (unset for NULL) from the start of the process: when the
 * environment differs, sets it and runs this program again, since an allocator may read its
 * variable before main. Called before any CUDA call, while the process has one thread. */
static void ensure_env(const char *var, const char *value, char **argv) {
  const char *cur = getenv(var);
  int set = cur != NULL && cur[0] != '\0';
  if (value == NULL ? !set : (set && strcmp(cur, value) == 0)) return;
  if (value != NULL ? setenv(var, value, 1) : unsetenv(var)) {
    perror(var);
    exit(1);
  }
  execv(self_path, argv);
  perror(self_path);
  exit(1);
}

/* in, lower case and without spaces, into out. */
static void squeeze(const char *in, char *out, size_t len) {
  size_t j = 0;
  for (; *in && j + 1 < len; in++)
    if (!isspace((unsigned char)*in)) out[j++] = (char)tolower((unsigned char)*in);
  out[j] = '\0';
}

/* Whether text (a configuration as an allocator shows it) holds every key:value pair of conf
 * (PyTorch's syntax: pairs separated by commas), ignoring case and spaces. */
static int config_shows(const char *text, const char *conf) {
  char t[4096], pair[256], p[256];
  squeeze(text, t, sizeof t);
  while (*conf) {
    size_t n = strcspn(conf, ",");
    snprintf(pair, sizeof pair, "%.*s", (int)n, conf);
    squeeze(pair, p, sizeof p);
    if (p[0] != '\0' && strstr(t, p) == NULL) return 0;
    conf += n;
    if (*conf == ',') conf++;
  }
  return 1;
}

static void frag_line(const char *spec, allocator_t *A, trace_t *t) {
  fprintf(stderr, "bench --config %s: %s\n", spec, t->name);
  replay_result_t r = replay_twice(A, t);
  printf("frag\t%s\t%lld\t%lld\t%.1f\t%.1f\t%lld\n", t->name, r.peak_live, r.reserved_peak, r.cold_ns, r.warm_ns,
         r.device_allocs);
  fflush(stdout);
}

/* bench --config SPEC: one configuration's fragmentation figures, one tab-separated line per
 * workload ("frag", name, peak live bytes, peak reserved bytes, ns/event cold, warm, device
 * allocs), after a "config" line with what the allocator made of its configuration. Exits 1
 * when the configuration did not take effect. */
int frag_child(const char *spec, int ntraces, char **paths, char **argv) {
  char name[32], conf_text[512], set_var[128], set_value[128];
  const char *settings = split_spec(spec, name, sizeof name, conf_text, sizeof conf_text);
  const char *conf = conf_text[0] ? conf_text : NULL;
  const char *var = conf_var(name);
  int ai = -1;
  for (int a = 0; a < nalloc; a++)
    if (strcmp(allocators[a].name, name) == 0 && !allocators[a].slow) ai = a;
  if (ai < 0 || (conf != NULL && var == NULL) || (settings[0] && strcmp(name, "gpupool") != 0)) {
    fprintf(stderr, "bench --config %s: expected gpupool[:CONF][;VAR=VALUE...], pytorch[:CONF] (when built with "
                    "PyTorch) or cudaMallocAsync\n", spec);
    return 2;
  }
  if (var != NULL) ensure_env(var, conf, argv);
  for (const char *l = settings; (l = next_setting(l, set_var, sizeof set_var, set_value, sizeof set_value)) != NULL;)
    ensure_env(set_var, set_value[0] ? set_value : NULL, argv);
  allocator_t *A = &allocators[ai];
  cuda_setup(strcmp(name, "pytorch") == 0);

  /* What the allocator made of its configuration, seen after a first allocation (each reads
   * its configuration at first use). */
  char text[4096] = "the device's default pool, release threshold at its maximum";
  int ok = 1;
  void *probe = A->alloc(1 << 20, NULL);
  if (strcmp(name, "gpupool") == 0) {
    size_t needed = 0;
    if (gpupool_config_string(text, sizeof text, &needed) != GPUPOOL_SUCCESS) {
      snprintf(text, sizeof text, "gpupool_config_string failed: %s", gpupool_last_error_message());
      ok = 0;
    } else if (conf != NULL && !config_shows(text, conf)) {
      ok = 0;
    }
  }
#ifdef GPUPOOL_BENCH_TORCH
  if (strcmp(name, "pytorch") == 0) {
    int seen = torch_expandable_segments();
    int wanted = conf != NULL && config_shows(conf, "expandable_segments:True");
    snprintf(text, sizeof text, "PYTORCH_CUDA_ALLOC_CONF=%s; its segments: %s", conf ? conf : "(unset)",
             seen > 0 ? "expandable" : seen == 0 ? "not expandable" : "none");
    ok = seen == wanted;
  }
#endif
  A->release(probe, NULL);
  if (A->reset) A->reset();
  printf("config\t%s\t%s\n", spec, text);
  fflush(stdout);
  if (!ok) {
    fprintf(stderr, "bench --config %s: the configuration did not take effect (%s)\n", spec, text);
    return 1;
  }

  trace_t rnd = random_trace();
  frag_line(spec, A, &rnd);
  free(rnd.ev);
  for (int i = 0; i < ntraces; i++) {
    trace_t t = load_trace(paths[i]);
    frag_line(spec, A, &t);
    free(t.ev);
  }
  return 0;
}

typedef struct {
  int have;
  long long live, reserved, allocs;
  double cold, warm;
} frag_cell_t;
#define MAXWORK 64
static char frag_work[MAXWORK][128];
static int nfrag_work;
static frag_cell_t frag_cell[MAXWORK][NFRAG];
static char frag_note[NFRAG][2048];

static int frag_workload(const char *name) {
  for (int w = 0; w < nfrag_work; w++)
    if (strcmp(frag_work[w], name) == 0) return w;
  if (nfrag_work == MAXWORK) {
    fprintf(stderr, "bench: more than %d workloads\n", MAXWORK);
    exit(1);
  }
  snprintf(frag_work[nfrag_work], sizeof frag_work[0], "%s", name);
  return nfrag_work++;
}

/* Runs configuration ci in a child (bench --config), with GPUPOOL_CONF and
 * PYTORCH_CUDA_ALLOC_CONF removed from its environment but for the one its configuration sets,
 * and gathers its lines. Returns 0 when the child succeeded. */
static int frag_run(int ci, int ntraces, char **paths) {
  const char *spec = frag_specs[ci];
  char name[32], assign[512], conf_text[512];
  split_spec(spec, name, sizeof name, conf_text, sizeof conf_text);
  const char *conf = conf_text[0] ? conf_text : NULL;
  const char *var = conf_var(name);
  size_t n = 0;
  while (environ[n]) n++;
  char **envp = calloc(n + 2, sizeof(char *));
  size_t k = 0;
  for (size_t i = 0; i < n; i++)
    if (strncmp(environ[i], "GPUPOOL_CONF=", 13) != 0 && strncmp(environ[i], "PYTORCH_CUDA_ALLOC_CONF=", 24) != 0 &&
        !set_by_specs(environ[i]))
      envp[k++] = environ[i];
  if (conf != NULL && var != NULL) {
    snprintf(assign, sizeof assign, "%s=%s", var, conf);
    envp[k++] = assign;
  }
  envp[k] = NULL;
  char **args = calloc((size_t)ntraces + 4, sizeof(char *));
  args[0] = self_path;
  args[1] = "--config";
  args[2] = (char *)spec;
  for (int i = 0; i < ntraces; i++) args[3 + i] = paths[i];

  int fd[2];
  if (pipe(fd) != 0) {
    perror("pipe");
    exit(1);
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fd[1], 1);
  posix_spawn_file_actions_addclose(&fa, fd[0]);
  posix_spawn_file_actions_addclose(&fa, fd[1]);
  fflush(stdout);
  pid_t pid;
  int err = posix_spawn(&pid, self_path, &fa, NULL, args, envp);
  posix_spawn_file_actions_destroy(&fa);
  close(fd[1]);
  free(envp);
  free(args);
  if (err != 0) {
    fprintf(stderr, "bench: posix_spawn %s: %s\n", self_path, strerror(err));
    exit(1);
  }
  FILE *in = fdopen(fd[0], "r");
  static char line[8192];
  while (fgets(line, sizeof line, in)) {
    line[strcspn(line, "\n")] = '\0';
    if (strncmp(line, "config\t", 7) == 0) {
      const char *text = strchr(line + 7, '\t');
      snprintf(frag_note[ci], sizeof frag_note[ci], "%s", text ? text + 1 : "");
    } else if (strncmp(line, "frag\t", 5) == 0) {
      char *f[7], *save = NULL;
      int nf = 0;
      for (char *p = strtok_r(line, "\t", &save); p && nf < 7; p = strtok_r(NULL, "\t", &save)) f[nf++] = p;
      if (nf != 7) {
        fprintf(stderr, "bench: --config %s wrote a line of %d fields\n", spec, nf);
        continue;
      }
      frag_cell_t *c = &frag_cell[frag_workload(f[1])][ci];
      *c = (frag_cell_t){1, atoll(f[2]), atoll(f[3]), atoll(f[6]), atof(f[4]), atof(f[5])};
    } else {
      fprintf(stderr, "%s\n", line);
    }
  }
  fclose(in);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) {
      perror("waitpid");
      exit(1);
    }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return 0;
  char why[64];
  if (WIFSIGNALED(status))
    snprintf(why, sizeof why, "died of signal %d (%s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
  else
    snprintf(why, sizeof why, "exited with %d", WEXITSTATUS(status));
  size_t used = strlen(frag_note[ci]);
  snprintf(frag_note[ci] + used, sizeof frag_note[ci] - used, "%sFAILED: %s", used ? "; " : "", why);
  return 1;
}

/* The fragmentation table; returns 1 when a configuration failed. */
int bench_frag(int ntraces, char **paths) {
  int failed = 0;
  for (int ci = 0; ci < NFRAG; ci++) {
    fprintf(stderr, "bench: fragmentation, %s\n", frag_specs[ci]);
    failed |= frag_run(ci, ntraces, paths);
  }
  printf("\nFragmentation, each configuration in its own process (live: the peak of the sum of live requested "
         "sizes; reserved and device allocs: the cold pass's):\n\n");
  printf("| workload | configuration | reserved/live | peak reserved MiB | peak live MiB | ns/event cold | "
         "ns/event warm | device allocs |\n");
  printf("|---|---|---|---|---|---|---|---|\n");
  for (int w = 0; w < nfrag_work; w++) {
    for (int ci = 0; ci < NFRAG; ci++) {
      frag_cell_t *c = &frag_cell[w][ci];
      char label[256], ratio[32] = "-", reserved[32] = "-", allocs[32] = "-";
      snprintf(label, sizeof label, "%s", frag_specs[ci]);
      char *colon = strchr(label, ':');
      if (colon) *colon = ' ';
      if (!c->have) {
        printf("| %s | %s | - | - | - | - | - | - |\n", frag_work[w], label);
        continue;
      }
      if (c->reserved >= 0 && c->live > 0) {
        snprintf(ratio, sizeof ratio, "%.2f", (double)c->reserved / (double)c->live);
        snprintf(reserved, sizeof reserved, "%.0f", (double)c->reserved / 1048576.0);
      }
      if (c->allocs >= 0) snprintf(allocs, sizeof allocs, "%lld", c->allocs);
      printf("| %s | %s | %s | %s | %.1f | %.0f | %.0f | %s |\n", frag_work[w], label, ratio, reserved,
             (double)c->live / 1048576.0, c->cold, c->warm, allocs);
    }
  }
  printf("\n");
  for (int ci = 0; ci < NFRAG; ci++) printf("- %s: %s\n", frag_specs[ci], frag_note[ci]);
  return failed;
}

