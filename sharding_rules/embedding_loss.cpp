// Embedding lookup and the negative log-likelihood loss.
//
//   embedding(weight[V, E], indices)     indices split -> rows split alike
//                                        weight S(1)   -> last dim split
//   embedding_dense_backward             split rows    -> Partial weight grad
//   nll_loss_forward(logits[N, C], tgt)  rows split: sum -> Partial; mean -> Partial
//                                        of (local sum / global weight), with the
//                                        targets replicated so every rank knows the
//                                        global weight without communicating
//   nll_loss_backward                    rows split alike

#include "sharding_rules/rule.h"

#include <ATen/ATen.h>

namespace vescale {

namespace {

const Placement R = Placement::replicate();
const Placement P = Placement::partial();
Placement S(int64_t d) { return Placement::shard(static_cast<int32_t>(d)); }

// embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)
ShardingChoice embedding_rule(const OpCall& call) {
  const int64_t idx_ndim = call.inputs[1].ndim();
  DimStrategies s = {{{R, R}, {R}}, {{S(1), R}, {S(idx_ndim)}}};
  for (int64_t d = 0; d < idx_ndim; ++d) s.push_back({{R, S(d)}, {S(d)}});
  return choose_cheapest(call, s);
}

// embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)
ShardingChoice embedding_backward_rule(const OpCall& call) {
  const int64_t idx_ndim = call.inputs[1].ndim();
  const bool scale_by_freq = call.bool_arg(4);  // frequencies must be counted globally
  DimStrategies s = {{{R, R}, {R}}, {{S(idx_ndim), R}, {S(1)}}, {{P, R}, {P}}};
  if (!scale_by_freq)
    for (int64_t d = 0; d < idx_ndim; ++d) s.push_back({{S(d), S(d)}, {P}});
  return choose_cheapest(call, s);
}

enum Reduction : int64_t { kNone = 0, kMean = 1, kSum = 2 };

// Rows of the logits this rank holds, from the spec it was given.
std::pair<int64_t, int64_t> local_rows(const TensorSpec& logits) {
  return {logits.local.offsets[0], logits.local.sizes[0]};
}

// nll_loss_forward for mean reduction over split rows: this rank's loss sum divided
// by the global total weight, computed from the replicated targets.
void nll_mean_locally(const c10::OperatorHandle& op, torch::jit::Stack* stack, const LocalContext& ctx) {
  auto args = torch::jit::last(*stack, 5);
  const at::Tensor self = args[0].toTensor();
  const at::Tensor target = args[1].toTensor();
  const auto weight = args[2].toOptional<at::Tensor>();
  const int64_t ignore_index = args[4].toInt();
  const auto [offset, rows] = local_rows(*ctx.inputs[0]);
  auto [sum, unused] = at::nll_loss_forward(self, target.narrow(0, offset, rows), weight, kSum, ignore_index);
  const auto valid = target.ne(ignore_index);
  at::Tensor total;
  if (weight && weight->defined()) {
    total = weight->index_select(0, target.masked_fill(valid.logical_not(), 0)).mul(valid).sum();
  } else {
    total = valid.sum();
  }
  total = total.to(self.scalar_type());
  torch::jit::drop(*stack, 5);
  torch::jit::push(*stack, sum.div(total), total);
}

// nll_loss_forward(self, target, weight?, reduction, ignore_index) -> (output, total_weight)
ShardingChoice nll_loss_rule(const OpCall& call) {
  const bool batched = call.inputs[0].ndim() == 2;
  const auto reduction = call.int_arg(3);
  DimStrategies s = {{{R, R, R}, {R, R}}};
  if (batched) {
    if (reduction == kNone) s.push_back({{S(0), S(0), R}, {S(0), P}});
    if (reduction == kSum) s.push_back({{S(0), S(0), R}, {P, P}});
    if (reduction == kMean) s.push_back({{S(0), R, R}, {P, R}});
  }
  auto choice = choose_cheapest(call, s);
  const bool split_rows = std::any_of(choice.inputs[0].begin(), choice.inputs[0].end(),
                                      [](const Placement& p) { return p.is_shard(); });
  if (reduction == kMean && split_rows) choice.local_fn = nll_mean_locally;
  return choice;
}

// nll_loss_backward(grad_output, self, target, weight?, reduction, ignore_index, total_weight)
ShardingChoice nll_loss_backward_rule(const OpCall& call) {
  const bool batched = call.inputs[1].ndim() == 2;
  const auto reduction = call.int_arg(4);
  // total_weight only matters for mean; elsewhere it may stay wherever it is.
  DimStrategies s = {{{R, R, R, R, R}, {R}}};
  if (batched) {
    const Placement grad = reduction == kNone ? S(0) : R;
    s.push_back({{grad, S(0), S(0), R, R}, {S(0)}});
  }
  auto choice = choose_cheapest(call, s);
  if (reduction != kMean) choice.inputs[4] = call.inputs[4].placements;
  return choice;
}

}  // namespace

VESCALE_RULES(embedding_loss) {
  rules.add("aten::embedding", embedding_rule);
  rules.add("aten::embedding_dense_backward", embedding_backward_rule);
  rules.add("aten::nll_loss_forward", nll_loss_rule);
  rules.add("aten::nll_loss_backward", nll_loss_backward_rule);
}

}  // namespace vescale
