// Ops that make new tensors from a DTensor's metadata, and ops that read a DTensor
// out as a Python value.
//
//   zeros_like / ones_like / empty_like / full_like   same layout as the input, with
//                                                     Partial read as Replicate (a
//                                                     filled tensor is not a partial sum)
//   new_zeros / new_ones / new_empty / new_full /     like the input when of its shape,
//   new_empty_strided                                 replicated otherwise
//   _local_scalar_dense (item), equal                 read the replicated value
//
// None of them reads the input's values except the last group, so inputs stay where
// they are.

#include "sharding_rules/rule.h"

namespace vescale {

namespace {

Placements current(const TensorArg& a) { return a.placements; }

ShardingChoice like_rule(const OpCall& call) {
  ShardingChoice c;
  c.inputs.push_back(current(call.inputs[0]));
  Placements out = current(call.inputs[0]);
  for (auto& p : out)
    if (p.is_partial()) p = Placement::replicate();
  c.outputs.push_back(out);
  return c;
}

// new_*(self, size, ...): a tensor of self's own shape keeps self's layout (autograd
// makes gradient buffers this way); any other size is replicated.
ShardingChoice new_tensor_rule(const OpCall& call) {
  const auto& self = call.inputs[0];
  const auto& out = call.outputs[0];
  if (out.shape != self.shape) {
    ShardingChoice c = replicate_all(call);
    c.inputs[0] = current(self);
    return c;
  }
  ShardingChoice c = like_rule(call);
  const auto box = local_box(out.shape, c.outputs[0], call.mesh.shape, call.mesh.coordinate);
  const std::vector<int64_t> local_size(box.sizes.begin(), box.sizes.end());
  c.local_args.emplace_back(1, c10::IValue(local_size));
  if (call.schema().name() == "aten::new_empty_strided") {
    const auto strides = strides_like(local_size, out.stride);
    c.local_args.emplace_back(2, c10::IValue(std::vector<int64_t>(strides.begin(), strides.end())));
  }
  return c;
}

// one_hot(self, num_classes): a new trailing class dim, whole.
ShardingChoice one_hot_rule(const OpCall& call) {
  ShardingChoice c;
  c.inputs.push_back(current(call.inputs[0]));
  c.outputs.push_back(current(call.inputs[0]));
  return c;
}

}  // namespace

VESCALE_RULES(tensor_creation) {
  rules.add("aten::one_hot", one_hot_rule);
  for (const char* op : {"aten::zeros_like", "aten::ones_like", "aten::empty_like", "aten::full_like"})
    rules.add(op, like_rule);
  for (const char* op : {"aten::new_zeros", "aten::new_ones", "aten::new_empty", "aten::new_full",
                         "aten::new_empty_strided"})
    rules.add(op, new_tensor_rule);
  for (const char* op : {"aten::_local_scalar_dense", "aten::equal"}) rules.add(op, replicate_all);
}

}  // namespace vescale
