#pragma once
// A Partial value is reduced once.
//
// Reducing the same Partial shards along two routes (an all-reduce for one consumer,
// a reduce-scatter along another dim for the next) sums in different orders, and the
// results differ in their last bits. Single-device code assumes one value: amin's
// backward compares the input with the minimum it produced (`self == result`) and
// divides by the number of matches, which was zero on some elements (NaN gradients).
// So the first reduction of a Partial DTensor is kept with it, and every later
// consumer is served from that reduced form by exact data movement (slicing,
// gathering, all-to-all), never by another sum. Any write into the tensor's shard
// storage drops it, through whichever tensor it came: views made below autograd have
// version counters of their own, so the storage is what is tracked.

#include "collectives/redistribute_plan.h"
#include "dispatch/dtensor_impl.h"

namespace vescale {

// `impl`'s shard laid out as `target`, by `plan` (planned from impl's own spec), or
// from the kept reduction of its Partial value when there is one. A first full
// reduction is kept, and the result may be the kept tensor itself: the handler reads it
// in the local op, redistribute() hands it out (a write into it then drops it from the
// source). `written_or_aliased`: the caller writes into the result or makes it (part of)
// a tensor's shard; a reduction kept by an earlier call, which may be in other hands
// already, is then copied, never handed over.
at::Tensor laid_out_as(DTensorImpl& impl, const collectives::RedistPlan& plan, const SpecPtr& target,
                       bool written_or_aliased);

// After an op wrote into `written_local`: drops the reductions kept for tensors whose
// shard shares its storage. Costs one relaxed load while nothing is kept anywhere.
void forget_reductions(const at::Tensor& written_local);

}  // namespace vescale
