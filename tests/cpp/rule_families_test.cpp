// Every rule family, called directly with a hand-built OpCall (no meta kernels, no
// process group): the placements each rule picks, and the costs behind the choice.

#include "collectives/redistribute_plan.h"
#include "sharding_rules/rule.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace vescale {
namespace {

const Placement R = Placement::replicate();
const Placement P = Placement::partial();
Placement S(int32_t d) { return Placement::shard(d); }
Placement Pmax() { return Placement::partial(ReduceOp::Max); }

TensorArg tensor(std::vector<int64_t> shape, Placements p, at::ScalarType dtype = at::kFloat) {
  TensorArg a;
  a.defined = true;
  a.is_dtensor = true;
  a.shape.assign(shape.begin(), shape.end());
  a.stride = dense_strides(a.shape);
  a.dtype = dtype;
  a.placements = std::move(p);
  return a;
}

TensorArg result(std::vector<int64_t> shape, at::ScalarType dtype = at::kFloat) {
  auto a = tensor(std::move(shape), {});
  a.is_dtensor = false;
  return a;
}

// Builds the call the dispatcher would describe and asks the op's rule.
struct Call {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;
  OpCall call;

  Call(const char* name, const char* overload, std::vector<c10::IValue> arguments, std::vector<TensorArg> inputs,
       std::vector<TensorArg> outputs, const MeshPtr& mesh)
      : op(c10::Dispatcher::singleton().findSchemaOrThrow(name, overload)),
        args(std::move(arguments)),
        call{op, args, *mesh, std::move(inputs), std::move(outputs), {}} {
    // Flattened inputs come from the tensor arguments in order (one each here).
    for (size_t a = 0; a < op.schema().arguments().size() && call.input_arg.size() < call.inputs.size(); ++a)
      if (is_tensor_argument(op.schema().arguments()[a])) call.input_arg.push_back(static_cast<uint32_t>(a));
  }

  ShardingChoice decide() const {
    const auto* rule = rules().find(c10::toString(op.operator_name()));
    EXPECT_NE(rule, nullptr) << "no rule for " << op.operator_name();
    return (*rule)(call);
  }
};

class RuleFamilies : public ::testing::Test {
 protected:
  MeshPtr m4 = make_test_mesh({4}, {1});
  MeshPtr m22 = make_test_mesh({2, 2}, {1, 0});
};

TEST_F(RuleFamilies, PointwiseFollowsTheCheapestShard) {
  Call add("aten::add", "Tensor", {c10::IValue(), c10::IValue(), 1},
           {tensor({8, 6}, {S(1)}), tensor({8, 6}, {S(0)})}, {result({8, 6})}, m4);
  // Either operand may move: an all-to-all of one beats gathering both.
  const auto c = add.decide();
  EXPECT_EQ(c.inputs[0], c.inputs[1]);
  EXPECT_TRUE(c.outputs[0][0].is_shard());
}

TEST_F(RuleFamilies, PointwiseLinearityKeepsPartials) {
  Call scale("aten::mul", "Tensor", {c10::IValue(), c10::IValue()},
             {tensor({8}, {P}), tensor({8}, {R})}, {result({8})}, m4);
  EXPECT_EQ(scale.decide().outputs[0], Placements{P});
  Call grad("aten::gelu_backward", "", {c10::IValue(), c10::IValue(), std::string("none")},
            {tensor({8}, {P}), tensor({8}, {R})}, {result({8})}, m4);
  EXPECT_EQ(grad.decide().outputs[0], Placements{P});
  Call square("aten::mul", "Tensor", {c10::IValue(), c10::IValue()},
              {tensor({8}, {P}), tensor({8}, {P})}, {result({8})}, m4);
  const auto c = square.decide();
  EXPECT_FALSE(c.inputs[0] == Placements{P} && c.inputs[1] == Placements{P});
}

TEST_F(RuleFamilies, MatmulOnTwoMeshDims) {
  // DP x TP: rows over DP, a column-parallel weight over TP.
  Call mm("aten::mm", "", {c10::IValue(), c10::IValue()},
          {tensor({8, 6}, {S(0), R}), tensor({6, 4}, {R, S(1)})}, {result({8, 4})}, m22);
  EXPECT_EQ(mm.decide().outputs[0], (Placements{S(0), S(1)}));
  // row-parallel: contraction split over TP gives a partial sum
  Call row("aten::mm", "", {c10::IValue(), c10::IValue()},
           {tensor({8, 6}, {S(0), S(1)}), tensor({6, 4}, {R, S(0)})}, {result({8, 4})}, m22);
  EXPECT_EQ(row.decide().outputs[0], (Placements{S(0), P}));
}

TEST_F(RuleFamilies, ReductionsProducePartials) {
  Call amax("aten::amax", "", {c10::IValue(), std::vector<int64_t>{1}, false},
            {tensor({4, 6}, {S(1)})}, {result({4})}, m4);
  const auto c = amax.decide();
  EXPECT_EQ(c.outputs[0], Placements{Pmax()});
  EXPECT_NE(c.local_fn, nullptr);  // empty blocks give the identity
  Call argmax("aten::argmax", "", {c10::IValue(), 1, false}, {tensor({4, 6}, {S(1)})}, {result({4}, at::kLong)}, m4);
  EXPECT_NE(argmax.decide().inputs[0], Placements{S(1)});  // indices need the whole dim
  Call var("aten::var", "correction", {c10::IValue(), std::vector<int64_t>{1}, c10::IValue(), false},
           {tensor({4, 6}, {S(0)})}, {result({4})}, m4);
  EXPECT_EQ(var.decide().outputs[0], Placements{S(0)});
}

TEST_F(RuleFamilies, VectorNormsSplitOrCompose) {
  Call l1("aten::linalg_vector_norm", "", {c10::IValue(), 1.0, c10::IValue(), false, c10::IValue()},
          {tensor({4, 6}, {S(1)})}, {result({})}, m4);
  EXPECT_EQ(l1.decide().outputs[0], Placements{P});
  Call l2("aten::linalg_vector_norm", "", {c10::IValue(), 2.0, c10::IValue(), false, c10::IValue()},
          {tensor({4, 6}, {S(1)})}, {result({})}, m4);
  EXPECT_NE(l2.decide().decompose, nullptr);
}

TEST_F(RuleFamilies, ViewsAndShapes) {
  // 6 split over 4 ranks is 2, 2, 2, 0: as 3 x 2 that is still 1, 1, 1, 0 rows of 2,
  // but as 2 x 3 it is no block of the new dims, so it is gathered.
  Call kept("aten::view", "", {c10::IValue(), std::vector<int64_t>{2, 4, 3, 2}},
            {tensor({2, 4, 6}, {S(2)})}, {result({2, 4, 3, 2})}, m4);
  EXPECT_EQ(kept.decide().outputs[0], Placements{S(2)});
  Call gathered("aten::view", "", {c10::IValue(), std::vector<int64_t>{2, 4, 2, 3}},
                {tensor({2, 4, 6}, {S(2)})}, {result({2, 4, 2, 3})}, m4);
  EXPECT_EQ(gathered.decide().inputs[0], Placements{R});
  Call heads("aten::view", "", {c10::IValue(), std::vector<int64_t>{2, 4, 4, 2}},
             {tensor({2, 4, 8}, {S(2)})}, {result({2, 4, 4, 2})}, m4);
  EXPECT_EQ(heads.decide().outputs[0], Placements{S(2)});
  Call cat("aten::cat", "", {c10::IValue(), 0}, {tensor({4, 6}, {S(1)}), tensor({2, 6}, {S(1)})}, {result({6, 6})}, m4);
  EXPECT_EQ(cat.decide().outputs[0], Placements{S(1)});
}

TEST_F(RuleFamilies, NormsKeepTheirDimsWhole) {
  Call ln("aten::native_layer_norm", "", {c10::IValue(), std::vector<int64_t>{6}, c10::IValue(), c10::IValue(), 1e-5},
          {tensor({4, 5, 6}, {S(1)}), TensorArg{}, TensorArg{}}, {result({4, 5, 6}), result({4, 5, 1}), result({4, 5, 1})}, m4);
  EXPECT_EQ(ln.decide().outputs[1], Placements{S(1)});
  Call softmax("aten::_softmax", "", {c10::IValue(), 1, false}, {tensor({4, 6}, {S(1)})}, {result({4, 6})}, m4);
  EXPECT_NE(softmax.decide().decompose, nullptr);  // split along the softmax dim: composed
}

TEST_F(RuleFamilies, NormBackwardRunsWhereItsForwardRan) {
  // native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, mask)
  auto backward = [&](Placement input) {
    return Call("aten::native_layer_norm_backward", "",
                {c10::IValue(), c10::IValue(), std::vector<int64_t>{6}, c10::IValue(), c10::IValue(), c10::IValue(),
                 c10::IValue(), std::vector<bool>{true, true, false}},
                {tensor({4, 5, 6}, {P}), tensor({4, 5, 6}, {input}), tensor({4, 5, 1}, {input}),
                 tensor({4, 5, 1}, {input}), tensor({6}, {R}), TensorArg{}},
                {result({4, 5, 6}), result({6}), TensorArg{}}, m4)
        .decide();
  };
  // Megatron TP: a replicated forward all-reduces the Partial gradient once, no split grads
  const auto replicated = backward(R);
  EXPECT_EQ(replicated.inputs[0], Placements{R});
  EXPECT_EQ(replicated.outputs[0], Placements{R});
  EXPECT_EQ(replicated.outputs[1], Placements{R});
  // sequence parallel: the forward ran split, so does the backward (reduce-scatter, Partial weight grad)
  const auto split = backward(S(1));
  EXPECT_EQ(split.inputs[0], Placements{S(1)});
  EXPECT_EQ(split.outputs[0], Placements{S(1)});
  EXPECT_EQ(split.outputs[1], Placements{P});
}

TEST_F(RuleFamilies, SpatialOpsSplitBatchAndChannelsOnlyIntoNonEmptyParts) {
  // avg_pool2d(self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
  auto pool = [&](std::vector<int64_t> shape, Placement p, std::vector<int64_t> out) {
    return Call("aten::avg_pool2d", "",
                {c10::IValue(), std::vector<int64_t>{2, 2}, std::vector<int64_t>{2, 2}, std::vector<int64_t>{0, 0},
                 false, true, c10::IValue()},
                {tensor(std::move(shape), {p})}, {result(std::move(out))}, m4)
        .decide();
  };
  EXPECT_EQ(pool({8, 3, 4, 4}, S(0), {8, 3, 2, 2}).outputs[0], Placements{S(0)});  // batch stays split
  EXPECT_EQ(pool({2, 8, 4, 4}, S(1), {2, 8, 2, 2}).outputs[0], Placements{S(1)});  // so do channels
  EXPECT_EQ(pool({5, 3, 4, 4}, S(0), {5, 3, 2, 2}).inputs[0], Placements{R});      // 5 rows: one rank empty
  EXPECT_EQ(pool({8, 3, 4, 4}, S(2), {8, 3, 2, 2}).inputs[0].at(0).is_shard(2), false);  // spatial: whole
  // convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
  //                      output_padding, groups, output_mask)
  Call conv_bwd("aten::convolution_backward", "",
                {c10::IValue(), c10::IValue(), c10::IValue(), std::vector<int64_t>{6}, std::vector<int64_t>{1, 1},
                 std::vector<int64_t>{0, 0}, std::vector<int64_t>{1, 1}, false, std::vector<int64_t>{0, 0}, 1,
                 std::vector<bool>{true, true, true}},
                {tensor({8, 6, 2, 2}, {S(0)}), tensor({8, 3, 4, 4}, {S(0)}), tensor({6, 3, 3, 3}, {R})},
                {result({8, 3, 4, 4}), result({6, 3, 3, 3}), result({6})}, m4);
  const auto c = conv_bwd.decide();
  EXPECT_EQ(c.outputs[0], Placements{S(0)});
  EXPECT_EQ(c.outputs[1], Placements{P});  // each rank's samples give part of the weight gradient
  EXPECT_EQ(c.outputs[2], Placements{P});
}

TEST_F(RuleFamilies, ElementwiseLossesSplitAlikeAndReducePartially) {
  // mse_loss(self, target, reduction): 0 none, 1 mean, 2 sum
  auto mse = [&](int64_t reduction, std::vector<int64_t> out) {
    return Call("aten::mse_loss", "", {c10::IValue(), c10::IValue(), reduction},
                {tensor({8, 6}, {S(1)}), tensor({8, 6}, {S(1)})}, {result(std::move(out))}, m4)
        .decide();
  };
  EXPECT_EQ(mse(0, {8, 6}).outputs[0], Placements{S(1)});
  const auto mean = mse(1, {});
  EXPECT_EQ(mean.outputs[0], Placements{P});
  EXPECT_NE(mean.local_fn, nullptr);  // a local sum over the global count
  EXPECT_EQ(mse(2, {}).local_fn, nullptr);
  // mse_loss_backward(grad_output, self, target, reduction): the scalar gradient stays replicated
  Call bwd("aten::mse_loss_backward", "", {c10::IValue(), c10::IValue(), c10::IValue(), int64_t{1}},
           {tensor({}, {R}), tensor({8, 6}, {S(0)}), tensor({8, 6}, {S(0)})}, {result({8, 6})}, m4);
  const auto b = bwd.decide();
  EXPECT_EQ(b.inputs[0], Placements{R});
  EXPECT_EQ(b.outputs[0], Placements{S(0)});
  EXPECT_NE(b.local_fn, nullptr);
}

TEST_F(RuleFamilies, FftKeepsTransformedDimsWhole) {
  // _fft_r2c(self, dim, normalization, onesided)
  auto r2c = [&](std::vector<int64_t> dims, std::vector<int64_t> shape, std::vector<int64_t> out) {
    return Call("aten::_fft_r2c", "", {c10::IValue(), std::move(dims), int64_t{0}, true},
                {tensor(std::move(shape), {S(0)})}, {result(std::move(out), at::kComplexFloat)}, m4)
        .decide();
  };
  EXPECT_EQ(r2c({1}, {8, 6}, {8, 4}).outputs[0], Placements{S(0)});  // a batch of row transforms
  EXPECT_EQ(r2c({0}, {8, 6}, {5, 6}).inputs[0], Placements{R});      // the transformed dim is gathered
  EXPECT_EQ(r2c({1}, {6, 6}, {6, 4}).inputs[0], Placements{R});      // 6 rows over 4 ranks: one would be empty
}

TEST_F(RuleFamilies, VocabularyParallelEmbeddingAndLoss) {
  Call emb("aten::embedding", "", {c10::IValue(), c10::IValue(), -1, false, false},
           {tensor({64, 8}, {S(0)}), tensor({2, 5}, {R}, at::kLong)}, {result({2, 5, 8})}, m4);
  const auto e = emb.decide();
  EXPECT_EQ(e.outputs[0], Placements{P});
  EXPECT_NE(e.local_fn, nullptr);
  Call nll("aten::nll_loss_forward", "", {c10::IValue(), c10::IValue(), c10::IValue(), 1, -100},
           {tensor({6, 64}, {S(1)}), tensor({6}, {R}, at::kLong), TensorArg{}}, {result({}), result({})}, m4);
  const auto n = nll.decide();
  EXPECT_EQ(n.inputs[0], Placements{S(1)});
  EXPECT_EQ(n.outputs[0], Placements{P});
  EXPECT_NE(n.local_fn, nullptr);
}

TEST_F(RuleFamilies, AttentionSplitsBatchOrHeads) {
  const std::vector<int64_t> qkv = {2, 4, 6, 8};
  Call sdpa("aten::_scaled_dot_product_flash_attention_for_cpu", "",
            {c10::IValue(), c10::IValue(), c10::IValue(), 0.0, true, c10::IValue(), c10::IValue()},
            {tensor(qkv, {S(1)}), tensor(qkv, {S(1)}), tensor(qkv, {S(1)}), TensorArg{}},
            {result(qkv), result({2, 4, 6})}, m4);
  const auto c = sdpa.decide();
  EXPECT_EQ(c.outputs[0], Placements{S(1)});
  EXPECT_EQ(c.outputs[1], Placements{S(1)});
}

TEST_F(RuleFamilies, GroupedQueryAttentionSplitsHeadsOnlyWhereKeyValueHeadsDivide) {
  // 8 query heads reading 2 key/value heads: 4 ranks cannot split the 2 evenly, so the
  // query's head split is gathered and the batch splits instead; 2 ranks can.
  auto gqa = [](const MeshPtr& mesh) {
    Call sdpa("aten::_scaled_dot_product_flash_attention_for_cpu", "",
              {c10::IValue(), c10::IValue(), c10::IValue(), 0.0, true, c10::IValue(), c10::IValue()},
              {tensor({4, 8, 6, 8}, {S(1)}), tensor({4, 2, 6, 8}, {R}), tensor({4, 2, 6, 8}, {R}), TensorArg{}},
              {result({4, 8, 6, 8}), result({4, 8, 6})}, mesh);
    return sdpa.decide();
  };
  const auto four = gqa(make_test_mesh({4}, {1}));
  EXPECT_EQ(four.inputs[1], Placements{S(0)});
  EXPECT_EQ(four.outputs[0], Placements{S(0)});
  const auto two = gqa(make_test_mesh({2}, {1}));
  EXPECT_EQ(two.inputs[1], Placements{S(1)});
  EXPECT_EQ(two.outputs[0], Placements{S(1)});
}

TEST_F(RuleFamilies, RandomOpsKeepLayoutsAndDrawWhole) {
  Call fill("aten::normal_", "", {c10::IValue(), 0.0, 1.0, c10::IValue()}, {tensor({8}, {S(0)})}, {result({8})}, m4);
  const auto c = fill.decide();
  EXPECT_EQ(c.inputs[0], Placements{S(0)});
  EXPECT_NE(c.local_fn, nullptr);
  Call dropout("aten::native_dropout", "", {c10::IValue(), 0.5, true}, {tensor({8}, {P})},
               {result({8}), result({8}, at::kBool)}, m4);
  const auto d = dropout.decide();
  EXPECT_EQ(d.outputs[0], Placements{P});  // dropout is linear in its input
  EXPECT_EQ(d.outputs[1], Placements{R});
}

TEST_F(RuleFamilies, IndexingKeepsTheIndexedDimWhole) {
  Call gather("aten::gather", "", {c10::IValue(), 1, c10::IValue(), false},
              {tensor({4, 6}, {S(0)}), tensor({4, 3}, {S(0)}, at::kLong)}, {result({4, 3})}, m4);
  EXPECT_EQ(gather.decide().outputs[0], Placements{S(0)});
  Call topk("aten::topk", "", {c10::IValue(), 2, 1, true, true}, {tensor({4, 6}, {S(1)})},
            {result({4, 2}), result({4, 2}, at::kLong)}, m4);
  EXPECT_NE(topk.decide().inputs[0], Placements{S(1)});
}

// An index list of n entries (the rules read only its length; the tensors are inputs).
c10::IValue index_list(size_t n) {
  c10::List<std::optional<at::Tensor>> list;
  for (size_t i = 0; i < n; ++i) list.push_back(std::nullopt);
  return list;
}

TEST_F(RuleFamilies, CatSkipsLegacyEmptyInputs) {
  // torch.cat([torch.tensor([]), k], dim=-2) as Hugging Face's KV cache does: the dim
  // wraps by k's rank, the empty input keeps its placement and moves nothing.
  Call cat("aten::cat", "", {c10::IValue(), -2},
           {tensor({0}, {R}), tensor({2, 4, 16, 8}, {S(1)}), tensor({0}, {S(0)})}, {result({2, 4, 16, 8})}, m4);
  const auto c = cat.decide();
  EXPECT_EQ(c.inputs[0], Placements{R});
  EXPECT_EQ(c.inputs[1], Placements{S(1)});
  EXPECT_EQ(c.inputs[2], Placements{S(0)});
  EXPECT_EQ(c.outputs[0], Placements{S(1)});
  // split along the cat dim (2 once wrapped by k's rank): that dim is made whole
  Call along("aten::cat", "", {c10::IValue(), -2}, {tensor({0}, {R}), tensor({2, 4, 16, 8}, {S(2)})},
             {result({2, 4, 16, 8})}, m4);
  EXPECT_NE(along.decide().inputs[1], Placements{S(2)});
  Call none_left("aten::cat", "", {c10::IValue(), -2}, {tensor({0}, {S(0)}), tensor({0}, {P})}, {result({0})}, m4);
  const auto e = none_left.decide();
  EXPECT_EQ(e.inputs[0], Placements{S(0)});
  EXPECT_EQ(e.inputs[1], Placements{P});
  EXPECT_EQ(e.outputs[0], Placements{R});
}

TEST_F(RuleFamilies, IndexPutTakesBroadcastValues) {
  // x[x > 0] = 0.0: a bool mask and 0-d values; x and the mask split alike, no gather.
  Call mask("aten::index_put_", "", {c10::IValue(), index_list(1), c10::IValue(), false},
            {tensor({4, 6}, {S(1)}), tensor({4, 6}, {S(1)}, at::kBool), tensor({}, {R})}, {result({4, 6})}, m4);
  auto c = mask.decide();
  EXPECT_EQ(c.inputs[0], Placements{S(1)});
  EXPECT_EQ(c.inputs[1], Placements{S(1)});
  EXPECT_EQ(c.inputs[2], Placements{R});
  EXPECT_EQ(c.outputs[0], Placements{S(1)});
  // x[[0, 2]] = row (values of fewer dims), x split on the untouched dim: the row splits too
  Call row("aten::index_put_", "", {c10::IValue(), index_list(1), c10::IValue(), false},
           {tensor({4, 6}, {S(1)}), tensor({2}, {R}, at::kLong), tensor({6}, {R})}, {result({4, 6})}, m4);
  c = row.decide();
  EXPECT_EQ(c.inputs[0], Placements{S(1)});
  EXPECT_EQ(c.inputs[2], Placements{S(0)});
  // ... and a unit dim of the values broadcasts: they stay whole there
  Call unit("aten::index_put", "", {c10::IValue(), index_list(2), c10::IValue(), true},
            {tensor({3, 4, 6}, {S(2)}), TensorArg{}, tensor({2}, {R}, at::kLong), tensor({1, 1}, {R})},
            {result({3, 4, 6})}, m4);
  c = unit.decide();
  EXPECT_EQ(c.inputs[0], Placements{S(2)});
  EXPECT_EQ(c.inputs[3], Placements{R});
  EXPECT_EQ(c.outputs[0], Placements{S(2)});
  // values with a row per selected element can't follow a split mask: gathered
  Call rows("aten::index_put_", "", {c10::IValue(), index_list(1), c10::IValue(), false},
            {tensor({4, 6}, {S(0)}), tensor({4}, {S(0)}, at::kBool), tensor({3, 6}, {R})}, {result({4, 6})}, m4);
  c = rows.decide();
  EXPECT_NE(c.inputs[1], Placements{S(0)});
  EXPECT_NE(c.inputs[0], Placements{S(0)});
}

TEST_F(RuleFamilies, CostsPreferLocalWorkOverCommunication) {
  // Cutting a replicated operand locally is cheaper than any collective.
  const auto local = collectives::plan_redistribution(*m4, {R}, {S(0)}, {1024, 1024}, at::kFloat).cost;
  const auto gather = collectives::plan_redistribution(*m4, {S(0)}, {R}, {1024, 1024}, at::kFloat).cost;
  EXPECT_LT(local, gather);
}

}  // namespace
}  // namespace vescale
