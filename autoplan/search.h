#pragma once
// The planner's search at scale: every (DP x TP x PP, x CP when asked) factorisation of the world, virtual
// stages, micro-batch size, ZeRO stage, sequence parallelism and recomputation, each with
// its best pipeline split (autoplan/split.h), under a memory limit; ranked by the step
// time the event simulation (autoplan/step_model.h) predicts.
//
// Exhaustive where it matters and cheap where it can be: every candidate gets its costs,
// split and exact per-rank memory; only the ones that fit are simulated, best lower bound
// first, and the simulation stops once the next lower bound cannot beat the k-th best
// simulated step (a lower bound is the busiest rank's work with no waiting, so nothing
// skipped could have ranked). Candidates not ranked come back, the closest few of each kind
// (over memory, simulated but outside the top k, pruned), with the reason they lost.

#include "autoplan/step_model.h"

#include <cstdint>
#include <string>
#include <vector>

namespace vescale::autoplan {

struct SearchConstraints {
  int64_t world = 1;
  double memory_limit = 0;  // bytes for tensors per GPU; <= 0: the hardware's memory less its reserve
  // Fixed by the user when > 0 (or >= 0 for zero, sequence_parallel, recompute); searched otherwise.
  int64_t tp = 0, pp = 0, dp = 0, vp = 0, micro_batch = 0, microbatches = 0;
  int64_t min_vp = 1;          // 2: interleaved schedules only
  int zero = -1;
  int sequence_parallel = -1;  // 0 or 1
  int recompute = -1;          // Recompute as int
  int zero_bubble = -1;        // 1: ZB-H1 only, 0: 1F1B (or interleaved) only; -1: both where vp is 1
  int64_t max_tp = 0;          // largest TP searched (0: one node)
  // Context parallelism: fixed when cp > 0; else searched up to max_cp. 1 by default:
  // vescale cannot run it yet, so plans with it are simulations of a Megatron-class stack.
  int64_t cp = 0, max_cp = 1;
  int64_t max_micro_batch = 8;
  std::string split = "balanced";  // or "uniform"
  int64_t top_k = 10;              // candidates simulated and ranked
  int64_t keep_rejected = 20;      // rejected candidates returned (those that came closest)
};

struct Candidate {
  StepEstimate estimate;
  std::string verdict;  // ranked: how it compares with the best; rejected: why
};

struct SearchResult {
  std::vector<Candidate> ranked;    // best first
  std::vector<Candidate> rejected;  // over memory or pruned, closest first
  int64_t enumerated = 0;           // configurations generated
  int64_t invalid = 0;              // shapes that do not divide (heads, batch, layers)
  int64_t over_memory = 0;
  int64_t pruned = 0;               // fit, but their lower bound could not make the top k
  int64_t simulated = 0;
  double seconds = 0;               // wall time of the search
};

SearchResult search(const Transformer& m, const Hardware& hw, const SearchConstraints& c);

// "+4.2% (idle +0.31 s, TP comm +0.12 s)": what makes `a` slower than `best`.
std::string why_slower(const StepEstimate& a, const StepEstimate& best);

}  // namespace vescale::autoplan
