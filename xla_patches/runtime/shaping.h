// Occupancy shaping arithmetic: how many blocks of a kernel are resident on one
// SM, and how much dynamic shared memory caps that number.
//
// Residency of one kernel on one SM is the minimum over four limits
// (CUDA C Programming Guide, "Occupancy"; CUDA occupancy calculator):
//
//   warps    = ceil(threads / warp_size)
//   by_block = max_blocks_per_sm
//   by_warp  = floor(max_threads_per_sm / (warps * warp_size))
//   by_regs  = floor(regs_per_sm / (roundup(regs_per_thread * warp_size,
//                                           reg_alloc_unit) * warps))
//   by_smem  = floor(smem_per_sm / (static + dynamic + reserved_per_block))
//   blocks/SM = min(by_block, by_warp, by_regs, by_smem)
//
// To cap residency at N blocks per SM we raise only the dynamic shared memory,
// choosing the smallest value with by_smem <= N:
//
//   (static + dyn + reserved) * (N + 1) > smem_per_sm
//   dyn = floor(smem_per_sm / (N + 1)) + 1 - static - reserved
//
// clamped below by the launch's own dynamic shared memory (shaping never
// shrinks a launch). If static + dyn exceeds the per-block opt-in limit the
// launch cannot be shaped that far: dyn is capped at opt-in - static and the
// result says so (JOR_SHAPE_CAPPED). A kernel already at or below N blocks per
// SM is left alone (JOR_SHAPE_UNCHANGED).
//
// The Python mirror is jax_overlap/_src/plan.py (blocks_per_sm,
// shaped_dynamic_smem); a test keeps the two equal.
#ifndef JAX_OVERLAP_XLA_PATCHES_RUNTIME_SHAPING_H_
#define JAX_OVERLAP_XLA_PATCHES_RUNTIME_SHAPING_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Per-SM limits of one device, as reported by cuDeviceGetAttribute.
typedef struct JorDeviceLimits {
  int64_t sm_count;
  int64_t smem_per_sm;              // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
  int64_t smem_per_block_optin;     // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
  int64_t smem_reserved_per_block;  // RESERVED_SHARED_MEMORY_PER_BLOCK
  int64_t max_threads_per_sm;       // MAX_THREADS_PER_MULTIPROCESSOR
  int64_t max_blocks_per_sm;        // MAX_BLOCKS_PER_MULTIPROCESSOR
  int64_t regs_per_sm;              // MAX_REGISTERS_PER_MULTIPROCESSOR
  int64_t warp_size;                // WARP_SIZE
  int64_t reg_alloc_unit;           // 256 on every NVIDIA part since sm_30
} JorDeviceLimits;

enum JorShapeStatus {
  JOR_SHAPE_INVALID = -1,   // bad input (non-positive threads, N < 1, ...)
  JOR_SHAPE_UNCHANGED = 0,  // already at or below the cap: launch as is
  JOR_SHAPE_SHAPED = 1,     // dynamic smem raised; residency <= N
  JOR_SHAPE_CAPPED = 2,     // raised to the opt-in limit; residency may exceed N
};

// Resident blocks per SM for a kernel, per the formula above. Returns 0 when the
// kernel cannot run at all (too many threads, registers or shared memory).
__attribute__((visibility("default"))) int64_t jor_blocks_per_sm(
    const JorDeviceLimits* d, int64_t threads, int64_t regs_per_thread,
    int64_t smem_total);

// Dynamic shared memory that caps residency at `blocks_per_sm`. Writes one of
// JorShapeStatus to *status (if not null). On JOR_SHAPE_INVALID or
// JOR_SHAPE_UNCHANGED returns `dynamic_smem` itself.
__attribute__((visibility("default"))) int64_t jor_shaped_dynamic_smem(
    const JorDeviceLimits* d, int64_t threads, int64_t regs_per_thread,
    int64_t static_smem, int64_t dynamic_smem, int64_t blocks_per_sm,
    int* status);

// Dynamic shared memory after adding `padding_bytes`, capped at the opt-in
// limit (status JOR_SHAPE_CAPPED when the cap bit).
__attribute__((visibility("default"))) int64_t jor_padded_dynamic_smem(
    const JorDeviceLimits* d, int64_t static_smem, int64_t dynamic_smem,
    int64_t padding_bytes, int* status);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // JAX_OVERLAP_XLA_PATCHES_RUNTIME_SHAPING_H_
