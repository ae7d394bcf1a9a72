#pragma once
// The eager planner's memory of one pipeline rank: what vescale holds at each of a step's
// fullest moments (forward and backward, the gradients' reduction, the optimizer step,
// ZeRO's gather of the updated parameters) for the plan's ZeRO stage and schedule, and
// the largest of them by kind.

#include "autoplan/eager.h"

#include <vector>

namespace vescale::autoplan::eager {

// What one pipeline rank holds for a plan (eager.cpp sums it over the rank's stages).
struct RankHoldings {
  double param_bytes = 0;          // this rank's parameters
  double optimizer_elements = 0;   // elements its optimizer step updates (1/DP of them under ZeRO)
  std::vector<double> blocks;      // ZeRO's units: each block's parameter bytes
  double root_bytes = 0;           // ZeRO's root unit: everything outside the blocks
  double head_bytes = 0;           // the units after the blocks
  double saved = 0;                // the most kept for backward at once (saved tensors, a split backward's)
  double saved_with_grads = 0;     // the most kept once this rank's gradients are there
  double rematerialized = 0;       // a recomputed block's saved tensors, alive during its backward
  double transient = 0;            // the loss rank's forward and backward temporaries
  double bucketed = 0;             // gradient bytes that go through DDP's buckets
};

// Per stage: the most micro-batches whose forward ran and whose backward (B, or W when
// split) has not, at any point of its rank's order (what the split search budgets).
std::vector<double> in_flight(const Schedule& s, int64_t stages);

// What one rank's schedule order keeps for backward (eager_memory.cpp says how).
struct Kept {
  double peak = 0;        // the most at once
  double with_grads = 0;  // the most once the rank's gradients are there
};
Kept peak_kept(const std::vector<Action>& order, const std::vector<double>& saved, const std::vector<double>& held);

// DDP's buckets of `bytes` of gradients: as many as the cap asks, of equal size.
std::vector<double> buckets_of(double bytes, double cap);

Memory rank_memory(const Problem& p, const Config& c, const RankHoldings& h);

}  // namespace vescale::autoplan::eager
