// Legacy cuBLAS through dlopen (no link-time dependency), shared by the GPU benchmark's
// programs: cublasCreate_v2, cublasSetStream_v2, cublasGemmEx and, where the library has it,
// cublasSetSmCountTarget (enum values from cublas_api.h and library_types.h).
#ifndef JAX_OVERLAP_BENCHMARKS_GPU_CUBLAS_LOADER_H_
#define JAX_OVERLAP_BENCHMARKS_GPU_CUBLAS_LOADER_H_

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdlib.h>

#include <string>

constexpr int kCublasOpN = 0;            // CUBLAS_OP_N
constexpr int kCudaR32F = 0;             // CUDA_R_32F
constexpr int kCudaR16BF = 14;           // CUDA_R_16BF
constexpr int kCublasCompute32F = 68;    // CUBLAS_COMPUTE_32F
constexpr int kCublasGemmDefault = -1;   // CUBLAS_GEMM_DEFAULT
typedef int (*CublasCreate)(void**);
typedef int (*CublasSetStream)(void*, cudaStream_t);
typedef int (*CublasSetSmCountTarget)(void*, int);
typedef int (*CublasGemmEx)(void*, int, int, int, int, int, const void*, const void*, int, int,
                            const void*, int, int, const void*, void*, int, int, int, int);

struct Cublas {
  void* handle = nullptr;
  CublasSetStream set_stream = nullptr;
  CublasGemmEx gemm = nullptr;
  CublasSetSmCountTarget set_sm_count_target = nullptr;  // null: the library lacks it
  std::string library;
};

// The first of $CUBLAS_LIBRARY, libcublas.so.13, .12, libcublas.so that loads and creates a
// handle.
inline bool LoadCublas(Cublas* c) {
  const char* names[] = {getenv("CUBLAS_LIBRARY"), "libcublas.so.13", "libcublas.so.12",
                         "libcublas.so"};
  for (const char* n : names) {
    if (n == nullptr || *n == '\0') continue;
    void* h = dlopen(n, RTLD_NOW | RTLD_GLOBAL);
    if (h == nullptr) continue;
    auto create = reinterpret_cast<CublasCreate>(dlsym(h, "cublasCreate_v2"));
    c->set_stream = reinterpret_cast<CublasSetStream>(dlsym(h, "cublasSetStream_v2"));
    c->gemm = reinterpret_cast<CublasGemmEx>(dlsym(h, "cublasGemmEx"));
    c->set_sm_count_target =
        reinterpret_cast<CublasSetSmCountTarget>(dlsym(h, "cublasSetSmCountTarget"));
    if (create && c->set_stream && c->gemm && create(&c->handle) == 0) {
      c->library = n;
      return true;
    }
  }
  return false;
}

// D = A B, bf16 N x N x N with fp32 accumulation, on stream `s`; the cuBLAS status.
inline int CublasBf16Gemm(const Cublas& c, int n, const void* a, const void* b, void* d,
                          cudaStream_t s) {
  const float one = 1.f, zero = 0.f;
  int st = c.set_stream(c.handle, s);
  if (st != 0) return st;
  return c.gemm(c.handle, kCublasOpN, kCublasOpN, n, n, n, &one, a, kCudaR16BF, n, b, kCudaR16BF,
                n, &zero, d, kCudaR16BF, n, kCublasCompute32F, kCublasGemmDefault);
}

#endif  // JAX_OVERLAP_BENCHMARKS_GPU_CUBLAS_LOADER_H_
