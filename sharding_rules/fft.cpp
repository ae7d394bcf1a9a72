// FFTs: the transformed dims must be whole on every rank; every other dim is a batch of
// independent transforms and may stay split (the result follows the input), when no rank
// gets an empty part (MKL rejects empty batches).
//
//   _fft_r2c(self, dim, normalization, onesided)
//   _fft_c2c(self, dim, normalization, forward)
//   _fft_c2r(self, dim, normalization, last_dim_size)

#include "sharding_rules/rule.h"

#include <ATen/ATen.h>

namespace vescale {

namespace {

ShardingChoice fft_rule(const OpCall& call) {
  const int64_t n = call.inputs[0].ndim();
  const auto transformed = call.dims_arg("dim", n, false);
  DimStrategies s;
  for (int64_t d = 0; d < n; ++d) {
    if (std::find(transformed.begin(), transformed.end(), d) != transformed.end()) continue;
    if (!divides_over_all_ranks(call, call.inputs[0].shape[static_cast<size_t>(d)])) continue;
    const auto S = Placement::shard(static_cast<int32_t>(d));
    s.push_back({{S}, {S}});
  }
  return choose_cheapest(call, s);
}

}  // namespace

VESCALE_RULES(fft) {
  for (const char* op : {"aten::_fft_r2c", "aten::_fft_c2c", "aten::_fft_c2r"}) rules.add(op, fft_rule);
}

}  // namespace vescale
