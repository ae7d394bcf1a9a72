#pragma once
// The redistribution planner: source placements -> target placements as an ordered
// list of per-mesh-dim steps, with their cost. Pure: no process group is touched.
//
// Nested shards (two mesh dims sharding one tensor dim) constrain the order: an inner
// shard must be removed before the outer one changes, and a new outer shard is cut
// before the inner one. The plan therefore runs in two phases:
//   1. innermost mesh dim first, take away every shard that changes or sits inside a
//      changing shard of the same tensor dim (all-gather, or all-to-all when a single
//      even shard moves between tensor dims);
//   2. outermost first, reach the targets (chunk, all-reduce, reduce-scatter,
//      replicate->partial).
// Partials on several mesh dims reduce innermost mesh dim first (the way nested
// shards split outermost first). With one reduce op the order does not matter; with
// mixed ops every partial dim is all-reduced, innermost first, before phase 2.

#include "core/spec.h"

#include <string>
#include <vector>

namespace vescale::collectives {

struct RedistStep {
  enum class Kind : uint8_t {
    AllGather,      // Shard(dim) or InterleavedShard(dim, groups) -> Replicate
    AllToAll,       // Shard(dim) -> Shard(to_dim)
    AllReduce,      // Partial(op) -> Replicate
    ReduceScatter,  // Partial(op) -> Shard(dim) or InterleavedShard(dim, groups)
    Chunk,          // Replicate -> Shard(dim) or InterleavedShard(dim, groups), local
    ToPartial,      // Replicate -> Partial(op), local
  };
  Kind kind;
  int32_t mesh_dim;
  int32_t dim = -1;
  int32_t to_dim = -1;
  ReduceOp op = ReduceOp::Sum;
  int32_t groups = 1;  // > 1: the split is interleaved (InterleavedShard)
  Placements before;  // the tensor's placements just before this step

  std::string str() const;
};

struct RedistPlan {
  std::vector<RedistStep> steps;
  double cost = 0;  // seconds, from the alpha-beta model
  bool empty() const { return steps.empty(); }
  std::string str() const;
};

// Plans `src` -> `dst` placements on `mesh` for a tensor of `shape` and `dtype`.
// Both must have one placement per mesh dim with non-negative, in-range Shard dims.
RedistPlan plan_redistribution(
    const Mesh& mesh,
    PlacementsRef src,
    PlacementsRef dst,
    c10::ArrayRef<int64_t> shape,
    c10::ScalarType dtype);

inline RedistPlan plan_redistribution(const TensorSpec& src, PlacementsRef dst) {
  return plan_redistribution(*src.mesh, src.placements, dst, src.shape, src.dtype);
}

}  // namespace vescale::collectives
