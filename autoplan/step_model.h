#pragma once
// One training step of a transformer under one parallel configuration, on simulated
// hardware: per-stage costs from autoplan/transformer.h and the hardware table, the
// pipeline timeline from autoplan/pipeline_sim.h, then the data-parallel gradient
// reduction (overlapped with the end of the backward where the timeline leaves room), the
// tied-embedding gradient sum and the optimizer step; and the memory of every rank.
//
// Rank order is Megatron's: tensor-parallel ranks are consecutive, then context-parallel,
// then data-parallel, then pipeline (so TP groups sit inside a node when tp <= 8, CP rings
// stride tp, DP groups stride tp * cp, and pipeline neighbours stride tp * cp * dp). CP
// ranks hold the same weights, so gradients are reduced, and ZeRO shards, over DP x CP.
//
// Tensor-parallel collectives are not overlapped with compute unless the hardware entry
// says so (Hardware::tp_overlap; Megatron of the validation runs had none, nor has
// vescale yet). Context parallelism is modelled for planning at scale only (vescale has
// none to run it with; autoplan/search.h searches it only when asked). What the model
// leaves out, on purpose: the
// vocabulary-parallel cross-entropy's three tiny all-reduces, gradient-norm reductions,
// kernel launch gaps, stragglers and congestion between jobs.

#include "autoplan/hardware.h"
#include "autoplan/schedule_orders.h"
#include "autoplan/transformer.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace vescale::autoplan {

struct ParallelConfig {
  int64_t dp = 1, tp = 1, pp = 1;
  int64_t cp = 1;             // context parallelism: each sequence split over cp ranks (ring attention)
  int64_t vp = 1;             // virtual stages (model chunks) per pipeline rank: > 1 is interleaved 1F1B
  bool zero_bubble = false;   // ZB-H1 (vp 1): each backward split in input and weight passes
  int64_t micro_batch = 1;    // sequences per micro-batch
  int zero = 0;               // 0: replicated; 1: optimizer state sharded over DP; 2: + gradients; 3: + parameters
  bool sequence_parallel = false;
  Recompute recompute = Recompute::none;
  std::vector<int64_t> layers_per_stage;  // pp * vp entries in stage order; empty: chosen by the split

  int64_t world() const { return dp * tp * cp * pp; }
  int64_t stages() const { return pp * vp; }
  std::string str() const;
};

struct StepOptions {
  double memory_limit = 0;         // bytes per GPU for tensors; <= 0: the hardware's memory less its reserve
  std::string split = "balanced";  // "balanced" (autoplan/split.h) or "uniform" (equal layer counts)
  bool simulate = true;            // false: costs, memory and a lower bound only, no timeline
  double bucket_bytes = 40e6 * 4;  // DP gradient bucket (Megatron: 40M fp32 elements)
};

struct Memory {
  double params = 0, grads = 0, optimizer = 0, activations = 0, other = 0;
  double total() const { return params + grads + optimizer + activations + other; }
};

// Seconds of the slowest rank's step, by what they are spent on.
struct Breakdown {
  double compute = 0;     // forward and backward kernels (first pass)
  double recompute = 0;   // forward kernels redone in the backward
  double tp_comm = 0;     // tensor-parallel collectives (not overlapped)
  double cp_comm = 0;     // context-parallel ring transfers the attention beside them does not hide
  double zero_comm = 0;   // ZeRO-2/3 per-micro-batch collectives beyond what compute hides
  double idle = 0;        // pipeline bubble and waiting for sends
  double dp_exposed = 0;  // DP gradient reduction and ZeRO parameter gather not hidden
  double embedding_sync = 0;  // tied embedding gradients between first and last stage
  double optimizer = 0;
};

struct StepEstimate {
  bool feasible = false;
  std::string reason;             // why not, when not
  ParallelConfig config;          // with the split filled in
  int64_t microbatches = 0;
  double step_s = 0;              // the step, simulated (or the lower bound when not simulated)
  double lower_bound_s = 0;       // the busiest rank's work, no waiting: step_s >= this
  double pipeline_s = 0;          // the forward-backward timeline
  double bubble = 0;              // idle fraction of the pipeline timeline
  Breakdown breakdown;            // of the rank that finishes last
  Memory memory;                  // of the rank with the most
  int64_t memory_rank = 0;        // that pipeline rank
  std::vector<double> rank_memory;  // bytes per GPU, per pipeline rank (the same along TP and DP)
  std::vector<double> stage_forward, stage_backward;  // seconds per micro-batch, per stage
  std::vector<double> stage_weight_backward;          // ZB-H1: the weight pass's part of stage_backward
  double model_flops = 0;         // 6 * params-per-token FLOPs + attention, the step, all ranks (MFU numerator)
};

// Schedules already made, by (ranks, micro-batches, virtual stages): a search asks for
// the same few shapes thousands of times.
class OrdersCache {
 public:
  std::shared_ptr<const Orders> get(int32_t ranks, int32_t microbatches, int32_t virtual_stages,
                                    bool zero_bubble = false);

 private:
  std::vector<std::pair<std::tuple<int32_t, int32_t, int32_t, bool>, std::shared_ptr<const Orders>>> made_;
};

StepEstimate estimate_step(const Transformer& m, const Hardware& hw, const ParallelConfig& c,
                           const StepOptions& opt = {}, OrdersCache* cache = nullptr);

// Why `c` cannot run `m` at all (shapes that do not divide), or empty.
std::string config_problem(const Transformer& m, const ParallelConfig& c);

}  // namespace vescale::autoplan
