// The redistribution planner, without any process group: step order and kinds for
// every transition on 1-d and 2-d meshes, and the cost model's ordering.

#include "collectives/redistribute_plan.h"

#include <gtest/gtest.h>

namespace vescale {
namespace {

const Placement R = Placement::replicate();
const Placement P = Placement::partial();
Placement S(int32_t d) { return Placement::shard(d); }

std::string plan(std::vector<int64_t> mesh_shape, Placements src, Placements dst,
                 std::vector<int64_t> shape = {8, 8}) {
  auto mesh = make_test_mesh(mesh_shape, std::vector<int64_t>(mesh_shape.size(), 0));
  return collectives::plan_redistribution(*mesh, src, dst, shape, at::kFloat).str();
}

TEST(Plan, OneDimTransitions) {
  EXPECT_EQ(plan({4}, {S(0)}, {S(0)}), "(nothing)");
  EXPECT_EQ(plan({4}, {S(0)}, {R}), "all_gather(dim=0, mesh_dim=0)");
  EXPECT_EQ(plan({4}, {R}, {S(1)}), "chunk(dim=1, mesh_dim=0)");
  EXPECT_EQ(plan({4}, {P}, {R}), "all_reduce(sum, mesh_dim=0)");
  EXPECT_EQ(plan({4}, {P}, {S(1)}), "reduce_scatter(sum, dim=1, mesh_dim=0)");
  EXPECT_EQ(plan({4}, {R}, {P}), "to_partial(sum, mesh_dim=0)");
  EXPECT_EQ(plan({4}, {S(0)}, {S(1)}), "all_to_all(dim=0->1, mesh_dim=0)");
  EXPECT_EQ(plan({4}, {Placement::partial(ReduceOp::Max)}, {P}),
            "all_reduce(max, mesh_dim=0); to_partial(sum, mesh_dim=0)");
  EXPECT_EQ(plan({4}, {S(0)}, {P}), "all_gather(dim=0, mesh_dim=0); to_partial(sum, mesh_dim=0)");
}

TEST(Plan, UnevenShardMovesThroughReplicate) {
  // 6 rows do not split evenly over 4 ranks: no all-to-all.
  EXPECT_EQ(plan({4}, {S(0)}, {S(1)}, {6, 8}), "all_gather(dim=0, mesh_dim=0); chunk(dim=1, mesh_dim=0)");
}

TEST(Plan, IndependentMeshDims) {
  EXPECT_EQ(plan({2, 2}, {S(0), S(1)}, {R, S(1)}), "all_gather(dim=0, mesh_dim=0)");
  EXPECT_EQ(plan({2, 2}, {P, S(1)}, {R, R}), "all_gather(dim=1, mesh_dim=1); all_reduce(sum, mesh_dim=0)");
  EXPECT_EQ(plan({2, 2}, {R, R}, {S(0), S(1)}), "chunk(dim=0, mesh_dim=0); chunk(dim=1, mesh_dim=1)");
}

TEST(Plan, NestedShardsUnwindInnerFirst) {
  // The inner shard of dim 0 must go before the outer one changes ...
  EXPECT_EQ(plan({2, 2}, {S(0), S(0)}, {R, S(0)}),
            "all_gather(dim=0, mesh_dim=1); all_gather(dim=0, mesh_dim=0); chunk(dim=0, mesh_dim=1)");
  // ... and a new outer shard is cut before the inner one.
  EXPECT_EQ(plan({2, 2}, {R, S(0)}, {S(0), S(0)}),
            "all_gather(dim=0, mesh_dim=1); chunk(dim=0, mesh_dim=0); chunk(dim=0, mesh_dim=1)");
  EXPECT_EQ(plan({2, 2}, {P, S(0)}, {S(0), S(0)}),
            "all_gather(dim=0, mesh_dim=1); reduce_scatter(sum, dim=0, mesh_dim=0); chunk(dim=0, mesh_dim=1)");
  // An inner shard of another dim is untouched.
  EXPECT_EQ(plan({2, 2}, {S(0), S(1)}, {R, S(1)}), "all_gather(dim=0, mesh_dim=0)");
}

TEST(Plan, MixedPartialsReduceInnermostFirst) {
  const Placement max = Placement::partial(ReduceOp::Max);
  EXPECT_EQ(plan({2, 2}, {max, P}, {R, P}),
            "all_reduce(sum, mesh_dim=1); all_reduce(max, mesh_dim=0); to_partial(sum, mesh_dim=1)");
  // One op: no ordering constraint, so only what changes moves.
  EXPECT_EQ(plan({2, 2}, {P, P}, {R, P}), "all_reduce(sum, mesh_dim=0)");
}

TEST(Plan, StepsRecordThePlacementsBefore) {
  auto mesh = make_test_mesh({2, 2}, {0, 0});
  const auto p = collectives::plan_redistribution(*mesh, {S(0), S(0)}, {R, R}, {8}, at::kFloat);
  ASSERT_EQ(p.steps.size(), 2u);
  EXPECT_EQ(p.steps[0].before, (Placements{S(0), S(0)}));
  EXPECT_EQ(p.steps[1].before, (Placements{S(0), R}));
}

TEST(Plan, CostsOrderCollectives) {
  auto mesh = make_test_mesh({4}, {0});
  const std::vector<int64_t> shape = {1024, 1024};
  auto cost = [&](Placements a, Placements b) {
    return collectives::plan_redistribution(*mesh, a, b, shape, at::kFloat).cost;
  };
  EXPECT_EQ(cost({R}, {R}), 0.0);
  EXPECT_LT(cost({R}, {S(0)}), cost({S(0)}, {R}));        // local chunk < all-gather
  EXPECT_LT(cost({P}, {S(0)}), cost({P}, {R}));           // reduce-scatter < all-reduce
  EXPECT_LT(cost({S(0)}, {S(1)}), cost({S(0)}, {R}));     // all-to-all < all-gather
  EXPECT_GT(cost({S(0)}, {R}), 0.0);
}

TEST(Plan, InterleavedGoesThroughGroupedSteps) {
  const Placement I = Placement::interleaved(0, 2);
  EXPECT_EQ(plan({2}, {I}, {R}), "all_gather(dim=0, groups=2, mesh_dim=0)");
  EXPECT_EQ(plan({2}, {R}, {I}), "chunk(dim=0, groups=2, mesh_dim=0)");
  EXPECT_EQ(plan({2}, {P}, {I}), "reduce_scatter(sum, dim=0, groups=2, mesh_dim=0)");
  // Never an all-to-all: the pieces are not one block.
  EXPECT_EQ(plan({2}, {I}, {S(1)}), "all_gather(dim=0, groups=2, mesh_dim=0); chunk(dim=1, mesh_dim=0)");
  EXPECT_EQ(plan({2, 2}, {S(1), I}, {S(1), R}), "all_gather(dim=0, groups=2, mesh_dim=1)");
  auto mesh = make_test_mesh({2}, {0});
  EXPECT_THROW(collectives::plan_redistribution(*mesh, {R}, {Placement::interleaved(0, 3)}, std::vector<int64_t>{8, 8}, at::kFloat),
               c10::ValueError);  // 8 rows do not make 3 blocks of 2 pieces
}

TEST(Plan, RejectsBadTargets) {
  auto mesh = make_test_mesh({4}, {0});
  EXPECT_THROW(collectives::plan_redistribution(*mesh, {R}, {S(2)}, std::vector<int64_t>{4, 4}, at::kFloat), c10::IndexError);
  EXPECT_THROW(collectives::plan_redistribution(*mesh, {R}, {R, R}, std::vector<int64_t>{4, 4}, at::kFloat), c10::ValueError);
}

}  // namespace
}  // namespace vescale
