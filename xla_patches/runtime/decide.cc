#include "decide.h"

#include <stdlib.h>

#include <atomic>
#include <string>

#include "driver_info.h"
#include "log.h"
#include "regions.h"
#include "rules.h"
#include "shaping.h"
#include "symbols.h"

namespace jor {

namespace {

// NCCL's Simple-protocol channel size: NCCL_NTHREADS (default 512) plus one
// synchronization warp (NCCL_SIMPLE_EXTRA_GROUP_IF_NTHREADS_GE: 96 threads).
int64_t NcclSimpleThreads() {
  static const int64_t threads = [] {
    int64_t n = 512;
    const char* v = getenv("NCCL_NTHREADS");
    int64_t parsed = 0;
    if (v != nullptr && ParseInt(v, &parsed) && parsed >= 64 && parsed <= 512 &&
        parsed % 64 == 0) {
      n = parsed;
    }
    return n >= 96 ? n + 32 : n;
  }();
  return threads;
}

// The communication block the rules make room for; false: no room check.
bool CommBlockFor(const Rules* rules, int cc_major, int cc_minor, JorCommBlock* out) {
  if (rules->room == Rules::kRoomGiven) {
    *out = rules->comm;
    return true;
  }
  if (rules->room == Rules::kRoomAuto) {
    return jor_nccl_comm_block(cc_major, cc_minor, NcclSimpleThreads(), out) != 0;
  }
  return false;
}

void CountNoRoom(int reasons) {
  Count(kCounter_launches_no_room);
  if (reasons & JOR_NO_ROOM_REGISTERS) Count(kCounter_no_room_registers);
  if (reasons & JOR_NO_ROOM_THREADS) Count(kCounter_no_room_threads);
  if (reasons & JOR_NO_ROOM_SMEM) Count(kCounter_no_room_smem);
  if (reasons & JOR_NO_ROOM_BLOCKS) Count(kCounter_no_room_blocks);
}

std::atomic<int64_t> g_stream_index{0};

}  // namespace

Decision Decide(CUfunction f, CUstream stream, bool known_stream, unsigned threads, unsigned dyn,
                bool skip, unsigned* new_dyn, CUfunction* launch_f) {
  *new_dyn = dyn;
  *launch_f = f;
  const Rules* rules = CurrentRules();
  const int64_t region_blocks = CurrentRegionBlocks(stream, known_stream);
  if (region_blocks > 0) Count(kCounter_launches_in_region);
  if ((rules == nullptr || rules->kernels.empty()) && region_blocks <= 0) return kPass;
  static const Rules* const kEmpty = [] {
    Rules* r = new Rules();
    r->generation = 1;
    r->room = Rules::kRoomAuto;  // regions without a plan make room for NCCL's channel
    return r;
  }();
  if (rules == nullptr) rules = kEmpty;
  if (f == nullptr) return kPass;
  f = Launchable(f);
  FuncLite* lite = &TlsFunc(f);
  std::string name;
  if (lite->f != f || lite->generation != rules->generation ||
      lite->epoch != FuncEpoch() || Verbose() >= 3) {
    FuncInfo info;
    if (!FuncFor(f, rules, &info, Verbose() >= 3)) return kFallback;
    FillTls(f, info);
    lite = &TlsFunc(f);
    name = info.name;
  }
  int64_t blocks = 0, padding = 0;
  if (lite->rule >= 0) {
    blocks = rules->kernels[lite->rule].blocks_per_sm;
    padding = rules->kernels[lite->rule].padding_bytes;
  } else {
    blocks = region_blocks;
  }
  if (blocks <= 0 && padding <= 0) return kPass;
  if (skip || lite->cluster) {
    Count(kCounter_launches_skipped);
    return kPass;
  }
  JorDeviceLimits limits;
  int cc_major = 0, cc_minor = 0;
  if (!DeviceLimits(&limits, &cc_major, &cc_minor)) return kFallback;
  JorCommBlock comm;
  const bool room = blocks > 0 && CommBlockFor(rules, cc_major, cc_minor, &comm);
  if (room) {
    // The room rule loops over caps and warps: remembered per thread for the last
    // launch configuration of this function (a kernel relaunches with the same one).
    if (!(lite->room_valid && lite->room_threads == threads && lite->room_dyn == dyn &&
          lite->room_blocks == blocks && lite->room_smem_sm == limits.smem_per_sm)) {
      lite->room_r = jor_room_cap(&limits, &comm, threads, lite->regs, lite->static_smem, dyn,
                                  blocks, &lite->room_reasons);
      lite->room_threads = threads;
      lite->room_dyn = dyn;
      lite->room_blocks = blocks;
      lite->room_smem_sm = limits.smem_per_sm;
      lite->room_valid = true;
    }
    const int reasons = lite->room_reasons;
    const int64_t r = lite->room_r;
    if (r < 1) {
      // No reason: the arithmetic says the kernel cannot run at all; leave it to the driver.
      if (reasons == 0) Count(kCounter_launches_skipped);
      else CountNoRoom(reasons);
      return kPass;
    }
    blocks = r;
  }
  int status = JOR_SHAPE_INVALID;
  int64_t shaped =
      blocks > 0 ? jor_shaped_dynamic_smem(&limits, threads, lite->regs, lite->static_smem,
                                           dyn, blocks, &status)
                 : jor_padded_dynamic_smem(&limits, lite->static_smem, dyn, padding, &status);
  if (status == JOR_SHAPE_INVALID) {
    Count(kCounter_launches_skipped);
    return kPass;
  }
  if (blocks > 0 && status != JOR_SHAPE_INVALID) {
    const int64_t max_dyn = limits.smem_per_block_optin - lite->static_smem;
    shaped = DriverChecked(f, threads, dyn, status == JOR_SHAPE_UNCHANGED ? dyn : shaped, blocks,
                           max_dyn);
    status = shaped >= max_dyn ? JOR_SHAPE_CAPPED : JOR_SHAPE_SHAPED;
    // The driver may ask for more shared memory than the arithmetic: the room
    // must still be there.
    if (room && shaped != dyn) {
      const int why =
          jor_no_room(&limits, &comm, blocks, threads, lite->regs, lite->static_smem + shaped);
      if (why != 0) {
        CountNoRoom(why);
        return kPass;
      }
    }
  }
  if (status == JOR_SHAPE_UNCHANGED || shaped == dyn) return kPass;
  if (!EnsureMaxDynamic(f, lite, shaped)) return kFallback;
  if (status == JOR_SHAPE_CAPPED) Count(kCounter_launches_capped);
  *new_dyn = static_cast<unsigned>(shaped);
  *launch_f = f;
  Log(3, "launch %s: %u threads, dynamic smem %u -> %u", name.c_str(), threads,
      dyn, *new_dyn);
  return kShape;
}

int64_t NextStreamIndex() { return g_stream_index.fetch_add(1); }

bool PromoteStream(int64_t index, bool requested_priority) {
  const Rules* rules = CurrentRules();
  if (rules == nullptr || !rules->stream_priority_highest) return false;
  for (int64_t i : rules->stream_create_order) {
    if (i == index) return true;
  }
  return rules->promote_requested && requested_priority;
}

CUresult CreatePromoted(CUstream* ph, unsigned flags, int64_t index) {
  auto range = REAL(cuCtxGetStreamPriorityRange);
  auto create = REAL(cuStreamCreateWithPriority);
  int least = 0, greatest = 0;
  if (range == nullptr || create == nullptr ||
      range(&least, &greatest) != JOR_CUDA_SUCCESS) {
    return -1;
  }
  CUresult r = create(ph, flags, greatest);
  if (r == JOR_CUDA_SUCCESS) {
    Count(kCounter_streams_promoted);
    Log(2, "stream #%lld created at priority %d (highest)", (long long)index, greatest);
  }
  return r;
}

}  // namespace jor
