// Process-wide start of the library.
#ifndef JAX_OVERLAP_XLA_PATCHES_RUNTIME_INIT_H_
#define JAX_OVERLAP_XLA_PATCHES_RUNTIME_INIT_H_

namespace jor {

// Reads JAX_OVERLAP_RT_VERBOSE and JAX_OVERLAP_RT_RULES and resolves the real
// driver entry points, once per process (every hook and API entry calls it;
// the library's constructor does too).
void EnsureInit();

}  // namespace jor

#endif  // JAX_OVERLAP_XLA_PATCHES_RUNTIME_INIT_H_
