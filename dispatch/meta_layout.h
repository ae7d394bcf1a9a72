#pragma once
// The global strides of a result come from the op's meta kernel, run on the global
// metadata. A few meta kernels lay results out unlike the CPU kernels that run the
// shards (torch 2.13): a plain run and a sharded run then disagree about the result's
// memory order, which the user reads (stride(), is_contiguous()) and which random ops
// draw in (a dropout after the op drew another mask than one device does).

#include "sharding_rules/rule.h"

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace vescale {

// Corrects `outputs` (from the meta kernel of op `name` over `metas`, the meta inputs;
// `args` the call's arguments, on a mesh of `device`) to the CPU kernel's layout where
// the two are known to differ.
void match_cpu_layout(const std::string& name, c10::ArrayRef<c10::IValue> args, c10::DeviceType device,
                      const std::vector<at::Tensor>& metas, std::vector<TensorArg>& outputs);

}  // namespace vescale
