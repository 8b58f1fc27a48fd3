// Which hook a program gets. Every hooked symbol has one hook instance per
// path by which the program obtained it (so launches are counted by path) and,
// for the launch entry points, a few slot instances that forward to versioned
// driver implementations cuGetProcAddress hands out. hooks.cc holds the hooks
// and the tables; procaddr.cc decides what cuGetProcAddress answers.
#ifndef JAX_OVERLAP_XLA_PATCHES_RUNTIME_DISPATCH_H_
#define JAX_OVERLAP_XLA_PATCHES_RUNTIME_DISPATCH_H_

#include "cuda_types.h"

namespace jor {

// Paths by which a program obtained a hook.
enum Path { kPathDirect = 0, kPathDlsym = 1, kPathProcAddr = 2, kNumPaths };

// Slot instances per launch entry point.
constexpr int kExtraSlots = 4;

// The hook for symbol `id` reached through `path`.
void* HookFor(int path, int id);

// Whether `p` is one of this library's hooks (any path, any slot).
bool IsOurHook(void* p);

// Slot instance `slot` of symbol `id`'s hook, or null when `id` has no slots.
void* SlotHook(int id, int slot);

// The driver entry point slot `slot` of symbol `id` forwards to, or null.
void* SlotReal(int id, int slot);

// A slot hook forwarding to `answer` (a versioned driver entry point for the
// launch symbol `id`), or null when the slots are used up or `id` has none.
void* SlotHookFor(int id, void* answer);

// What cuGetProcAddress(_v2) hands the program for `symbol`, given the real
// driver's result `r` and answer `*pfn`: the hook replaces `*pfn` when the
// answer is the entry point the hook forwards to.
CUresult ProcAddrCommon(const char* symbol, void** pfn, int version, cuuint64_t flags,
                        CUresult r);

}  // namespace jor

#endif  // JAX_OVERLAP_XLA_PATCHES_RUNTIME_DISPATCH_H_
