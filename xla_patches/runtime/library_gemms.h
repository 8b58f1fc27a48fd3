// Library GEMMs: the plan's SM-count target (rules.h, `library_gemms sm_count_target N`)
// on every cuBLAS handle and cuBLASLt matmul descriptor the program creates.
//
// On Hopper cuBLAS runs large GEMMs as persistent kernels with a block on every SM it
// targets: a collective launched behind one waits for all of it (measured on an H200).
// cuBLAS's documented lever asks its heuristics for fewer SMs, leaving the rest to a
// concurrent stream: cublasSetSmCountTarget on a handle (the legacy API, XLA's
// __cublas$gemm thunks) and CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET on a matmul descriptor
// (cuBLASLt, XLA's __cublas$lt$matmul thunks). Whether the persistent grid shrinks is what
// benchmarks/gpu/gemm_dispatch.cu measures; the library only applies the target and counts.
//
// XLA loads cuBLAS with dlopen and finds its entry points with dlsym: the library's dlsym
// answers cublasCreate_v2 and cublasLtMatmulDescCreate with the hooks here, which call the
// real ones and then set the target on what they created (resolving the setter in the same
// library). Without the rule they only count. A program linked against cuBLAS directly is
// not reached.
#ifndef JAX_OVERLAP_XLA_PATCHES_RUNTIME_LIBRARY_GEMMS_H_
#define JAX_OVERLAP_XLA_PATCHES_RUNTIME_LIBRARY_GEMMS_H_

namespace jor {

// The hook to hand out for `name` looked up with dlsym in `handle`, whose real entry point
// is `real`; null for every name other than cublasCreate_v2 and cublasLtMatmulDescCreate
// (and when `real` is null).
void* LibraryGemmHook(void* handle, const char* name, void* real);

}  // namespace jor

#endif  // JAX_OVERLAP_XLA_PATCHES_RUNTIME_LIBRARY_GEMMS_H_
