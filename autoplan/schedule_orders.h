#pragma once
// The per-rank action orders of 1F1B and Megatron's interleaved 1F1B, made in C++ for
// the planner's large configurations (thousands of actions per candidate), exactly as
// vescale/parallel/pipeline/schedules.py makes them (tests/python/test_autoplan_scale.py
// compares the two), and what an order means for memory: how many micro-batches' saved
// activations a rank holds at its worst moment.

#include "autoplan/pipeline_sim.h"

#include <cstdint>
#include <vector>

namespace vescale::autoplan {

struct Orders {
  int32_t ranks = 1, virtual_stages = 1, microbatches = 1;
  std::vector<std::vector<Action>> orders;  // per pipeline rank
  std::vector<int32_t> placement;           // stage -> rank: stage s on rank s % ranks
  int32_t stages() const { return ranks * virtual_stages; }
};

// virtual_stages == 1: 1F1B (rank r runs p - r - 1 warm-up forwards); > 1: interleaved
// 1F1B, micro-batches in rounds of `ranks` (microbatches must be a multiple of it).
Orders one_f_one_b(int32_t ranks, int32_t microbatches, int32_t virtual_stages = 1);

// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B with each backward split in
// its input pass (I) and weight pass (W); rank r holds back its first r W's, which fill
// the cool-down (schedules.py _zb_h1).
Orders zb_h1(int32_t ranks, int32_t microbatches);

// Per rank, the most bytes held at once when an F of stage s keeps `saved[s]` bytes until
// the B of the same stage and micro-batch frees them; a split backward's I frees them
// and keeps `weight_held[s]` (what its W reads) until the W (empty: nothing kept).
std::vector<double> peak_held(const Orders& o, const std::vector<double>& saved,
                              const std::vector<double>& weight_held = {});

}  // namespace vescale::autoplan
