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
