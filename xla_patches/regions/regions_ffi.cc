// XLA FFI handlers that open and close an occupancy region.
//
// Both handlers are identities on any number of buffers (the Python wrapper
// aliases every operand to its result, so no copy happens) and tie the region
// to the enclosed computation by data dependence: the enclosed ops consume the
// begin call's results and the end call consumes theirs.
//
// Host side:
//   * CPU handlers record (kind, region id, blocks_per_sm) in order; tests read
//     the record with jor_ffi_region_events().
//   * CUDA handlers call jor_region_begin_on_stream (the thunk's stream) /
//     jor_region_end in the runtime library (libjax_overlap_rt.so, LD_PRELOAD)
//     on the launching thread. The
//     symbols are resolved with dlsym at run time, so this library does not
//     link the runtime library and is a no-op without it.
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Event {
  int64_t kind;  // 1 begin, 2 end
  int64_t region_id;
  int64_t blocks_per_sm;
};

std::mutex g_events_mu;
std::vector<Event>* g_events = new std::vector<Event>();

void Record(int64_t kind, int64_t region_id, int64_t blocks_per_sm) {
  std::lock_guard<std::mutex> lock(g_events_mu);
  g_events->push_back({kind, region_id, blocks_per_sm});
}

// Copies operand i to result i when XLA did not alias them (CPU).
ffi::Error CopyThroughHost(ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (args.size() != rets.size()) {
    return ffi::Error::InvalidArgument(
        "jax_overlap region: expected as many results as operands");
  }
  for (size_t i = 0; i < args.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (!in.has_value() || !out.has_value()) {
      return ffi::Error::InvalidArgument("jax_overlap region: operands must be arrays");
    }
    if (in->size_bytes() != (*out)->size_bytes()) {
      return ffi::Error::InvalidArgument(
          "jax_overlap region: result shape differs from operand shape");
    }
    if (in->untyped_data() != (*out)->untyped_data() && in->size_bytes() > 0) {
      memcpy((*out)->untyped_data(), in->untyped_data(), in->size_bytes());
    }
  }
  return ffi::Error::Success();
}

// cuMemcpyDtoDAsync from the already-loaded driver, for the unaliased case.
typedef int (*MemcpyDtoDAsyncFn)(uintptr_t, uintptr_t, size_t, void*);

MemcpyDtoDAsyncFn DriverMemcpy() {
  static MemcpyDtoDAsyncFn fn = [] {
    void* h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    void* p = h ? dlsym(h, "cuMemcpyDtoDAsync_v2") : nullptr;
    return reinterpret_cast<MemcpyDtoDAsyncFn>(p);
  }();
  return fn;
}

ffi::Error CopyThroughDevice(void* stream, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (args.size() != rets.size()) {
    return ffi::Error::InvalidArgument(
        "jax_overlap region: expected as many results as operands");
  }
  for (size_t i = 0; i < args.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (!in.has_value() || !out.has_value()) {
      return ffi::Error::InvalidArgument("jax_overlap region: operands must be arrays");
    }
    if (in->untyped_data() == (*out)->untyped_data() || in->size_bytes() == 0) continue;
    MemcpyDtoDAsyncFn copy = DriverMemcpy();
    if (copy == nullptr ||
        copy(reinterpret_cast<uintptr_t>((*out)->untyped_data()),
             reinterpret_cast<uintptr_t>(in->untyped_data()), in->size_bytes(), stream) != 0) {
      return ffi::Error::Internal("jax_overlap region: device copy of an unaliased operand failed");
    }
  }
  return ffi::Error::Success();
}

typedef int (*RegionBeginFn)(int64_t, int64_t);
typedef int (*RegionBeginOnStreamFn)(int64_t, int64_t, void*);
typedef int (*RegionEndFn)(int64_t);

RegionBeginFn RuntimeBegin() {
  static RegionBeginFn fn =
      reinterpret_cast<RegionBeginFn>(dlsym(RTLD_DEFAULT, "jor_region_begin"));
  return fn;
}

// The region applies to the launches on the thunk's stream only (an older
// runtime library without it: every launch of the thread).
RegionBeginOnStreamFn RuntimeBeginOnStream() {
  static RegionBeginOnStreamFn fn = reinterpret_cast<RegionBeginOnStreamFn>(
      dlsym(RTLD_DEFAULT, "jor_region_begin_on_stream"));
  return fn;
}

RegionEndFn RuntimeEnd() {
  static RegionEndFn fn = reinterpret_cast<RegionEndFn>(dlsym(RTLD_DEFAULT, "jor_region_end"));
  return fn;
}

ffi::Error CheckAttrs(int64_t region_id, int64_t blocks_per_sm) {
  (void)region_id;
  if (blocks_per_sm < 0) {
    return ffi::Error::InvalidArgument(
        "jax_overlap region: blocks_per_sm must be >= 0 (0: the plan decides)");
  }
  return ffi::Error::Success();
}

// ---- Implementations. ----

ffi::Error RegionBeginCpuImpl(ffi::RemainingArgs args, ffi::RemainingRets rets,
                              int64_t region_id, int64_t blocks_per_sm) {
  if (auto err = CheckAttrs(region_id, blocks_per_sm); err.failure()) return err;
  Record(1, region_id, blocks_per_sm);
  return CopyThroughHost(args, rets);
}

ffi::Error RegionEndCpuImpl(ffi::RemainingArgs args, ffi::RemainingRets rets,
                            int64_t region_id, int64_t blocks_per_sm) {
  if (auto err = CheckAttrs(region_id, blocks_per_sm); err.failure()) return err;
  auto copied = CopyThroughHost(args, rets);
  Record(2, region_id, blocks_per_sm);
  return copied;
}

ffi::Error RegionBeginCudaImpl(void* stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                               int64_t region_id, int64_t blocks_per_sm) {
  if (auto err = CheckAttrs(region_id, blocks_per_sm); err.failure()) return err;
  if (RegionBeginOnStreamFn begin = RuntimeBeginOnStream()) {
    begin(region_id, blocks_per_sm, stream);
  } else if (RegionBeginFn begin = RuntimeBegin()) {
    begin(region_id, blocks_per_sm);
  }
  return CopyThroughDevice(stream, args, rets);
}

ffi::Error RegionEndCudaImpl(void* stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                             int64_t region_id, int64_t blocks_per_sm) {
  if (auto err = CheckAttrs(region_id, blocks_per_sm); err.failure()) return err;
  auto copied = CopyThroughDevice(stream, args, rets);
  if (RegionEndFn end = RuntimeEnd()) end(region_id);
  return copied;
}

}  // namespace

// ---- Handler symbols (exported for jax.ffi.pycapsule). ----

#pragma GCC visibility push(default)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOverlapRegionBeginCpu, RegionBeginCpuImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()               // operands
                                  .RemainingRets()               // aliased results
                                  .Attr<int64_t>("region_id")
                                  .Attr<int64_t>("blocks_per_sm"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOverlapRegionEndCpu, RegionEndCpuImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("region_id")
                                  .Attr<int64_t>("blocks_per_sm"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOverlapRegionBeginCuda, RegionBeginCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()  // cudaStream_t
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("region_id")
                                  .Attr<int64_t>("blocks_per_sm"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxOverlapRegionEndCuda, RegionEndCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("region_id")
                                  .Attr<int64_t>("blocks_per_sm"));

#pragma GCC visibility pop

// ---- Test access to the CPU event record. ----

extern "C" __attribute__((visibility("default"))) int64_t jor_ffi_region_event_count() {
  std::lock_guard<std::mutex> lock(g_events_mu);
  return static_cast<int64_t>(g_events->size());
}

// Copies up to `max` events as (kind, region_id, blocks_per_sm) triples.
extern "C" __attribute__((visibility("default"))) int64_t jor_ffi_region_events(int64_t* out,
                                                                               int64_t max) {
  std::lock_guard<std::mutex> lock(g_events_mu);
  int64_t n = static_cast<int64_t>(g_events->size());
  if (n > max) n = max;
  for (int64_t i = 0; i < n; ++i) {
    out[3 * i] = (*g_events)[i].kind;
    out[3 * i + 1] = (*g_events)[i].region_id;
    out[3 * i + 2] = (*g_events)[i].blocks_per_sm;
  }
  return n;
}

extern "C" __attribute__((visibility("default"))) void jor_ffi_region_events_clear() {
  std::lock_guard<std::mutex> lock(g_events_mu);
  g_events->clear();
}
