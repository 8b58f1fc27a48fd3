// The compiled plan the library applies (JAX_OVERLAP_RT_RULES, jor_set_rules):
// its text format, the parser, the active rule set and kernel-name matching.
// Nothing here calls the driver: rules.cc builds and is tested without CUDA
// (xla_patches/testing/rules_test.cc).
#ifndef JAX_OVERLAP_XLA_PATCHES_RUNTIME_RULES_H_
#define JAX_OVERLAP_XLA_PATCHES_RUNTIME_RULES_H_

#include <stdint.h>

#include <atomic>
#include <memory>
#include <regex>
#include <string>
#include <unordered_map>
#include <vector>

#include "shaping.h"

namespace jor {

struct KernelRule {
  std::string pattern;
  bool is_regex = false;
  std::regex regex;
  int64_t blocks_per_sm = 0;  // > 0: cap residency
  int64_t padding_bytes = 0;  // > 0: add this much dynamic shared memory
};

struct Rules {
  uint64_t generation = 0;
  std::vector<KernelRule> kernels;
  // Per kernel rule: distinct functions it has selected so far (a rule that
  // stays at 0 names no kernel the program launched).
  std::unique_ptr<std::atomic<uint64_t>[]> functions;
  std::unordered_map<int64_t, int64_t> regions;  // id -> blocks_per_sm
  bool stream_priority_highest = false;
  bool promote_requested = false;
  std::vector<int64_t> stream_create_order;
  // The communication block caps must make room for: none (caps as given),
  // `comm` as stated, or NCCL's channel for the device (auto).
  enum { kRoomNone, kRoomGiven, kRoomAuto } room = kRoomNone;
  JorCommBlock comm{0, 0, 0};
  // > 0: the SM-count target set on every cuBLAS handle and cuBLASLt matmul
  // descriptor the program creates (library_gemms.h).
  int64_t gemm_sm_count_target = 0;
  std::string text;
};

// Rules text, one rule per line, fields separated by tabs:
//   version  1
//   kernel   glob|regex  <pattern>  blocks_per_sm|padding_bytes  <int>
//   region   <int64 id>  blocks_per_sm  <int>
//   streams  priority  highest|default
//   streams  promote_requested  0|1
//   streams  create_order  <i>,<j>,...
//   comm_block  auto | none | <threads> <regs_per_thread> <smem_bytes>
//   library_gemms  sm_count_target  <int >= 1>
// Returns the number of lines that could not be used (each is logged).
int ParseRules(const char* text, Rules* rules);

// Parses `text` and makes it the active rule set (the old one stays alive for
// threads still reading it). Returns the number of lines ignored.
int InstallRules(const char* text);

// The active rules, or null before any were installed.
const Rules* CurrentRules();

// Whether kernel rule `rule` selects the function named `name` (glob: fnmatch;
// regex: ECMAScript search). An unnamed function matches nothing.
bool RuleMatches(const KernelRule& rule, const std::string& name);

// Whole-string decimal integer.
bool ParseInt(const std::string& s, int64_t* out);

}  // namespace jor

#endif  // JAX_OVERLAP_XLA_PATCHES_RUNTIME_RULES_H_
