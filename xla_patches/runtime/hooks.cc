// The hooks: one template per kind of driver entry point, each forwarding to
// the real entry point (or a slot's versioned one) after the plan's decision
// (decide.h), bound to the symbols of hooks.h, laid out per path in one table,
// and exported under the driver's own names for programs that call them directly.
#include <stddef.h>

#include "cuda_types.h"
#include "decide.h"
#include "dispatch.h"
#include "driver_info.h"
#include "hooks.h"
#include "init.h"
#include "log.h"
#include "symbols.h"

#define JOR_EXPORT extern "C" __attribute__((visibility("default")))

namespace jor {

namespace {

void* RealOrSlot(int id, int slot) { return slot < 0 ? Real(id) : SlotReal(id, slot); }

void CountPath(int path) {
  static const CounterId kByPath[kNumPaths] = {
      kCounter_launches_direct, kCounter_launches_dlsym, kCounter_launches_procaddr};
  Count(kByPath[path]);
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
  EnsureInit();
  auto real = reinterpret_cast<PFN_cuLaunchKernel>(RealOrSlot(kId, kSlot));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  Count(kCounter_launches_seen);
  CountPath(kPath);
  unsigned dyn = sharedMemBytes;
  const unsigned threads = blockDimX * blockDimY * blockDimZ;
  CUfunction g = f;
  Decision d = Decide(f, hStream, true, threads, sharedMemBytes, false, &dyn, &g);
  if (d == kFallback) Count(kCounter_launches_fallback);
  if (d != kShape) return real JOR_LAUNCH_ARGS;
  CUresult r = real(g, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
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
  EnsureInit();
  auto real = reinterpret_cast<PFN_cuLaunchKernelEx>(RealOrSlot(kId, kSlot));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  Count(kCounter_launches_seen);
  CountPath(kPath);
  if (config == nullptr) return real JOR_LAUNCH_EX_ARGS;
  unsigned dyn = config->sharedMemBytes;
  const unsigned threads = config->blockDimX * config->blockDimY * config->blockDimZ;
  CUfunction g = f;
  Decision d = Decide(f, config->hStream, true, threads, config->sharedMemBytes,
                      SkipLaunchEx(config), &dyn, &g);
  if (d == kFallback) Count(kCounter_launches_fallback);
  if (d != kShape) return real JOR_LAUNCH_EX_ARGS;
  CUlaunchConfig shaped = *config;
  shaped.sharedMemBytes = dyn;
  CUresult r = real(&shaped, g, kernelParams, extra);
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
  CUfunction g = p->func;
  Decision d = Decide(p->func, nullptr, false, p->blockDimX * p->blockDimY * p->blockDimZ,
                      p->sharedMemBytes, false, &dyn, &g);
  if (d == kFallback) Count(kCounter_launches_fallback);
  if (d != kShape) return false;
  *shaped = *p;
  shaped->func = g;
  shaped->sharedMemBytes = dyn;
  return true;
}

template <int kPath, int kId, typename Params>
CUresult GraphAddHook(CUgraphNode* node, CUgraph graph, const CUgraphNode* deps, size_t n,
                      const Params* p) {
  EnsureInit();
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
  EnsureInit();
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
  EnsureInit();
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
  EnsureInit();
  auto real = reinterpret_cast<PFN_cuGraphAddNode>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  return GenericNode(p, [&](CUgraphNodeParams* q) { return real(node, graph, deps, n, q); });
}

template <int kPath, int kId>
CUresult GraphAddNodeV2Hook(CUgraphNode* node, CUgraph graph, const CUgraphNode* deps,
                            const CUgraphEdgeData* edges, size_t n, CUgraphNodeParams* p) {
  EnsureInit();
  auto real = reinterpret_cast<PFN_cuGraphAddNode_v2>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  return GenericNode(p,
                     [&](CUgraphNodeParams* q) { return real(node, graph, deps, edges, n, q); });
}

template <int kPath, int kId>
CUresult GraphNodeSetParamsHook(CUgraphNode node, CUgraphNodeParams* p) {
  EnsureInit();
  auto real = reinterpret_cast<PFN_cuGraphNodeSetParams>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  return GenericNode(p, [&](CUgraphNodeParams* q) { return real(node, q); });
}

template <int kPath, int kId>
CUresult GraphExecNodeSetParamsHook(CUgraphExec exec, CUgraphNode node, CUgraphNodeParams* p) {
  EnsureInit();
  auto real = reinterpret_cast<PFN_cuGraphExecNodeSetParams>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  return GenericNode(p, [&](CUgraphNodeParams* q) { return real(exec, node, q); });
}

// Cooperative launches need every block resident at once: shaping would lower
// residency and can make the launch fail (COOPERATIVE_LAUNCH_TOO_LARGE), so they
// are counted and never shaped.
template <int kPath, int kId>
CUresult LaunchCooperativeHook JOR_COOP_PARAMS {
  EnsureInit();
  auto real = reinterpret_cast<PFN_cuLaunchCooperativeKernel>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  Count(kCounter_launches_seen);
  CountPath(kPath);
  unsigned dyn = sharedMemBytes;
  CUfunction g = f;
  Decide(f, hStream, true, blockDimX * blockDimY * blockDimZ, sharedMemBytes, true, &dyn, &g);
  return real JOR_COOP_ARGS;
}

// The program's own attribute changes keep the cached limits true: a kernel
// whose MAX_DYNAMIC_SHARED_SIZE_BYTES the program lowers is raised again before a
// shaped launch, and a carve-out the program sets is asked for again.
template <int kPath, int kId>
CUresult FuncSetAttributeHook(CUfunction f, int attrib, int value) {
  EnsureInit();
  auto real = reinterpret_cast<PFN_cuFuncSetAttribute>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  CUresult r = real(f, attrib, value);
  if (r == JOR_CUDA_SUCCESS) NoteFuncAttribute(f, attrib, value);
  return r;
}

template <int kPath, int kId>
CUresult StreamCreateHook(CUstream* ph, unsigned int flags) {
  EnsureInit();
  auto real = reinterpret_cast<PFN_cuStreamCreate>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  Count(kCounter_streams_created);
  const int64_t index = NextStreamIndex();
  if (PromoteStream(index, false) && CreatePromoted(ph, flags, index) == JOR_CUDA_SUCCESS) {
    return JOR_CUDA_SUCCESS;
  }
  return real(ph, flags);
}

template <int kPath, int kId>
CUresult StreamCreateWithPriorityHook(CUstream* ph, unsigned int flags, int priority) {
  EnsureInit();
  auto real = reinterpret_cast<PFN_cuStreamCreateWithPriority>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  Count(kCounter_streams_created);
  const int64_t index = NextStreamIndex();
  if (PromoteStream(index, priority != 0) &&
      CreatePromoted(ph, flags, index) == JOR_CUDA_SUCCESS) {
    return JOR_CUDA_SUCCESS;
  }
  return real(ph, flags, priority);
}

// cuModuleUnload / cuLibraryUnload: the unloaded kernels' handles may be reused.
template <int kPath, int kId, typename Handle>
CUresult UnloadHook(Handle handle) {
  EnsureInit();
  auto real = reinterpret_cast<CUresult (*)(Handle)>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  CUresult r = real(handle);
  ForgetFunctions();
  return r;
}

template <int kPath, int kId>
CUresult GetProcAddressHook(const char* symbol, void** pfn, int version, cuuint64_t flags) {
  EnsureInit();
  auto real = reinterpret_cast<PFN_cuGetProcAddress>(Real(kId));
  if (real == nullptr) return JOR_CUDA_ERROR_NOT_INITIALIZED;
  return ProcAddrCommon(symbol, pfn, version, flags, real(symbol, pfn, version, flags));
}

template <int kPath, int kId>
CUresult GetProcAddressV2Hook(const char* symbol, void** pfn, int version, cuuint64_t flags,
                              CUdriverProcAddressQueryResult* status) {
  EnsureInit();
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
JOR_BIND(cuModuleUnload, (UnloadHook<kPath, kSym_cuModuleUnload, CUmodule>))
JOR_BIND(cuLibraryUnload, (UnloadHook<kPath, kSym_cuLibraryUnload, CUlibrary>))
JOR_BIND(cuGetProcAddress, (GetProcAddressHook<kPath, kSym_cuGetProcAddress>))
JOR_BIND(cuGetProcAddress_v2, (GetProcAddressV2Hook<kPath, kSym_cuGetProcAddress_v2>))
#undef JOR_BIND

}  // namespace

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

}  // namespace jor

// Exported driver symbols (the direct path), generated from the list.
#define JOR_DEFINE_EXPORT(name, ret, params, args)                              \
  JOR_EXPORT ret name params {                                                  \
    return reinterpret_cast<jor::PFN_##name>(                                   \
        jor::HookImpl<jor::kPathDirect, jor::kSym_##name>::Get()) args;         \
  }
JOR_HOOKED_SYMBOLS(JOR_DEFINE_EXPORT)
#undef JOR_DEFINE_EXPORT
