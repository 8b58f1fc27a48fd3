#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace jor {

// ---------------------------------------------------------------------------
// Logging.
// ---------------------------------------------------------------------------

namespace {
int g_verbose = -1;
}  // namespace

int Verbose() {
  if (g_verbose < 0) {
    const char* v = getenv("JAX_OVERLAP_RT_VERBOSE");
    g_verbose = (v && *v) ? atoi(v) : 0;
    if (v && *v && g_verbose == 0 && strcmp(v, "0") != 0) g_verbose = 1;
  }
  return g_verbose;
}

void Log(int level, const char* fmt, ...) {
  if (Verbose() < level) return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  static const char kLevel[] = "WIDT";
  fprintf(stderr, "[jax_overlap_rt pid=%d tid=%ld %c] %s\n", (int)getpid(),
          (long)syscall(SYS_gettid), kLevel[level < 0 ? 0 : (level > 3 ? 3 : level)],
          msg);
}


const char* const kCounterNames[kNumCounters] = {
#define JOR_COUNTER_NAME(name, doc) #name,
    JOR_COUNTERS(JOR_COUNTER_NAME)
#undef JOR_COUNTER_NAME
};

std::atomic<uint64_t> g_counters[kNumCounters];

void PrintCounters() {
  fprintf(stderr, "[jax_overlap_rt pid=%d] counters:", (int)getpid());
  for (int i = 0; i < kNumCounters; ++i) {
    fprintf(stderr, " %s=%llu", kCounterNames[i],
            (unsigned long long)g_counters[i].load());
  }
  fprintf(stderr, "\n");
}

}  // namespace jor
