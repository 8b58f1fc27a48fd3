// Diagnostics of the runtime library: leveled logging to stderr and the
// counters (hooks.h lists them), readable through jor_counter_*.
#ifndef JAX_OVERLAP_XLA_PATCHES_RUNTIME_LOG_H_
#define JAX_OVERLAP_XLA_PATCHES_RUNTIME_LOG_H_

#include <stdint.h>

#include <atomic>

#include "hooks.h"

namespace jor {

// JAX_OVERLAP_RT_VERBOSE: 0 (default), 1 warnings and counters at exit,
// 2 one line per kernel decision, 3 every launch.
int Verbose();

__attribute__((format(printf, 2, 3))) void Log(int level, const char* fmt, ...);

enum CounterId {
#define JOR_COUNTER_ENUM(name, doc) kCounter_##name,
  JOR_COUNTERS(JOR_COUNTER_ENUM)
#undef JOR_COUNTER_ENUM
  kNumCounters
};

extern const char* const kCounterNames[kNumCounters];
extern std::atomic<uint64_t> g_counters[kNumCounters];

inline void Count(CounterId id, uint64_t n = 1) {
  g_counters[id].fetch_add(n, std::memory_order_relaxed);
}

// One line with every counter, on stderr.
void PrintCounters();

}  // namespace jor

#endif  // JAX_OVERLAP_XLA_PATCHES_RUNTIME_LOG_H_
