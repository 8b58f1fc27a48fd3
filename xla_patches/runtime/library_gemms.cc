#include "library_gemms.h"

#include <stddef.h>
#include <string.h>

#include <atomic>

#include "init.h"
#include "log.h"
#include "rules.h"
#include "symbols.h"

namespace jor {

namespace {

// cuBLAS's types are opaque handles; statuses and the attribute id from cublas_api.h and
// cublasLt.h.
constexpr int kStatusNotInitialized = 1;  // CUBLAS_STATUS_NOT_INITIALIZED
constexpr int kDescSmCountTarget = 15;    // CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET
typedef int (*CreateFn)(void**);
typedef int (*SetTargetFn)(void*, int);
typedef int (*DescCreateFn)(void**, int, int);
typedef int (*DescSetFn)(void*, int, const void*, size_t);

std::atomic<CreateFn> g_create{nullptr};
std::atomic<SetTargetFn> g_set_target{nullptr};
std::atomic<DescCreateFn> g_desc_create{nullptr};
std::atomic<DescSetFn> g_desc_set{nullptr};

int Target() {
  const Rules* rules = CurrentRules();
  return rules == nullptr ? 0 : static_cast<int>(rules->gemm_sm_count_target);
}

int CreateHook(void** handle) {
  EnsureInit();
  CreateFn real = g_create.load(std::memory_order_acquire);
  if (real == nullptr) return kStatusNotInitialized;
  const int status = real(handle);
  if (status != 0 || handle == nullptr || *handle == nullptr) return status;
  Count(kCounter_gemm_handles_seen);
  const int target = Target();
  if (target <= 0) return status;
  SetTargetFn set = g_set_target.load(std::memory_order_acquire);
  const int r = set == nullptr ? -1 : set(*handle, target);
  if (r == 0) {
    Count(kCounter_gemm_handles_targeted);
    Log(2, "cuBLAS handle %p: SM-count target %d", *handle, target);
  } else {
    Count(kCounter_gemm_target_errors);
    Log(1, "cublasSetSmCountTarget(%d) failed (status %d); the handle keeps the device's SMs",
        target, r);
  }
  return status;
}

int DescCreateHook(void** desc, int compute_type, int scale_type) {
  EnsureInit();
  DescCreateFn real = g_desc_create.load(std::memory_order_acquire);
  if (real == nullptr) return kStatusNotInitialized;
  const int status = real(desc, compute_type, scale_type);
  if (status != 0 || desc == nullptr || *desc == nullptr) return status;
  Count(kCounter_gemm_descs_seen);
  const int target = Target();
  if (target <= 0) return status;
  DescSetFn set = g_desc_set.load(std::memory_order_acquire);
  const int r =
      set == nullptr ? -1 : set(*desc, kDescSmCountTarget, &target, sizeof(target));
  if (r == 0) {
    Count(kCounter_gemm_descs_targeted);
    Log(2, "cuBLASLt matmul descriptor %p: SM-count target %d", *desc, target);
  } else {
    Count(kCounter_gemm_target_errors);
    Log(1, "CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET=%d refused (status %d)", target, r);
  }
  return status;
}

// Keeps the first library's entry point (`slot`) and its setter; false for another library
// (whose lookups are left alone).
template <typename Fn, typename SetFn>
bool Record(std::atomic<Fn>* slot, void* real, std::atomic<SetFn>* setter, void* handle,
            const char* setter_name) {
  Fn expected = nullptr;
  Fn fn = reinterpret_cast<Fn>(real);
  if (!slot->compare_exchange_strong(expected, fn) && expected != fn) return false;
  if (setter->load() == nullptr) {
    DlsymFn dl = RealDlsym();
    void* s = dl == nullptr ? nullptr : dl(handle, setter_name);
    setter->store(reinterpret_cast<SetFn>(s), std::memory_order_release);
  }
  return true;
}

}  // namespace

void* LibraryGemmHook(void* handle, const char* name, void* real) {
  if (name == nullptr || real == nullptr || name[0] != 'c') return nullptr;
  if (strcmp(name, "cublasCreate_v2") == 0) {
    if (!Record(&g_create, real, &g_set_target, handle, "cublasSetSmCountTarget")) return nullptr;
    Count(kCounter_lookups_dlsym);
    return reinterpret_cast<void*>(&CreateHook);
  }
  if (strcmp(name, "cublasLtMatmulDescCreate") == 0) {
    if (!Record(&g_desc_create, real, &g_desc_set, handle, "cublasLtMatmulDescSetAttribute")) {
      return nullptr;
    }
    Count(kCounter_lookups_dlsym);
    return reinterpret_cast<void*>(&DescCreateHook);
  }
  return nullptr;
}

}  // namespace jor
