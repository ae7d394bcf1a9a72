#pragma once
// Pipeline split points: a contiguous cut of the block sequence into stages that makes
// the slowest stage as fast as it can be, with every stage inside the memory limit.
//
// Dynamic programming over (stage, blocks placed so far): best[s][k] is the smallest
// possible slowest-stage time when stages 0..s hold blocks [0, k). A stage's time and
// memory only grow as it takes more blocks, so the scan over where stage s starts stops
// as soon as the stage alone is slower than the best found: with identical blocks (a
// transformer's layers, clustered into one run) a stage stops after about L / S blocks
// and the whole search costs O(L^2) rather than O(S L^2). Embedding and head are not
// blocks: they are the first and the last stage's fixed extras.

#include <cstdint>
#include <limits>
#include <vector>

namespace vescale::autoplan {

struct SplitProblem {
  std::vector<double> block_time;    // seconds per micro-batch (forward + backward), per block
  std::vector<double> block_static;  // bytes per block whatever the micro-batches (parameters, gradients, optimizer)
  std::vector<double> block_saved;   // bytes per block per micro-batch in flight
  std::vector<double> stage_time;    // per stage: fixed extra seconds (empty: none)
  std::vector<double> stage_bytes;   // per stage: fixed extra bytes (empty: none)
  std::vector<double> in_flight;     // per stage: micro-batches it holds at its peak (empty: 1)
  double memory_limit = std::numeric_limits<double>::infinity();
};

struct Split {
  bool feasible = false;               // false: no split fits the memory limit
  std::vector<int64_t> blocks;         // per stage, >= 1 each
  double bottleneck = 0;               // the slowest stage's seconds
};

// `stages` stages, each with at least one block.
Split split_stages(const SplitProblem& p, int64_t stages);

// Interleaved schedules: a rank runs all of its chunks (stages r, r + ranks, r + 2 ranks,
// ...), so the step waits on the busiest rank more than on the slowest stage. Starting
// from `counts` (layers per stage, identical layers of `layer_time` each; `stage_extra`:
// seconds a stage has besides its layers, e.g. the embedding and the head), moves one
// layer at a time from the busiest rank's fullest stage to the least busy rank's emptiest
// one while the move leaves both below the busiest rank's load before it (each move lowers
// the sum of squared loads, so it ends). Every stage keeps at least one layer.
std::vector<int64_t> balance_ranks(std::vector<int64_t> counts, double layer_time,
                                   const std::vector<double>& stage_extra, int64_t ranks);

// Every split tried, for tests on small problems.
Split split_brute_force(const SplitProblem& p, int64_t stages);

}  // namespace vescale::autoplan
