#pragma once
// Views that had to be taken from a copy, kept in step with their base.
//
// A view op whose input needs another layout cannot alias that input when the input
// cannot change layout in place (the user laid it out, or another tensor shares its
// shard). The view is then a view of a copy: the base laid out as the view needs.
// Torch's aliasing still holds, by exact data movement:
//   - a write into such a view (or into a view of it) is pushed back into the base,
//     by redistributing the whole copy to the base's layout;
//   - a write into the base, or into anything sharing the base's shard, refreshes the
//     live copies taken from it.
// Copies are found by the storage of the base's shard. Which copies are alive is a
// per-rank fact (Python frees cycles whenever its collector runs), so the ranks agree
// before refreshing (one small all-reduce per live copy, on this rare path only).

#include "dispatch/dtensor_impl.h"

namespace vescale {

// Records `view` as a view of `copy_local` (laid out as `copy_spec`), a copy of `base`.
void record_view_of_copy(const at::Tensor& view, const at::Tensor& base, at::Tensor copy_local, SpecPtr copy_spec);

// The record of the copy whose storage `local` shares (from_local of a view-copy's
// to_local): nullopt when there is none (the same answer on every rank), else the record
// for the new DTensor to take, so that writes into it reach the copy's base as writes
// into the view do, or null where it is gone on this rank or belongs to another mesh.
std::optional<std::shared_ptr<const DTensorImpl::CopyOf>> copy_record_of(const at::Tensor& local, const Mesh& mesh);

// After an op wrote into `written`'s shard: refresh the copies taken from what it
// aliases (except the one whose shard is `skip`), and push a copy back into its base.
// Costs one relaxed load when no copy is registered anywhere.
void after_write(const at::Tensor& written, const void* skip = nullptr);

// A shard replaced by relayout keeps the copies taken from the old one.
void moved_shard(const at::Tensor& old_local, const at::Tensor& new_local);

}  // namespace vescale
