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
    const int64_t regs_per_warp =
        RoundUp(regs_per_thread * d->warp_size, d->reg_alloc_unit);
    blocks = Min(blocks, d->regs_per_sm / (regs_per_warp * warps));
  }
  const int64_t smem_block = smem_total + d->smem_reserved_per_block;
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
  int64_t dyn = d->smem_per_sm / (blocks_per_sm + 1) + 1 - static_smem -
                d->smem_reserved_per_block;
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
