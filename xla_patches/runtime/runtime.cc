// libjax_overlap_rt.so: occupancy shaping and stream priority at kernel launch.
//
// Loaded with LD_PRELOAD (jax-overlap launch sets it). It sees every kernel
// launch however the program reaches the driver:
//   * direct calls: it defines the hooked driver symbols (hooks.h) itself;
//   * dlopen("libcuda.so.1") + dlsym (XLA's runtime): it defines dlsym and,
//     for a handle that is libcuda, answers hooked names with its hooks;
//   * cuGetProcAddress / cuGetProcAddress_v2 (the CUDA runtime, cuBLAS, CuPy):
//     it asks the real driver, keeps the answer and hands out its hook.
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
//   JAX_OVERLAP_RT_RULES    compiled plan (see ParseRules below)
//   JAX_OVERLAP_RT_VERBOSE  0 (default), 1: warnings and counters at exit,
//                           2: one line per kernel decision, 3: every launch
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <fnmatch.h>
#include <memory>
#include <mutex>
#include <regex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "hooks.h"
#include "shaping.h"

#define JOR_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// ---------------------------------------------------------------------------
// Logging.
// ---------------------------------------------------------------------------

int g_verbose = -1;

int Verbose() {
  if (g_verbose < 0) {
    const char* v = getenv("JAX_OVERLAP_RT_VERBOSE");
    g_verbose = (v && *v) ? atoi(v) : 0;
    if (v && *v && g_verbose == 0 && strcmp(v, "0") != 0) g_verbose = 1;
  }
  return g_verbose;
}

__attribute__((format(printf, 2, 3))) void Log(int level, const char* fmt,
                                                 ...) {
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

// ---------------------------------------------------------------------------
// Counters.
// ---------------------------------------------------------------------------

enum CounterId {
#define JOR_COUNTER_ENUM(name, doc) kCounter_##name,
  JOR_COUNTERS(JOR_COUNTER_ENUM)
#undef JOR_COUNTER_ENUM
  kNumCounters
};

const char* const kCounterNames[] = {
#define JOR_COUNTER_NAME(name, doc) #name,
    JOR_COUNTERS(JOR_COUNTER_NAME)
#undef JOR_COUNTER_NAME
};

std::atomic<uint64_t> g_counters[kNumCounters];

inline void Count(CounterId id, uint64_t n = 1) {
  g_counters[id].fetch_add(n, std::memory_order_relaxed);
}

// ---------------------------------------------------------------------------
// Symbols: one enum, one name table, one real-pointer table.
// ---------------------------------------------------------------------------

enum SymId {
#define JOR_SYM_ENUM(name, ret, params, args) kSym_##name,
  JOR_HOOKED_SYMBOLS(JOR_SYM_ENUM) kNumHooked,
  JOR_USED_SYMBOLS(JOR_SYM_ENUM) kNumSyms
#undef JOR_SYM_ENUM
};

const char* const kSymNames[] = {
#define JOR_SYM_NAME(name, ret, params, args) #name,
    JOR_HOOKED_SYMBOLS(JOR_SYM_NAME) "",
    JOR_USED_SYMBOLS(JOR_SYM_NAME)
#undef JOR_SYM_NAME
};

// kSymNames has an empty slot at kNumHooked so that the enum and the table
// share indices; SymName() skips it.
#define JOR_SYM_TYPE(name, ret, params, args) typedef ret(*PFN_##name) params;
JOR_HOOKED_SYMBOLS(JOR_SYM_TYPE)
JOR_USED_SYMBOLS(JOR_SYM_TYPE)
#undef JOR_SYM_TYPE

std::atomic<void*> g_real[kNumSyms + 1];

// Paths by which a program obtained a hook; each has its own instantiation
// so that launches can be counted by path.
enum Path { kPathDirect = 0, kPathDlsym = 1, kPathProcAddr = 2, kNumPaths };

typedef void* (*DlsymFn)(void*, const char*);
DlsymFn g_real_dlsym = nullptr;
pthread_once_t g_dlsym_once = PTHREAD_ONCE_INIT;
pthread_once_t g_init_once = PTHREAD_ONCE_INIT;
std::atomic<void*> g_libcuda_handle{nullptr};

void ResolveRealDlsym() {
  // dlsym itself is interposed, so the real one comes from dlvsym: glibc >= 2.34
  // versions it GLIBC_2.34, older glibc GLIBC_2.2.5 (x86-64) / GLIBC_2.17 (arm64).
  static const char* const kVersions[] = {"GLIBC_2.34", "GLIBC_2.2.5",
                                          "GLIBC_2.17"};
  for (const char* v : kVersions) {
    void* p = dlvsym(RTLD_NEXT, "dlsym", v);
    if (p != nullptr) {
      g_real_dlsym = reinterpret_cast<DlsymFn>(p);
      return;
    }
  }
}

DlsymFn RealDlsym() {
  pthread_once(&g_dlsym_once, ResolveRealDlsym);
  return g_real_dlsym;
}

void* LibcudaHandle() {
  void* h = g_libcuda_handle.load(std::memory_order_acquire);
  if (h != nullptr) return h;
  static const char* const kNames[] = {"libcuda.so.1", "libcuda.so"};
  for (const char* n : kNames) {
    h = dlopen(n, RTLD_LAZY | RTLD_NOLOAD);
    if (h != nullptr) {
      g_libcuda_handle.store(h, std::memory_order_release);
      return h;
    }
  }
  return nullptr;
}

// The real entry point for `id`, resolved on first use.
void* Real(int id) {
  void* p = g_real[id].load(std::memory_order_acquire);
  if (p != nullptr) return p;
  DlsymFn real_dlsym = RealDlsym();
  if (real_dlsym == nullptr) return nullptr;
  void* h = LibcudaHandle();
  if (h != nullptr) p = real_dlsym(h, kSymNames[id]);
  if (p == nullptr) p = real_dlsym(RTLD_NEXT, kSymNames[id]);
  if (p != nullptr) {
    void* expected = nullptr;
    g_real[id].compare_exchange_strong(expected, p);
    p = g_real[id].load(std::memory_order_acquire);
  }
  return p;
}

#define REAL(name) reinterpret_cast<PFN_##name>(Real(kSym_##name))

// ---------------------------------------------------------------------------
// Rules (the compiled plan) and regions.
// ---------------------------------------------------------------------------

struct KernelRule {
  std::string pattern;
  bool is_regex = false;
  std::regex regex;
  int64_t blocks_per_sm = 0;  // > 0: cap residency
  int64_t padding_bytes = 0;  // > 0: add this much dynamic shared memory
};

struct Rules {
  uint64_t generation = 0;
  std::vector<KernelRule> kernels;
  // Per kernel rule: distinct functions it has selected so far (a rule that
  // stays at 0 names no kernel the program launched).
  std::unique_ptr<std::atomic<uint64_t>[]> functions;
  std::unordered_map<int64_t, int64_t> regions;  // id -> blocks_per_sm
  bool stream_priority_highest = false;
  bool promote_requested = false;
  std::vector<int64_t> stream_create_order;
  // The communication block caps must make room for: none (caps as given),
  // `comm` as stated, or NCCL's channel for the device (auto).
  enum { kRoomNone, kRoomGiven, kRoomAuto } room = kRoomNone;
  JorCommBlock comm{0, 0, 0};
  std::string text;
};

std::atomic<const Rules*> g_rules{nullptr};
std::atomic<uint64_t> g_generation{1};
std::mutex g_rules_mu;  // serializes jor_set_rules; old rules are kept alive
std::vector<const Rules*>* g_retired_rules = nullptr;

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t pos = s.find(sep, start);
    out.push_back(s.substr(start, pos == std::string::npos ? std::string::npos
                                                           : pos - start));
    if (pos == std::string::npos) break;
    start = pos + 1;
  }
  return out;
}

bool ParseInt(const std::string& s, int64_t* out) {
  if (s.empty()) return false;
  char* end = nullptr;
  long long v = strtoll(s.c_str(), &end, 10);
  if (end == nullptr || *end != '\0') return false;
  *out = v;
  return true;
}

// Rules text, one rule per line, fields separated by tabs:
//   version  1
//   kernel   glob|regex  <pattern>  blocks_per_sm|padding_bytes  <int>
//   region   <int64 id>  blocks_per_sm  <int>
//   streams  priority  highest|default
//   streams  promote_requested  0|1
//   streams  create_order  <i>,<j>,...
//   comm_block  auto | none | <threads> <regs_per_thread> <smem_bytes>
// Returns the number of lines that could not be used (each is logged).
int ParseRules(const char* text, Rules* rules) {
  int errors = 0;
  rules->text = text ? text : "";
  for (const std::string& raw : Split(rules->text, '\n')) {
    std::string line = raw;
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> f = Split(line, '\t');
    int64_t value = 0;
    if (f[0] == "version" && f.size() == 2) {
      if (f[1] != "1") {
        Log(0, "rules: unsupported version %s (expected 1)", f[1].c_str());
        ++errors;
      }
    } else if (f[0] == "kernel" && f.size() == 5 &&
               (f[1] == "glob" || f[1] == "regex") &&
               (f[3] == "blocks_per_sm" || f[3] == "padding_bytes") &&
               ParseInt(f[4], &value) &&
               (f[3] == "blocks_per_sm" ? value >= 1 : value >= 0)) {
      KernelRule rule;
      rule.pattern = f[2];
      rule.is_regex = f[1] == "regex";
      if (rule.is_regex) {
        try {
          rule.regex = std::regex(rule.pattern, std::regex::ECMAScript);
        } catch (const std::exception& e) {
          Log(0, "rules: bad regex '%s': %s", rule.pattern.c_str(), e.what());
          ++errors;
          continue;
        }
      }
      (f[3] == "blocks_per_sm" ? rule.blocks_per_sm : rule.padding_bytes) = value;
      rules->kernels.push_back(std::move(rule));
    } else if (f[0] == "region" && f.size() == 4 && f[2] == "blocks_per_sm" &&
               ParseInt(f[1], &value)) {
      int64_t blocks = 0;
      if (!ParseInt(f[3], &blocks) || blocks < 1) {
        Log(0, "rules: bad blocks_per_sm in line '%s'", line.c_str());
        ++errors;
        continue;
      }
      rules->regions[value] = blocks;
    } else if (f[0] == "streams" && f.size() == 3 && f[1] == "priority" &&
               (f[2] == "highest" || f[2] == "default")) {
      rules->stream_priority_highest = f[2] == "highest";
    } else if (f[0] == "streams" && f.size() == 3 && f[1] == "promote_requested" &&
               (f[2] == "0" || f[2] == "1")) {
      rules->promote_requested = f[2] == "1";
    } else if (f[0] == "comm_block" && f.size() == 2 && (f[1] == "auto" || f[1] == "none")) {
      rules->room = f[1] == "auto" ? Rules::kRoomAuto : Rules::kRoomNone;
    } else if (f[0] == "comm_block" && f.size() == 4) {
      int64_t t = 0, r = 0, m = 0;
      if (!ParseInt(f[1], &t) || !ParseInt(f[2], &r) || !ParseInt(f[3], &m) || t < 1 ||
          t > 1024 || r < 0 || r > 255 || m < 0) {
        Log(0, "rules: bad comm_block line '%s' (threads 1-1024, registers 0-255, bytes >= 0)",
            line.c_str());
        ++errors;
        continue;
      }
      rules->room = Rules::kRoomGiven;
      rules->comm = JorCommBlock{t, r, m};
    } else if (f[0] == "streams" && f.size() == 3 && f[1] == "create_order") {
      for (const std::string& item : Split(f[2], ',')) {
        if (item.empty()) continue;
        if (!ParseInt(item, &value) || value < 0) {
          Log(0, "rules: bad stream index '%s'", item.c_str());
          ++errors;
          continue;
        }
        rules->stream_create_order.push_back(value);
      }
    } else {
      Log(0, "rules: ignoring line '%s'", line.c_str());
      ++errors;
    }
  }
  return errors;
}

int InstallRules(const char* text) {
  Rules* rules = new Rules();
  int errors = ParseRules(text, rules);
  rules->functions.reset(new std::atomic<uint64_t>[rules->kernels.size()]());
  rules->generation = g_generation.fetch_add(1) + 1;
  std::lock_guard<std::mutex> lock(g_rules_mu);
  const Rules* old = g_rules.exchange(rules, std::memory_order_acq_rel);
  // Launching threads may still read the old rules: keep them alive.
  if (old != nullptr) {
    if (g_retired_rules == nullptr) g_retired_rules = new std::vector<const Rules*>();
    g_retired_rules->push_back(old);
  }
  Log(2, "rules: %zu kernel rules, %zu region rules, stream priority %s",
      rules->kernels.size(), rules->regions.size(),
      rules->stream_priority_highest ? "highest" : "default");
  return errors;
}

const Rules* CurrentRules() { return g_rules.load(std::memory_order_acquire); }

struct RegionFrame {
  int64_t id;
  int64_t blocks_per_sm;  // resolved at begin: plan's entry, else the attribute
  bool any_stream;        // opened by jor_region_begin: every launch of the thread
  CUstream stream;        // opened by jor_region_begin_on_stream: launches on this stream
};
constexpr int kMaxRegionDepth = 32;
thread_local RegionFrame t_regions[kMaxRegionDepth];
thread_local int t_region_depth = 0;

// The cap of the innermost open region that applies to a launch on `stream`
// (`any` for a launch whose stream is not known, such as a graph node: only
// regions opened for every stream apply).
int64_t CurrentRegionBlocks(CUstream stream, bool known_stream) {
  int d = t_region_depth > kMaxRegionDepth ? kMaxRegionDepth : t_region_depth;
  for (int i = d - 1; i >= 0; --i) {
    const RegionFrame& r = t_regions[i];
    if (r.any_stream || (known_stream && r.stream == stream)) return r.blocks_per_sm;
  }
  return 0;
}

// ---------------------------------------------------------------------------
// Per-device limits and per-function attributes, cached.
// ---------------------------------------------------------------------------

constexpr int kMaxDevices = 64;
struct DeviceSlot {
  std::atomic<int> state{0};  // 0 unknown, 1 ok, 2 failed
  JorDeviceLimits limits;
  int cc_major = 0, cc_minor = 0;  // 0 when the driver does not say
};
DeviceSlot g_devices[kMaxDevices];
std::mutex g_device_mu;

bool DeviceLimits(JorDeviceLimits* out, int* cc_major = nullptr, int* cc_minor = nullptr) {
  CUdevice dev = 0;
  auto get_device = REAL(cuCtxGetDevice);
  auto get_attr = REAL(cuDeviceGetAttribute);
  if (get_device == nullptr || get_attr == nullptr) return false;
  if (get_device(&dev) != JOR_CUDA_SUCCESS || dev < 0 || dev >= kMaxDevices) {
    return false;
  }
  DeviceSlot& slot = g_devices[dev];
  int state = slot.state.load(std::memory_order_acquire);
  auto cached = [&] {
    *out = slot.limits;
    if (cc_major != nullptr) *cc_major = slot.cc_major;
    if (cc_minor != nullptr) *cc_minor = slot.cc_minor;
    return true;
  };
  if (state == 1) return cached();
  std::lock_guard<std::mutex> lock(g_device_mu);
  if (slot.state.load() == 1) return cached();
  struct {
    int attr;
    int64_t* field;
  } table[] = {
      {JOR_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, &slot.limits.sm_count},
      {JOR_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, &slot.limits.smem_per_sm},
      {JOR_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
       &slot.limits.smem_per_block_optin},
      {JOR_CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK,
       &slot.limits.smem_reserved_per_block},
      {JOR_CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR,
       &slot.limits.max_threads_per_sm},
      {JOR_CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR, &slot.limits.max_blocks_per_sm},
      {JOR_CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR, &slot.limits.regs_per_sm},
      {JOR_CU_DEVICE_ATTRIBUTE_WARP_SIZE, &slot.limits.warp_size},
  };
  for (auto& entry : table) {
    int value = 0;
    if (get_attr(&value, entry.attr, dev) != JOR_CUDA_SUCCESS) {
      Log(1, "device %d: cuDeviceGetAttribute(%d) failed; shaping disabled on it",
          dev, entry.attr);
      return false;  // not cached: a later launch tries again
    }
    *entry.field = value;
  }
  // Register allocation granularity per warp: 256 on every part since sm_30
  // (CUDA occupancy calculator, "Register allocation unit size").
  slot.limits.reg_alloc_unit = 256;
  int major = 0, minor = 0;
  if (get_attr(&major, JOR_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev) != JOR_CUDA_SUCCESS ||
      get_attr(&minor, JOR_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev) != JOR_CUDA_SUCCESS) {
    major = minor = 0;
  }
  slot.cc_major = major;
  slot.cc_minor = minor;
  // Shared memory allocation unit per block (CUDA occupancy calculator): 128
  // bytes on sm_80 and later, 256 before.
  slot.limits.smem_alloc_unit = major >= 8 || major == 0 ? 128 : 256;
  slot.state.store(1, std::memory_order_release);
  if (cc_major != nullptr) *cc_major = major;
  if (cc_minor != nullptr) *cc_minor = minor;
  Log(2,
      "device %d: %lld SMs, smem/SM %lld, opt-in %lld, reserved %lld, threads/SM "
      "%lld, blocks/SM %lld, regs/SM %lld",
      dev, (long long)slot.limits.sm_count, (long long)slot.limits.smem_per_sm,
      (long long)slot.limits.smem_per_block_optin,
      (long long)slot.limits.smem_reserved_per_block,
      (long long)slot.limits.max_threads_per_sm,
      (long long)slot.limits.max_blocks_per_sm, (long long)slot.limits.regs_per_sm);
  *out = slot.limits;
  return true;
}

struct FuncInfo {
  std::string name;
  int static_smem = 0;
  int regs = 0;
  int max_dynamic_smem = 0;
  bool carveout_set = false;
  bool queried = false;
  bool failed = false;      // the driver could not answer; asked again only under new rules
  bool cluster = false;     // compiled with fixed cluster dimensions: always a cluster launch
  uint64_t generation = 0;  // rules generation of `rule`
  int rule = -1;            // index into Rules::kernels, -1: none
};

std::shared_mutex g_func_mu;
std::unordered_map<CUfunction, FuncInfo>* g_funcs = nullptr;

bool QueryFunc(CUfunction f, FuncInfo* info) {
  auto get_attr = REAL(cuFuncGetAttribute);
  if (get_attr == nullptr) return false;
  if (get_attr(&info->static_smem, JOR_CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, f) !=
          JOR_CUDA_SUCCESS ||
      get_attr(&info->regs, JOR_CU_FUNC_ATTRIBUTE_NUM_REGS, f) != JOR_CUDA_SUCCESS ||
      get_attr(&info->max_dynamic_smem,
               JOR_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
               f) != JOR_CUDA_SUCCESS) {
    return false;
  }
  // Compile-time cluster dimensions make every launch of the function a cluster
  // launch, whatever the launch call says. Drivers before CUDA 12 do not know
  // the attributes: no answer means no fixed cluster.
  int dims[3] = {1, 1, 1};
  const int attrs[3] = {JOR_CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH,
                        JOR_CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT,
                        JOR_CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH};
  for (int i = 0; i < 3; ++i) {
    if (get_attr(&dims[i], attrs[i], f) != JOR_CUDA_SUCCESS || dims[i] < 1) dims[i] = 1;
  }
  info->cluster = dims[0] * dims[1] * dims[2] > 1;
  const char* name = nullptr;
  auto get_name = REAL(cuFuncGetName);
  if (get_name != nullptr && get_name(&name, f) == JOR_CUDA_SUCCESS && name) {
    info->name = name;
  } else {
    info->name = "";
  }
  return true;
}

bool RuleMatches(const KernelRule& rule, const std::string& name) {
  if (name.empty()) return false;
  if (rule.is_regex) {
    try {
      return std::regex_search(name, rule.regex);
    } catch (const std::exception&) {
      return false;
    }
  }
  return fnmatch(rule.pattern.c_str(), name.c_str(), 0) == 0;
}

// Looks up (or queries) `f` and its matching kernel rule under `rules`.
// The name is copied only when `want_name` (logging): the per-launch path
// copies a few integers under a shared lock.
bool FuncFor(CUfunction f, const Rules* rules, FuncInfo* out, bool want_name) {
  {
    std::shared_lock<std::shared_mutex> lock(g_func_mu);
    if (g_funcs != nullptr) {
      auto it = g_funcs->find(f);
      if (it != g_funcs->end() && it->second.generation == rules->generation) {
        const FuncInfo& cached = it->second;
        if (cached.failed) return false;
        out->static_smem = cached.static_smem;
        out->regs = cached.regs;
        out->max_dynamic_smem = cached.max_dynamic_smem;
        out->carveout_set = cached.carveout_set;
        out->cluster = cached.cluster;
        out->queried = cached.queried;
        out->generation = cached.generation;
        out->rule = cached.rule;
        if (want_name) out->name = cached.name;
        return true;
      }
    }
  }
  FuncInfo info;
  {
    std::shared_lock<std::shared_mutex> lock(g_func_mu);
    if (g_funcs != nullptr) {
      auto it = g_funcs->find(f);
      if (it != g_funcs->end()) info = it->second;
    }
  }
  if (!info.queried) {
    if (!QueryFunc(f, &info)) {
      // Remember the failure: a function the driver cannot describe (say a CUkernel
      // handle it does not resolve) is not asked about again on every launch.
      info.failed = true;
      info.generation = rules->generation;
      Log(1, "kernel %p: the driver did not report its attributes; launched unchanged", f);
      std::unique_lock<std::shared_mutex> lock(g_func_mu);
      if (g_funcs == nullptr) g_funcs = new std::unordered_map<CUfunction, FuncInfo>();
      (*g_funcs)[f] = info;
      return false;
    }
    info.queried = true;
    info.failed = false;
  }
  info.rule = -1;
  for (size_t i = 0; i < rules->kernels.size(); ++i) {
    if (RuleMatches(rules->kernels[i], info.name)) {
      info.rule = static_cast<int>(i);
      rules->functions[i].fetch_add(1, std::memory_order_relaxed);
      break;
    }
  }
  info.generation = rules->generation;
  Log(2, "kernel %s: static smem %d, %d regs, max dynamic smem %d, rule %d",
      info.name.empty() ? "<unnamed>" : info.name.c_str(), info.static_smem,
      info.regs, info.max_dynamic_smem, info.rule);
  std::unique_lock<std::shared_mutex> lock(g_func_mu);
  if (g_funcs == nullptr) g_funcs = new std::unordered_map<CUfunction, FuncInfo>();
  (*g_funcs)[f] = info;
  *out = info;
  return true;
}

// A per-thread, direct-mapped copy of the attributes of recently launched
// functions, so that the common launch takes no lock.
struct FuncLite {
  CUfunction f = nullptr;
  uint64_t generation = 0;
  uint64_t epoch = 0;
  int static_smem = 0;
  int regs = 0;
  int max_dynamic_smem = 0;
  bool carveout_set = false;
  bool cluster = false;
  int rule = -1;
  // Last answer of the room rule (Decide), valid until the slot is refilled.
  bool room_valid = false;
  unsigned room_threads = 0, room_dyn = 0;
  int64_t room_blocks = 0, room_smem_sm = 0, room_r = 0;
  int room_reasons = 0;
};
constexpr int kTlsFuncs = 16;
thread_local FuncLite t_funcs[kTlsFuncs];

FuncLite& TlsFunc(CUfunction f) {
  return t_funcs[(reinterpret_cast<uintptr_t>(f) >> 4) % kTlsFuncs];
}

// Bumped when a module or library is unloaded: its CUfunction handles may be
// reused by kernels loaded later, so every cached entry is dropped.
std::atomic<uint64_t> g_func_epoch{1};

void FillTls(CUfunction f, const FuncInfo& info) {
  FuncLite& slot = TlsFunc(f);
  slot.f = f;
  slot.epoch = g_func_epoch.load(std::memory_order_acquire);
  slot.generation = info.generation;
  slot.static_smem = info.static_smem;
  slot.regs = info.regs;
  slot.max_dynamic_smem = info.max_dynamic_smem;
  slot.carveout_set = info.carveout_set;
  slot.cluster = info.cluster;
  slot.rule = info.rule;
  slot.room_valid = false;
}

// Raises the kernel's MAX_DYNAMIC_SHARED_SIZE_BYTES to `dyn` if it is lower
// (and asks once for the largest carve-out). The shared entry is checked under
// the lock so that one raise serves every thread.
bool EnsureMaxDynamic(CUfunction f, FuncLite* lite, int64_t dyn) {
  if (dyn <= lite->max_dynamic_smem && lite->carveout_set) return true;
  auto set_attr = REAL(cuFuncSetAttribute);
  if (set_attr == nullptr) return false;
  std::unique_lock<std::shared_mutex> lock(g_func_mu);
  FuncInfo* entry = nullptr;
  if (g_funcs != nullptr) {
    auto it = g_funcs->find(f);
    if (it != g_funcs->end()) entry = &it->second;
  }
  int current = entry ? entry->max_dynamic_smem : lite->max_dynamic_smem;
  bool carveout = entry ? entry->carveout_set : lite->carveout_set;
  if (!carveout) {
    // Ask for the largest shared-memory carve-out so that residency is the one
    // computed from smem_per_sm; a refusal only makes residency lower.
    set_attr(f, JOR_CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100);
    carveout = true;
  }
  if (dyn > current) {
    if (set_attr(f, JOR_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                 static_cast<int>(dyn)) != JOR_CUDA_SUCCESS) {
      return false;
    }
    Count(kCounter_func_attr_raised);
    current = static_cast<int>(dyn);
  }
  if (entry != nullptr) {
    entry->carveout_set = carveout;
    entry->max_dynamic_smem = current;
  }
  lite->carveout_set = carveout;
  lite->max_dynamic_smem = current;
  return true;
}

// The driver's word on residency. The arithmetic (shaping.cc) proposes the dynamic
// shared memory for a cap; the driver's occupancy calculator, which knows rules the
// arithmetic approximates (registers per sub-partition, allocation units), decides:
// a kernel the driver already runs at or below the cap is not padded, and a
// proposal the driver still finds above the cap grows in 128-byte steps up to the
// opt-in limit. Answers are cached per (function, block size, dynamic smem, cap).
// Returns the dynamic shared memory to launch with; `dyn` itself means "leave it".
struct OccKey {
  CUfunction f;
  unsigned threads, dyn;
  int64_t cap;
  bool operator==(const OccKey& o) const {
    return f == o.f && threads == o.threads && dyn == o.dyn && cap == o.cap;
  }
};
struct OccKeyHash {
  size_t operator()(const OccKey& k) const {
    return std::hash<const void*>()(k.f) ^ (size_t(k.threads) << 1) ^ (size_t(k.dyn) << 17) ^
           (size_t(k.cap) << 40);
  }
};
std::shared_mutex g_occ_mu;
std::unordered_map<OccKey, int64_t, OccKeyHash>* g_occ = nullptr;

int64_t DriverChecked(CUfunction f, unsigned threads, unsigned dyn, int64_t proposed,
                      int64_t cap, int64_t max_dyn) {
  auto occ = REAL(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags);
  if (occ == nullptr) return proposed;
  const OccKey key{f, threads, dyn, cap};
  {
    std::shared_lock<std::shared_mutex> lock(g_occ_mu);
    if (g_occ != nullptr) {
      auto it = g_occ->find(key);
      if (it != g_occ->end()) return it->second;
    }
  }
  int64_t result = proposed;
  int n = 0;
  if (occ(&n, f, static_cast<int>(threads), dyn, 0) == JOR_CUDA_SUCCESS) {
    if (n <= cap) {
      result = dyn;  // already at or below the cap
    } else {
      for (int64_t d = proposed;; d = std::min<int64_t>(max_dyn, d + 128)) {
        if (occ(&n, f, static_cast<int>(threads), static_cast<size_t>(d), 0) !=
            JOR_CUDA_SUCCESS) {
          result = proposed;
          break;
        }
        result = d;
        if (n <= cap || d >= max_dyn) break;
      }
    }
  }
  std::unique_lock<std::shared_mutex> lock(g_occ_mu);
  if (g_occ == nullptr) g_occ = new std::unordered_map<OccKey, int64_t, OccKeyHash>();
  (*g_occ)[key] = result;
  return result;
}

// NCCL's Simple-protocol channel size: NCCL_NTHREADS (default 512) plus one
// synchronization warp (NCCL_SIMPLE_EXTRA_GROUP_IF_NTHREADS_GE: 96 threads).
int64_t NcclSimpleThreads() {
  static const int64_t threads = [] {
    int64_t n = 512;
    const char* v = getenv("NCCL_NTHREADS");
    int64_t parsed = 0;
    if (v != nullptr && ParseInt(v, &parsed) && parsed >= 64 && parsed <= 512 &&
        parsed % 64 == 0) {
      n = parsed;
    }
    return n >= 96 ? n + 32 : n;
  }();
  return threads;
}

// The communication block the rules make room for; false: no room check.
bool CommBlockFor(const Rules* rules, int cc_major, int cc_minor, JorCommBlock* out) {
  if (rules->room == Rules::kRoomGiven) {
    *out = rules->comm;
    return true;
  }
  if (rules->room == Rules::kRoomAuto) {
    return jor_nccl_comm_block(cc_major, cc_minor, NcclSimpleThreads(), out) != 0;
  }
  return false;
}

void CountNoRoom(int reasons) {
  Count(kCounter_launches_no_room);
  if (reasons & JOR_NO_ROOM_REGISTERS) Count(kCounter_no_room_registers);
  if (reasons & JOR_NO_ROOM_THREADS) Count(kCounter_no_room_threads);
  if (reasons & JOR_NO_ROOM_SMEM) Count(kCounter_no_room_smem);
  if (reasons & JOR_NO_ROOM_BLOCKS) Count(kCounter_no_room_blocks);
}

enum Decision { kPass, kShape, kFallback, kSkip };

// Decides the dynamic shared memory of one launch. `skip` marks launches that
// must keep their configuration (cooperative, clusters).
Decision Decide(CUfunction f, CUstream stream, bool known_stream, unsigned threads, unsigned dyn,
                bool skip,
                unsigned* new_dyn) {
  *new_dyn = dyn;
  const Rules* rules = CurrentRules();
  const int64_t region_blocks = CurrentRegionBlocks(stream, known_stream);
  if (region_blocks > 0) Count(kCounter_launches_in_region);
  if ((rules == nullptr || rules->kernels.empty()) && region_blocks <= 0) return kPass;
  static const Rules* const kEmpty = [] {
    Rules* r = new Rules();
    r->generation = 1;
    r->room = Rules::kRoomAuto;  // regions without a plan make room for NCCL's channel
    return r;
  }();
  if (rules == nullptr) rules = kEmpty;
  if (f == nullptr) return kPass;
  FuncLite* lite = &TlsFunc(f);
  std::string name;
  if (lite->f != f || lite->generation != rules->generation ||
      lite->epoch != g_func_epoch.load(std::memory_order_acquire) || Verbose() >= 3) {
    FuncInfo info;
    if (!FuncFor(f, rules, &info, Verbose() >= 3)) return kFallback;
    FillTls(f, info);
    lite = &TlsFunc(f);
    name = info.name;
  }
  int64_t blocks = 0, padding = 0;
  if (lite->rule >= 0) {
    blocks = rules->kernels[lite->rule].blocks_per_sm;
    padding = rules->kernels[lite->rule].padding_bytes;
  } else {
    blocks = region_blocks;
  }
  if (blocks <= 0 && padding <= 0) return kPass;
  if (skip || lite->cluster) {
    Count(kCounter_launches_skipped);
    return kPass;
  }
  JorDeviceLimits limits;
  int cc_major = 0, cc_minor = 0;
  if (!DeviceLimits(&limits, &cc_major, &cc_minor)) return kFallback;
  JorCommBlock comm;
  const bool room = blocks > 0 && CommBlockFor(rules, cc_major, cc_minor, &comm);
  if (room) {
    // The room rule loops over caps and warps: remembered per thread for the last
    // launch configuration of this function (a kernel relaunches with the same one).
    if (!(lite->room_valid && lite->room_threads == threads && lite->room_dyn == dyn &&
          lite->room_blocks == blocks && lite->room_smem_sm == limits.smem_per_sm)) {
      lite->room_r = jor_room_cap(&limits, &comm, threads, lite->regs, lite->static_smem, dyn,
                                  blocks, &lite->room_reasons);
      lite->room_threads = threads;
      lite->room_dyn = dyn;
      lite->room_blocks = blocks;
      lite->room_smem_sm = limits.smem_per_sm;
      lite->room_valid = true;
    }
    const int reasons = lite->room_reasons;
    const int64_t r = lite->room_r;
    if (r < 1) {
      // No reason: the arithmetic says the kernel cannot run at all; leave it to the driver.
      if (reasons == 0) Count(kCounter_launches_skipped);
      else CountNoRoom(reasons);
      return kPass;
    }
    blocks = r;
  }
  int status = JOR_SHAPE_INVALID;
  int64_t shaped =
      blocks > 0 ? jor_shaped_dynamic_smem(&limits, threads, lite->regs, lite->static_smem,
                                           dyn, blocks, &status)
                 : jor_padded_dynamic_smem(&limits, lite->static_smem, dyn, padding, &status);
  if (status == JOR_SHAPE_INVALID) {
    Count(kCounter_launches_skipped);
    return kPass;
  }
  if (blocks > 0 && status != JOR_SHAPE_INVALID) {
    const int64_t max_dyn = limits.smem_per_block_optin - lite->static_smem;
    shaped = DriverChecked(f, threads, dyn, status == JOR_SHAPE_UNCHANGED ? dyn : shaped, blocks,
                           max_dyn);
    status = shaped >= max_dyn ? JOR_SHAPE_CAPPED : JOR_SHAPE_SHAPED;
    // The driver may ask for more shared memory than the arithmetic: the room
    // must still be there.
    if (room && shaped != dyn) {
      const int why =
          jor_no_room(&limits, &comm, blocks, threads, lite->regs, lite->static_smem + shaped);
      if (why != 0) {
        CountNoRoom(why);
        return kPass;
      }
    }
  }
  if (status == JOR_SHAPE_UNCHANGED || shaped == dyn) return kPass;
  if (!EnsureMaxDynamic(f, lite, shaped)) return kFallback;
  if (status == JOR_SHAPE_CAPPED) Count(kCounter_launches_capped);
  *new_dyn = static_cast<unsigned>(shaped);
  Log(3, "launch %s: %u threads, dynamic smem %u -> %u", name.c_str(), threads,
      dyn, *new_dyn);
  return kShape;
}

void CountPath(int path) {
  static const CounterId kByPath[kNumPaths] = {
      kCounter_launches_direct, kCounter_launches_dlsym, kCounter_launches_procaddr};
  Count(kByPath[path]);
}

void InitOnce();

// ---------------------------------------------------------------------------
// Hooks.
// ---------------------------------------------------------------------------

// Driver answers from cuGetProcAddress that are not the exported entry points
// (versioned implementations) each get a hook instance of their own, a slot,
// that forwards to exactly that answer.
constexpr int kExtraSlots = 4;
std::atomic<void*> g_slot_real[kNumHooked][kExtraSlots];

void* RealOrSlot(int id, int slot) {
  return slot < 0 ? Real(id) : g_slot_real[id][slot].load(std::memory_order_acquire);
}

// Whether `stream` is capturing into a graph. A shaped launch that fails there is
// not re-launched: the failure has already invalidated the capture, and a second
// launch would only replace the real error with "capture invalidated".
bool Capturing(CUstream stream) {
  auto is_capturing = REAL(cuStreamIsCapturing);
  int status = 0;  // CU_STREAM_CAPTURE_STATUS_NONE
  return is_capturing != nullptr && is_capturing(stream, &status) == JOR_CUDA_SUCCESS &&
         status != 0;
}

// After a shaped launch failed with `r`: true when the original launch may follow.
bool MayRelaunch(CUresult r, CUstream stream) {
  if (Capturing(stream)) {
    Count(kCounter_capture_errors);
    Log(1, "shaped launch failed inside stream capture (error %d); not re-launched", r);
    return false;
  }
  Count(kCounter_launches_fallback);
  Log(1, "shaped launch failed (error %d); launching the original configuration", r);
  return true;
}

template <int kPath, int kId, int kSlot = -1>
CUresult LaunchKernelHook JOR_LAUNCH_PARAMS {
  pthread_once(&g_init_once, InitOnce);
  auto real = reinterpret_cast<PFN_cuLaunchKernel>(RealOrSlot(kId, kSlot));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  Count(kCounter_launches_seen);
  CountPath(kPath);
  unsigned dyn = sharedMemBytes;
  const unsigned threads = blockDimX * blockDimY * blockDimZ;
  Decision d = Decide(f, hStream, true, threads, sharedMemBytes, false, &dyn);
  if (d == kFallback) Count(kCounter_launches_fallback);
  if (d != kShape) return real JOR_LAUNCH_ARGS;
  CUresult r = real(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                    dyn, hStream, kernelParams, extra);
  if (r == JOR_CUDA_SUCCESS) {
    Count(kCounter_launches_shaped);
    return r;
  }
  if (!MayRelaunch(r, hStream)) return r;
  return real JOR_LAUNCH_ARGS;
}

bool SkipLaunchEx(const CUlaunchConfig* config) {
  for (unsigned i = 0; i < config->numAttrs && config->attrs != nullptr; ++i) {
    const CUlaunchAttribute& a = config->attrs[i];
    if (a.id == JOR_CU_LAUNCH_ATTRIBUTE_COOPERATIVE && a.value.cooperative != 0) return true;
    if (a.id == JOR_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION &&
        a.value.clusterDim.x * a.value.clusterDim.y * a.value.clusterDim.z > 1) {
      return true;
    }
  }
  return false;
}

template <int kPath, int kId, int kSlot = -1>
CUresult LaunchKernelExHook JOR_LAUNCH_EX_PARAMS {
  pthread_once(&g_init_once, InitOnce);
  auto real = reinterpret_cast<PFN_cuLaunchKernelEx>(RealOrSlot(kId, kSlot));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  Count(kCounter_launches_seen);
  CountPath(kPath);
  if (config == nullptr) return real JOR_LAUNCH_EX_ARGS;
  unsigned dyn = config->sharedMemBytes;
  const unsigned threads = config->blockDimX * config->blockDimY * config->blockDimZ;
  Decision d = Decide(f, config->hStream, true, threads, config->sharedMemBytes,
                      SkipLaunchEx(config), &dyn);
  if (d == kFallback) Count(kCounter_launches_fallback);
  if (d != kShape) return real JOR_LAUNCH_EX_ARGS;
  CUlaunchConfig shaped = *config;
  shaped.sharedMemBytes = dyn;
  CUresult r = real(&shaped, f, kernelParams, extra);
  if (r == JOR_CUDA_SUCCESS) {
    Count(kCounter_launches_shaped);
    return r;
  }
  if (!MayRelaunch(r, config->hStream)) return r;
  return real JOR_LAUNCH_EX_ARGS;
}

// Graph kernel nodes (command buffers): shaped when they are added or updated,
// with the policy active on the recording thread at that time.
template <typename Params>
bool ShapeNode(const Params* p, Params* shaped) {
  Count(kCounter_graph_nodes_seen);
  if (p == nullptr || p->func == nullptr) return false;
  unsigned dyn = p->sharedMemBytes;
  Decision d = Decide(p->func, nullptr, false, p->blockDimX * p->blockDimY * p->blockDimZ,
                      p->sharedMemBytes, false, &dyn);
  if (d == kFallback) Count(kCounter_launches_fallback);
  if (d != kShape) return false;
  *shaped = *p;
  shaped->sharedMemBytes = dyn;
  return true;
}

template <int kPath, int kId, typename Params>
CUresult GraphAddHook(CUgraphNode* node, CUgraph graph, const CUgraphNode* deps, size_t n,
                      const Params* p) {
  pthread_once(&g_init_once, InitOnce);
  typedef CUresult (*Fn)(CUgraphNode*, CUgraph, const CUgraphNode*, size_t, const Params*);
  auto real = reinterpret_cast<Fn>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  Params shaped;
  if (!ShapeNode(p, &shaped)) return real(node, graph, deps, n, p);
  CUresult r = real(node, graph, deps, n, &shaped);
  if (r == JOR_CUDA_SUCCESS) {
    Count(kCounter_graph_nodes_shaped);
    return r;
  }
  Count(kCounter_launches_fallback);
  return real(node, graph, deps, n, p);
}

template <int kPath, int kId, typename Params>
CUresult GraphSetHook(CUgraphExec exec, CUgraphNode node, const Params* p) {
  pthread_once(&g_init_once, InitOnce);
  typedef CUresult (*Fn)(CUgraphExec, CUgraphNode, const Params*);
  auto real = reinterpret_cast<Fn>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  Params shaped;
  if (!ShapeNode(p, &shaped)) return real(exec, node, p);
  CUresult r = real(exec, node, &shaped);
  if (r == JOR_CUDA_SUCCESS) {
    Count(kCounter_graph_nodes_shaped);
    return r;
  }
  Count(kCounter_launches_fallback);
  return real(exec, node, p);
}

// cuGraphKernelNodeSetParams: a node of a graph not yet instantiated.
template <int kPath, int kId, typename Params>
CUresult GraphNodeSetHook(CUgraphNode node, const Params* p) {
  pthread_once(&g_init_once, InitOnce);
  typedef CUresult (*Fn)(CUgraphNode, const Params*);
  auto real = reinterpret_cast<Fn>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  Params shaped;
  if (!ShapeNode(p, &shaped)) return real(node, p);
  CUresult r = real(node, &shaped);
  if (r == JOR_CUDA_SUCCESS) {
    Count(kCounter_graph_nodes_shaped);
    return r;
  }
  Count(kCounter_launches_fallback);
  return real(node, p);
}

// The generic node API (cuGraphAddNode(_v2), cuGraphNodeSetParams,
// cuGraphExecNodeSetParams): kernel nodes are shaped like cuGraphAddKernelNode's,
// every other node type passes through untouched. `call` runs the real entry
// point with the given parameters.
template <typename Call>
CUresult GenericNode(CUgraphNodeParams* p, Call call) {
  if (p == nullptr || p->type != JOR_CU_GRAPH_NODE_TYPE_KERNEL) return call(p);
  CUgraphNodeParams shaped = *p;
  if (!ShapeNode(&p->kernel, &shaped.kernel)) return call(p);
  CUresult r = call(&shaped);
  if (r == JOR_CUDA_SUCCESS) {
    Count(kCounter_graph_nodes_shaped);
    return r;
  }
  Count(kCounter_launches_fallback);
  return call(p);
}

template <int kPath, int kId>
CUresult GraphAddNodeHook(CUgraphNode* node, CUgraph graph, const CUgraphNode* deps, size_t n,
                          CUgraphNodeParams* p) {
  pthread_once(&g_init_once, InitOnce);
  auto real = reinterpret_cast<PFN_cuGraphAddNode>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  return GenericNode(p, [&](CUgraphNodeParams* q) { return real(node, graph, deps, n, q); });
}

template <int kPath, int kId>
CUresult GraphAddNodeV2Hook(CUgraphNode* node, CUgraph graph, const CUgraphNode* deps,
                            const CUgraphEdgeData* edges, size_t n, CUgraphNodeParams* p) {
  pthread_once(&g_init_once, InitOnce);
  auto real = reinterpret_cast<PFN_cuGraphAddNode_v2>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  return GenericNode(p,
                     [&](CUgraphNodeParams* q) { return real(node, graph, deps, edges, n, q); });
}

template <int kPath, int kId>
CUresult GraphNodeSetParamsHook(CUgraphNode node, CUgraphNodeParams* p) {
  pthread_once(&g_init_once, InitOnce);
  auto real = reinterpret_cast<PFN_cuGraphNodeSetParams>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  return GenericNode(p, [&](CUgraphNodeParams* q) { return real(node, q); });
}

template <int kPath, int kId>
CUresult GraphExecNodeSetParamsHook(CUgraphExec exec, CUgraphNode node, CUgraphNodeParams* p) {
  pthread_once(&g_init_once, InitOnce);
  auto real = reinterpret_cast<PFN_cuGraphExecNodeSetParams>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  return GenericNode(p, [&](CUgraphNodeParams* q) { return real(exec, node, q); });
}

// Cooperative launches need every block resident at once: shaping would lower
// residency and can make the launch fail (COOPERATIVE_LAUNCH_TOO_LARGE), so they
// are counted and never shaped.
template <int kPath, int kId>
CUresult LaunchCooperativeHook JOR_COOP_PARAMS {
  pthread_once(&g_init_once, InitOnce);
  auto real = reinterpret_cast<PFN_cuLaunchCooperativeKernel>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  Count(kCounter_launches_seen);
  CountPath(kPath);
  unsigned dyn = sharedMemBytes;
  Decide(f, hStream, true, blockDimX * blockDimY * blockDimZ, sharedMemBytes, true, &dyn);
  return real JOR_COOP_ARGS;
}

// The program's own attribute changes keep the cached limits true: a kernel
// whose MAX_DYNAMIC_SHARED_SIZE_BYTES the program lowers is raised again before a
// shaped launch, and a carve-out the program sets is asked for again.
template <int kPath, int kId>
CUresult FuncSetAttributeHook(CUfunction f, int attrib, int value) {
  pthread_once(&g_init_once, InitOnce);
  auto real = reinterpret_cast<PFN_cuFuncSetAttribute>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  CUresult r = real(f, attrib, value);
  if (r != JOR_CUDA_SUCCESS || (attrib != JOR_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES &&
                                attrib != JOR_CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT)) {
    return r;
  }
  std::unique_lock<std::shared_mutex> lock(g_func_mu);
  if (g_funcs != nullptr) {
    auto it = g_funcs->find(f);
    if (it != g_funcs->end()) {
      if (attrib == JOR_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
        it->second.max_dynamic_smem = value;
      } else {
        it->second.carveout_set = false;
      }
    }
  }
  // Per-thread copies are refreshed from the shared entry on their next launch.
  g_func_epoch.fetch_add(1, std::memory_order_acq_rel);
  return r;
}

std::atomic<int64_t> g_stream_index{0};

// Whether the plan puts the index-th created stream at the highest priority.
bool PromoteStream(int64_t index, bool requested_priority) {
  const Rules* rules = CurrentRules();
  if (rules == nullptr || !rules->stream_priority_highest) return false;
  for (int64_t i : rules->stream_create_order) {
    if (i == index) return true;
  }
  return rules->promote_requested && requested_priority;
}

CUresult CreatePromoted(CUstream* ph, unsigned flags, int64_t index) {
  auto range = REAL(cuCtxGetStreamPriorityRange);
  auto create = REAL(cuStreamCreateWithPriority);
  int least = 0, greatest = 0;
  if (range == nullptr || create == nullptr ||
      range(&least, &greatest) != JOR_CUDA_SUCCESS) {
    return -1;
  }
  CUresult r = create(ph, flags, greatest);
  if (r == JOR_CUDA_SUCCESS) {
    Count(kCounter_streams_promoted);
    Log(2, "stream #%lld created at priority %d (highest)", (long long)index, greatest);
  }
  return r;
}

template <int kPath, int kId>
CUresult StreamCreateHook(CUstream* ph, unsigned int flags) {
  pthread_once(&g_init_once, InitOnce);
  auto real = reinterpret_cast<PFN_cuStreamCreate>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  Count(kCounter_streams_created);
  const int64_t index = g_stream_index.fetch_add(1);
  if (PromoteStream(index, false) && CreatePromoted(ph, flags, index) == JOR_CUDA_SUCCESS) {
    return JOR_CUDA_SUCCESS;
  }
  return real(ph, flags);
}

template <int kPath, int kId>
CUresult StreamCreateWithPriorityHook(CUstream* ph, unsigned int flags, int priority) {
  pthread_once(&g_init_once, InitOnce);
  auto real = reinterpret_cast<PFN_cuStreamCreateWithPriority>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  Count(kCounter_streams_created);
  const int64_t index = g_stream_index.fetch_add(1);
  if (PromoteStream(index, priority != 0) &&
      CreatePromoted(ph, flags, index) == JOR_CUDA_SUCCESS) {
    return JOR_CUDA_SUCCESS;
  }
  return real(ph, flags, priority);
}

void* HookFor(int path, int id);
bool IsOurHook(void* p);

void ForgetFunctions() {
  {
    std::unique_lock<std::shared_mutex> lock(g_func_mu);
    if (g_funcs != nullptr) g_funcs->clear();
    g_func_epoch.fetch_add(1, std::memory_order_acq_rel);
  }
  std::unique_lock<std::shared_mutex> lock(g_occ_mu);
  if (g_occ != nullptr) g_occ->clear();
}

template <int kPath, int kId>
CUresult ModuleUnloadHook(CUmodule hmod) {
  pthread_once(&g_init_once, InitOnce);
  auto real = reinterpret_cast<PFN_cuModuleUnload>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  CUresult r = real(hmod);
  ForgetFunctions();
  return r;
}

template <int kPath, int kId>
CUresult LibraryUnloadHook(CUlibrary library) {
  pthread_once(&g_init_once, InitOnce);
  auto real = reinterpret_cast<PFN_cuLibraryUnload>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  CUresult r = real(library);
  ForgetFunctions();
  return r;
}

// The hook to hand out for a cuGetProcAddress answer, or -1 for none.
int ProcAddrHookId(const char* symbol, int version, cuuint64_t flags, void* answer,
                   int* intended) {
  *intended = -1;
  if (symbol == nullptr) return -1;
  const bool ptsz = (flags & JOR_CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
  int id = -1;
  int alt = -1;  // the other variant of the same entry point
  if (strcmp(symbol, "cuLaunchKernel") == 0) {
    id = ptsz ? kSym_cuLaunchKernel_ptsz : kSym_cuLaunchKernel;
    alt = ptsz ? kSym_cuLaunchKernel : kSym_cuLaunchKernel_ptsz;
  } else if (strcmp(symbol, "cuLaunchKernelEx") == 0) {
    id = ptsz ? kSym_cuLaunchKernelEx_ptsz : kSym_cuLaunchKernelEx;
    alt = ptsz ? kSym_cuLaunchKernelEx : kSym_cuLaunchKernelEx_ptsz;
  } else if (strcmp(symbol, "cuGraphAddKernelNode") == 0) {
    // cuda.h maps the name to the _v2 ABI from CUDA 12.0.
    id = version >= 12000 ? kSym_cuGraphAddKernelNode_v2 : kSym_cuGraphAddKernelNode;
    alt = version >= 12000 ? kSym_cuGraphAddKernelNode : kSym_cuGraphAddKernelNode_v2;
  } else if (strcmp(symbol, "cuGraphExecKernelNodeSetParams") == 0) {
    id = version >= 12000 ? kSym_cuGraphExecKernelNodeSetParams_v2
                          : kSym_cuGraphExecKernelNodeSetParams;
    alt = version >= 12000 ? kSym_cuGraphExecKernelNodeSetParams
                           : kSym_cuGraphExecKernelNodeSetParams_v2;
  } else if (strcmp(symbol, "cuGraphKernelNodeSetParams") == 0) {
    id = version >= 12000 ? kSym_cuGraphKernelNodeSetParams_v2 : kSym_cuGraphKernelNodeSetParams;
    alt = version >= 12000 ? kSym_cuGraphKernelNodeSetParams : kSym_cuGraphKernelNodeSetParams_v2;
  } else if (strcmp(symbol, "cuGraphAddNode") == 0) {
    // The _v2 ABI (edge data) from CUDA 12.3.
    id = version >= 12030 ? kSym_cuGraphAddNode_v2 : kSym_cuGraphAddNode;
    alt = version >= 12030 ? kSym_cuGraphAddNode : kSym_cuGraphAddNode_v2;
  } else if (strcmp(symbol, "cuLaunchCooperativeKernel") == 0) {
    id = ptsz ? kSym_cuLaunchCooperativeKernel_ptsz : kSym_cuLaunchCooperativeKernel;
    alt = ptsz ? kSym_cuLaunchCooperativeKernel : kSym_cuLaunchCooperativeKernel_ptsz;
  } else if (strcmp(symbol, "cuGetProcAddress") == 0) {
    id = version >= 12000 ? kSym_cuGetProcAddress_v2 : kSym_cuGetProcAddress;
    alt = version >= 12000 ? kSym_cuGetProcAddress : kSym_cuGetProcAddress_v2;
  } else {
    for (int i = 0; i < kNumHooked; ++i) {
      if (strcmp(symbol, kSymNames[i]) == 0) id = i;
    }
  }
  if (id < 0) return -1;
  *intended = id;
  // The driver's answer must be the entry point the hook forwards to; if it is
  // the other variant's, hand out that hook; if it is neither, hand out none.
  void* known = Real(id);
  if (known == nullptr) {
    void* expected = nullptr;
    g_real[id].compare_exchange_strong(expected, answer);
    known = g_real[id].load();
  }
  if (known == answer) return id;
  if (alt >= 0 && Real(alt) == answer) return alt;
  return -1;
}

void* SlotHook(int id, int slot) {
#define JOR_SLOTS(sym, tmpl)                                                     \
  case kSym_##sym: {                                                             \
    static void* const kSlots[kExtraSlots] = {                                   \
        reinterpret_cast<void*>(tmpl<kPathProcAddr, kSym_##sym, 0>),             \
        reinterpret_cast<void*>(tmpl<kPathProcAddr, kSym_##sym, 1>),             \
        reinterpret_cast<void*>(tmpl<kPathProcAddr, kSym_##sym, 2>),             \
        reinterpret_cast<void*>(tmpl<kPathProcAddr, kSym_##sym, 3>)};            \
    return kSlots[slot];                                                         \
  }
  switch (id) {
    JOR_SLOTS(cuLaunchKernel, LaunchKernelHook)
    JOR_SLOTS(cuLaunchKernel_ptsz, LaunchKernelHook)
    JOR_SLOTS(cuLaunchKernelEx, LaunchKernelExHook)
    JOR_SLOTS(cuLaunchKernelEx_ptsz, LaunchKernelExHook)
    default:
      return nullptr;
  }
#undef JOR_SLOTS
}

// A slot hook forwarding to `answer` for launch entry points, or null.
void* SlotHookFor(int id, void* answer) {
  if (SlotHook(id, 0) == nullptr) return nullptr;
  for (int slot = 0; slot < kExtraSlots; ++slot) {
    void* expected = nullptr;
    if (g_slot_real[id][slot].compare_exchange_strong(expected, answer) || expected == answer) {
      Log(2, "cuGetProcAddress(%s): versioned entry point %p in slot %d", kSymNames[id], answer,
          slot);
      return SlotHook(id, slot);
    }
  }
  return nullptr;
}

CUresult ProcAddrCommon(const char* symbol, void** pfn, int version, cuuint64_t flags,
                        CUresult r) {
  if (r != JOR_CUDA_SUCCESS || pfn == nullptr || *pfn == nullptr) return r;
  // A driver that resolves its own exports through the symbol table hands back
  // this library's definitions: they are hooks already.
  if (IsOurHook(*pfn)) return r;
  int intended = -1;
  int id = ProcAddrHookId(symbol, version, flags, *pfn, &intended);
  if (id < 0 && intended >= 0) {
    void* hook = SlotHookFor(intended, *pfn);
    if (hook != nullptr) {
      Count(kCounter_lookups_procaddr);
      *pfn = hook;
      return r;
    }
  }
  if (id < 0) {
    if (intended >= 0) {
      Count(kCounter_lookups_unhooked);
      Log(1, "cuGetProcAddress(%s): unexpected entry point; left unhooked", symbol);
    }
    return r;
  }
  Count(kCounter_lookups_procaddr);
  *pfn = HookFor(kPathProcAddr, id);
  return r;
}

template <int kPath, int kId>
CUresult GetProcAddressHook(const char* symbol, void** pfn, int version, cuuint64_t flags) {
  pthread_once(&g_init_once, InitOnce);
  auto real = reinterpret_cast<PFN_cuGetProcAddress>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  return ProcAddrCommon(symbol, pfn, version, flags, real(symbol, pfn, version, flags));
}

template <int kPath, int kId>
CUresult GetProcAddressV2Hook(const char* symbol, void** pfn, int version, cuuint64_t flags,
                              CUdriverProcAddressQueryResult* status) {
  pthread_once(&g_init_once, InitOnce);
  auto real = reinterpret_cast<PFN_cuGetProcAddress_v2>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  return ProcAddrCommon(symbol, pfn, version, flags,
                        real(symbol, pfn, version, flags, status));
}

// Which hook template implements which symbol.
template <int kPath, int kId>
struct HookImpl;
#define JOR_BIND(sym, impl)                   \
  template <int kPath>                        \
  struct HookImpl<kPath, kSym_##sym> {        \
    static void* Get() {                      \
      return reinterpret_cast<void*>(impl);   \
    }                                         \
  };
JOR_BIND(cuLaunchKernel, (LaunchKernelHook<kPath, kSym_cuLaunchKernel>))
JOR_BIND(cuLaunchKernel_ptsz, (LaunchKernelHook<kPath, kSym_cuLaunchKernel_ptsz>))
JOR_BIND(cuLaunchKernelEx, (LaunchKernelExHook<kPath, kSym_cuLaunchKernelEx>))
JOR_BIND(cuLaunchKernelEx_ptsz, (LaunchKernelExHook<kPath, kSym_cuLaunchKernelEx_ptsz>))
JOR_BIND(cuGraphAddKernelNode,
         (GraphAddHook<kPath, kSym_cuGraphAddKernelNode, CUDA_KERNEL_NODE_PARAMS_v1>))
JOR_BIND(cuGraphAddKernelNode_v2,
         (GraphAddHook<kPath, kSym_cuGraphAddKernelNode_v2, CUDA_KERNEL_NODE_PARAMS_v2>))
JOR_BIND(cuGraphExecKernelNodeSetParams,
         (GraphSetHook<kPath, kSym_cuGraphExecKernelNodeSetParams,
                       CUDA_KERNEL_NODE_PARAMS_v1>))
JOR_BIND(cuGraphExecKernelNodeSetParams_v2,
         (GraphSetHook<kPath, kSym_cuGraphExecKernelNodeSetParams_v2,
                       CUDA_KERNEL_NODE_PARAMS_v2>))
JOR_BIND(cuGraphKernelNodeSetParams,
         (GraphNodeSetHook<kPath, kSym_cuGraphKernelNodeSetParams, CUDA_KERNEL_NODE_PARAMS_v1>))
JOR_BIND(cuGraphKernelNodeSetParams_v2,
         (GraphNodeSetHook<kPath, kSym_cuGraphKernelNodeSetParams_v2,
                           CUDA_KERNEL_NODE_PARAMS_v2>))
JOR_BIND(cuGraphAddNode, (GraphAddNodeHook<kPath, kSym_cuGraphAddNode>))
JOR_BIND(cuGraphAddNode_v2, (GraphAddNodeV2Hook<kPath, kSym_cuGraphAddNode_v2>))
JOR_BIND(cuGraphNodeSetParams, (GraphNodeSetParamsHook<kPath, kSym_cuGraphNodeSetParams>))
JOR_BIND(cuGraphExecNodeSetParams,
         (GraphExecNodeSetParamsHook<kPath, kSym_cuGraphExecNodeSetParams>))
JOR_BIND(cuLaunchCooperativeKernel,
         (LaunchCooperativeHook<kPath, kSym_cuLaunchCooperativeKernel>))
JOR_BIND(cuLaunchCooperativeKernel_ptsz,
         (LaunchCooperativeHook<kPath, kSym_cuLaunchCooperativeKernel_ptsz>))
JOR_BIND(cuFuncSetAttribute, (FuncSetAttributeHook<kPath, kSym_cuFuncSetAttribute>))
JOR_BIND(cuStreamCreate, (StreamCreateHook<kPath, kSym_cuStreamCreate>))
JOR_BIND(cuStreamCreateWithPriority,
         (StreamCreateWithPriorityHook<kPath, kSym_cuStreamCreateWithPriority>))
JOR_BIND(cuModuleUnload, (ModuleUnloadHook<kPath, kSym_cuModuleUnload>))
JOR_BIND(cuLibraryUnload, (LibraryUnloadHook<kPath, kSym_cuLibraryUnload>))
JOR_BIND(cuGetProcAddress, (GetProcAddressHook<kPath, kSym_cuGetProcAddress>))
JOR_BIND(cuGetProcAddress_v2, (GetProcAddressV2Hook<kPath, kSym_cuGetProcAddress_v2>))
#undef JOR_BIND

// Dispatch: hook address per (path, symbol), generated from the one list.
void* const* HookTable(int path) {
#define JOR_HOOK_ENTRY(P) \
  JOR_HOOKED_SYMBOLS(JOR_HOOK_ENTRY_##P)
#define JOR_HOOK_ENTRY_0(name, ret, params, args) HookImpl<0, kSym_##name>::Get(),
#define JOR_HOOK_ENTRY_1(name, ret, params, args) HookImpl<1, kSym_##name>::Get(),
#define JOR_HOOK_ENTRY_2(name, ret, params, args) HookImpl<2, kSym_##name>::Get(),
  static void* const kTable[kNumPaths][kNumHooked] = {
      {JOR_HOOK_ENTRY(0)}, {JOR_HOOK_ENTRY(1)}, {JOR_HOOK_ENTRY(2)}};
#undef JOR_HOOK_ENTRY_0
#undef JOR_HOOK_ENTRY_1
#undef JOR_HOOK_ENTRY_2
#undef JOR_HOOK_ENTRY
  return kTable[path];
}

void* HookFor(int path, int id) { return HookTable(path)[id]; }

bool IsOurHook(void* p) {
  for (int path = 0; path < kNumPaths; ++path) {
    for (int i = 0; i < kNumHooked; ++i) {
      if (HookFor(path, i) == p) return true;
    }
  }
  for (int i = 0; i < kNumHooked; ++i) {
    for (int slot = 0; slot < kExtraSlots && SlotHook(i, 0) != nullptr; ++slot) {
      if (SlotHook(i, slot) == p) return true;
    }
  }
  return false;
}

int HookedId(const char* name) {
  if (name == nullptr || name[0] != 'c' || name[1] != 'u') return -1;
  for (int i = 0; i < kNumHooked; ++i) {
    if (strcmp(name, kSymNames[i]) == 0) return i;
  }
  return -1;
}

bool IsLibcuda(void* handle) {
  if (handle == RTLD_DEFAULT || handle == RTLD_NEXT || handle == nullptr) return false;
  if (handle == g_libcuda_handle.load(std::memory_order_acquire)) return true;
  struct link_map* lm = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &lm) != 0 || lm == nullptr || lm->l_name == nullptr) {
    return false;
  }
  const char* base = strrchr(lm->l_name, '/');
  base = base ? base + 1 : lm->l_name;
  if (strncmp(base, "libcuda.so", 10) != 0) return false;
  void* expected = nullptr;
  g_libcuda_handle.compare_exchange_strong(expected, handle);
  return true;
}

// dlsym(RTLD_NEXT, ...) from another object: the real dlsym would answer
// relative to this library (its caller), so search the objects loaded after
// the caller, in load order, as glibc would. This library is one of them when
// it comes later: an interposer preloaded before it then finds its hooks.
void* DlsymNextFromCaller(const char* name, void* caller) {
  DlsymFn real = RealDlsym();
  Dl_info info;
  struct link_map* lm = nullptr;
  if (dladdr1(caller, &info, reinterpret_cast<void**>(&lm), RTLD_DL_LINKMAP) == 0 ||
      lm == nullptr) {
    return real(RTLD_NEXT, name);
  }
  for (struct link_map* l = lm->l_next; l != nullptr; l = l->l_next) {
    if (l->l_name == nullptr || l->l_name[0] == '\0') continue;
    void* h = dlopen(l->l_name, RTLD_LAZY | RTLD_NOLOAD);
    if (h == nullptr) continue;
    void* p = real(h, name);
    dlclose(h);
    if (p != nullptr) return p;
  }
  return nullptr;
}

void PrintCounters() {
  fprintf(stderr, "[jax_overlap_rt pid=%d] counters:", (int)getpid());
  for (int i = 0; i < kNumCounters; ++i) {
    fprintf(stderr, " %s=%llu", kCounterNames[i],
            (unsigned long long)g_counters[i].load());
  }
  fprintf(stderr, "\n");
}

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

__attribute__((constructor)) void OnLoad() { pthread_once(&g_init_once, InitOnce); }

// Kernel rules that selected no function: the plan names kernels this program
// never launched (a plan written for another step, or HLO names instead of the
// names the driver reports).
void PrintUnmatchedRules() {
  const Rules* rules = CurrentRules();
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

__attribute__((destructor)) void OnUnload() {
  if (Verbose() >= 1) {
    PrintCounters();
    PrintUnmatchedRules();
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// Exported driver symbols (the direct path), generated from the list.
// ---------------------------------------------------------------------------

#define JOR_DEFINE_EXPORT(name, ret, params, args)                               \
  JOR_EXPORT ret name params {                                                   \
    return reinterpret_cast<PFN_##name>(HookImpl<kPathDirect, kSym_##name>::Get()) \
        args;                                                                    \
  }
JOR_HOOKED_SYMBOLS(JOR_DEFINE_EXPORT)
#undef JOR_DEFINE_EXPORT

JOR_EXPORT void* dlsym(void* handle, const char* name) __THROW {
  DlsymFn real = RealDlsym();
  if (real == nullptr) return nullptr;
  if (handle == RTLD_NEXT) return DlsymNextFromCaller(name, __builtin_return_address(0));
  const int id = HookedId(name);
  if (id < 0 || !IsLibcuda(handle)) return real(handle, name);
  void* p = real(handle, name);
  if (p == nullptr || IsOurHook(p)) return p;
  void* expected = nullptr;
  g_real[id].compare_exchange_strong(expected, p);
  if (g_real[id].load() != p) return p;  // another libcuda: leave it alone
  Count(kCounter_lookups_dlsym);
  return HookFor(kPathDlsym, id);
}

// ---------------------------------------------------------------------------
// API for Python (ctypes), the FFI region handlers and benchmarks.
// ---------------------------------------------------------------------------

JOR_EXPORT int jor_version(void) { return 1; }

JOR_EXPORT int jor_counter_count(void) { return kNumCounters; }

JOR_EXPORT const char* jor_counter_name(int i) {
  return (i >= 0 && i < kNumCounters) ? kCounterNames[i] : nullptr;
}

JOR_EXPORT uint64_t jor_counter_value(int i) {
  return (i >= 0 && i < kNumCounters) ? g_counters[i].load() : 0;
}

JOR_EXPORT void jor_reset_counters(void) {
  for (auto& c : g_counters) c.store(0);
}

// Replaces the active rules; returns the number of lines that were ignored.
JOR_EXPORT int jor_set_rules(const char* text) {
  pthread_once(&g_init_once, InitOnce);
  return InstallRules(text ? text : "");
}

JOR_EXPORT int jor_rule_count(void) {
  const Rules* r = CurrentRules();
  return r ? static_cast<int>(r->kernels.size() + r->regions.size()) : 0;
}

JOR_EXPORT int jor_kernel_rule_count(void) {
  const Rules* r = CurrentRules();
  return r ? static_cast<int>(r->kernels.size()) : 0;
}

// The pattern of kernel rule `i` of the active rules, or null.
JOR_EXPORT const char* jor_kernel_rule_pattern(int i) {
  const Rules* r = CurrentRules();
  if (r == nullptr || i < 0 || static_cast<size_t>(i) >= r->kernels.size()) return nullptr;
  return r->kernels[i].pattern.c_str();
}

// Distinct functions kernel rule `i` has selected so far; -1 for a bad index.
JOR_EXPORT int64_t jor_kernel_rule_functions(int i) {
  const Rules* r = CurrentRules();
  if (r == nullptr || i < 0 || static_cast<size_t>(i) >= r->kernels.size()) return -1;
  return static_cast<int64_t>(r->functions[i].load());
}

namespace {
int RegionBegin(int64_t region_id, int64_t blocks_per_sm, bool any_stream, CUstream stream) {
  pthread_once(&g_init_once, InitOnce);
  const Rules* rules = CurrentRules();
  int64_t blocks = blocks_per_sm > 0 ? blocks_per_sm : 0;
  if (rules != nullptr) {
    auto it = rules->regions.find(region_id);
    if (it != rules->regions.end()) blocks = it->second;
  }
  Count(kCounter_regions_entered);
  if (!any_stream) {
    // The same region already open on the same stream: its end never ran (a thunk
    // between begin and end failed, ending that execution). Close the stale frame
    // instead of nesting in it.
    const int depth = t_region_depth > kMaxRegionDepth ? kMaxRegionDepth : t_region_depth;
    for (int i = depth - 1; i >= 0; --i) {
      if (!t_regions[i].any_stream && t_regions[i].id == region_id &&
          t_regions[i].stream == stream) {
        Log(1, "region %lld begins again on its stream before its end: the earlier one is "
               "closed", (long long)region_id);
        for (int j = i; j + 1 < depth; ++j) t_regions[j] = t_regions[j + 1];
        --t_region_depth;
        break;
      }
    }
  }
  int d = t_region_depth++;
  if (d < kMaxRegionDepth) {
    t_regions[d] = {region_id, blocks, any_stream, stream};
  } else {
    Log(1, "occupancy regions nested deeper than %d; region %lld ignored", kMaxRegionDepth,
        (long long)region_id);
  }
  Log(3, "region %lld begin: blocks_per_sm %lld", (long long)region_id, (long long)blocks);
  return t_region_depth;
}
}  // namespace

// Enters an occupancy region on the calling thread: launches from this thread
// are capped at the plan's blocks_per_sm for `region_id`, else `blocks_per_sm`
// (0: no cap), until the matching jor_region_end.
JOR_EXPORT int jor_region_begin(int64_t region_id, int64_t blocks_per_sm) {
  return RegionBegin(region_id, blocks_per_sm, true, nullptr);
}

// The same, for launches on `stream` only (what XLA's region thunks pass): other
// streams' launches from the thread are not capped, and a region whose end never
// ran (a failed execution) is closed when the region begins again on that stream.
JOR_EXPORT int jor_region_begin_on_stream(int64_t region_id, int64_t blocks_per_sm,
                                          void* stream) {
  return RegionBegin(region_id, blocks_per_sm, false, static_cast<CUstream>(stream));
}

JOR_EXPORT int jor_region_end(int64_t region_id) {
  if (t_region_depth <= 0) {
    Log(1, "region %lld end without begin", (long long)region_id);
    return -1;
  }
  if (t_region_depth > kMaxRegionDepth) return --t_region_depth;  // not stored
  // Close the innermost open frame of this region: regions whose ends XLA
  // orders differently from their begins still close the right frame.
  const int depth = t_region_depth;
  int found = depth - 1;
  for (int i = depth - 1; i >= 0; --i) {
    if (t_regions[i].id == region_id) {
      found = i;
      break;
    }
  }
  for (int i = found; i + 1 < depth; ++i) t_regions[i] = t_regions[i + 1];
  --t_region_depth;
  Log(3, "region %lld end", (long long)region_id);
  return t_region_depth;
}

JOR_EXPORT int64_t jor_region_blocks_per_sm(void) { return CurrentRegionBlocks(nullptr, false); }
