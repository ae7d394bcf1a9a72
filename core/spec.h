#pragma once
// TensorSpec: everything about a DTensor except its local data.
//
// Specs are interned: equal live specs are one object, so the per-op cache keys on the
// pointer (a cached decision holds the specs of its key, so a key's pointer cannot be
// reused by another spec while the decision lives). Each spec also carries what this rank derives from it (its local block),
// computed once when the spec is first made.

#include "core/mesh.h"
#include "core/placement.h"

#include <c10/core/ScalarType.h>
#include <c10/util/SmallVector.h>

#include <memory>
#include <string>

namespace vescale {

using Shape = c10::SmallVector<int64_t, 6>;

struct TensorSpec {
  MeshPtr mesh;
  Placements placements;  // one per mesh dim, Shard dims non-negative
  Shape shape;            // global
  Shape stride;           // global
  int64_t storage_offset = 0;  // global; nonzero for views (autograd's as_strided reads it)
  c10::ScalarType dtype = c10::ScalarType::Float;

  // Derived for this rank.
  LocalBox local;  // this rank's block of the global tensor
  size_t hash = 0;

  int64_t ndim() const { return static_cast<int64_t>(shape.size()); }
  int64_t numel() const;
  bool is_replicated() const { return all_replicate(placements); }
  std::string str() const;  // "Spec([Shard(0)], shape=[4, 8], float)"
};

using SpecPtr = std::shared_ptr<const TensorSpec>;

// Returns the canonical spec. Validates placements against the shape: Shard dims
// must lie within the tensor's rank (negative dims count from the end).
SpecPtr make_spec(
    MeshPtr mesh,
    PlacementsRef placements,
    c10::ArrayRef<int64_t> shape,
    c10::ArrayRef<int64_t> stride,
    c10::ScalarType dtype,
    int64_t storage_offset = 0);

// The interning table's size: `entries` before dropping those whose spec died, `live`
// after (this call drops them). Specs are held weakly by the table: bounded by what
// tensors and cached decisions hold, within 2 * live + min_sweep entries.
struct SpecTableSize {
  size_t entries = 0;
  size_t live = 0;
  size_t min_sweep = 0;
};
SpecTableSize spec_table_size();

// Same spec with other placements (shape, stride, offset and dtype kept).
SpecPtr with_placements(const SpecPtr& spec, PlacementsRef placements);

// Contiguous strides for a shape.
Shape dense_strides(c10::ArrayRef<int64_t> shape);

// Strides for `shape` that keep the dim order of `like_strides` (outermost first),
// densely packed: how a local shard's layout maps onto the global tensor. Dims of
// stride 0 keep their contiguous place, as in torch's empty_like.
Shape strides_like(c10::ArrayRef<int64_t> shape, c10::ArrayRef<int64_t> like_strides);

// Normalises a Shard dim (negative counts from the end) and checks its range.
// `what` names the caller in the error message.
int32_t normalize_shard_dim(int64_t dim, int64_t ndim, const std::string& what);

}  // namespace vescale
