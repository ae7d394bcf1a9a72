#pragma once
// Observing the per-op path: vescale.explain's decision capture, the op context of the
// collective recorder (collectives/trace.h) and NaN/Inf detection.
//
// The handler reads one flag word (collectives::trace::flags()); when it is zero nothing here runs.
// When an observer is on, the call goes through observed_kernel, which wraps the
// normal kernel: before it, the decision is recomputed with the rule's candidates
// logged (vescale.explain); during it, the collectives it issues are collected; after
// it, the results are described and, for detect_anomaly, checked for NaN/Inf.

#include "collectives/trace.h"
#include "dispatch/call_scan.h"
#include "dispatch/decision.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace vescale {

struct ExplainedTensor {
  bool defined = false;
  bool is_dtensor = false;  // a plain input takes part as Replicate
  std::string name;         // the schema argument ("self", "tensors[1]") or "result 0"
  Shape shape;
  c10::ScalarType dtype = c10::ScalarType::Float;
  Placements placements;    // inputs: as they came; results: as they leave
  Placements target;        // inputs: what the op needed
  std::string moves;        // inputs: the redistribution steps, empty when none
  double cost = 0;          // inputs: the moves' modelled cost, seconds
};

// One op call as the engine handled it.
struct OpExplanation {
  enum class How : uint8_t { Rule, Fallback, Decomposed };
  std::string op;    // "aten::mm"
  std::string mesh;  // the mesh's str()
  How how = How::Rule;
  std::string fallback_reason;
  bool cache_hit = false;  // the decision came from the cache (it is recomputed here to explain it)
  int depth = 0;           // > 0: issued by a decomposition of an enclosing op
  int32_t scope = 0;       // the comm_trace scope (module) it ran in, 0 when none
  std::vector<ExplainedTensor> inputs;
  CandidateLog candidates;
  std::vector<ExplainedTensor> outputs;
  std::vector<collectives::trace::CollectiveEvent> collectives;

  std::string str() const;
};

using KernelFn = void (*)(const c10::OperatorHandle&, torch::jit::Stack*);

// Runs `run` (the normal kernel) with the observers that are on.
void observed_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack, KernelFn run);

// ---- vescale.explain's capture -----------------------------------------------------

// Starts capturing the explanations of the ops that run from now on, keeping the last
// `capacity`; returns a handle for end_explain_capture. Captures nest.
int64_t begin_explain_capture(size_t capacity);
std::vector<std::shared_ptr<const OpExplanation>> end_explain_capture(int64_t handle);

// ---- NaN/Inf detection ---------------------------------------------------------------

struct Anomaly {
  std::string op;
  std::string result;      // which result, and its spec
  bool inputs_finite = true;
  int64_t rank = -1;       // global rank of this process (from the mesh)
  int32_t scope = 0;
  std::string message;     // the whole story in one sentence
};

// Turns the check on (counted); with `raise`, the first op that produces a non-finite
// value raises at once, otherwise it is only recorded (first_anomaly) and the caller
// decides when to look (vescale.debug.detect_anomaly agrees across ranks first).
void begin_anomaly_detection(bool raise);
void end_anomaly_detection(bool raise);  // `raise` as given to begin
std::optional<Anomaly> first_anomaly();
void reset_anomaly();

// Names of scope ids (set by the Python tracer), used in messages.
int32_t scope_id(const std::string& module, bool backward);
std::string scope_name(int32_t scope);

}  // namespace vescale
