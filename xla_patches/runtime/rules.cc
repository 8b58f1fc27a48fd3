#include "rules.h"

#include <fnmatch.h>
#include <stdlib.h>

#include <mutex>

#include "log.h"

namespace jor {

namespace {

std::atomic<const Rules*> g_rules{nullptr};
std::atomic<uint64_t> g_generation{1};
std::mutex g_rules_mu;  // serializes jor_set_rules; old rules are kept alive
std::vector<const Rules*>* g_retired_rules = nullptr;

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t pos = s.find(sep, start);
    out.push_back(s.substr(start, pos == std::string::npos ? std::string::npos
                                                           : pos - start));
    if (pos == std::string::npos) break;
    start = pos + 1;
  }
  return out;
}

}  // namespace

bool ParseInt(const std::string& s, int64_t* out) {
  if (s.empty()) return false;
  char* end = nullptr;
  long long v = strtoll(s.c_str(), &end, 10);
  if (end == nullptr || *end != '\0') return false;
  *out = v;
  return true;
}

int ParseRules(const char* text, Rules* rules) {
  int errors = 0;
  rules->text = text ? text : "";
  for (const std::string& raw : Split(rules->text, '\n')) {
    std::string line = raw;
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> f = Split(line, '\t');
    int64_t value = 0;
    if (f[0] == "version" && f.size() == 2) {
      if (f[1] != "1") {
        Log(0, "rules: unsupported version %s (expected 1)", f[1].c_str());
        ++errors;
      }
    } else if (f[0] == "kernel" && f.size() == 5 &&
               (f[1] == "glob" || f[1] == "regex") &&
               (f[3] == "blocks_per_sm" || f[3] == "padding_bytes") &&
               ParseInt(f[4], &value) &&
               (f[3] == "blocks_per_sm" ? value >= 1 : value >= 0)) {
      KernelRule rule;
      rule.pattern = f[2];
      rule.is_regex = f[1] == "regex";
      if (rule.is_regex) {
        try {
          rule.regex = std::regex(rule.pattern, std::regex::ECMAScript);
        } catch (const std::exception& e) {
          Log(0, "rules: bad regex '%s': %s", rule.pattern.c_str(), e.what());
          ++errors;
          continue;
        }
      }
      (f[3] == "blocks_per_sm" ? rule.blocks_per_sm : rule.padding_bytes) = value;
      rules->kernels.push_back(std::move(rule));
    } else if (f[0] == "region" && f.size() == 4 && f[2] == "blocks_per_sm" &&
               ParseInt(f[1], &value)) {
      int64_t blocks = 0;
      if (!ParseInt(f[3], &blocks) || blocks < 1) {
        Log(0, "rules: bad blocks_per_sm in line '%s'", line.c_str());
        ++errors;
        continue;
      }
      rules->regions[value] = blocks;
    } else if (f[0] == "streams" && f.size() == 3 && f[1] == "priority" &&
               (f[2] == "highest" || f[2] == "default")) {
      rules->stream_priority_highest = f[2] == "highest";
    } else if (f[0] == "streams" && f.size() == 3 && f[1] == "promote_requested" &&
               (f[2] == "0" || f[2] == "1")) {
      rules->promote_requested = f[2] == "1";
    } else if (f[0] == "comm_block" && f.size() == 2 && (f[1] == "auto" || f[1] == "none")) {
      rules->room = f[1] == "auto" ? Rules::kRoomAuto : Rules::kRoomNone;
    } else if (f[0] == "comm_block" && f.size() == 4) {
      int64_t t = 0, r = 0, m = 0;
      if (!ParseInt(f[1], &t) || !ParseInt(f[2], &r) || !ParseInt(f[3], &m) || t < 1 ||
          t > 1024 || r < 0 || r > 255 || m < 0) {
        Log(0, "rules: bad comm_block line '%s' (threads 1-1024, registers 0-255, bytes >= 0)",
            line.c_str());
        ++errors;
        continue;
      }
      rules->room = Rules::kRoomGiven;
      rules->comm = JorCommBlock{t, r, m};
    } else if (f[0] == "library_gemms" && f.size() == 3 && f[1] == "sm_count_target") {
      if (!ParseInt(f[2], &value) || value < 1 || value > 4096) {
        Log(0, "rules: bad sm_count_target in line '%s' (an SM count, 1-4096)", line.c_str());
        ++errors;
        continue;
      }
      rules->gemm_sm_count_target = value;
    } else if (f[0] == "streams" && f.size() == 3 && f[1] == "create_order") {
      for (const std::string& item : Split(f[2], ',')) {
        if (item.empty()) continue;
        if (!ParseInt(item, &value) || value < 0) {
          Log(0, "rules: bad stream index '%s'", item.c_str());
          ++errors;
          continue;
        }
        rules->stream_create_order.push_back(value);
      }
    } else {
      Log(0, "rules: ignoring line '%s'", line.c_str());
      ++errors;
    }
  }
  return errors;
}

int InstallRules(const char* text) {
  Rules* rules = new Rules();
  int errors = ParseRules(text, rules);
  rules->functions.reset(new std::atomic<uint64_t>[rules->kernels.size()]());
  rules->generation = g_generation.fetch_add(1) + 1;
  std::lock_guard<std::mutex> lock(g_rules_mu);
  const Rules* old = g_rules.exchange(rules, std::memory_order_acq_rel);
  // Launching threads may still read the old rules: keep them alive.
  if (old != nullptr) {
    if (g_retired_rules == nullptr) g_retired_rules = new std::vector<const Rules*>();
    g_retired_rules->push_back(old);
  }
  Log(2, "rules: %zu kernel rules, %zu region rules, stream priority %s",
      rules->kernels.size(), rules->regions.size(),
      rules->stream_priority_highest ? "highest" : "default");
  return errors;
}

const Rules* CurrentRules() { return g_rules.load(std::memory_order_acquire); }

bool RuleMatches(const KernelRule& rule, const std::string& name) {
  if (name.empty()) return false;
  if (rule.is_regex) {
    try {
      return std::regex_search(name, rule.regex);
    } catch (const std::exception&) {
      return false;
    }
  }
  return fnmatch(rule.pattern.c_str(), name.c_str(), 0) == 0;
}


}  // namespace jor
