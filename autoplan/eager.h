#pragma once
// The eager planner's cost model and search: plans for the ranks at hand from what was
// measured on them, not from a hardware table.
//
// Inputs (vescale/autoplan/eager.py gathers them):
// - per unit (embeddings, each block, final norm and head) and per tensor-parallel layout
//   (tp, sequence parallel), its forward and backward seconds as a + b * samples (measured
//   on the model at tp = 1, on real local shards over a virtual mesh for tp > 1), the
//   input-gradient share of its backward, bytes saved for backward and handed on, one TP
//   rank's parameter bytes, and the collectives its forward and backward issue (read off
//   what-if runs through the engine), bytes as a + b * samples;
// - alpha-beta per collective kind and group size, fitted to the backend's microbenchmarks;
// - the pipeline schedules' per-rank orders (vescale/parallel/pipeline/schedules.py);
// - the optimizer step's seconds per tensor and per element.
//
// One step of a configuration (DP x TP x PP, ZeRO stage, sequence parallelism, schedule,
// micro-batches, split) is: the stages' forward and backward per micro-batch (compute,
// tensor-parallel collectives, ZeRO-3's gathers of each block for its forward and its
// backward; under a pipeline the root's parameters once a step, held for the schedule)
// on the pipeline timeline
// (autoplan/pipeline_sim.h) with the activation sends between ranks; then the
// data-parallel gradient reduction (all-reduce, or reduce-scatter for ZeRO-2/3), the
// parameter all-gather after a ZeRO-1/2 step, the sums of parameters several pipeline
// stages hold, the loss's reduction, and the optimizer step on this rank's share. The
// split of the blocks into stages balances the stages' measured times under the memory
// limit (autoplan/split.h), or follows a fixed method (uniform, FLOPs, parameters).
//
// Ranks that share the machine's processors (4 gloo ranks on 2 cores) are modelled by
// processor sharing on the pipeline timeline: the profile's times are those of all ranks
// computing at once, a pipeline rank computing while others wait runs faster.
//
// Memory of a rank: parameters (1/dp of them under ZeRO-3, plus the largest unit
// gathered), optimizer state (two fp32 moments; under ZeRO an fp32 master copy too where
// the parameters are not fp32, both 1/dp) and DDP's all-reduce buckets (ZeRO-0/1: kept
// from step to step, as big as the gradients) all the time, plus the largest of four
// moments: the forward and backward (what the micro-batches keep for backward at the
// fullest moment of the rank's schedule order, with a zero-bubble split's gradients kept
// from I to W, the loss rank's temporaries measured at the layout's shards, and the
// gradients: whole ones only from the rank's first backward on, meeting what is kept
// then; under ZeRO-2/3 without a pipeline their slices and two units' whole gradients),
// the end of the backward (the gradients), the optimizer step (the gradients it keeps and
// its temporaries, measured per element), and ZeRO-1/2's gather of the updated parameters
// (one bucket's, whole; ZeRO-1 gathers into DDP's kept bucket).
//
// Recomputation (activation checkpointing of every block): a block keeps only its input
// (the bytes the block before hands on) and runs its forward, collectives included, again
// at the start of its backward. It never makes a step faster, so the search tries it only
// for a configuration that does not fit the memory limit without it (or when asked).

#include "autoplan/pipeline_sim.h"

#include <cstdint>
#include <string>
#include <vector>

namespace vescale::autoplan::eager {

struct Comm {
  std::string kind;  // all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send
  int64_t group = 1;
  double bytes_a = 0, bytes_b = 0;  // bytes = a + b * samples
};

struct AlphaBeta {
  std::string kind;
  int64_t group = 1;
  double alpha = 0, beta = 0;
};

// Seconds of a collective: alpha + beta * bytes, the nearest measured group size scaled
// by its ring steps when the group size itself was not measured.
class CommCost {
 public:
  explicit CommCost(std::vector<AlphaBeta> table);
  double time(const std::string& kind, int64_t group, double bytes) const;

 private:
  std::vector<AlphaBeta> table_;
};

// One unit at one tensor-parallel layout; seconds and bytes per micro-batch of n samples.
struct UnitCost {
  double fwd_a = 0, fwd_b = 0, bwd_a = 0, bwd_b = 0;
  double input_share = 0.5;  // the input-gradient part of the backward (zero-bubble schedules)
  double split_cost = 1.0;   // the two parts of a split backward against a plain one
  double shadow = 0;         // its forward on meta: what a later pipeline stage pays per micro-batch
  double saved_a = 0, saved_b = 0;
  double held_a = 0, held_b = 0;  // kept from a split backward's I to its W (vescale/autoplan/split_backward.py)
  double out_a = 0, out_b = 0;  // bytes of what it hands on (one TP rank's part)
  double param_bytes = 0;       // one TP rank's
  double param_numel = 0;
  int64_t param_tensors = 0;
  // bytes of its parameters' gradients that arrive Partial over TP (LayerNorms under SP,
  // row-parallel biases): reduced in buckets after backward (vescale/parallel/tp_grads.py)
  double partial_grad_bytes = 0;
  std::vector<Comm> fwd_comm, bwd_comm;
};

struct Layout {
  int64_t tp = 1;
  bool sp = false;
  std::vector<UnitCost> units;  // in the order of Problem::units
  // a forward + backward's peak beyond the gradients on one TP rank, a + b * samples,
  // where measured at sharded shapes (else the problem's, split over TP)
  bool has_working = false;
  double working_a = 0, working_b = 0;
};

struct Unit {
  std::string name;
  int kind = 1;               // 0: before the blocks (first stage), 1: a block, 2: after them (last stage)
  double flops = 0;           // forward FLOPs per sample (split_method "flops")
  double params = 0;          // parameter count (split_method "parameters")
  bool cut_before = true;     // blocks: may a stage start here
};

struct Schedule {
  std::string name;
  int64_t pp = 1, microbatches = 1, vp = 1;
  std::vector<std::vector<Action>> orders;  // per pipeline rank
  std::vector<int32_t> placement;           // stage -> rank
};

struct Problem {
  std::vector<Unit> units;
  std::vector<Layout> layouts;
  std::vector<AlphaBeta> comm;
  std::vector<Schedule> schedules;
  int64_t world = 1;
  int64_t batch = 1;                       // samples per step (global)
  double optimizer_per_tensor = 0, optimizer_per_element = 0;  // seconds of the step
  double state_bytes_per_element = 8;      // AdamW: two fp32 moments
  double master_bytes_per_element = 4;     // ZeRO: an fp32 master copy (0 for fp32 parameters)
  double grad_bytes_per_param_byte = 1;
  double glue_param_bytes = 0;             // held by every pipeline stage (summed over them each step)
  double tied_param_bytes = 0;             // one tensor held by the first and the last stage
  double bucket_bytes = 25.0 * (1 << 20);  // DDP's bucket cap
  double step_overhead = 0;                // seconds per step outside the model (loader, wrappers)
  // Ranks sharing processors: the units' times were measured while `profiled_busy` ranks
  // computed at once on `cores` processors (<= 0: as many as ranks). A pipeline rank that
  // computes while others idle runs faster (autoplan/pipeline_sim.h, processor sharing).
  double cores = 0;
  int64_t profiled_busy = 1;
  // Memory measured on the whole model on one rank: what a forward + backward adds at its
  // peak beyond the gradients (saved activations and transient buffers, a + b * samples),
  // and what the optimizer step adds beyond its state, per element.
  double working_a = 0, working_b = 0;
  double optimizer_temp_per_element = 0;
  // Seconds per byte of a tensor copy: DDP flattens gradients into its buckets and back,
  // ZeRO packs and unpacks slices around its collectives.
  double copy_per_byte = 0;
  // Processor seconds the pipeline runtime spends per schedule action beyond the units'
  // compute (its Python, the send and receive, the autograd call; measured by
  // vescale/autoplan/runtime_cost.py), added to every F, B, I and W of a pipeline.
  double action_seconds = 0;
  // Whole copies of an all-gather's output the backend holds while it runs: gloo gathers
  // into a flat buffer of its own and copies out of it (1); NCCL writes in place (0).
  double gather_copies = 0;
};

struct Constraints {
  int64_t pp = 0, dp = 0, tp = 0;  // > 0: fixed
  int zero = -1, sp = -1;          // >= 0: fixed
  int recompute = -1;              // >= 0: fixed; -1: only where the plan does not fit without it
  int64_t microbatches = 0, vp = 0;
  std::string schedule;            // empty: any
  std::string split = "time";      // time (balanced measured time under the memory limit), uniform, flops, parameters
  double memory_limit = 0;         // bytes per rank; <= 0: none
  int64_t top_k = 10;
};

struct Config {
  int64_t pp = 1, dp = 1, tp = 1;
  bool sp = false;
  int zero = 0;
  bool recompute = false;  // every block checkpointed
  std::string schedule = "none";
  int64_t microbatches = 1, vp = 1;
  std::vector<int64_t> blocks_per_stage;  // filled by the split
  std::string str() const;
};

struct Breakdown {
  double compute = 0;     // forward and backward of the busiest pipeline rank
  double tp_comm = 0;     // tensor-parallel collectives
  double zero_comm = 0;   // ZeRO-3 gathers during forward and backward
  double idle = 0;        // pipeline bubble and waiting for sends
  double dp_comm = 0;     // gradient reduction, ZeRO parameter gather after the step, loss reduction
  double pp_sync = 0;     // sums of parameters several stages hold, loss broadcast
  double optimizer = 0;
  double other = 0;       // fixed per-step overhead
};

struct Memory {
  double params = 0, grads = 0, optimizer = 0, activations = 0;
  double total() const { return params + grads + optimizer + activations; }
};

// A collective the estimate priced: `count` calls of `bytes` each (as the collective
// recorder counts bytes: this rank's input), and what issues it.
struct Priced {
  std::string kind;
  int64_t group = 1;
  double bytes = 0;
  int64_t count = 1;
  std::string what;  // "tp", "tp grads", "zero3", "dp", "zero", "pipeline", "stage sync"
};

struct Estimate {
  Config config;
  bool feasible = false;
  std::string reason;
  double step_s = 0;
  double bubble = 0;
  Breakdown breakdown;
  std::vector<Memory> rank_memory;  // per pipeline rank
  Memory memory;                    // of the rank with the most
  std::vector<double> stage_forward, stage_backward;  // seconds per micro-batch, per stage
  std::vector<Priced> rank0_comms;  // what the first rank's step sends, as priced
  std::string verdict;
};

struct Result {
  std::vector<Estimate> ranked;    // feasible, best first (all of them)
  std::vector<Estimate> rejected;  // over memory or not runnable, with reasons
  int64_t enumerated = 0;
  double seconds = 0;
};

// The layout for (tp, sp), or nullptr.
const Layout* find_layout(const Problem& p, int64_t tp, bool sp);

// One configuration; config.blocks_per_stage empty: chosen by `split`.
Estimate estimate(const Problem& p, const Config& c, const std::string& split = "time", double memory_limit = 0);

// Every configuration the constraints allow, ranked.
Result search(const Problem& p, const Constraints& c);

// "+4.2%: TP comm +3.1 ms, idle +0.4 ms": what makes `a` slower than `best`.
std::string why_slower(const Estimate& a, const Estimate& best);

}  // namespace vescale::autoplan::eager
