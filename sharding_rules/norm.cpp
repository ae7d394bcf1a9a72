// Normalisations: the normalised dims must be whole on every rank; any other dim may
// be split, and every tensor of the call follows it. Parameter gradients of a split
// batch come out Partial (each rank summed its own rows). A backward runs split only
// along a dim its forward input was split along: with a replicated input (Megatron
// tensor parallelism without sequence parallelism) a Partial gradient is all-reduced
// once, rather than reduce-scattered here, gathered again by the next layer and
// all-reduced a second time for the weight gradients.
//
//   op                                      split dims            parameter grads
//   native_layer_norm(+_backward)           d < ndim - len(norm)  Partial(sum)
//   native_group_norm(+_backward)           batch (dim 0)         Partial(sum)
//   rms_norm                                composite: decomposes into the ops above autograd
//   _softmax / _log_softmax (+_backward)    d != softmax dim      -
//     (input already split along the softmax dim: composed from max / sum reductions)

#include "sharding_rules/rule.h"

#include <ATen/ATen.h>

namespace vescale {

namespace {

const Placement R = Placement::replicate();

// native_layer_norm(input, normalized_shape, weight?, bias?, eps) -> (out, mean, rstd)
ShardingChoice layer_norm_rule(const OpCall& call) {
  const auto axis = call.inputs[0].ndim() - static_cast<int64_t>(call.int_list_arg("normalized_shape").size());
  DimStrategies s;
  for (int32_t d = 0; d < axis; ++d) {
    const auto S = Placement::shard(d);
    s.push_back({{S, R, R}, {S, S, S}});
  }
  return choose_cheapest(call, s);
}

// native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight?,
//                            bias?, output_mask) -> (grad_input, grad_weight, grad_bias)
ShardingChoice layer_norm_backward_rule(const OpCall& call) {
  const auto axis = call.inputs[1].ndim() - static_cast<int64_t>(call.int_list_arg("normalized_shape").size());
  DimStrategies s;
  const auto P = Placement::partial();
  for (int32_t d = 0; d < axis; ++d) {
    const auto S = Placement::shard(d);
    if (call.inputs[1].sharded_along(d)) s.push_back({{S, S, S, S, R, R}, {S, P, P}});
  }
  return choose_cheapest(call, s);
}

// Softmax over a split dim, composed from reductions whose partial results are
// combined across ranks (max and sum of exponentials: one small all-reduce each) instead
// of gathering the whole tensor: the loss-parallel form of log_softmax over a split
// vocabulary.
at::Tensor float_if(const at::Tensor& x, bool to_float) { return to_float ? x.to(at::kFloat) : x; }

void softmax_composed(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 3);
  const auto x = float_if(args[0].toTensor(), args[2].toBool());
  const int64_t dim = args[1].toInt();
  const bool log = op.schema().name() == "aten::_log_softmax";
  const auto shifted = x - at::amax(x, {dim}, true);
  auto out = log ? shifted - shifted.exp().sum({dim}, true).log() : shifted.exp() / shifted.exp().sum({dim}, true);
  torch::jit::drop(*stack, 3);
  torch::jit::push(*stack, std::move(out));
}

void softmax_backward_composed(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 4);
  const auto grad = args[0].toTensor();
  const auto output = args[1].toTensor();
  const int64_t dim = args[2].toInt();
  const auto dtype = static_cast<at::ScalarType>(args[3].toInt());
  const bool log = op.schema().name() == "aten::_log_softmax_backward_data";
  auto out = log ? grad - output.exp() * grad.sum({dim}, true) : output * (grad - (grad * output).sum({dim}, true));
  torch::jit::drop(*stack, 4);
  torch::jit::push(*stack, out.to(dtype));
}

// _softmax(self, dim, half_to_float), _softmax_backward_data(grad, output, dim, dtype),
// and the log_softmax pair: every tensor split alike, never along `dim`; when the input
// is split along `dim` already, the composed form above.
ShardingChoice softmax_rule(const OpCall& call, bool backward, bool composable = true) {
  const int64_t ndim = call.outputs[0].ndim();
  const int64_t dim = at::maybe_wrap_dim(call.int_arg("dim"), ndim);
  // (Over an empty dim there is nothing to compose: the split strategies below apply.)
  for (const auto& in : call.inputs)
    for (const auto& p : in.placements)
      if (composable && p.is_shard(dim) && call.inputs[0].shape[dim] > 0)
        return ShardingChoice::composition(backward ? softmax_backward_composed : softmax_composed);
  const size_t n = call.inputs.size();
  DimStrategies s;
  for (int32_t d = 0; d < ndim; ++d)
    if (d != dim) s.push_back({Placements(n, Placement::shard(d)), {Placement::shard(d)}});
  return choose_cheapest(call, s);
}

// native_group_norm(input[N, C, *], weight?, bias?, N, C, HxW, group, eps)
//   -> (out, mean[N, G], rstd[N, G]): only the batch may split; the local call gets
// the local batch size.
std::vector<std::pair<size_t, c10::IValue>> local_batch(const OpCall& call, size_t input, const Placements& p,
                                                        size_t n_arg) {
  const auto box = local_box(call.inputs[input].shape, p, call.mesh.shape, call.mesh.coordinate);
  return {{n_arg, c10::IValue(box.sizes[0])}};
}

ShardingChoice group_norm_rule(const OpCall& call) {
  const auto S0 = Placement::shard(0);
  auto c = choose_cheapest(call, {{{S0, R, R}, {S0, S0, S0}}});
  c.local_args = local_batch(call, 0, c.inputs[0], 3);
  return c;
}

// native_group_norm_backward(grad_out, input, mean, rstd, weight?, N, C, HxW, group,
// output_mask) -> (grad_input, grad_weight, grad_bias)
ShardingChoice group_norm_backward_rule(const OpCall& call) {
  const auto S0 = Placement::shard(0);
  const auto P = Placement::partial();
  DimStrategies s;
  if (call.inputs[1].sharded_along(0)) s.push_back({{S0, S0, S0, S0, R}, {S0, P, P}});
  auto c = choose_cheapest(call, s);
  c.local_args = local_batch(call, 1, c.inputs[1], 5);
  return c;
}

}  // namespace

VESCALE_RULES(norm) {
  rules.add("aten::native_group_norm", group_norm_rule);
  rules.add("aten::native_group_norm_backward", group_norm_backward_rule);
  rules.add("aten::native_layer_norm", layer_norm_rule);
  rules.add("aten::native_layer_norm_backward", layer_norm_backward_rule);
  for (const char* op : {"aten::_softmax", "aten::_log_softmax"})
    rules.add(op, [](const OpCall& c) { return softmax_rule(c, false); });
  for (const char* op : {"aten::_softmax_backward_data", "aten::_log_softmax_backward_data"})
    rules.add(op, [](const OpCall& c) { return softmax_rule(c, true); });
  // Attention's softmax, which gives 0 rather than NaN on rows that are wholly masked.
  rules.add("aten::_safe_softmax", [](const OpCall& c) { return softmax_rule(c, false, false); });
}

}  // namespace vescale
