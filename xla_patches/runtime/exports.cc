// libjax_overlap_rt.so: occupancy shaping and stream priority at kernel launch.
//
// Loaded with LD_PRELOAD (jax-overlap launch sets it). It sees every kernel
// launch however the program reaches the driver:
//   * direct calls: it defines the hooked driver symbols (hooks.h) itself;
//   * dlopen("libcuda.so.1") + dlsym (XLA's runtime): it defines dlsym and,
//     for a handle that is libcuda, answers hooked names with its hooks;
//   * cuGetProcAddress / cuGetProcAddress_v2 (the CUDA runtime, cuBLAS, CuPy):
//     it asks the real driver, keeps the answer and hands out its hook.
// and, through dlsym too, cuBLAS handles and cuBLASLt descriptors as they are created
// (library_gemms.h: the plan's SM-count target for library GEMMs).
// Each hook forwards to the real driver entry point, found once under
// pthread_once (dlvsym / dlsym on RTLD_NEXT or on the libcuda handle).
//
// Without rules (JAX_OVERLAP_RT_RULES, written by `jax-overlap launch` from a
// validated JSON plan) and outside occupancy regions every launch is passed on
// unchanged; the library only counts. With rules, a selected launch gets more
// dynamic shared memory so that at most N of its blocks are resident per SM
// (shaping.h); on any driver error the original launch is sent and counted.
//
// Environment:
//   JAX_OVERLAP_RT_RULES    compiled plan (format: rules.h)
//   JAX_OVERLAP_RT_VERBOSE  0 (default), 1: warnings and counters at exit,
//                           2: one line per kernel decision, 3: every launch
//
// The library's parts: rules.cc (the plan), symbols.cc (real entry points),
// driver_info.cc (what the driver says, cached), regions.cc, decide.cc (what a
// launch or a stream gets), hooks.cc and procaddr.cc (what the program gets),
// shaping.cc (the residency arithmetic), log.cc (logging, counters) and this
// file: start-up, dlsym and the C API for Python, the FFI handlers and benchmarks.
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

#include "dispatch.h"
#include "init.h"
#include "library_gemms.h"
#include "log.h"
#include "regions.h"
#include "rules.h"
#include "symbols.h"

#define JOR_EXPORT extern "C" __attribute__((visibility("default")))

namespace jor {

namespace {

pthread_once_t g_init_once = PTHREAD_ONCE_INIT;

void InitOnce() {
  Verbose();
  const char* text = getenv("JAX_OVERLAP_RT_RULES");
  if (text != nullptr && *text != '\0') {
    int errors = InstallRules(text);
    if (errors > 0) Log(0, "JAX_OVERLAP_RT_RULES: %d line(s) ignored", errors);
  }
  for (int i = 0; i < kNumSyms; ++i) {
    if (kSymNames[i][0] != '\0') Real(i);
  }
  Log(2, "initialized; libcuda %s", LibcudaHandle() ? "loaded" : "not loaded yet");
}

// Kernel rules that selected no function: the plan names kernels this program
// never launched (a plan written for another step, or HLO names instead of the
// names the driver reports).
void PrintUnmatchedRules() {
  const jor::Rules* rules = CurrentRules();
  if (rules == nullptr) return;
  size_t unmatched = 0;
  for (size_t i = 0; i < rules->kernels.size(); ++i) {
    if (rules->functions[i].load() == 0) ++unmatched;
  }
  if (unmatched == 0) return;
  fprintf(stderr, "[jax_overlap_rt %d] %zu of %zu kernel rule(s) matched no kernel:", getpid(),
          unmatched, rules->kernels.size());
  for (size_t i = 0; i < rules->kernels.size(); ++i) {
    if (rules->functions[i].load() == 0) {
      fprintf(stderr, " %s%s", rules->kernels[i].is_regex ? "regex:" : "",
              rules->kernels[i].pattern.c_str());
    }
  }
  fprintf(stderr, "\n");
}

}  // namespace

void EnsureInit() { pthread_once(&g_init_once, InitOnce); }

namespace {

__attribute__((constructor)) void OnLoad() { EnsureInit(); }

__attribute__((destructor)) void OnUnload() {
  if (Verbose() >= 1) {
    PrintCounters();
    PrintUnmatchedRules();
  }
}

}  // namespace

}  // namespace jor

JOR_EXPORT void* dlsym(void* handle, const char* name) __THROW {
  jor::DlsymFn real = jor::RealDlsym();
  if (real == nullptr) return nullptr;
  if (handle == RTLD_NEXT) return jor::DlsymNextFromCaller(name, __builtin_return_address(0));
  if (name != nullptr && name[0] == 'c' && name[1] == 'u' && name[2] == 'b') {
    void* p = real(handle, name);  // a cuBLAS entry point (library_gemms.h)
    void* hook = jor::LibraryGemmHook(handle, name, p);
    return hook != nullptr ? hook : p;
  }
  const int id = jor::HookedId(name);
  if (id < 0 || !jor::IsLibcuda(handle)) return real(handle, name);
  void* p = real(handle, name);
  if (p == nullptr || jor::IsOurHook(p)) return p;
  if (jor::RecordReal(id, p) != p) return p;  // another libcuda: leave it alone
  jor::Count(jor::kCounter_lookups_dlsym);
  return jor::HookFor(jor::kPathDlsym, id);
}

// ---------------------------------------------------------------------------
// API for Python (ctypes), the FFI region handlers and benchmarks.
// ---------------------------------------------------------------------------

JOR_EXPORT int jor_version(void) { return 1; }

JOR_EXPORT int jor_counter_count(void) { return jor::kNumCounters; }

JOR_EXPORT const char* jor_counter_name(int i) {
  return (i >= 0 && i < jor::kNumCounters) ? jor::kCounterNames[i] : nullptr;
}

JOR_EXPORT uint64_t jor_counter_value(int i) {
  return (i >= 0 && i < jor::kNumCounters) ? jor::g_counters[i].load() : 0;
}

JOR_EXPORT void jor_reset_counters(void) {
  for (auto& c : jor::g_counters) c.store(0);
}

// Replaces the active rules; returns the number of lines that were ignored.
JOR_EXPORT int jor_set_rules(const char* text) {
  jor::EnsureInit();
  return jor::InstallRules(text ? text : "");
}

JOR_EXPORT int jor_rule_count(void) {
  const jor::Rules* r = jor::CurrentRules();
  return r ? static_cast<int>(r->kernels.size() + r->regions.size()) : 0;
}

JOR_EXPORT int jor_kernel_rule_count(void) {
  const jor::Rules* r = jor::CurrentRules();
  return r ? static_cast<int>(r->kernels.size()) : 0;
}

// The pattern of kernel rule `i` of the active rules, or null.
JOR_EXPORT const char* jor_kernel_rule_pattern(int i) {
  const jor::Rules* r = jor::CurrentRules();
  if (r == nullptr || i < 0 || static_cast<size_t>(i) >= r->kernels.size()) return nullptr;
  return r->kernels[i].pattern.c_str();
}

// Distinct functions kernel rule `i` has selected so far; -1 for a bad index.
JOR_EXPORT int64_t jor_kernel_rule_functions(int i) {
  const jor::Rules* r = jor::CurrentRules();
  if (r == nullptr || i < 0 || static_cast<size_t>(i) >= r->kernels.size()) return -1;
  return static_cast<int64_t>(r->functions[i].load());
}

// Enters an occupancy region on the calling thread: launches from this thread
// are capped at the plan's blocks_per_sm for `region_id`, else `blocks_per_sm`
// (0: no cap), until the matching jor_region_end.
JOR_EXPORT int jor_region_begin(int64_t region_id, int64_t blocks_per_sm) {
  return jor::RegionBegin(region_id, blocks_per_sm, true, nullptr);
}

// The same, for launches on `stream` only (what XLA's region thunks pass): other
// streams' launches from the thread are not capped, and a region whose end never
// ran (a failed execution) is closed when the region begins again on that stream.
JOR_EXPORT int jor_region_begin_on_stream(int64_t region_id, int64_t blocks_per_sm,
                                          void* stream) {
  return jor::RegionBegin(region_id, blocks_per_sm, false, static_cast<CUstream>(stream));
}

JOR_EXPORT int jor_region_end(int64_t region_id) { return jor::RegionEnd(region_id); }

JOR_EXPORT int64_t jor_region_blocks_per_sm(void) {
  return jor::CurrentRegionBlocks(nullptr, false);
}
