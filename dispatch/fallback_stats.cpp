#include "dispatch/fallback_stats.h"

#include <c10/util/Exception.h>

#include <mutex>
#include <unordered_map>

namespace vescale {

namespace {

struct Entry {
  std::string reason;
  std::atomic<int64_t> count{0};
};

std::mutex& mu() {
  static std::mutex m;
  return m;
}

// Node-based: entries never move, so handed-out counter pointers stay valid.
std::unordered_map<std::string, Entry>& entries() {
  static std::unordered_map<std::string, Entry> e;
  return e;
}

}  // namespace

std::atomic<int64_t>* fallback_counter(const std::string& op, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu());
  auto [it, inserted] = entries().try_emplace(op);
  if (inserted) {
    it->second.reason = reason;
    TORCH_WARN("vescale: ", op, " runs through the replicate fallback (", reason,
               "), which gathers its DTensor inputs to Replicate. Results stay correct, at "
               "the cost of communication. vescale.fallback_counts() lists every op that did this.");
  }
  return &it->second.count;
}

std::vector<FallbackEntry> fallback_report() {
  std::lock_guard<std::mutex> lock(mu());
  std::vector<FallbackEntry> out;
  for (const auto& [op, e] : entries()) out.push_back({op, e.reason, e.count.load()});
  return out;
}

void reset_fallback_counts() {
  std::lock_guard<std::mutex> lock(mu());
  for (auto& [op, e] : entries()) e.count = 0;
}

}  // namespace vescale
