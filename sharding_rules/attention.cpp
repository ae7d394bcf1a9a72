// Scaled dot-product attention on [batch, heads, seq, head_dim] tensors: batch and
// heads are independent problems, so either may be split, every tensor of the call
// alike (the mask broadcasts). The sequence and head dims stay whole.
//
// _fused_sdp_choice only inspects its inputs to pick a kernel: it runs on the shards
// as they are, without moving anything.

#include "sharding_rules/rule.h"

namespace vescale {

namespace {

// Candidate splits shared by forward and backward: every tensor split on `d`
// (logsumexp is [batch, heads, seq], aligned from the left), except the attention
// mask, the last tensor argument, which broadcasts from the right.
DimStrategies batch_or_heads(const OpCall& call) {
  DimStrategies s;
  const size_t mask = call.inputs.size() - 1;
  for (int32_t d : {-1, 0, 1}) {
    const Placement p = d < 0 ? Placement::replicate() : Placement::shard(d);
    DimStrategy st;
    for (size_t i = 0; i < call.inputs.size(); ++i) {
      const auto& in = call.inputs[i];
      if (!in.defined) st.inputs.push_back(Placement::replicate());
      else st.inputs.push_back(i == mask ? broadcast_input_placement(p, 4, in) : p);
    }
    st.outputs.assign(call.outputs.size(), p);
    s.push_back(std::move(st));
  }
  return s;
}

ShardingChoice sdpa_rule(const OpCall& call) { return choose_cheapest(call, batch_or_heads(call)); }

ShardingChoice as_they_are(const OpCall& call) {
  ShardingChoice c;
  for (const auto& in : call.inputs) c.inputs.push_back(in.placements);
  c.outputs.assign(call.outputs.size(), Placements(static_cast<size_t>(call.mesh.ndim()), Placement::replicate()));
  return c;
}

}  // namespace

VESCALE_RULES(attention) {
  rules.add("aten::_scaled_dot_product_flash_attention_for_cpu", sdpa_rule);
  rules.add("aten::_scaled_dot_product_flash_attention_for_cpu_backward", sdpa_rule);
  rules.add("aten::_fused_sdp_choice", as_they_are);
}

}  // namespace vescale
