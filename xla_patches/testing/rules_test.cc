// Tests of the runtime library's rule parsing, installation and kernel-name
// matching (rules.h). Linked with rules.cc and log.cc only: no driver, no
// dlopen, no CUDA. tests/test_runtime_rules.py builds it with the library's own
// compiler flags, runs it and checks that it references no driver symbol.
#include <stdio.h>
#include <string.h>

#include <string>

#include "../runtime/log.h"
#include "../runtime/rules.h"

namespace {

int g_checks = 0;
int g_failures = 0;

#define CHECK(cond)                                                        \
  do {                                                                     \
    ++g_checks;                                                            \
    if (!(cond)) {                                                         \
      ++g_failures;                                                        \
      fprintf(stderr, "rules_test.cc:%d: CHECK failed: %s\n", __LINE__, #cond); \
    }                                                                      \
  } while (0)

void TestFullPlan() {
  jor::Rules rules;
  const char* text =
      "# written by jax-overlap launch\n"
      "version\t1\n"
      "kernel\tglob\t*gemm*\tblocks_per_sm\t2\n"
      "kernel\tregex\t^loop_.*fusion$\tpadding_bytes\t4096\n"
      "region\t7\tblocks_per_sm\t3\n"
      "region\t-1\tblocks_per_sm\t1\n"
      "streams\tpriority\thighest\n"
      "streams\tpromote_requested\t1\n"
      "streams\tcreate_order\t0,2\n"
      "comm_block\t640\t64\t1024\n"
      "library_gemms\tsm_count_target\t100\n";
  CHECK(jor::ParseRules(text, &rules) == 0);
  CHECK(rules.gemm_sm_count_target == 100);
  CHECK(rules.text == text);
  CHECK(rules.kernels.size() == 2);
  CHECK(rules.kernels[0].pattern == "*gemm*" && !rules.kernels[0].is_regex);
  CHECK(rules.kernels[0].blocks_per_sm == 2 && rules.kernels[0].padding_bytes == 0);
  CHECK(rules.kernels[1].is_regex && rules.kernels[1].padding_bytes == 4096);
  CHECK(rules.kernels[1].blocks_per_sm == 0);
  CHECK(rules.regions.size() == 2 && rules.regions.at(7) == 3 && rules.regions.at(-1) == 1);
  CHECK(rules.stream_priority_highest && rules.promote_requested);
  CHECK(rules.stream_create_order.size() == 2 && rules.stream_create_order[1] == 2);
  CHECK(rules.room == jor::Rules::kRoomGiven);
  CHECK(rules.comm.threads == 640 && rules.comm.regs_per_thread == 64 &&
        rules.comm.smem_bytes == 1024);
}

void TestDefaultsAndRoomKeywords() {
  jor::Rules empty;
  CHECK(jor::ParseRules("", &empty) == 0);
  CHECK(empty.kernels.empty() && empty.regions.empty());
  CHECK(!empty.stream_priority_highest && !empty.promote_requested);
  CHECK(empty.room == jor::Rules::kRoomNone);
  CHECK(empty.gemm_sm_count_target == 0);
  jor::Rules automatic;
  CHECK(jor::ParseRules("comm_block\tauto\nstreams\tpriority\tdefault\n", &automatic) == 0);
  CHECK(automatic.room == jor::Rules::kRoomAuto && !automatic.stream_priority_highest);
  jor::Rules none;
  CHECK(jor::ParseRules("comm_block\tauto\ncomm_block\tnone\n", &none) == 0);
  CHECK(none.room == jor::Rules::kRoomNone);
}

void TestCommentsBlankLinesAndLineEndings() {
  jor::Rules rules;
  CHECK(jor::ParseRules("\n# a comment\n\r\nkernel\tglob\tnccl*\tblocks_per_sm\t1\r\n  \n",
                        &rules) == 0);
  CHECK(rules.kernels.size() == 1 && rules.kernels[0].pattern == "nccl*");
}

// Each bad line is counted once and kept out; the good lines around it stay.
void TestBadLinesAreCountedAndSkipped() {
  struct {
    const char* line;
    int errors;
  } cases[] = {
      {"version\t2", 1},
      {"kernel\tglob\t*\tblocks_per_sm\t0", 1},          // caps start at 1
      {"kernel\tglob\t*\tpadding_bytes\t-8", 1},         // padding >= 0
      {"kernel\tglob\t*\tblocks_per_sm\ttwo", 1},
      {"kernel\tfnmatch\t*\tblocks_per_sm\t2", 1},       // glob or regex only
      {"kernel\tregex\t(unclosed\tblocks_per_sm\t2", 1},
      {"kernel\tglob\t*\tblocks_per_sm", 1},             // a field missing
      {"region\t7\tblocks_per_sm\t0", 1},
      {"region\tseven\tblocks_per_sm\t2", 1},
      {"streams\tpriority\thigh", 1},
      {"streams\tpromote_requested\tyes", 1},
      {"streams\tcreate_order\t1,x,-2,3", 2},            // x and -2; 1 and 3 kept
      {"comm_block\t2048\t64\t0", 1},                    // threads 1-1024
      {"comm_block\t512\t300\t0", 1},                    // registers 0-255
      {"comm_block\t512\t64\t-1", 1},
      {"comm_block\tmaybe", 1},
      {"kernel glob * blocks_per_sm 2", 1},              // spaces, not tabs
      {"shaping\ton", 1},
      {"library_gemms\tsm_count_target\t0", 1},       // an SM count, 1-4096
      {"library_gemms\tsm_count_target\tmany", 1},
      {"library_gemms\tsm_target\t66", 1},
  };
  for (const auto& c : cases) {
    jor::Rules rules;
    std::string text = std::string("kernel\tglob\tgood*\tblocks_per_sm\t2\n") + c.line +
                       "\nregion\t1\tblocks_per_sm\t4\n";
    const int errors = jor::ParseRules(text.c_str(), &rules);
    CHECK(errors == c.errors);
    if (errors != c.errors) fprintf(stderr, "  line '%s': %d errors\n", c.line, errors);
    CHECK(rules.kernels.size() == 1 && rules.kernels[0].pattern == "good*");
    CHECK(rules.regions.size() == 1 && rules.regions.at(1) == 4);
    CHECK(rules.room == jor::Rules::kRoomNone);
  }
  jor::Rules order;
  jor::ParseRules("streams\tcreate_order\t1,x,-2,3\n", &order);
  CHECK(order.stream_create_order.size() == 2 && order.stream_create_order[0] == 1 &&
        order.stream_create_order[1] == 3);
}

void TestMatching() {
  jor::Rules rules;
  CHECK(jor::ParseRules("kernel\tglob\t*gemm*\tblocks_per_sm\t2\n"
                        "kernel\tregex\t^loop_.*fusion$\tblocks_per_sm\t1\n"
                        "kernel\tregex\tnccl\tpadding_bytes\t0\n",
                        &rules) == 0);
  const jor::KernelRule& glob = rules.kernels[0];
  const jor::KernelRule& anchored = rules.kernels[1];
  const jor::KernelRule& search = rules.kernels[2];
  CHECK(jor::RuleMatches(glob, "sm90_xmma_gemm_bf16bf16_bf16f32"));
  CHECK(jor::RuleMatches(glob, "gemm_fusion_1"));
  CHECK(!jor::RuleMatches(glob, "loop_add_fusion"));
  CHECK(jor::RuleMatches(anchored, "loop_add_fusion"));
  CHECK(!jor::RuleMatches(anchored, "input_loop_add_fusion"));
  CHECK(!jor::RuleMatches(anchored, "loop_add_fusion_1"));
  CHECK(jor::RuleMatches(search, "ncclDevKernel_AllGather_RING_LL"));  // regex: search
  CHECK(!jor::RuleMatches(glob, ""));  // an unnamed function matches nothing
  CHECK(!jor::RuleMatches(search, ""));
}

void TestInstallKeepsOldRulesAlive() {
  CHECK(jor::CurrentRules() == nullptr);
  CHECK(jor::InstallRules("kernel\tglob\ta*\tblocks_per_sm\t1\n") == 0);
  const jor::Rules* first = jor::CurrentRules();
  CHECK(first != nullptr && first->kernels.size() == 1);
  CHECK(first->functions != nullptr && first->functions[0].load() == 0);
  CHECK(jor::InstallRules("kernel\tglob\tb*\tblocks_per_sm\t1\nbogus\n") == 1);
  const jor::Rules* second = jor::CurrentRules();
  CHECK(second != first && second->generation > first->generation);
  CHECK(second->kernels[0].pattern == "b*");
  // Threads launching under the first rules may still read them.
  CHECK(first->kernels[0].pattern == "a*");
  CHECK(jor::InstallRules(nullptr) == 0);
  CHECK(jor::CurrentRules()->kernels.empty());
}

void TestParseInt() {
  int64_t v = 0;
  CHECK(jor::ParseInt("12", &v) && v == 12);
  CHECK(jor::ParseInt("-3", &v) && v == -3);
  CHECK(jor::ParseInt("9223372036854775807", &v) && v == INT64_MAX);
  CHECK(!jor::ParseInt("", &v));
  CHECK(!jor::ParseInt("12x", &v));
  CHECK(!jor::ParseInt("1 2", &v));
}

}  // namespace

int main() {
  TestFullPlan();
  TestDefaultsAndRoomKeywords();
  TestCommentsBlankLinesAndLineEndings();
  TestBadLinesAreCountedAndSkipped();
  TestMatching();
  TestInstallKeepsOldRulesAlive();
  TestParseInt();
  printf("rules_test: %d checks, %d failed\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
