// Spatial ops of vision-style models: each sample of the batch, and for pooling,
// upsampling and padding each channel too, is computed on its own, so those leading
// dims may be split (every tensor of the call alike); the spatial dims stay whole.
//
//   op family                                        split dims        weights
//   max/avg/adaptive pooling (+_backward)            batch, channel    -
//   upsample_* / reflection/replication pad (+bwd)   batch, channel    -
//   grid_sampler_2d/3d (+_backward), pixel_(un)shuffle  batch        -
//   convolution / convolution_backward               batch             replicated; grads Partial
//
// Unbatched inputs (no batch dim) split only their channel dim. A dim is split only
// when every rank gets a non-empty part (its size divides by the number of ranks): the
// CPU kernels reject empty channel or spatial dims, and a rank that raises while the
// others go on leaves them waiting.

#include "sharding_rules/rule.h"

#include <ATen/ATen.h>

namespace vescale {

namespace {

const Placement R = Placement::replicate();

// Strategies splitting dim d of every defined tensor alike, for each d below
// `ndim - spatial` of the first input where the first input and every result agree in size.
DimStrategies leading_dims(const OpCall& call, int64_t spatial, int64_t max_split_dims) {
  const size_t n_in = call.inputs.size(), n_out = call.outputs.size();
  const auto& first = call.inputs[0];
  DimStrategies s = {{Placements(n_in, R), Placements(n_out, R)}};
  const int64_t leading = std::min(first.ndim() - spatial, max_split_dims);
  for (int64_t d = 0; d < leading; ++d) {
    const auto S = Placement::shard(static_cast<int32_t>(d));
    bool fits = divides_over_all_ranks(call, first.shape[static_cast<size_t>(d)]);
    for (const auto& t : call.inputs)
      fits &= !t.defined || (t.ndim() > d && t.shape[static_cast<size_t>(d)] == first.shape[static_cast<size_t>(d)]);
    for (const auto& t : call.outputs)
      fits &= !t.defined || (t.ndim() > d && t.shape[static_cast<size_t>(d)] == first.shape[static_cast<size_t>(d)]);
    if (fits) s.push_back({Placements(n_in, S), Placements(n_out, S)});
  }
  return s;
}

RuleFn per_channel(int64_t spatial) {
  return [spatial](const OpCall& call) { return choose_cheapest(call, leading_dims(call, spatial, 2)); };
}

RuleFn per_sample(int64_t spatial) {
  return [spatial](const OpCall& call) { return choose_cheapest(call, leading_dims(call, spatial, 1)); };
}

// upsample_*_backward(grad_output, output_size, input_size, ...): input_size is the
// whole [N, C, ...] shape; the local call gets this rank's share.
RuleFn upsample_backward(int64_t spatial) {
  return [spatial](const OpCall& call) {
    auto c = choose_cheapest(call, leading_dims(call, spatial, 2));
    const auto box = local_box(call.outputs[0].shape, c.outputs[0], call.mesh.shape, call.mesh.coordinate);
    c.local_args.emplace_back(2, c10::IValue(std::vector<int64_t>(box.sizes.begin(), box.sizes.end())));
    return c;
  };
}

// convolution(input, weight, bias?, ...) -> out: a batch split needs no communication.
ShardingChoice convolution_rule(const OpCall& call) {
  const auto S0 = Placement::shard(0);
  DimStrategies s;
  if (divides_over_all_ranks(call, call.inputs[0].shape[0])) s.push_back({{S0, R, R}, {S0}});
  return choose_cheapest(call, s);
}

// convolution_backward(grad_output, input, weight, ...) -> (grad_input, grad_weight,
// grad_bias): each rank's samples give it a part of the weight and bias gradients.
ShardingChoice convolution_backward_rule(const OpCall& call) {
  const auto S0 = Placement::shard(0);
  const auto P = Placement::partial();
  DimStrategies s;
  if (divides_over_all_ranks(call, call.inputs[1].shape[0])) s.push_back({{S0, S0, R}, {S0, P, P}});
  return choose_cheapest(call, s);
}

}  // namespace

VESCALE_RULES(spatial) {
  for (const char* op : {"aten::max_pool2d_with_indices", "aten::max_pool2d_with_indices_backward",
                         "aten::avg_pool2d", "aten::avg_pool2d_backward", "aten::_adaptive_avg_pool2d",
                         "aten::_adaptive_avg_pool2d_backward", "aten::adaptive_max_pool2d",
                         "aten::adaptive_max_pool2d_backward", "aten::reflection_pad2d", "aten::reflection_pad2d_backward",
                         "aten::replication_pad2d", "aten::replication_pad2d_backward", "aten::upsample_nearest2d",
                         "aten::upsample_bilinear2d", "aten::upsample_bicubic2d", "aten::_upsample_nearest_exact2d",
                         "aten::_upsample_bilinear2d_aa"})
    rules.add(op, per_channel(2));
  for (const char* op : {"aten::max_pool3d_with_indices", "aten::max_pool3d_with_indices_backward",
                         "aten::avg_pool3d", "aten::avg_pool3d_backward", "aten::_adaptive_avg_pool3d",
                         "aten::_adaptive_avg_pool3d_backward", "aten::adaptive_max_pool3d",
                         "aten::adaptive_max_pool3d_backward", "aten::reflection_pad3d", "aten::reflection_pad3d_backward",
                         "aten::replication_pad3d", "aten::replication_pad3d_backward", "aten::upsample_nearest3d",
                         "aten::upsample_trilinear3d", "aten::_upsample_nearest_exact3d"})
    rules.add(op, per_channel(3));
  for (const char* op : {"aten::reflection_pad1d", "aten::reflection_pad1d_backward", "aten::replication_pad1d",
                         "aten::replication_pad1d_backward", "aten::upsample_nearest1d", "aten::upsample_linear1d",
                         "aten::_upsample_nearest_exact1d"})
    rules.add(op, per_channel(1));
  for (const char* op : {"aten::upsample_nearest1d_backward", "aten::upsample_linear1d_backward",
                         "aten::_upsample_nearest_exact1d_backward"})
    rules.add(op, upsample_backward(1));
  for (const char* op : {"aten::upsample_nearest2d_backward", "aten::upsample_bilinear2d_backward",
                         "aten::upsample_bicubic2d_backward", "aten::_upsample_nearest_exact2d_backward",
                         "aten::_upsample_bilinear2d_aa_backward"})
    rules.add(op, upsample_backward(2));
  for (const char* op : {"aten::upsample_nearest3d_backward", "aten::upsample_trilinear3d_backward",
                         "aten::_upsample_nearest_exact3d_backward"})
    rules.add(op, upsample_backward(3));
  for (const char* op : {"aten::grid_sampler_2d", "aten::grid_sampler_2d_backward"}) rules.add(op, per_sample(2));
  // (*, C, H, W): any leading batch dims; channels mix
  for (const char* op : {"aten::pixel_shuffle", "aten::pixel_unshuffle"}) rules.add(op, per_sample(3));
  for (const char* op : {"aten::grid_sampler_3d", "aten::grid_sampler_3d_backward"}) rules.add(op, per_sample(3));
  rules.add("aten::convolution", convolution_rule);
  rules.add("aten::convolution_backward", convolution_backward_rule);
}

}  // namespace vescale
