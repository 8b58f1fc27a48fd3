// What the driver says about the current device and about each kernel, asked
// once and cached: the device's residency limits, each function's attributes
// and the kernel rule that selects it (shared map, plus a per-thread copy so
// the common launch takes no lock), the driver's occupancy answers, and the
// attribute raises shaping needs.
#ifndef JAX_OVERLAP_XLA_PATCHES_RUNTIME_DRIVER_INFO_H_
#define JAX_OVERLAP_XLA_PATCHES_RUNTIME_DRIVER_INFO_H_

#include <stdint.h>

#include <string>

#include "cuda_types.h"
#include "rules.h"
#include "shaping.h"

namespace jor {

// The current device's limits (and compute capability, 0 when the driver does
// not say); false when the driver cannot answer (asked again next time).
bool DeviceLimits(JorDeviceLimits* out, int* cc_major = nullptr, int* cc_minor = nullptr);

struct FuncInfo {
  std::string name;
  int static_smem = 0;
  int regs = 0;
  int max_dynamic_smem = 0;
  bool carveout_set = false;
  bool queried = false;
  bool failed = false;      // the driver could not answer; asked again only under new rules
  bool cluster = false;     // compiled with fixed cluster dimensions: always a cluster launch
  uint64_t generation = 0;  // rules generation of `rule`
  int rule = -1;            // index into Rules::kernels, -1: none
};

// The function to describe, shape and launch for the handle a launch names. The
// CUDA runtime of CUDA 12 and later, and libraries built on it (cuBLAS, NCCL),
// launch context-less kernels (CUkernel, from cuLibraryGetKernel) through
// cuLaunchKernel; the driver accepts them there but cuFuncGetAttribute,
// cuFuncSetAttribute and the occupancy calculator answer
// CUDA_ERROR_INVALID_HANDLE. Such a handle stands for its function in the
// current context (cuKernelGetFunction), asked at every launch since the answer
// depends on the context; a module's CUfunction (XLA's kernels) is itself.
CUfunction Launchable(CUfunction f);

// Looks up (or queries) `f` and its matching kernel rule under `rules`.
// The name is copied only when `want_name` (logging): the per-launch path
// copies a few integers under a shared lock. False: the driver could not
// describe `f` (remembered until new rules).
bool FuncFor(CUfunction f, const Rules* rules, FuncInfo* out, bool want_name);

// A per-thread, direct-mapped copy of the attributes of recently launched
// functions, so that the common launch takes no lock.
struct FuncLite {
  CUfunction f = nullptr;
  uint64_t generation = 0;
  uint64_t epoch = 0;
  int static_smem = 0;
  int regs = 0;
  int max_dynamic_smem = 0;
  bool carveout_set = false;
  bool cluster = false;
  int rule = -1;
  // Last answer of the room rule (Decide), valid until the slot is refilled.
  bool room_valid = false;
  unsigned room_threads = 0, room_dyn = 0;
  int64_t room_blocks = 0, room_smem_sm = 0, room_r = 0;
  int room_reasons = 0;
};

// This thread's slot for `f` (direct-mapped: it may hold another function).
FuncLite& TlsFunc(CUfunction f);

// Fills `f`'s slot from the shared entry.
void FillTls(CUfunction f, const FuncInfo& info);

// Bumped when cached function entries become stale (module unload, the
// program's own attribute changes): slots of an older epoch are refilled.
uint64_t FuncEpoch();

// Raises the kernel's MAX_DYNAMIC_SHARED_SIZE_BYTES to `dyn` if it is lower
// (and asks once for the largest carve-out). The shared entry is checked under
// the lock so that one raise serves every thread.
bool EnsureMaxDynamic(CUfunction f, FuncLite* lite, int64_t dyn);

// The driver's word on residency. The arithmetic (shaping.cc) proposes the dynamic
// shared memory for a cap; the driver's occupancy calculator, which knows rules the
// arithmetic approximates (registers per sub-partition, allocation units), decides:
// a kernel the driver already runs at or below the cap is not padded, and a
// proposal the driver still finds above the cap grows in 128-byte steps up to the
// opt-in limit. Answers are cached per (function, block size, dynamic smem, cap).
// Returns the dynamic shared memory to launch with; `dyn` itself means "leave it".
int64_t DriverChecked(CUfunction f, unsigned threads, unsigned dyn, int64_t proposed,
                      int64_t cap, int64_t max_dyn);

// Drops every cached function entry and occupancy answer (a module or library
// was unloaded: its CUfunction handles may be reused by kernels loaded later).
void ForgetFunctions();

// The program set `attrib` of `f` to `value` itself: keeps the cached limits
// true (a lowered MAX_DYNAMIC_SHARED_SIZE_BYTES is raised again before a shaped
// launch, a carve-out the program set is asked for again).
void NoteFuncAttribute(CUfunction f, int attrib, int value);

}  // namespace jor

#endif  // JAX_OVERLAP_XLA_PATCHES_RUNTIME_DRIVER_INFO_H_
