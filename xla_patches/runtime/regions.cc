#include "regions.h"

#include "init.h"
#include "log.h"
#include "rules.h"

namespace jor {

namespace {

struct RegionFrame {
  int64_t id;
  int64_t blocks_per_sm;  // resolved at begin: plan's entry, else the attribute
  bool any_stream;        // opened by jor_region_begin: every launch of the thread
  CUstream stream;        // opened by jor_region_begin_on_stream: launches on this stream
};
constexpr int kMaxRegionDepth = 32;
thread_local RegionFrame t_regions[kMaxRegionDepth];
thread_local int t_region_depth = 0;

}  // namespace

int64_t CurrentRegionBlocks(CUstream stream, bool known_stream) {
  int d = t_region_depth > kMaxRegionDepth ? kMaxRegionDepth : t_region_depth;
  for (int i = d - 1; i >= 0; --i) {
    const RegionFrame& r = t_regions[i];
    if (r.any_stream || (known_stream && r.stream == stream)) return r.blocks_per_sm;
  }
  return 0;
}

int RegionBegin(int64_t region_id, int64_t blocks_per_sm, bool any_stream, CUstream stream) {
  EnsureInit();
  const Rules* rules = CurrentRules();
  int64_t blocks = blocks_per_sm > 0 ? blocks_per_sm : 0;
  if (rules != nullptr) {
    auto it = rules->regions.find(region_id);
    if (it != rules->regions.end()) blocks = it->second;
  }
  Count(kCounter_regions_entered);
  if (!any_stream) {
    // The same region already open on the same stream: its end never ran (a thunk
    // between begin and end failed, ending that execution). Close the stale frame
    // instead of nesting in it.
    const int depth = t_region_depth > kMaxRegionDepth ? kMaxRegionDepth : t_region_depth;
    for (int i = depth - 1; i >= 0; --i) {
      if (!t_regions[i].any_stream && t_regions[i].id == region_id &&
          t_regions[i].stream == stream) {
        Log(1, "region %lld begins again on its stream before its end: the earlier one is "
               "closed", (long long)region_id);
        for (int j = i; j + 1 < depth; ++j) t_regions[j] = t_regions[j + 1];
        --t_region_depth;
        break;
      }
    }
  }
  int d = t_region_depth++;
  if (d < kMaxRegionDepth) {
    t_regions[d] = {region_id, blocks, any_stream, stream};
  } else {
    Log(1, "occupancy regions nested deeper than %d; region %lld ignored", kMaxRegionDepth,
        (long long)region_id);
  }
  Log(3, "region %lld begin: blocks_per_sm %lld", (long long)region_id, (long long)blocks);
  return t_region_depth;
}

int RegionEnd(int64_t region_id) {
  if (t_region_depth <= 0) {
    Log(1, "region %lld end without begin", (long long)region_id);
    return -1;
  }
  if (t_region_depth > kMaxRegionDepth) return --t_region_depth;  // not stored
  // Close the innermost open frame of this region: regions whose ends XLA
  // orders differently from their begins still close the right frame.
  const int depth = t_region_depth;
  int found = depth - 1;
  for (int i = depth - 1; i >= 0; --i) {
    if (t_regions[i].id == region_id) {
      found = i;
      break;
    }
  }
  for (int i = found; i + 1 < depth; ++i) t_regions[i] = t_regions[i + 1];
  --t_region_depth;
  Log(3, "region %lld end", (long long)region_id);
  return t_region_depth;
}


}  // namespace jor
