// The few CUDA driver types the runtime library uses, declared here so that it
// builds without a CUDA toolkit.
//
// Every numeric value below is the one in the public driver header cuda.h
// (CUDA 13.0, /usr/local/cuda/include/cuda.h; the same values are listed in the
// Driver API reference, "Data types used by CUDA driver",
// docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__TYPES.html). The values are
// part of the driver ABI and have not changed since they were introduced.
#ifndef JAX_OVERLAP_XLA_PATCHES_RUNTIME_CUDA_TYPES_H_
#define JAX_OVERLAP_XLA_PATCHES_RUNTIME_CUDA_TYPES_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef int CUresult;  // enum cudaError_enum
typedef int CUdevice;
typedef struct CUctx_st* CUcontext;
typedef struct CUmod_st* CUmodule;
typedef struct CUlib_st* CUlibrary;
typedef struct CUfunc_st* CUfunction;
typedef struct CUkern_st* CUkernel;
typedef struct CUstream_st* CUstream;
typedef struct CUgraph_st* CUgraph;
typedef struct CUgraphNode_st* CUgraphNode;
typedef struct CUgraphExec_st* CUgraphExec;
typedef uint64_t cuuint64_t;

// enum cudaError_enum (cuda.h).
enum {
  JOR_CUDA_SUCCESS = 0,
  JOR_CUDA_ERROR_INVALID_VALUE = 1,
  JOR_CUDA_ERROR_NOT_INITIALIZED = 3,
  JOR_CUDA_ERROR_INVALID_HANDLE = 400,
  JOR_CUDA_ERROR_NOT_FOUND = 500,
};

// enum CUfunction_attribute_enum (cuda.h).
enum {
  JOR_CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0,
  JOR_CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1,
  JOR_CU_FUNC_ATTRIBUTE_NUM_REGS = 4,
  JOR_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8,
  JOR_CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9,
  // Cluster dimensions fixed at compile time (__cluster_dims__), CUDA 12.
  JOR_CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH = 11,
  JOR_CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT = 12,
  JOR_CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH = 13,
};

// enum CUdevice_attribute_enum (cuda.h).
enum {
  JOR_CU_DEVICE_ATTRIBUTE_WARP_SIZE = 10,
  JOR_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
  JOR_CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR = 39,
  JOR_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81,
  JOR_CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR = 82,
  JOR_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97,
  JOR_CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR = 106,
  JOR_CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK = 111,
  JOR_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
  JOR_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
};

// enum CUlaunchAttributeID_enum (cuda.h).
enum {
  JOR_CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2,
  JOR_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4,
};

// enum CUdriverProcAddress_flags_enum (cuda.h).
enum {
  JOR_CU_GET_PROC_ADDRESS_DEFAULT = 0,
  JOR_CU_GET_PROC_ADDRESS_LEGACY_STREAM = 1 << 0,
  JOR_CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM = 1 << 1,
};

// enum CUstreamCaptureStatus_enum (cuda.h).
enum { JOR_CU_STREAM_CAPTURE_STATUS_NONE = 0 };

typedef int CUdriverProcAddressQueryResult;

// union CUlaunchAttributeValue_union: 64 bytes (cuda.h pads it to 64).
typedef union CUlaunchAttributeValue_union {
  char pad[64];
  int cooperative;
  struct {
    unsigned int x, y, z;
  } clusterDim;
} CUlaunchAttributeValue;

// struct CUlaunchAttribute_st (cuda.h): id, padding to 8 bytes, value.
typedef struct CUlaunchAttribute_st {
  int id;
  char pad[8 - sizeof(int)];
  CUlaunchAttributeValue value;
} CUlaunchAttribute;

// struct CUlaunchConfig_st (cuda.h).
typedef struct CUlaunchConfig_st {
  unsigned int gridDimX, gridDimY, gridDimZ;
  unsigned int blockDimX, blockDimY, blockDimZ;
  unsigned int sharedMemBytes;
  CUstream hStream;
  CUlaunchAttribute* attrs;
  unsigned int numAttrs;
} CUlaunchConfig;

// struct CUDA_KERNEL_NODE_PARAMS_st (v1) and _v2_st (cuda.h). v1 is a prefix of v2.
typedef struct CUDA_KERNEL_NODE_PARAMS_v1_st {
  CUfunction func;
  unsigned int gridDimX, gridDimY, gridDimZ;
  unsigned int blockDimX, blockDimY, blockDimZ;
  unsigned int sharedMemBytes;
  void** kernelParams;
  void** extra;
} CUDA_KERNEL_NODE_PARAMS_v1;

typedef struct CUDA_KERNEL_NODE_PARAMS_v2_st {
  CUfunction func;
  unsigned int gridDimX, gridDimY, gridDimZ;
  unsigned int blockDimX, blockDimY, blockDimZ;
  unsigned int sharedMemBytes;
  void** kernelParams;
  void** extra;
  CUkernel kern;
  CUcontext ctx;
} CUDA_KERNEL_NODE_PARAMS_v2;

// CUDA_KERNEL_NODE_PARAMS_v3 (CUDA 12.2) has the v2 layout.
typedef CUDA_KERNEL_NODE_PARAMS_v2 CUDA_KERNEL_NODE_PARAMS_v3;

// struct CUgraphNodeParams_st (cuda.h, CUDA 12.2): the generic node API
// (cuGraphAddNode, cuGraphNodeSetParams, cuGraphExecNodeSetParams). Only the
// kernel member is read; the union is padded to 29 long longs.
#define JOR_CU_GRAPH_NODE_TYPE_KERNEL 0
typedef struct CUgraphNodeParams_st {
  int type;  // CUgraphNodeType
  int reserved0[3];
  union {
    long long reserved1[29];
    CUDA_KERNEL_NODE_PARAMS_v3 kernel;
  };
  long long reserved2;
} CUgraphNodeParams;

// struct CUgraphEdgeData_st (cuda.h, CUDA 12.3): passed through, never read.
typedef struct CUgraphEdgeData_st CUgraphEdgeData;

#ifdef __cplusplus
static_assert(sizeof(CUgraphNodeParams) == 256, "CUgraphNodeParams is 256 bytes in cuda.h");
}  // extern "C"
#endif

#endif  // JAX_OVERLAP_XLA_PATCHES_RUNTIME_CUDA_TYPES_H_
