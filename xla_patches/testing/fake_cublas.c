/* A fake cuBLAS / cuBLASLt for testing the runtime library without a GPU: the few entry
 * points the library's SM-count target touches (xla_patches/runtime/library_gemms.h), each
 * remembering what it was given.
 *
 *   cublasCreate_v2, cublasSetSmCountTarget, cublasGetSmCountTarget      (a handle)
 *   cublasLtMatmulDescCreate, cublasLtMatmulDescSetAttribute,
 *   cublasLtMatmulDescGetAttribute                                       (a descriptor)
 *
 * FAKE_CUBLAS_REFUSE=1: the setters refuse every target (CUBLAS_STATUS_INVALID_VALUE), as a
 * cuBLAS without the attribute would.
 */
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))
#define SUCCESS 0
#define INVALID_VALUE 7
#define SM_COUNT_TARGET 15 /* CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET */

typedef struct {
  int sm_count_target;
} Handle;

typedef struct {
  int compute_type, scale_type, sm_count_target;
} Desc;

static int refuse(void) {
  const char* r = getenv("FAKE_CUBLAS_REFUSE");
  return r != NULL && r[0] == '1';
}

EXPORT int cublasCreate_v2(void** handle) {
  if (handle == NULL) return INVALID_VALUE;
  *handle = calloc(1, sizeof(Handle));
  return SUCCESS;
}

EXPORT int cublasSetSmCountTarget(void* handle, int n) {
  if (handle == NULL || n < 0 || refuse()) return INVALID_VALUE;
  ((Handle*)handle)->sm_count_target = n;
  return SUCCESS;
}

EXPORT int cublasGetSmCountTarget(void* handle, int* n) {
  if (handle == NULL || n == NULL) return INVALID_VALUE;
  *n = ((Handle*)handle)->sm_count_target;
  return SUCCESS;
}

EXPORT int cublasLtMatmulDescCreate(void** desc, int compute_type, int scale_type) {
  if (desc == NULL) return INVALID_VALUE;
  Desc* d = calloc(1, sizeof(Desc));
  d->compute_type = compute_type;
  d->scale_type = scale_type;
  *desc = d;
  return SUCCESS;
}

EXPORT int cublasLtMatmulDescSetAttribute(void* desc, int attr, const void* buf, size_t size) {
  if (desc == NULL || buf == NULL || refuse()) return INVALID_VALUE;
  if (attr != SM_COUNT_TARGET || size != sizeof(int)) return INVALID_VALUE;
  memcpy(&((Desc*)desc)->sm_count_target, buf, sizeof(int));
  return SUCCESS;
}

EXPORT int cublasLtMatmulDescGetAttribute(void* desc, int attr, void* buf, size_t size,
                                          size_t* written) {
  if (desc == NULL || buf == NULL || attr != SM_COUNT_TARGET || size < sizeof(int)) {
    return INVALID_VALUE;
  }
  memcpy(buf, &((Desc*)desc)->sm_count_target, sizeof(int));
  if (written != NULL) *written = sizeof(int);
  return SUCCESS;
}
