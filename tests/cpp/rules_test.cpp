// Sharding rules through the real propagation path (meta run, rule, cost choice,
// cache), on meshes without process groups: only decisions are made, nothing runs.

#include "dispatch/call_scan.h"
#include "dispatch/dtensor_impl.h"
#include "dispatch/propagation.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace vescale {
namespace {

const Placement R = Placement::replicate();
const Placement P = Placement::partial();
Placement S(int32_t d) { return Placement::shard(d); }

// A DTensor whose local shard is zeros, on a mesh seen from `coordinate`.
at::Tensor dt(const MeshPtr& mesh, std::vector<int64_t> shape, Placements p, at::ScalarType dtype = at::kFloat) {
  auto spec = make_spec(mesh, p, shape, dense_strides(shape), dtype);
  return make_dtensor(at::zeros(c10::IntArrayRef(spec->local.sizes), at::TensorOptions().dtype(dtype)), spec);
}

const Decision& decide(const char* name, const char* overload, std::vector<c10::IValue> args) {
  const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
  const OpInfo& info = op_info(op);
  CallScan scan;
  scan.run(op, info, args);
  return lookup_decision(op, info, args, scan);
}

Placements in(const Decision& d, size_t i) { return d.targets[i]->placements; }
Placements out(const Decision& d, size_t j) {
  if (d.outputs.size() <= j) {
    ADD_FAILURE() << "no result spec: the call went to the replicate fallback";
    return {};
  }
  return d.outputs[j]->placements;
}

// This binary has no Python, so only ops with C++ meta kernels can be decided here
// (torch registers many meta kernels from Python); the rest are covered by pytest.

class Rules : public ::testing::Test {
 protected:
  MeshPtr m1 = make_test_mesh({2}, {0});
  MeshPtr m2 = make_test_mesh({2, 2}, {0, 1});
};

TEST_F(Rules, MatmulKeepsShardsThatNeedNoCommunication) {
  auto& rows = decide("aten::mm", "", {dt(m1, {4, 6}, {S(0)}), dt(m1, {6, 8}, {R})});
  EXPECT_EQ(in(rows, 0), Placements{S(0)});
  EXPECT_EQ(out(rows, 0), Placements{S(0)});
  EXPECT_TRUE(rows.to_target[0].empty() && rows.to_target[1].empty());

  auto& contraction = decide("aten::mm", "", {dt(m1, {4, 6}, {S(1)}), dt(m1, {6, 8}, {S(0)})});
  EXPECT_EQ(out(contraction, 0), Placements{P});

  // A column-split left operand: cutting the replicated right operand locally beats
  // gathering.
  auto& cut = decide("aten::mm", "", {dt(m1, {4, 6}, {S(1)}), dt(m1, {6, 8}, {R})});
  EXPECT_EQ(in(cut, 1), Placements{S(0)});
  EXPECT_EQ(out(cut, 0), Placements{P});
}

TEST_F(Rules, MatmulOnTwoMeshDims) {
  auto& d = decide("aten::mm", "", {dt(m2, {4, 6}, {S(0), R}), dt(m2, {6, 8}, {R, S(1)})});
  EXPECT_EQ(out(d, 0), (Placements{S(0), S(1)}));
}

TEST_F(Rules, AddmmBiasFollowsTheProduct) {
  auto& d = decide("aten::addmm", "", {dt(m1, {8}, {R}), dt(m1, {4, 6}, {R}), dt(m1, {6, 8}, {S(1)}), 1, 1});
  EXPECT_EQ(out(d, 0), Placements{S(1)});
  EXPECT_EQ(in(d, 0), Placements{S(0)});
}

TEST_F(Rules, PointwiseBroadcastAndPartial) {
  auto& b = decide("aten::add", "Tensor", {dt(m1, {4, 6}, {S(1)}), dt(m1, {6}, {R}), 1});
  EXPECT_EQ(out(b, 0), Placements{S(1)});
  EXPECT_EQ(in(b, 1), Placements{S(0)});

  auto& sum_of_partials = decide("aten::add", "Tensor", {dt(m1, {4}, {P}), dt(m1, {4}, {P}), 1});
  EXPECT_EQ(out(sum_of_partials, 0), Placements{P});
  EXPECT_TRUE(sum_of_partials.to_target[0].empty());

  auto& product = decide("aten::mul", "Tensor", {dt(m1, {4}, {P}), dt(m1, {4}, {P})});
  // At most one factor of a product may stay partial.
  EXPECT_FALSE(in(product, 0) == Placements{P} && in(product, 1) == Placements{P});

  auto& exp = decide("aten::exp", "", {dt(m1, {4}, {P})});
  EXPECT_NE(in(exp, 0), Placements{P});
}

TEST_F(Rules, InPlaceKeepsTheWrittenTensorsLayout) {
  auto& d = decide("aten::add_", "Tensor", {dt(m1, {4}, {R}), dt(m1, {4}, {S(0)}), 1});
  EXPECT_EQ(in(d, 0), Placements{R});
  EXPECT_EQ(in(d, 1), Placements{R});
  EXPECT_TRUE(d.write_back[0].empty());

  // A partial tensor cannot be updated nonlinearly in place: it is reduced into a
  // temporary and written back.
  auto& exp = decide("aten::exp_", "", {dt(m1, {4}, {P})});
  EXPECT_EQ(in(exp, 0), Placements{R});
  EXPECT_FALSE(exp.write_back[0].empty());
}

TEST_F(Rules, Reductions) {
  auto& over_split = decide("aten::sum", "dim_IntList",
                            {dt(m1, {4, 6}, {S(1)}), std::vector<int64_t>{1}, false, c10::IValue()});
  EXPECT_EQ(out(over_split, 0), Placements{P});
  auto& kept = decide("aten::sum", "dim_IntList",
                      {dt(m1, {4, 6, 2}, {S(2)}), std::vector<int64_t>{0}, false, c10::IValue()});
  EXPECT_EQ(out(kept, 0), Placements{S(1)});
  auto& mean = decide("aten::mean", "dim", {dt(m1, {5, 6}, {S(0)}), std::vector<int64_t>{0}, false, c10::IValue()});
  EXPECT_EQ(out(mean, 0), Placements{P});
  EXPECT_NE(mean.local_fn, nullptr);
}

TEST_F(Rules, ViewKeepsRowsThatStayBlocks) {
  auto& merge = decide("aten::view", "", {dt(m1, {4, 6, 8}, {S(0)}), std::vector<int64_t>{24, 8}});
  EXPECT_EQ(out(merge, 0), Placements{S(0)});
  ASSERT_EQ(merge.local_args.size(), 1u);
  EXPECT_EQ(merge.local_args[0].second.toIntVector(), (std::vector<int64_t>{12, 8}));

  auto& inner = decide("aten::view", "", {dt(m1, {4, 6, 8}, {S(1)}), std::vector<int64_t>{24, 8}});
  EXPECT_EQ(in(inner, 0), Placements{R});

  auto& uneven = decide("aten::view", "", {dt(m1, {3, 4}, {S(0)}), std::vector<int64_t>{12}});
  EXPECT_EQ(in(uneven, 0), Placements{R});

  auto& split = decide("aten::view", "", {dt(m1, {8, 6}, {S(0)}), std::vector<int64_t>{2, 4, 6}});
  EXPECT_EQ(out(split, 0), Placements{S(0)});

  auto& heads = decide("aten::view", "", {dt(m1, {2, 3, 8}, {S(2)}), std::vector<int64_t>{2, 3, 4, 2}});
  EXPECT_EQ(out(heads, 0), Placements{S(2)});
}

TEST_F(Rules, InterleavedLiftsThroughElementwiseOpsAndViews) {
  const Placement I0 = Placement::interleaved(0, 3), I1 = Placement::interleaved(1, 3);
  // A fused projection: x @ W^T with W^T's columns interleaved: the product keeps them.
  auto& mm = decide("aten::mm", "", {dt(m1, {4, 8}, {R}), dt(m1, {8, 12}, {I1})});
  EXPECT_EQ(out(mm, 0), Placements{I1});
  EXPECT_TRUE(mm.to_target[0].empty() && mm.to_target[1].empty());
  // Contracting over interleaved dims of both operands gives a partial sum.
  auto& contraction = decide("aten::mm", "", {dt(m1, {4, 12}, {I1}), dt(m1, {12, 8}, {I0})});
  EXPECT_EQ(out(contraction, 0), Placements{P});
  auto& add = decide("aten::add", "Tensor", {dt(m1, {4, 12}, {I1}), dt(m1, {12}, {R}), 1});
  EXPECT_EQ(out(add, 0), Placements{I1});
  EXPECT_EQ(in(add, 1), Placements{I0});
  auto& sum = decide("aten::sum", "dim_IntList", {dt(m1, {4, 12}, {I1}), std::vector<int64_t>{0}, false, c10::IValue()});
  EXPECT_EQ(out(sum, 0), Placements{I0});
  // The interleaved dim leads its view run: it survives; otherwise it is gathered.
  auto& rows = decide("aten::view", "", {dt(m1, {12, 4}, {I0}), std::vector<int64_t>{48}});
  EXPECT_EQ(out(rows, 0), Placements{I0});
  auto& unfit = decide("aten::view", "", {dt(m1, {12, 4}, {I0}), std::vector<int64_t>{3, 16}});
  EXPECT_EQ(in(unfit, 0), Placements{R});
  auto& t = decide("aten::t", "", {dt(m1, {12, 4}, {I0})});
  EXPECT_EQ(out(t, 0), Placements{I1});
  // Element-wise rules that do not lift (here softmax over the dim) gather it first.
  auto& softmax = decide("aten::_softmax", "", {dt(m1, {4, 12}, {I1}), 1, false});
  EXPECT_EQ(in(softmax, 0), Placements{R});
}

TEST_F(Rules, SplitIntoBlocksAndCatBack) {
  auto& split = decide("aten::split", "Tensor", {dt(m1, {4, 12}, {Placement::interleaved(1, 3)}), 4, 1});
  ASSERT_EQ(split.outputs.size(), 3u);
  for (size_t j = 0; j < 3; ++j) EXPECT_EQ(out(split, j), Placements{S(1)});
  ASSERT_EQ(split.local_args.size(), 1u);
  EXPECT_EQ(split.local_args[0].second.toInt(), 2);  // each rank cuts its 6 columns in 3
  auto& uneven = decide("aten::split", "Tensor", {dt(m1, {4, 12}, {Placement::interleaved(1, 3)}), 6, 1});
  EXPECT_EQ(in(uneven, 0), Placements{R});  // 2 parts of a 3-block dim: gathered
  std::vector<at::Tensor> parts = {dt(m1, {4, 4}, {S(1)}), dt(m1, {4, 4}, {S(1)})};
  auto& cat = decide("aten::cat", "", {c10::IValue(parts), 1});
  EXPECT_EQ(out(cat, 0), Placements{Placement::interleaved(1, 2)});
  EXPECT_TRUE(cat.to_target[0].empty() && cat.to_target[1].empty());
}

TEST_F(Rules, TransposeMovesTheShard) {
  auto& t = decide("aten::transpose", "int", {dt(m1, {4, 6, 2}, {S(0)}), 0, -1});
  EXPECT_EQ(out(t, 0), Placements{S(2)});
  auto& p = decide("aten::permute", "", {dt(m2, {4, 6, 2}, {S(0), S(2)}), std::vector<int64_t>{2, 0, 1}});
  EXPECT_EQ(out(p, 0), (Placements{S(1), S(0)}));
}

TEST_F(Rules, SoftmaxKeepsItsDimWhole) {
  auto& rows = decide("aten::_softmax", "", {dt(m1, {4, 6}, {S(0)}), 1, false});
  EXPECT_EQ(out(rows, 0), Placements{S(0)});
  // Split along the softmax dim already: composed from max and sum reductions.
  auto& cols = decide("aten::_log_softmax", "", {dt(m1, {4, 6}, {S(1)}), -1, false});
  EXPECT_NE(cols.decompose, nullptr);
}

TEST_F(Rules, CachedDecisionsKeepTheSpecsTheirKeysName) {
  // The cache key names an input's spec by address. Were the spec freed while the
  // decision stays cached, another spec could take its address on one rank only and
  // find this decision there: a composition on one rank, a gather on the other.
  std::weak_ptr<const TensorSpec> spec;
  const Decision* composed = nullptr;
  {
    auto x = dt(m1, {5, 7}, {S(1)});
    spec = dtensor_impl(x)->spec();
    composed = &decide("aten::_softmax", "", {x, 1, false});
  }
  ASSERT_NE(composed->decompose, nullptr);
  EXPECT_FALSE(spec.expired());
}

TEST_F(Rules, MeanLossOverSplitRowsReplicatesTheTargets) {
  auto& d = decide("aten::nll_loss_forward", "",
                   {dt(m1, {6, 5}, {S(0)}), dt(m1, {6}, {S(0)}, at::kLong), c10::IValue(), 1, -100});
  EXPECT_EQ(in(d, 0), Placements{S(0)});
  EXPECT_EQ(in(d, 1), Placements{R});
  EXPECT_EQ(out(d, 0), Placements{P});
  EXPECT_NE(d.local_fn, nullptr);
}

TEST_F(Rules, OpsWithoutRuleFallBackAndDecisionsAreCached) {
  auto x = dt(m1, {4, 6}, {S(0)});
  auto& d = decide("aten::trace", "", {x});
  ASSERT_NE(d.fallback_counter, nullptr);
  EXPECT_EQ(in(d, 0), Placements{R});
  const auto misses = decision_cache_misses();
  auto& again = decide("aten::trace", "", {dt(m1, {4, 6}, {S(0)})});
  EXPECT_EQ(&d, &again);
  EXPECT_EQ(decision_cache_misses(), misses);
}

TEST_F(Rules, DifferentMeshesAreAnError) {
  EXPECT_THROW(decide("aten::add", "Tensor", {dt(m1, {4}, {R}), dt(m2, {4}, {R, R}), 1}), c10::ValueError);
}

}  // namespace
}  // namespace vescale
