#pragma once
// A cached sharding decision for one (operator, input specs, non-tensor args) key:
// everything the per-op path needs to run the call without asking the rules again.

#include "collectives/redistribute_plan.h"
#include "sharding_rules/rule.h"

#include <atomic>
#include <vector>

namespace vescale {

struct Decision {
  MeshPtr mesh;
  // Per flattened input (null specs for undefined slots).
  // The spec each input had when decided. Held by every decision, a composition's too:
  // the cache key names specs by address, and a freed spec's address can go to another
  // spec on some ranks only, which would then find this decision there and not elsewhere.
  std::vector<SpecPtr> sources;
  std::vector<SpecPtr> targets;       // the spec the local op needs
  std::vector<collectives::RedistPlan> to_target;  // sources -> targets (empty: use as is)
  std::vector<collectives::RedistPlan> write_back; // targets -> sources, for written inputs that move
  // Per flattened result; empty for the replicate fallback, whose results are
  // replicated and take their shape from the local result.
  std::vector<SpecPtr> outputs;
  std::vector<std::pair<size_t, c10::IValue>> local_args;
  LocalFn local_fn = nullptr;
  DecomposeFn decompose = nullptr;
  // For a composition: per flattened result, the strides the op's own kernel gives it
  // (from the meta run). The composed ops may leave another layout (softmax composed of
  // exp and sum keeps a transposed input's; the softmax kernel returns contiguous), and
  // later ops that depend on memory order (random draws, view) must see the op's.
  std::vector<Shape> result_strides;
  // Set for the replicate fallback: the per-op counter to bump on every call.
  std::atomic<int64_t>* fallback_counter = nullptr;
};

}  // namespace vescale
