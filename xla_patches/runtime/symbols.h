// The driver entry points the library hooks and calls (hooks.h lists them):
// one enum, one name table, one function-pointer type per symbol, and where
// the real entry points are found: dlvsym for the real dlsym (this library
// defines dlsym), then libcuda's handle, then RTLD_NEXT.
#ifndef JAX_OVERLAP_XLA_PATCHES_RUNTIME_SYMBOLS_H_
#define JAX_OVERLAP_XLA_PATCHES_RUNTIME_SYMBOLS_H_

#include "hooks.h"

namespace jor {

enum SymId {
#define JOR_SYM_ENUM(name, ret, params, args) kSym_##name,
  JOR_HOOKED_SYMBOLS(JOR_SYM_ENUM) kNumHooked,
  JOR_USED_SYMBOLS(JOR_SYM_ENUM) kNumSyms
#undef JOR_SYM_ENUM
};

// Indexed by SymId; the slot at kNumHooked is "" so that the enum and the
// table share indices.
extern const char* const kSymNames[kNumSyms];

#define JOR_SYM_TYPE(name, ret, params, args) typedef ret(*PFN_##name) params;
JOR_HOOKED_SYMBOLS(JOR_SYM_TYPE)
JOR_USED_SYMBOLS(JOR_SYM_TYPE)
#undef JOR_SYM_TYPE

typedef void* (*DlsymFn)(void*, const char*);

// glibc's dlsym (found once through dlvsym), or null.
DlsymFn RealDlsym();

// libcuda's handle if the process has loaded it, else null.
void* LibcudaHandle();

// The real entry point for `id`, resolved on first use; null if the driver
// does not have it.
void* Real(int id);

// Records `p` as the real entry point of `id` unless one is known already;
// returns the one now recorded.
void* RecordReal(int id, void* p);

#define REAL(name) reinterpret_cast<PFN_##name>(::jor::Real(::jor::kSym_##name))

// The SymId of a hooked symbol's name, or -1.
int HookedId(const char* name);

// Whether `handle` (from dlopen) is libcuda; remembers it.
bool IsLibcuda(void* handle);

// dlsym(RTLD_NEXT, name) as seen from `caller`, another object.
void* DlsymNextFromCaller(const char* name, void* caller);

}  // namespace jor

#endif  // JAX_OVERLAP_XLA_PATCHES_RUNTIME_SYMBOLS_H_
