// The one list of driver symbols the runtime library touches.
//
// JOR_HOOKED_SYMBOLS: symbols the library defines itself (LD_PRELOAD) and hands
// out from dlsym(libcuda handle, ...) and cuGetProcAddress(_v2). Each entry is
//   X(name, return type, (parameters), (argument names))
// and expands to an enum value, a name-table entry, a function-pointer type,
// the exported definition and the per-path dispatch table (symbols.h, hooks.cc).
//
// JOR_USED_SYMBOLS: driver symbols the library only calls.
#ifndef JAX_OVERLAP_XLA_PATCHES_RUNTIME_HOOKS_H_
#define JAX_OVERLAP_XLA_PATCHES_RUNTIME_HOOKS_H_

#include "cuda_types.h"

#define JOR_LAUNCH_PARAMS                                                   \
  (CUfunction f, unsigned int gridDimX, unsigned int gridDimY,              \
   unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,   \
   unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,   \
   void** kernelParams, void** extra)
#define JOR_LAUNCH_ARGS                                                     \
  (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,        \
   sharedMemBytes, hStream, kernelParams, extra)
#define JOR_LAUNCH_EX_PARAMS \
  (const CUlaunchConfig* config, CUfunction f, void** kernelParams, void** extra)
#define JOR_LAUNCH_EX_ARGS (config, f, kernelParams, extra)

#define JOR_COOP_PARAMS                                                     \
  (CUfunction f, unsigned int gridDimX, unsigned int gridDimY,              \
   unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,   \
   unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,   \
   void** kernelParams)
#define JOR_COOP_ARGS                                                       \
  (f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,        \
   sharedMemBytes, hStream, kernelParams)

#define JOR_HOOKED_SYMBOLS(X)                                                   \
  X(cuLaunchKernel, CUresult, JOR_LAUNCH_PARAMS, JOR_LAUNCH_ARGS)               \
  X(cuLaunchKernel_ptsz, CUresult, JOR_LAUNCH_PARAMS, JOR_LAUNCH_ARGS)          \
  X(cuLaunchKernelEx, CUresult, JOR_LAUNCH_EX_PARAMS, JOR_LAUNCH_EX_ARGS)       \
  X(cuLaunchKernelEx_ptsz, CUresult, JOR_LAUNCH_EX_PARAMS, JOR_LAUNCH_EX_ARGS)  \
  X(cuGraphAddKernelNode, CUresult,                                             \
    (CUgraphNode * phGraphNode, CUgraph hGraph,                                 \
     const CUgraphNode* dependencies, size_t numDependencies,                   \
     const CUDA_KERNEL_NODE_PARAMS_v1* nodeParams),                             \
    (phGraphNode, hGraph, dependencies, numDependencies, nodeParams))           \
  X(cuGraphAddKernelNode_v2, CUresult,                                          \
    (CUgraphNode * phGraphNode, CUgraph hGraph,                                 \
     const CUgraphNode* dependencies, size_t numDependencies,                   \
     const CUDA_KERNEL_NODE_PARAMS_v2* nodeParams),                             \
    (phGraphNode, hGraph, dependencies, numDependencies, nodeParams))           \
  X(cuGraphExecKernelNodeSetParams, CUresult,                                   \
    (CUgraphExec hGraphExec, CUgraphNode hNode,                                 \
     const CUDA_KERNEL_NODE_PARAMS_v1* nodeParams),                             \
    (hGraphExec, hNode, nodeParams))                                            \
  X(cuGraphExecKernelNodeSetParams_v2, CUresult,                                \
    (CUgraphExec hGraphExec, CUgraphNode hNode,                                 \
     const CUDA_KERNEL_NODE_PARAMS_v2* nodeParams),                             \
    (hGraphExec, hNode, nodeParams))                                            \
  X(cuGraphKernelNodeSetParams, CUresult,                                       \
    (CUgraphNode hNode, const CUDA_KERNEL_NODE_PARAMS_v1* nodeParams),          \
    (hNode, nodeParams))                                                        \
  X(cuGraphKernelNodeSetParams_v2, CUresult,                                    \
    (CUgraphNode hNode, const CUDA_KERNEL_NODE_PARAMS_v2* nodeParams),          \
    (hNode, nodeParams))                                                        \
  X(cuGraphAddNode, CUresult,                                                   \
    (CUgraphNode * phGraphNode, CUgraph hGraph,                                 \
     const CUgraphNode* dependencies, size_t numDependencies,                   \
     CUgraphNodeParams* nodeParams),                                            \
    (phGraphNode, hGraph, dependencies, numDependencies, nodeParams))           \
  X(cuGraphAddNode_v2, CUresult,                                                \
    (CUgraphNode * phGraphNode, CUgraph hGraph,                                 \
     const CUgraphNode* dependencies, const CUgraphEdgeData* dependencyData,    \
     size_t numDependencies, CUgraphNodeParams* nodeParams),                    \
    (phGraphNode, hGraph, dependencies, dependencyData, numDependencies,        \
     nodeParams))                                                               \
  X(cuGraphNodeSetParams, CUresult,                                             \
    (CUgraphNode hNode, CUgraphNodeParams * nodeParams), (hNode, nodeParams))   \
  X(cuGraphExecNodeSetParams, CUresult,                                         \
    (CUgraphExec hGraphExec, CUgraphNode hNode, CUgraphNodeParams* nodeParams), \
    (hGraphExec, hNode, nodeParams))                                            \
  X(cuLaunchCooperativeKernel, CUresult, JOR_COOP_PARAMS, JOR_COOP_ARGS)        \
  X(cuLaunchCooperativeKernel_ptsz, CUresult, JOR_COOP_PARAMS, JOR_COOP_ARGS)   \
  X(cuFuncSetAttribute, CUresult, (CUfunction hfunc, int attrib, int value),    \
    (hfunc, attrib, value))                                                     \
  X(cuStreamCreate, CUresult, (CUstream * phStream, unsigned int Flags),        \
    (phStream, Flags))                                                          \
  X(cuStreamCreateWithPriority, CUresult,                                       \
    (CUstream * phStream, unsigned int flags, int priority),                    \
    (phStream, flags, priority))                                                \
  X(cuModuleUnload, CUresult, (CUmodule hmod), (hmod))                          \
  X(cuLibraryUnload, CUresult, (CUlibrary library), (library))                  \
  X(cuGetProcAddress, CUresult,                                                 \
    (const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags),        \
    (symbol, pfn, cudaVersion, flags))                                          \
  X(cuGetProcAddress_v2, CUresult,                                              \
    (const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags,         \
     CUdriverProcAddressQueryResult* symbolStatus),                             \
    (symbol, pfn, cudaVersion, flags, symbolStatus))

#define JOR_USED_SYMBOLS(X)                                                     \
  X(cuFuncGetAttribute, CUresult, (int* pi, int attrib, CUfunction hfunc),      \
    (pi, attrib, hfunc))                                                        \
  X(cuFuncGetName, CUresult, (const char** name, CUfunction hfunc),             \
    (name, hfunc))                                                              \
  X(cuKernelGetFunction, CUresult, (CUfunction * pFunc, CUkernel kernel),      \
    (pFunc, kernel))                                                            \
  X(cuDeviceGetAttribute, CUresult, (int* pi, int attrib, CUdevice dev),        \
    (pi, attrib, dev))                                                          \
  X(cuCtxGetDevice, CUresult, (CUdevice * device), (device))                    \
  X(cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags, CUresult,            \
    (int* numBlocks, CUfunction func, int blockSize, size_t dynamicSMemSize,    \
     unsigned int flags),                                                       \
    (numBlocks, func, blockSize, dynamicSMemSize, flags))                       \
  X(cuStreamIsCapturing, CUresult, (CUstream hStream, int* captureStatus),      \
    (hStream, captureStatus))                                                   \
  X(cuCtxGetStreamPriorityRange, CUresult,                                      \
    (int* leastPriority, int* greatestPriority),                                \
    (leastPriority, greatestPriority))

// Counters, readable through jor_counter_name / jor_counter_value.
#define JOR_COUNTERS(X)                                                        \
  X(launches_seen, "kernel launches that reached the library")                 \
  X(launches_shaped, "launches given more dynamic shared memory")              \
  X(launches_capped, "shaped launches capped at the opt-in limit")             \
  X(launches_fallback, "launches sent unchanged after a driver error")         \
  X(capture_errors, "shaped launches that failed inside stream capture")       \
  X(launches_skipped, "selected launches not shaped (cooperative, cluster)")   \
  X(launches_no_room, "selected launches left alone: no cap makes room for a communication block") \
  X(no_room_registers, "of those, register-limited")                           \
  X(no_room_threads, "of those, thread-limited")                               \
  X(no_room_smem, "of those, shared-memory-limited")                           \
  X(no_room_blocks, "of those, limited by blocks per SM")                      \
  X(launches_in_region, "launches made inside an occupancy region")            \
  X(launches_direct, "launches through the exported symbol")                   \
  X(launches_dlsym, "launches through a pointer from dlsym on libcuda")        \
  X(launches_procaddr, "launches through a pointer from cuGetProcAddress")     \
  X(launches_kernel_handle, "launches under a plan naming a context-less kernel (CUkernel)") \
  X(graph_nodes_seen, "kernel graph nodes added or updated")                   \
  X(graph_nodes_shaped, "kernel graph nodes given more shared memory")         \
  X(func_attr_raised, "MAX_DYNAMIC_SHARED_SIZE_BYTES raises")                  \
  X(streams_created, "streams created")                                        \
  X(streams_promoted, "streams created at the highest priority by the plan")   \
  X(lookups_dlsym, "hooked symbols handed out by dlsym")                       \
  X(lookups_procaddr, "hooked symbols handed out by cuGetProcAddress")         \
  X(lookups_unhooked, "cuGetProcAddress answers left unhooked")                \
  X(regions_entered, "occupancy regions entered")                             \
  X(gemm_handles_seen, "cuBLAS handles created")                               \
  X(gemm_handles_targeted, "cuBLAS handles given the plan's SM-count target")   \
  X(gemm_descs_seen, "cuBLASLt matmul descriptors created")                    \
  X(gemm_descs_targeted, "cuBLASLt matmul descriptors given the plan's SM-count target") \
  X(gemm_target_errors, "SM-count targets cuBLAS refused or could not be set")

#endif  // JAX_OVERLAP_XLA_PATCHES_RUNTIME_HOOKS_H_
