// Reductions. Per mesh dim:
//
//   input          result
//   R              R
//   S(kept dim)    S(that dim, renumbered)
//   S(reduced)     Partial(sum)        each rank reduces its own block
//   Partial(op)    Partial(op)         sum and mean are linear
//
// mean over a split dim becomes Partial(sum): every rank computes sum(block) / N with
// N the global count, which stays exact when blocks differ in size or are empty.

#include "sharding_rules/rule.h"

#include <ATen/ATen.h>

namespace vescale {

namespace {

struct ReduceArgs {
  std::vector<int64_t> dims;  // reduced dims, normalised
  bool keepdim = false;
};

// sum/mean(self, dtype) reduce everything; the .dim overloads take (self, dim, keepdim, ...).
ReduceArgs reduce_args(const OpCall& call) {
  const int64_t ndim = call.inputs[0].ndim();
  if (call.schema().arguments().size() <= 2) {
    ReduceArgs r;
    for (int64_t d = 0; d < ndim; ++d) r.dims.push_back(d);
    return r;
  }
  return {call.dims_arg(1, ndim), call.bool_arg(2)};
}

DimStrategies reduction_strategies(const OpCall& call) {
  const auto r = reduce_args(call);
  const int64_t ndim = call.inputs[0].ndim();
  auto reduced = [&](int64_t d) { return std::find(r.dims.begin(), r.dims.end(), d) != r.dims.end(); };
  DimStrategies s = {{{Placement::replicate()}, {Placement::replicate()}}};
  int32_t kept = 0;  // result dim of the next kept input dim
  for (int32_t d = 0; d < ndim; ++d) {
    if (reduced(d)) {
      s.push_back({{Placement::shard(d)}, {Placement::partial(ReduceOp::Sum)}});
      if (r.keepdim) ++kept;
    } else {
      s.push_back({{Placement::shard(d)}, {Placement::shard(kept++)}});
    }
  }
  for (const ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg})
    s.push_back({{Placement::partial(op)}, {Placement::partial(op)}});
  return s;
}

ShardingChoice sum_rule(const OpCall& call) { return choose_cheapest(call, reduction_strategies(call)); }

// mean's local computation: sum of this rank's block over the global count.
void mean_as_partial_sum(const c10::OperatorHandle& op, torch::jit::Stack* stack, const LocalContext& ctx) {
  const auto& in = *ctx.inputs[0];
  const bool has_dims = op.schema().arguments().size() > 2;
  auto args = torch::jit::last(*stack, op.schema().arguments().size());
  const at::Tensor self = args[0].toTensor();
  std::vector<int64_t> dims;
  bool keepdim = false;
  std::optional<at::ScalarType> dtype;
  if (has_dims) {
    if (!args[1].isNone())
      for (const auto& v : args[1].toListRef()) dims.push_back(at::maybe_wrap_dim(v.toInt(), in.ndim()));
    keepdim = args[2].toBool();
    dtype = args[3].toOptional<at::ScalarType>();
  } else {
    dtype = args[1].toOptional<at::ScalarType>();
  }
  if (dims.empty())
    for (int64_t d = 0; d < in.ndim(); ++d) dims.push_back(d);
  int64_t count = 1;
  for (auto d : dims) count *= in.shape[static_cast<size_t>(d)];
  auto result = at::sum(self, dims, keepdim, dtype).div_(count);
  torch::jit::drop(*stack, op.schema().arguments().size());
  torch::jit::push(*stack, std::move(result));
}

ShardingChoice mean_rule(const OpCall& call) {
  auto choice = choose_cheapest(call, reduction_strategies(call));
  choice.local_fn = mean_as_partial_sum;
  return choice;
}

}  // namespace

VESCALE_RULES(reduction) {
  for (const char* op : {"aten::sum", "aten::sum.dim_IntList"}) rules.add(op, sum_rule);
  for (const char* op : {"aten::mean", "aten::mean.dim"}) rules.add(op, mean_rule);
}

}  // namespace vescale
