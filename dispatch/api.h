#pragma once
// The DTensor operations behind the Python API, autograd-aware where they move data
// between layouts: from_local, to_local, redistribute, distribute_tensor.

#include "core/spec.h"

#include <ATen/core/Tensor.h>

#include <optional>

namespace vescale {

// Wraps this rank's shard as a DTensor with `spec`. Differentiable: the gradient
// reaching `local` is the DTensor gradient in spec's layout (Partial read as Replicate).
at::Tensor from_local(const at::Tensor& local, SpecPtr spec);

// This rank's shard, sharing storage. Differentiable: the gradient of the local
// tensor becomes a DTensor gradient with `grad_placements` (default: the tensor's).
at::Tensor to_local(const at::Tensor& dtensor, std::optional<Placements> grad_placements);

// The same global tensor in other placements. Differentiable: gradients go back to
// the original placements (Partial read as Replicate). Returns `dtensor` itself when
// nothing changes; otherwise a tensor that shares no storage with it. With `async_op`,
// the last collective is issued and the result returned at once; the first use of its
// shard waits (independent work can run meanwhile).
at::Tensor redistribute(const at::Tensor& dtensor, PlacementsRef placements, bool async_op = false);

// The same, without autograd (for use inside backward functions and internals).
at::Tensor redistribute_no_grad(const at::Tensor& dtensor, PlacementsRef placements, bool async_op = false);

// Makes gradients accumulated into this leaf DTensor arrive in its own placements
// (a hook redistributes each incoming gradient: a replicated gradient of a sharded
// parameter is cut locally, a partial one is reduced), ahead of the user's hooks.
// Idempotent. The dispatcher calls it for every leaf that requires grad whenever the
// leaf meets an op (a look at its first hook), since a first `register_hook` on the
// leaf clears the hook list.
void align_grad_placements(const at::Tensor& leaf);

// Makes that hook leave Partial(sum) gradients Partial over the dims where `param` is
// replicated: whoever sets it reduces them (vescale/parallel/tp_grads.py).
void defer_partial_grads(const at::Tensor& param);

// Declares that the shard already holds the value under `placements` (an all-reduce
// wrote the sum into a Partial shard in place, say): the spec changes, no data moves.
void relabel(const at::Tensor& dtensor, PlacementsRef placements);

// Whether a dim of `shape` takes more than one step in some ranks' shards and not in
// others' (uneven shards: 7 rows over 4 ranks). Such a dim may have any stride on the
// ranks where it has one element or none, so the ranks' readings of a layout, and their
// answers on whether a shard keeps it, can differ there: they must agree.
bool shard_steps_may_differ(c10::IntArrayRef shape, PlacementsRef placements, c10::ArrayRef<int64_t> mesh_shape);

// `strides` as the mesh's `src_rank`-th rank (row-major) passes them, on every rank of
// the mesh (a broadcast): for layouts that must be agreed but that each rank reads off
// tensors of its own.
std::vector<int64_t> strides_of_mesh_rank(c10::IntArrayRef strides, const Mesh& mesh, int64_t src_rank);

// Shards a full tensor present on every rank. With `src_rank` set, the values are
// first broadcast from the mesh's `src_rank`-th rank (row-major), so ranks need not
// agree beforehand.
// The result is a leaf, requiring grad when `full` does.
at::Tensor distribute_tensor(const at::Tensor& full, MeshPtr mesh, PlacementsRef placements,
                             std::optional<int64_t> src_rank);

}  // namespace vescale
