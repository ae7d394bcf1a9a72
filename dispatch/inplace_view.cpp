// In-place view ops change which elements a tensor names, not their values: torch
// implements `transpose_`, `squeeze_`, `unsqueeze_`, `t_` and `as_strided_` by restriding
// self. On a DTensor the out-of-place view runs instead, through the dispatcher (its
// rule places the result: transposing Shard(0) gives Shard(1)), and self adopts the
// view's shard and spec, global sizes and strides included. Without this, the replicate
// fallback restrided a temporary and left the DTensor's global shape as it was
// (`matmul` of a 1-d input, which ends in `squeeze_`, came out (1, n) instead of (n,)).
//
//   in-place op          computed as
//   transpose_           transpose.int
//   t_                   t
//   squeeze_(.dim|.dims) squeeze(.dim|.dims)
//   unsqueeze_           unsqueeze
//   as_strided_          as_strided
//   detach_              detach
//   set_.source_Tensor   self adopts the source DTensor
//   resize_, resize_as_  a no-op at the same shape; another shape is refused
//
// (swapdims_ and swapaxes_ decompose into transpose_ above autograd.)

#include "dispatch/dtensor_impl.h"
#include "sharding_rules/rule.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <unordered_map>

namespace vescale {

namespace {

const std::unordered_map<std::string, std::pair<const char*, const char*>>& view_forms() {
  static const std::unordered_map<std::string, std::pair<const char*, const char*>> forms = {
      {"aten::transpose_", {"aten::transpose", "int"}},
      {"aten::t_", {"aten::t", ""}},
      {"aten::squeeze_", {"aten::squeeze", ""}},
      {"aten::squeeze_.dim", {"aten::squeeze", "dim"}},
      {"aten::squeeze_.dims", {"aten::squeeze", "dims"}},
      {"aten::unsqueeze_", {"aten::unsqueeze", ""}},
      {"aten::as_strided_", {"aten::as_strided", ""}},
      {"aten::detach_", {"aten::detach", ""}},
  };
  return forms;
}

std::string full_name(const c10::OperatorHandle& op) {
  const auto& name = op.operator_name();
  return name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
}

// Replaces the op's arguments on the stack with `self`, as a boxed in-place kernel does.
void return_self(const c10::OperatorHandle& op, torch::jit::Stack* stack, at::Tensor self) {
  torch::jit::drop(*stack, op.schema().arguments().size());
  stack->emplace_back(std::move(self));
}

void restride_as_view(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& [name, overload] = view_forms().at(full_name(op));
  static thread_local std::unordered_map<std::string, c10::OperatorHandle> handles;
  auto it = handles.find(name + std::string(".") + overload);
  if (it == handles.end())
    it = handles.emplace(name + std::string(".") + overload,
                         c10::Dispatcher::singleton().findSchemaOrThrow(name, overload)).first;
  const size_t n = op.schema().arguments().size();
  at::Tensor self = (*stack)[stack->size() - n].toTensor();
  torch::jit::Stack view_stack(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());
  it->second.callBoxed(view_stack);
  dtensor_impl(self)->adopt(*checked_dtensor_impl(view_stack[0].toTensor(), name));
  return_self(op, stack, std::move(self));
}

void set_from_source(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  at::Tensor self = (*stack)[stack->size() - 2].toTensor();
  const at::Tensor& source = (*stack)[stack->size() - 1].toTensor();
  TORCH_CHECK(is_dtensor(source), "set_: a DTensor can only take the data of another DTensor; distribute the "
              "source first (vescale.distribute_tensor) or call set_ on plain tensors");
  dtensor_impl(self)->adopt(*dtensor_impl(source));
  return_self(op, stack, std::move(self));
}

// resize_ keeps the storage's leading elements in memory order, which on a shard is
// not a block of the global tensor; only a resize to the current shape (a no-op, as
// `out=` kernels issue) has a meaning here.
void resize_in_place(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  at::Tensor self = (*stack)[stack->size() - n].toTensor();
  const auto& target = (*stack)[stack->size() - n + 1];
  const std::vector<int64_t> size =
      target.isTensor() ? target.toTensor().sizes().vec() : target.toIntVector();
  TORCH_CHECK(c10::IntArrayRef(size) == self.sizes(), full_name(op), ": a DTensor of shape ", self.sizes(),
              " cannot be resized to ", c10::IntArrayRef(size), " in place (its shards would no longer be "
              "blocks of the global tensor); make a new tensor of that shape and distribute it instead");
  return_self(op, stack, std::move(self));
}

ShardingChoice composition_of(DecomposeFn fn) {
  return ShardingChoice::composition(fn);
}

}  // namespace

VESCALE_RULES(inplace_view) {
  for (const auto& [name, form] : view_forms()) rules.add(name, [](const OpCall&) { return composition_of(restride_as_view); });
  rules.add("aten::set_.source_Tensor", [](const OpCall&) { return composition_of(set_from_source); });
  rules.add("aten::resize_", [](const OpCall&) { return composition_of(resize_in_place); });
  rules.add("aten::resize_as_", [](const OpCall&) { return composition_of(resize_in_place); });
}

}  // namespace vescale
