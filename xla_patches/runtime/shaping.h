// Occupancy shaping arithmetic: how many blocks of a kernel are resident on one
// SM, and how much dynamic shared memory caps that number.
//
// Residency of one kernel on one SM is the minimum over four limits
// (CUDA C Programming Guide, "Occupancy"; CUDA occupancy calculator):
//
//   warps    = ceil(threads / warp_size)
//   by_block = max_blocks_per_sm
//   by_warp  = floor(max_threads_per_sm / (warps * warp_size))
//   by_regs  = floor(floor(regs_per_sm / 4 / regs_per_warp) * 4 / warps)
//              regs_per_warp = roundup(regs_per_thread * warp_size, reg_alloc_unit);
//              the register file is split over four sub-partitions and a warp's
//              registers come from one of them
//   by_smem  = floor(smem_per_sm / roundup(static + dynamic + reserved_per_block,
//                                          smem_alloc_unit))
//   blocks/SM = min(by_block, by_warp, by_regs, by_smem)
//
// To cap residency at N blocks per SM we raise only the dynamic shared memory,
// choosing the smallest value with by_smem <= N:
//
//   roundup(static + dyn + reserved, unit) * (N + 1) > smem_per_sm
//   block = (floor(floor(smem_per_sm / (N + 1)) / unit) + 1) * unit
//   dyn   = block - (unit - 1) - static - reserved
//
// clamped below by the launch's own dynamic shared memory (shaping never
// shrinks a launch). If static + dyn exceeds the per-block opt-in limit the
// launch cannot be shaped that far: dyn is capped at opt-in - static and the
// result says so (JOR_SHAPE_CAPPED). A kernel already at or below N blocks per
// SM is left alone (JOR_SHAPE_UNCHANGED).
//
// Room for communication. A cap helps only if one communication block (an NCCL
// channel: JorCommBlock) can then become resident beside the capped compute
// blocks. jor_room_cap returns the largest r <= cap such that r compute blocks,
// with the dynamic shared memory that caps them at r, and one communication block
// fit together on an SM in every resource:
//   blocks     r + 1 <= max_blocks_per_sm
//   threads    r * roundup(threads, warp) + roundup(comm_threads, warp)
//                <= max_threads_per_sm
//   registers  per sub-partition (regs_per_sm / 4 each): the communication
//              block's warps placed round-robin, then each compute warp where
//              most registers are free; every warp must find room
//   shared mem r * roundup(static + dyn_r + reserved, unit)
//                + roundup(comm_smem + reserved, unit) <= smem_per_sm
// or 0 when no r >= 1 fits, with the limits that failed at r = 1 in *reasons
// (JorNoRoom bits): the kernel is register-, thread-, shared-memory- or
// block-limited and padding it cannot make room.
//
// The Python mirror is jax_overlap/_src/runtime/residency.py (blocks_per_sm,
// shaped_dynamic_smem, room_cap); a test keeps the two equal, and the test
// suite's fake driver checks residency against its own implementation of
// NVIDIA's rules.
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
  int64_t smem_alloc_unit;          // 128 bytes on sm_80 and later
} JorDeviceLimits;

// Launch footprint of one communication block the shaper makes room for.
typedef struct JorCommBlock {
  int64_t threads;
  int64_t regs_per_thread;  // 0: unknown, not checked
  int64_t smem_bytes;       // static + dynamic
} JorCommBlock;

enum JorNoRoom {
  JOR_NO_ROOM_THREADS = 1,
  JOR_NO_ROOM_REGISTERS = 2,
  JOR_NO_ROOM_SMEM = 4,
  JOR_NO_ROOM_BLOCKS = 8,
};

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

// Largest cap r in [1, blocks_per_sm] that leaves room for `comm` (see above);
// 0 when none does, with JorNoRoom bits in *reasons (if not null). A kernel that
// already runs at most r blocks per SM is checked with its own shared memory.
__attribute__((visibility("default"))) int64_t jor_room_cap(
    const JorDeviceLimits* d, const JorCommBlock* comm, int64_t threads,
    int64_t regs_per_thread, int64_t static_smem, int64_t dynamic_smem,
    int64_t blocks_per_sm, int* reasons);

// JorNoRoom bits for `blocks` blocks of a kernel (`smem_total` bytes of shared
// memory each) beside one `comm` block on an SM; 0 when they fit together.
__attribute__((visibility("default"))) int jor_no_room(
    const JorDeviceLimits* d, const JorCommBlock* comm, int64_t blocks, int64_t threads,
    int64_t regs_per_thread, int64_t smem_total);

// The communication block of an NCCL channel on a device of compute capability
// `major`.`minor` (NCCL src/include/device.h): NCCL_MAX_NTHREADS = 640 and
// __launch_bounds__(NCCL_MAX_NTHREADS, 1) bound registers at 96 per thread;
// dynamic shared memory ncclShmemDynamicSize = ncclShmemScratchWarpSize x 20
// warps (82,240 bytes on sm_80+ with the Simple protocol's unroll of 8, 41,280
// on sm_70); `nthreads` is the channel's block size (Simple protocol: 512
// threads plus one synchronization warp; NCCL_NTHREADS changes it; LL128 and
// tree launch 640). Returns 0 for devices NCCL's kernels do not cover.
__attribute__((visibility("default"))) int jor_nccl_comm_block(
    int major, int minor, int64_t nthreads, JorCommBlock* out);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // JAX_OVERLAP_XLA_PATCHES_RUNTIME_SHAPING_H_
