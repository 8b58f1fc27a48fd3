// Legacy cuBLAS through dlopen (no link-time dependency), shared by the GPU benchmark's
// programs: cublasCreate_v2, cublasSetStream_v2, cublasGemmEx and, where the library has it,
// cublasSetSmCountTarget (enum values from cublas_api.h and library_types.h).
#ifndef JAX_OVERLAP_BENCHMARKS_GPU_CUBLAS_LOADER_H_
#define JAX_OVERLAP_BENCHMARKS_GPU_CUBLAS_LOADER_H_

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdlib.h>

#include <initializer_list>
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

// Offers each library that dlopens, $`env` first, then `sonames` in order, to
// `accept(handle)` (which resolves its symbols and creates its handle) until one accepts;
// the name of that library, or nullptr.
template <class Accept>
inline const char* OpenFirstLibrary(const char* env, std::initializer_list<const char*> sonames,
                                    Accept accept) {
  const char* first = getenv(env);
  if (first != nullptr && *first != '\0') {
    void* h = dlopen(first, RTLD_NOW | RTLD_GLOBAL);
    if (h != nullptr && accept(h)) return first;
  }
  for (const char* n : sonames) {
    void* h = dlopen(n, RTLD_NOW | RTLD_GLOBAL);
    if (h != nullptr && accept(h)) return n;
  }
  return nullptr;
}

// The first of $CUBLAS_LIBRARY, libcublas.so.13, .12, libcublas.so that loads and creates a
// handle.
inline bool LoadCublas(Cublas* c) {
  const char* n = OpenFirstLibrary(
      "CUBLAS_LIBRARY", {"libcublas.so.13", "libcublas.so.12", "libcublas.so"}, [c](void* h) {
        auto create = reinterpret_cast<CublasCreate>(dlsym(h, "cublasCreate_v2"));
        c->set_stream = reinterpret_cast<CublasSetStream>(dlsym(h, "cublasSetStream_v2"));
        c->gemm = reinterpret_cast<CublasGemmEx>(dlsym(h, "cublasGemmEx"));
        c->set_sm_count_target =
            reinterpret_cast<CublasSetSmCountTarget>(dlsym(h, "cublasSetSmCountTarget"));
        return create && c->set_stream && c->gemm && create(&c->handle) == 0;
      });
  if (n != nullptr) c->library = n;
  return n != nullptr;
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
