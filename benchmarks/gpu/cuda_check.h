// CHECK(call): a CUDA runtime call that must succeed; on an error, prints the call and
// the runtime's message, prefixed with CHECK_PROGRAM (defined before including this), and
// exits with status 1. Shared by the GPU benchmark programs here.
#pragma once
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(x)                                                                         \
  do {                                                                                   \
    cudaError_t e = (x);                                                                 \
    if (e != cudaSuccess) {                                                              \
      fprintf(stderr, "%s: %s failed: %s\n", CHECK_PROGRAM, #x, cudaGetErrorString(e)); \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)
