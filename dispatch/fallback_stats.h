#pragma once
// Book-keeping for ops that ran through the replicate fallback: a counter per op,
// readable from Python, and one warning per op.

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace vescale {

struct FallbackEntry {
  std::string op;
  std::string reason;
  int64_t count;
};

// The counter for `op`; the first time an op is seen it is logged as a warning
// that names the reason. The pointer stays valid for the life of the process.
std::atomic<int64_t>* fallback_counter(const std::string& op, const std::string& reason);

std::vector<FallbackEntry> fallback_report();
void reset_fallback_counts();

}  // namespace vescale
