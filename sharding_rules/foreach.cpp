// The foreach ops apply one pointwise op to lists of tensors, element by element; the
// fused optimizer kernels update lists of parameters and their states the same way.
//
//   _foreach_<op>(lists..., [tensor | scalars])   element i is decided as the single op
//        on the i-th elements would be (with that op's linearity); a tensor shared by
//        every element (a scalar tensor) stays replicated
//   _fused_adam_ / _fused_adamw_ / _fused_sgd_ / _fused_adagrad_
//        every list's element i takes parameter i's layout (Partial read as Replicate),
//        except tensors of another shape (step counters); scales replicated

#include "sharding_rules/pointwise.h"

namespace vescale {

namespace {

const Placement R = Placement::replicate();

// The flattened inputs grouped by element: the slots of the list arguments at each
// position, and the slots of single-tensor arguments shared by every element.
struct Elements {
  std::vector<std::vector<size_t>> per_element;
  std::vector<size_t> shared;
};

Elements elements_of(const OpCall& call) {
  Elements e;
  std::vector<size_t> position(call.schema().arguments().size(), 0);
  for (size_t k = 0; k < call.inputs.size(); ++k) {
    const auto arg = call.input_arg[k];
    if (call.schema().arguments()[arg].type()->kind() != c10::TypeKind::ListType) {
      e.shared.push_back(k);
      continue;
    }
    const size_t i = position[arg]++;
    if (e.per_element.size() <= i) e.per_element.resize(i + 1);
    e.per_element[i].push_back(k);
  }
  return e;
}

Placements replicated(const OpCall& call) { return Placements(static_cast<size_t>(call.mesh.ndim()), R); }

ShardingChoice foreach_pointwise(const OpCall& call, const Linearity& lin) {
  const auto e = elements_of(call);
  const bool returns_list = !call.outputs.empty();
  ShardingChoice c;
  c.inputs.assign(call.inputs.size(), replicated(call));
  c.outputs.assign(call.outputs.size(), replicated(call));
  for (size_t i = 0; i < e.per_element.size(); ++i) {
    auto slots = e.per_element[i];
    slots.insert(slots.end(), e.shared.begin(), e.shared.end());
    OpCall one{call.op, call.args, call.mesh, {}, {}, {}};
    for (size_t k : slots) one.inputs.push_back(call.inputs[k]);
    if (returns_list) {
      one.outputs.push_back(call.outputs[i]);
    } else {  // in place: the result is the first list's element
      TensorArg out = call.inputs[slots[0]];
      out.written = false;
      out.placements.clear();
      one.outputs.push_back(out);
    }
    auto strategies = pointwise_strategies(one, lin);
    const size_t first_shared = slots.size() - e.shared.size();
    strategies.erase(std::remove_if(strategies.begin(), strategies.end(),
                                    [&](const DimStrategy& s) {
                                      for (size_t j = first_shared; j < slots.size(); ++j)
                                        if (s.inputs[j] != R) return true;
                                      return false;
                                    }),
                     strategies.end());
    const auto chosen = choose_cheapest(one, strategies, Interleaving::Lift);
    for (size_t j = 0; j < first_shared; ++j) c.inputs[slots[j]] = chosen.inputs[j];
    if (returns_list) c.outputs[i] = chosen.outputs[0];
  }
  return c;
}

RuleFn foreach(Linearity lin) {
  return [lin](const OpCall& call) { return foreach_pointwise(call, lin); };
}

// add / sub: additive with lists or a tensor, not with scalars (every rank would add them).
RuleFn foreach_add_like() {
  return [](const OpCall& call) {
    const auto& overload = call.schema().overload_name();
    const bool additive = overload == "List" || overload == "Tensor";
    return foreach_pointwise(call, Linearity{additive, {}});
  };
}

// mul: linear in either list element; scaling by scalars or a tensor is linear in self.
RuleFn foreach_mul() {
  return [](const OpCall& call) {
    const bool lists = call.schema().overload_name() == "List";
    return foreach_pointwise(call, lists ? Linearity{false, {0, 1}} : Linearity{false, {0}});
  };
}

// The fused optimizer kernels: element i of every list follows parameter i.
ShardingChoice fused_optimizer_rule(const OpCall& call) {
  const auto e = elements_of(call);
  ShardingChoice c;
  c.inputs.assign(call.inputs.size(), replicated(call));
  c.outputs.assign(call.outputs.size(), replicated(call));
  const size_t n = e.per_element.size();
  for (size_t i = 0; i < n; ++i) {
    const auto& param = call.inputs[e.per_element[i][0]];
    Placements p = param.placements;
    for (auto& x : p)
      if (x.is_partial()) x = R;
    for (size_t k : e.per_element[i])
      if (call.inputs[k].defined && call.inputs[k].shape == param.shape) c.inputs[k] = p;
    // The functional forms return each list anew, element by element.
    for (size_t j = i; j < call.outputs.size(); j += n)
      if (call.outputs[j].shape == param.shape) c.outputs[j] = p;
  }
  return c;
}

}  // namespace

VESCALE_RULES(foreach) {
  const Linearity nonlinear{false, {}};
  for (const char* base : {"aten::_foreach_add", "aten::_foreach_sub"}) rules.add_overloads(base, foreach_add_like());
  rules.add_overloads("aten::_foreach_mul", foreach_mul());
  rules.add_overloads("aten::_foreach_div", foreach(Linearity{false, {0}}));
  rules.add_overloads("aten::_foreach_lerp", foreach(Linearity{true, {0, 1}}));
  for (const char* base : {"aten::_foreach_neg", "aten::_foreach_zero", "aten::_foreach_copy", "aten::_foreach_clone"})
    rules.add_overloads(base, foreach(Linearity{true, {}}));
  for (const char* base : {"aten::_foreach_abs", "aten::_foreach_acos", "aten::_foreach_addcdiv", "aten::_foreach_addcmul",
                           "aten::_foreach_asin", "aten::_foreach_atan", "aten::_foreach_ceil", "aten::_foreach_clamp_max",
                           "aten::_foreach_clamp_min", "aten::_foreach_cos", "aten::_foreach_cosh", "aten::_foreach_erf",
                           "aten::_foreach_erfc", "aten::_foreach_exp", "aten::_foreach_expm1", "aten::_foreach_floor",
                           "aten::_foreach_frac", "aten::_foreach_lgamma", "aten::_foreach_log", "aten::_foreach_log10",
                           "aten::_foreach_log1p", "aten::_foreach_log2", "aten::_foreach_maximum",
                           "aten::_foreach_minimum", "aten::_foreach_pow", "aten::_foreach_reciprocal",
                           "aten::_foreach_round", "aten::_foreach_rsqrt", "aten::_foreach_sigmoid",
                           "aten::_foreach_sign", "aten::_foreach_sin", "aten::_foreach_sinh", "aten::_foreach_sqrt",
                           "aten::_foreach_tan", "aten::_foreach_tanh", "aten::_foreach_trunc"})
    rules.add_overloads(base, foreach(nonlinear));
  for (const char* base : {"aten::_fused_adam", "aten::_fused_adamw", "aten::_fused_sgd", "aten::_fused_adagrad"})
    rules.add_overloads(base, fused_optimizer_rule);
}

}  // namespace vescale
