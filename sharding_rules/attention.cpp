// Scaled dot-product attention on [batch, heads, seq, head_dim] tensors: batch and
// heads are independent problems, so either may be split, every tensor of the call
// alike (the mask broadcasts). The sequence and head dims stay whole.
//

#include "sharding_rules/rule.h"

#include <ATen/ATen.h>

namespace vescale {

namespace {

const std::string& arg_name(const OpCall& call, size_t slot) {
  return call.schema().arguments()[call.input_arg[slot]].name();
}

bool is_mask(const OpCall& call, size_t slot) {
  const auto& name = arg_name(call, slot);
  return name == "attn_mask" || name == "attn_bias";
}

// Candidate splits shared by forward and backward: the [batch, heads, seq, dim]
// tensors and logsumexp ([batch, heads, seq], aligned from the left) split on `d`;
// the mask broadcasts from the right; the rest (random-state scalars, empty sequence
// offsets) stays replicated. Without `heads`, only the batch splits.
DimStrategies batch_or_heads(const OpCall& call, bool heads) {
  const auto& q_shape = call.inputs[0].shape;
  DimStrategies s;
  for (int32_t d : {-1, 0, 1}) {
    if (d == 1 && !heads) break;
    const Placement p = d < 0 ? Placement::replicate() : Placement::shard(d);
    auto follows = [&](const TensorArg& t) { return t.ndim() >= 3 ? p : Placement::replicate(); };
    DimStrategy st;
    for (size_t i = 0; i < call.inputs.size(); ++i) {
      const auto& in = call.inputs[i];
      if (!in.defined) st.inputs.push_back(Placement::replicate());
      else st.inputs.push_back(is_mask(call, i) ? broadcast_input_placement(p, q_shape, in) : follows(in));
    }
    for (const auto& out : call.outputs) st.outputs.push_back(follows(out));
    s.push_back(std::move(st));
  }
  return s;
}

// Grouped-query attention (fewer key/value heads than query heads, the kernels' own
// enable_gqa): query head h reads key/value head h / (Hq / Hkv). Split over the heads,
// each rank keeps the key/value heads its query heads read only when the split cuts the
// key/value heads into equal parts; an uneven one (2 key/value heads over 4 ranks)
// would hand a kernel no key/value head at all. Such a call splits the batch instead.
bool splits_kv_heads_evenly(const OpCall& call, const ShardingChoice& choice) {
  for (size_t i = 0; i < call.inputs.size(); ++i) {
    if (arg_name(call, i) != "key" || call.inputs[i].ndim() < 2) continue;
    int64_t parts = 1;
    for (size_t m = 0; m < choice.inputs[i].size(); ++m)
      if (choice.inputs[i][m].is_shard() && choice.inputs[i][m].dim == 1) parts *= call.mesh.shape[m];
    return call.inputs[i].shape[1] % parts == 0;
  }
  return true;
}

// The kernels read every tensor's last dim as contiguous, which torch's front end
// checked on the global tensors (_fused_sdp_choice below); a shard need not share the
// global layout (a redistributed or uneven one), so any that does not is packed first.
void with_contiguous_last_dim(const c10::OperatorHandle& op, torch::jit::Stack* stack, const LocalContext&) {
  const size_t base = stack->size() - op.schema().arguments().size();
  for (size_t i = base; i < stack->size(); ++i) {
    auto& v = (*stack)[i];
    if (!v.isTensor()) continue;
    const auto& t = v.toTensor();
    if (t.defined() && t.dim() > 0 && t.size(-1) > 1 && t.stride(-1) != 1) v = t.contiguous();
  }
  op.callBoxed(stack);
}

ShardingChoice sdpa_rule(const OpCall& call) {
  ShardingChoice choice = choose_cheapest(call, batch_or_heads(call, /*heads=*/true));
  if (!splits_kv_heads_evenly(call, choice)) choice = choose_cheapest(call, batch_or_heads(call, /*heads=*/false));
  choice.local_fn = with_contiguous_last_dim;
  return choice;
}

// _fused_sdp_choice(query, key, value, attn_mask?, dropout_p, ...) reads only
// metadata. It is asked about the global shapes, so that every rank picks the same
// kernel (a rank holding an empty shard would pick another): each tensor becomes a
// stand-in of its global shape with zero strides but a unit last stride, which is
// what the kernel checks, at the cost of one row of memory.
void choose_for_global_shapes(const c10::OperatorHandle& op, torch::jit::Stack* stack, const LocalContext& ctx) {
  const size_t base = stack->size() - op.schema().arguments().size();
  for (size_t i = 0; i < ctx.inputs.size(); ++i) {
    const auto& spec = ctx.inputs[i];
    if (!spec) continue;
    std::vector<int64_t> strides(spec->shape.size(), 0);
    if (!strides.empty()) strides.back() = 1;
    const int64_t row = spec->shape.empty() ? 1 : std::max<int64_t>(spec->shape.back(), 1);
    const auto options = at::TensorOptions().dtype(spec->dtype).device(ctx.mesh.device_type);
    (*stack)[base + i] = at::empty({row}, options).as_strided(spec->shape, strides);
  }
  op.callBoxed(stack);
}

ShardingChoice sdp_choice_rule(const OpCall& call) {
  ShardingChoice c;
  for (const auto& in : call.inputs) c.inputs.push_back(in.placements);  // nothing moves
  c.local_fn = choose_for_global_shapes;
  return c;
}

}  // namespace

VESCALE_RULES(attention) {
  // The CPU kernel, and the CUDA ones (flash, memory-efficient, cuDNN) with their
  // backward: all take [batch, heads, seq, head_dim] and split alike.
  for (const char* op : {"aten::_scaled_dot_product_flash_attention_for_cpu",
                         "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                         "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_flash_attention_backward",
                         "aten::_scaled_dot_product_efficient_attention",
                         "aten::_scaled_dot_product_efficient_attention_backward",
                         "aten::_scaled_dot_product_cudnn_attention",
                         "aten::_scaled_dot_product_cudnn_attention_backward"})
    rules.add(op, sdpa_rule);
  rules.add("aten::_fused_sdp_choice", sdp_choice_rule);
}

}  // namespace vescale
