#pragma once
// The pipeline timeline simulator: per-rank action orders (a schedule) run on a clock
// with per-stage compute costs and the time activations and gradients take to cross
// between ranks. Every rank runs its actions in order, each as soon as the rank is
// free and what it depends on has arrived:
//
//   F(s, mb)    F(s-1, mb) done, plus the forward send when s-1 is on another rank
//   B / I(s, mb) F(s, mb) done, and B or I of (s+1, mb) plus the backward send
//   W(s, mb)    I(s, mb) done
//
// It is the planner's pipeline model and the schedules' check: orders that cannot all
// finish (ranks waiting on each other) or that miss an action raise, naming them.
// Links are not shared: two sends at once both take their full time.

#include <cstdint>
#include <string>
#include <vector>

namespace vescale::autoplan {

struct Action {
  char kind;  // 'F', 'B' (a whole backward), 'I' (input gradient), 'W' (weight gradient)
  int32_t stage;
  int32_t mb;
};

// Seconds one micro-batch takes in a stage.
struct StageCost {
  double forward = 1.0;
  double backward = 2.0;        // a whole backward (B)
  double input_backward = 1.0;  // I
  double weight_backward = 1.0; // W
};

struct PipelineModel {
  std::string name;                         // for messages
  std::vector<std::vector<Action>> orders;  // per pipeline rank
  std::vector<int32_t> placement;           // stage -> rank
  int32_t microbatches = 1;
  std::vector<StageCost> costs;             // per stage
  std::vector<double> send_forward;         // per boundary s -> s+1 (empty: free)
  std::vector<double> send_backward;        // per boundary s+1 -> s (empty: free)
};

struct TimedAction {
  Action action;
  int32_t rank;
  double start, end;
};

struct Timeline {
  std::vector<TimedAction> actions;  // in the order they were placed on the clock
  std::vector<double> busy;          // per rank: seconds of compute
  double makespan = 0;
  // The pipeline's idle fraction: 1 - sum(busy) / (ranks * makespan).
  double bubble() const;
};

Timeline simulate_pipeline(const PipelineModel& model);

// The same timeline when the ranks share `cores` processors (processor sharing): while k
// ranks compute at once, each advances at min(1, cores / k) of its own speed. An
// action's cost is then `costs` (compute, in seconds at full speed) followed by `waits`
// (per stage, the same four kinds: time spent in collectives, which takes no processor).
// cores <= 0 (or >= the ranks) and no waits give exactly simulate_pipeline's timeline.
// This is the eager planner's model of ranks that share a machine's cores: a pipeline's
// idle ranks leave their share to the busy ones.
Timeline simulate_pipeline_shared(const PipelineModel& model, double cores, const std::vector<StageCost>& waits = {});

}  // namespace vescale::autoplan
