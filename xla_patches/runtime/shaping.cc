// Occupancy shaping arithmetic; the formulas are in shaping.h.
#include "shaping.h"

namespace {

int64_t RoundUp(int64_t x, int64_t unit) {
  return unit <= 0 ? x : (x + unit - 1) / unit * unit;
}

int64_t Min(int64_t a, int64_t b) { return a < b ? a : b; }

bool LimitsValid(const JorDeviceLimits* d) {
  return d != nullptr && d->smem_per_sm > 0 && d->max_threads_per_sm > 0 &&
         d->max_blocks_per_sm > 0 && d->regs_per_sm > 0 && d->warp_size > 0 &&
         d->smem_reserved_per_block >= 0 && d->smem_per_block_optin > 0;
}

void SetStatus(int* status, int value) {
  if (status != nullptr) *status = value;
}

// Register file sub-partitions per SM (one per warp scheduler) on sm_70+.
constexpr int kSubPartitions = 4;

int64_t RegsPerWarp(const JorDeviceLimits* d, int64_t regs_per_thread) {
  return RoundUp(regs_per_thread * d->warp_size, d->reg_alloc_unit);
}

// Shared memory one resident block takes from its SM.
int64_t SmemBlock(const JorDeviceLimits* d, int64_t smem_total) {
  const int64_t bytes = smem_total + d->smem_reserved_per_block;
  return bytes > 0 ? RoundUp(bytes, d->smem_alloc_unit) : 0;
}

// JorNoRoom bits for `blocks` compute blocks (each `smem_total` bytes of shared
// memory) beside one communication block; 0 when they fit together.
int NoRoom(const JorDeviceLimits* d, const JorCommBlock* c, int64_t blocks,
           int64_t threads, int64_t regs_per_thread, int64_t smem_total) {
  int reasons = 0;
  if (blocks + 1 > d->max_blocks_per_sm) reasons |= JOR_NO_ROOM_BLOCKS;
  const int64_t warp = d->warp_size;
  if (blocks * RoundUp(threads, warp) + RoundUp(c->threads, warp) >
      d->max_threads_per_sm) {
    reasons |= JOR_NO_ROOM_THREADS;
  }
  if (c->regs_per_thread > 0 || regs_per_thread > 0) {
    int64_t free_regs[kSubPartitions];
    for (int64_t& f : free_regs) f = d->regs_per_sm / kSubPartitions;
    bool fits = true;
    const int64_t comm_warps = RoundUp(c->threads, warp) / warp;
    const int64_t comm_per_warp =
        c->regs_per_thread > 0 ? RegsPerWarp(d, c->regs_per_thread) : 0;
    for (int64_t w = 0; w < comm_warps; ++w) {
      free_regs[w % kSubPartitions] -= comm_per_warp;
      if (free_regs[w % kSubPartitions] < 0) fits = false;
    }
    const int64_t per_warp = regs_per_thread > 0 ? RegsPerWarp(d, regs_per_thread) : 0;
    const int64_t warps = blocks * (RoundUp(threads, warp) / warp);
    for (int64_t w = 0; w < warps && fits; ++w) {
      int best = 0;
      for (int p = 1; p < kSubPartitions; ++p) {
        if (free_regs[p] > free_regs[best]) best = p;
      }
      free_regs[best] -= per_warp;
      if (free_regs[best] < 0) fits = false;
    }
    if (!fits) reasons |= JOR_NO_ROOM_REGISTERS;
  }
  if (blocks * SmemBlock(d, smem_total) + SmemBlock(d, c->smem_bytes) > d->smem_per_sm) {
    reasons |= JOR_NO_ROOM_SMEM;
  }
  return reasons;
}

}  // namespace

extern "C" int64_t jor_blocks_per_sm(const JorDeviceLimits* d, int64_t threads,
                                     int64_t regs_per_thread,
                                     int64_t smem_total) {
  if (!LimitsValid(d) || threads <= 0 || regs_per_thread < 0 || smem_total < 0) {
    return 0;
  }
  const int64_t threads_rounded = RoundUp(threads, d->warp_size);
  const int64_t warps = threads_rounded / d->warp_size;
  int64_t blocks = d->max_blocks_per_sm;
  blocks = Min(blocks, d->max_threads_per_sm / threads_rounded);
  if (regs_per_thread > 0) {
    const int64_t regs_per_warp = RegsPerWarp(d, regs_per_thread);
    const int64_t warps_per_partition =
        d->regs_per_sm / kSubPartitions / regs_per_warp;
    blocks = Min(blocks, warps_per_partition * kSubPartitions / warps);
  }
  const int64_t smem_block = SmemBlock(d, smem_total);
  if (smem_block > 0) blocks = Min(blocks, d->smem_per_sm / smem_block);
  return blocks < 0 ? 0 : blocks;
}

extern "C" int64_t jor_shaped_dynamic_smem(const JorDeviceLimits* d,
                                           int64_t threads,
                                           int64_t regs_per_thread,
                                           int64_t static_smem,
                                           int64_t dynamic_smem,
                                           int64_t blocks_per_sm, int* status) {
  if (!LimitsValid(d) || threads <= 0 || regs_per_thread < 0 ||
      static_smem < 0 || dynamic_smem < 0 || blocks_per_sm < 1) {
    SetStatus(status, JOR_SHAPE_INVALID);
    return dynamic_smem;
  }
  const int64_t current =
      jor_blocks_per_sm(d, threads, regs_per_thread, static_smem + dynamic_smem);
  if (current <= blocks_per_sm) {
    SetStatus(status, JOR_SHAPE_UNCHANGED);
    return dynamic_smem;
  }
  // Smallest per-block footprint (a whole number of allocation units) of which
  // N + 1 do not fit, then the fewest bytes that round up to it.
  const int64_t unit = d->smem_alloc_unit > 0 ? d->smem_alloc_unit : 1;
  const int64_t block = (d->smem_per_sm / (blocks_per_sm + 1) / unit + 1) * unit;
  int64_t dyn = block - (unit - 1) - static_smem - d->smem_reserved_per_block;
  if (dyn < dynamic_smem) dyn = dynamic_smem;
  if (static_smem + dyn > d->smem_per_block_optin) {
    const int64_t capped = d->smem_per_block_optin - static_smem;
    if (capped <= dynamic_smem) {
      SetStatus(status, JOR_SHAPE_UNCHANGED);
      return dynamic_smem;
    }
    SetStatus(status, JOR_SHAPE_CAPPED);
    return capped;
  }
  SetStatus(status, JOR_SHAPE_SHAPED);
  return dyn;
}

extern "C" int64_t jor_padded_dynamic_smem(const JorDeviceLimits* d,
                                           int64_t static_smem,
                                           int64_t dynamic_smem,
                                           int64_t padding_bytes, int* status) {
  if (!LimitsValid(d) || static_smem < 0 || dynamic_smem < 0 ||
      padding_bytes < 0) {
    SetStatus(status, JOR_SHAPE_INVALID);
    return dynamic_smem;
  }
  if (padding_bytes == 0) {
    SetStatus(status, JOR_SHAPE_UNCHANGED);
    return dynamic_smem;
  }
  int64_t dyn = dynamic_smem + padding_bytes;
  if (static_smem + dyn > d->smem_per_block_optin) {
    const int64_t capped = d->smem_per_block_optin - static_smem;
    if (capped <= dynamic_smem) {
      SetStatus(status, JOR_SHAPE_UNCHANGED);
      return dynamic_smem;
    }
    SetStatus(status, JOR_SHAPE_CAPPED);
    return capped;
  }
  SetStatus(status, JOR_SHAPE_SHAPED);
  return dyn;
}

extern "C" int64_t jor_room_cap(const JorDeviceLimits* d, const JorCommBlock* comm,
                                int64_t threads, int64_t regs_per_thread,
                                int64_t static_smem, int64_t dynamic_smem,
                                int64_t blocks_per_sm, int* reasons) {
  if (reasons != nullptr) *reasons = 0;
  if (!LimitsValid(d) || comm == nullptr || comm->threads <= 0 ||
      comm->regs_per_thread < 0 || comm->smem_bytes < 0 || threads <= 0 ||
      regs_per_thread < 0 || static_smem < 0 || dynamic_smem < 0 || blocks_per_sm < 1) {
    return 0;
  }
  const int64_t natural =
      jor_blocks_per_sm(d, threads, regs_per_thread, static_smem + dynamic_smem);
  int last = 0;
  for (int64_t r = Min(blocks_per_sm, natural); r >= 1; --r) {
    int status = JOR_SHAPE_INVALID;
    const int64_t dyn = jor_shaped_dynamic_smem(d, threads, regs_per_thread, static_smem,
                                                dynamic_smem, r, &status);
    if (status == JOR_SHAPE_INVALID) return 0;
    if (status == JOR_SHAPE_CAPPED) {
      last = JOR_NO_ROOM_SMEM;  // padding cannot bring residency down to r
      continue;
    }
    last = NoRoom(d, comm, r, threads, regs_per_thread, static_smem + dyn);
    if (last == 0) return r;
  }
  if (reasons != nullptr) *reasons = natural < 1 ? 0 : last;
  return 0;
}

extern "C" int jor_no_room(const JorDeviceLimits* d, const JorCommBlock* comm,
                           int64_t blocks, int64_t threads, int64_t regs_per_thread,
                           int64_t smem_total) {
  if (!LimitsValid(d) || comm == nullptr || blocks < 0 || threads <= 0) return 0;
  return NoRoom(d, comm, blocks, threads, regs_per_thread, smem_total);
}

extern "C" int jor_nccl_comm_block(int major, int minor, int64_t nthreads,
                                   JorCommBlock* out) {
  (void)minor;
  if (out == nullptr || major < 7) return 0;
  // ncclShmemScratchWarpSize: the Simple protocol's (unroll * 32 + 1) * 16 bytes
  // dominates (unroll 8 on sm_80+, 4 before), times NCCL_MAX_NTHREADS / 32 warps.
  const int64_t unroll = major >= 8 ? 8 : 4;
  out->threads = nthreads > 0 ? nthreads : 512 + 32;
  out->regs_per_thread = 96;
  out->smem_bytes = (unroll * 32 + 1) * 16 * (640 / 32);
  return 1;
}
