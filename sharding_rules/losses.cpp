// Element-wise losses: every element's loss depends on that element of the input and
// target alone, so any dim may be split (input, target and weight alike). With
// reduction "none" the result is split the same way; "sum" gives each rank the sum of
// its part (Partial); "mean" the same sum divided by the global element count.
//
//   op (+_backward)                    self, target, weight   result (none / sum / mean)
//   mse_loss, huber_loss,              split alike on d        Shard(d) / Partial / Partial
//   smooth_l1_loss, soft_margin_loss,
//   binary_cross_entropy
//
// Backward: grad_output is split alike under "none", a replicated scalar otherwise;
// grad_input is split alike. Local "mean" steps run as "sum" over the global count.

#include "sharding_rules/rule.h"

#include <ATen/ATen.h>
#include <ATen/core/Reduction.h>

#include <algorithm>

namespace vescale {

namespace {

const Placement R = Placement::replicate();

int64_t reduction_of(const OpCall& call) { return call.find_arg("reduction")->toInt(); }

int64_t numel_of(const TensorSpec& s) {
  int64_t n = 1;
  for (auto d : s.shape) n *= d;
  return n;
}

// The op with reduction=sum on the local parts, divided by the global element count of
// `self` (input `self_index`): this rank's share of the global mean.
template <size_t self_index>
void mean_as_partial_sum(const c10::OperatorHandle& op, torch::jit::Stack* stack, const LocalContext& ctx) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const auto at_reduction = *schema.argumentIndexWithName("reduction");
  (*stack)[stack->size() - n + at_reduction] = c10::IValue(static_cast<int64_t>(at::Reduction::Sum));
  op.callBoxed(stack);
  stack->back().toTensor().div_(numel_of(*ctx.inputs[self_index]));
}

// Inputs from `first_loss_input` on are self, target and (optional) weight.
ShardingChoice loss_rule(const OpCall& call, size_t first_loss_input, bool backward) {
  const size_t n_in = call.inputs.size();
  const auto& self = call.inputs[first_loss_input];
  const auto reduction = reduction_of(call);
  DimStrategies s = {{Placements(n_in, R), Placements(call.outputs.size(), R)}};
  for (int64_t d = 0; d < self.ndim(); ++d) {
    const auto S = Placement::shard(static_cast<int32_t>(d));
    Placements in(n_in, S);
    bool fits = true;
    for (size_t i = first_loss_input; i < n_in; ++i)
      fits &= !call.inputs[i].defined || call.inputs[i].shape == self.shape;  // no broadcast weight
    if (!fits) continue;
    if (backward && reduction != at::Reduction::None) in[0] = R;  // the scalar gradient of a sum or mean
    const auto out = backward || reduction == at::Reduction::None ? S : Placement::partial();
    s.push_back({in, Placements(call.outputs.size(), out)});
  }
  auto c = choose_cheapest(call, s);
  const bool split = std::any_of(c.inputs[first_loss_input].begin(), c.inputs[first_loss_input].end(),
                                 [](const Placement& p) { return p.is_shard(); });
  if (split && reduction == at::Reduction::Mean)
    c.local_fn = backward ? mean_as_partial_sum<1> : mean_as_partial_sum<0>;
  return c;
}

}  // namespace

VESCALE_RULES(losses) {
  for (const char* op : {"aten::mse_loss", "aten::huber_loss", "aten::smooth_l1_loss", "aten::soft_margin_loss",
                         "aten::binary_cross_entropy"})
    rules.add(op, [](const OpCall& c) { return loss_rule(c, 0, false); });
  for (const char* op : {"aten::mse_loss_backward", "aten::huber_loss_backward", "aten::smooth_l1_loss_backward",
                         "aten::soft_margin_loss_backward", "aten::binary_cross_entropy_backward"})
    rules.add(op, [](const OpCall& c) { return loss_rule(c, 1, true); });
}

}  // namespace vescale
