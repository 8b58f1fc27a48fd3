// cuGetProcAddress(_v2): which hook the program gets for the driver's answer.
// The CUDA runtime, cuBLAS and CuPy reach the driver this way; the answer may be
// the exported entry point, the other ABI variant of the same name (per-thread
// default stream, the _v2 structs), or a versioned implementation, which gets
// a slot hook of its own.
#include <string.h>

#include <atomic>

#include "dispatch.h"
#include "log.h"
#include "symbols.h"

namespace jor {

namespace {

// Driver answers from cuGetProcAddress that are not the exported entry points
// (versioned implementations) each get a hook instance of their own, a slot,
// that forwards to exactly that answer.
std::atomic<void*> g_slot_real[kNumHooked][kExtraSlots];

// Names cuGetProcAddress resolves to one of two ABI variants: the per-thread
// default-stream variant when the flags ask for it (`since` 0), else the newer ABI
// from CUDA version `since` on (cuda.h maps the names so: the _v2 kernel-node
// structs and cuGetProcAddress_v2 from 12.0, cuGraphAddNode_v2's edge data from 12.3).
struct AbiVariants {
  const char* name;
  int plain, variant, since;
};
const AbiVariants kAbiVariants[] = {
    {"cuLaunchKernel", kSym_cuLaunchKernel, kSym_cuLaunchKernel_ptsz, 0},
    {"cuLaunchKernelEx", kSym_cuLaunchKernelEx, kSym_cuLaunchKernelEx_ptsz, 0},
    {"cuLaunchCooperativeKernel", kSym_cuLaunchCooperativeKernel,
     kSym_cuLaunchCooperativeKernel_ptsz, 0},
    {"cuGraphAddKernelNode", kSym_cuGraphAddKernelNode, kSym_cuGraphAddKernelNode_v2, 12000},
    {"cuGraphExecKernelNodeSetParams", kSym_cuGraphExecKernelNodeSetParams,
     kSym_cuGraphExecKernelNodeSetParams_v2, 12000},
    {"cuGraphKernelNodeSetParams", kSym_cuGraphKernelNodeSetParams,
     kSym_cuGraphKernelNodeSetParams_v2, 12000},
    {"cuGraphAddNode", kSym_cuGraphAddNode, kSym_cuGraphAddNode_v2, 12030},
    {"cuGetProcAddress", kSym_cuGetProcAddress, kSym_cuGetProcAddress_v2, 12000},
};

// The hook to hand out for a cuGetProcAddress answer, or -1 for none.
int ProcAddrHookId(const char* symbol, int version, cuuint64_t flags, void* answer,
                   int* intended) {
  *intended = -1;
  if (symbol == nullptr) return -1;
  const bool ptsz = (flags & JOR_CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
  int id = HookedId(symbol);
  int alt = -1;  // the other variant of the same entry point
  for (const AbiVariants& v : kAbiVariants) {
    if (strcmp(symbol, v.name) != 0) continue;
    const bool use_variant = v.since == 0 ? ptsz : version >= v.since;
    id = use_variant ? v.variant : v.plain;
    alt = use_variant ? v.plain : v.variant;
    break;
  }
  if (id < 0) return -1;
  *intended = id;
  // The driver's answer must be the entry point the hook forwards to; if it is
  // the other variant's, hand out that hook; if it is neither, hand out none.
  void* known = Real(id);
  if (known == nullptr) known = RecordReal(id, answer);
  if (known == answer) return id;
  if (alt >= 0 && Real(alt) == answer) return alt;
  return -1;
}

}  // namespace

void* SlotReal(int id, int slot) { return g_slot_real[id][slot].load(std::memory_order_acquire); }

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

}  // namespace jor
