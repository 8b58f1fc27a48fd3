#include "driver_info.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include "log.h"
#include "symbols.h"

namespace jor {

namespace {

constexpr int kMaxDevices = 64;
struct DeviceSlot {
  std::atomic<int> state{0};  // 0 unknown, 1 ok, 2 failed
  JorDeviceLimits limits;
  int cc_major = 0, cc_minor = 0;  // 0 when the driver does not say
};
DeviceSlot g_devices[kMaxDevices];
std::mutex g_device_mu;

std::shared_mutex g_func_mu;
std::unordered_map<CUfunction, FuncInfo>* g_funcs = nullptr;

// JOR_CUDA_SUCCESS, or the driver's error for the first attribute it refused.
CUresult QueryFunc(CUfunction f, FuncInfo* info) {
  auto get_attr = REAL(cuFuncGetAttribute);
  if (get_attr == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  const struct {
    int attr;
    int* field;
  } wanted[] = {
      {JOR_CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, &info->static_smem},
      {JOR_CU_FUNC_ATTRIBUTE_NUM_REGS, &info->regs},
      {JOR_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, &info->max_dynamic_smem},
  };
  for (const auto& w : wanted) {
    CUresult r = get_attr(w.field, w.attr, f);
    if (r != JOR_CUDA_SUCCESS) return r;
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
  return JOR_CUDA_SUCCESS;
}

// Handle kinds (Launchable): shared map, per-thread direct-mapped copy.
enum HandleKind : uint8_t { kKindUnknown = 0, kKindFunction = 1, kKindKernel = 2 };
std::shared_mutex g_kind_mu;
std::unordered_map<CUfunction, uint8_t>* g_kinds = nullptr;
struct KindSlot {
  CUfunction f = nullptr;
  uint64_t epoch = 0;
  uint8_t kind = kKindUnknown;
};
thread_local KindSlot t_kinds[16];

uint8_t Classify(CUfunction f) {
  // Only a handle the function API calls invalid is asked about as a kernel: the
  // driver is never handed a module's function as a CUkernel.
  int regs = 0;
  auto get_attr = REAL(cuFuncGetAttribute);
  if (get_attr == nullptr ||
      get_attr(&regs, JOR_CU_FUNC_ATTRIBUTE_NUM_REGS, f) != JOR_CUDA_ERROR_INVALID_HANDLE) {
    return kKindFunction;
  }
  auto get_function = REAL(cuKernelGetFunction);
  CUfunction g = nullptr;
  if (get_function != nullptr &&
      get_function(&g, reinterpret_cast<CUkernel>(f)) == JOR_CUDA_SUCCESS && g != nullptr) {
    Log(2, "kernel handle %p: a context-less kernel (CUkernel), shaped through its function", f);
    return kKindKernel;
  }
  // Neither, for now (say a kernel not yet loaded in this context): asked again at its
  // next launch; FuncFor reports what the driver said meanwhile.
  return kKindUnknown;
}

constexpr int kTlsFuncs = 16;
thread_local FuncLite t_funcs[kTlsFuncs];

std::atomic<uint64_t> g_func_epoch{1};

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

}  // namespace

bool DeviceLimits(JorDeviceLimits* out, int* cc_major, int* cc_minor) {
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
    const CUresult r = QueryFunc(f, &info);
    if (r != JOR_CUDA_SUCCESS) {
      // Remember the failure: a function the driver cannot describe (say a CUkernel
      // handle it does not resolve) is not asked about again on every launch.
      info.failed = true;
      info.generation = rules->generation;
      Log(1, "kernel %p: the driver did not report its attributes (error %d); launched unchanged",
          f, r);
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

CUfunction Launchable(CUfunction f) {
  if (f == nullptr) return f;
  KindSlot& slot = t_kinds[(reinterpret_cast<uintptr_t>(f) >> 4) % 16];
  const uint64_t epoch = g_func_epoch.load(std::memory_order_acquire);
  if (slot.f != f || slot.epoch != epoch) {
    uint8_t kind = kKindUnknown;
    {
      std::shared_lock<std::shared_mutex> lock(g_kind_mu);
      if (g_kinds != nullptr) {
        auto it = g_kinds->find(f);
        if (it != g_kinds->end()) kind = it->second;
      }
    }
    if (kind == kKindUnknown) {
      kind = Classify(f);
      if (kind == kKindUnknown) return f;
      std::unique_lock<std::shared_mutex> lock(g_kind_mu);
      if (g_kinds == nullptr) g_kinds = new std::unordered_map<CUfunction, uint8_t>();
      (*g_kinds)[f] = kind;
    }
    slot.f = f;
    slot.epoch = epoch;
    slot.kind = kind;
  }
  if (slot.kind != kKindKernel) return f;
  Count(kCounter_launches_kernel_handle);
  auto get_function = REAL(cuKernelGetFunction);
  CUfunction g = nullptr;
  if (get_function != nullptr &&
      get_function(&g, reinterpret_cast<CUkernel>(f)) == JOR_CUDA_SUCCESS && g != nullptr) {
    return g;
  }
  return f;  // no function in this context: described (and refused) as it is
}

FuncLite& TlsFunc(CUfunction f) {
  return t_funcs[(reinterpret_cast<uintptr_t>(f) >> 4) % kTlsFuncs];
}

uint64_t FuncEpoch() { return g_func_epoch.load(std::memory_order_acquire); }

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

void ForgetFunctions() {
  {
    std::unique_lock<std::shared_mutex> lock(g_kind_mu);
    if (g_kinds != nullptr) g_kinds->clear();
  }
  {
    std::unique_lock<std::shared_mutex> lock(g_func_mu);
    if (g_funcs != nullptr) g_funcs->clear();
    g_func_epoch.fetch_add(1, std::memory_order_acq_rel);
  }
  std::unique_lock<std::shared_mutex> lock(g_occ_mu);
  if (g_occ != nullptr) g_occ->clear();
}

void NoteFuncAttribute(CUfunction f, int attrib, int value) {
  if (attrib != JOR_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES &&
      attrib != JOR_CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT) {
    return;
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
}

}  // namespace jor
