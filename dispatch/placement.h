#pragma once
// Placements: how one mesh dimension lays out a tensor.
//
//   Shard(d)     the tensor is split along tensor dim d (torch.chunk semantics, so
//                uneven sizes leave the last shards smaller or empty)
//   Replicate()  every rank holds the whole tensor
//   Partial(op)  every rank holds a partial value; the tensor is the reduction (op)
//                of all of them
//
// A tensor on an N-d mesh has N placements. Several mesh dims may shard the same
// tensor dim: they nest in mesh-dim order (the outer mesh dim chunks first).

#include <c10/util/SmallVector.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <ostream>
#include <string>

namespace vescale {

enum class ReduceOp : uint8_t { Sum, Avg, Max, Min };

const char* reduce_op_name(ReduceOp op);  // "sum", "avg", "max", "min"
ReduceOp parse_reduce_op(const std::string& name);  // throws on unknown names

struct Placement {
  enum class Kind : uint8_t { Replicate, Shard, Partial };

  Kind kind = Kind::Replicate;
  ReduceOp op = ReduceOp::Sum;  // meaningful for Partial only
  int32_t dim = -1;             // meaningful for Shard only

  static constexpr Placement replicate() { return {}; }
  static constexpr Placement shard(int32_t d) { return {Kind::Shard, ReduceOp::Sum, d}; }
  static constexpr Placement partial(ReduceOp op = ReduceOp::Sum) {
    return {Kind::Partial, op, -1};
  }

  bool is_replicate() const { return kind == Kind::Replicate; }
  bool is_shard() const { return kind == Kind::Shard; }
  bool is_shard(int64_t d) const { return kind == Kind::Shard && dim == d; }
  bool is_partial() const { return kind == Kind::Partial; }
  bool is_partial(ReduceOp o) const { return kind == Kind::Partial && op == o; }

  friend bool operator==(const Placement& a, const Placement& b) {
    return a.kind == b.kind && (a.kind != Kind::Shard || a.dim == b.dim) &&
        (a.kind != Kind::Partial || a.op == b.op);
  }
  friend bool operator!=(const Placement& a, const Placement& b) { return !(a == b); }

  // A small integer that identifies the placement; used for hashing.
  uint32_t code() const {
    switch (kind) {
      case Kind::Replicate: return 0;
      case Kind::Partial: return 1 + static_cast<uint32_t>(op);
      case Kind::Shard: return 8 + static_cast<uint32_t>(dim);
    }
    return 0;
  }

  std::string str() const;  // "Shard(0)", "Replicate()", "Partial(sum)"
};

// One placement per mesh dimension.
using Placements = c10::SmallVector<Placement, 4>;
using PlacementsRef = c10::ArrayRef<Placement>;

std::string to_string(PlacementsRef placements);  // "[Shard(0), Replicate()]"

inline std::ostream& operator<<(std::ostream& os, const Placement& p) { return os << p.str(); }

bool any_partial(PlacementsRef placements);
bool all_replicate(PlacementsRef placements);

// ---- torch.chunk arithmetic -------------------------------------------------

// Size of piece `index` when `n` elements are split into `parts` pieces the way
// torch.chunk does it: pieces of ceil(n / parts), the tail ones smaller or empty.
inline int64_t chunk_size(int64_t n, int64_t parts, int64_t index) {
  const int64_t full = (n + parts - 1) / parts;
  const int64_t begin = full * index;
  if (begin >= n) return 0;
  return begin + full <= n ? full : n - begin;
}

inline int64_t chunk_offset(int64_t n, int64_t parts, int64_t index) {
  const int64_t full = (n + parts - 1) / parts;
  const int64_t begin = full * index;
  return begin < n ? begin : n;
}

// The block of the global tensor that one rank holds: per tensor dim, its size and
// its offset in the global tensor.
struct LocalBox {
  c10::SmallVector<int64_t, 6> sizes;
  c10::SmallVector<int64_t, 6> offsets;
};

// Computes the block a mesh coordinate holds for `global_shape` under `placements`.
// `mesh_shape` and `coordinate` have one entry per mesh dim.
LocalBox local_box(
    c10::ArrayRef<int64_t> global_shape,
    PlacementsRef placements,
    c10::ArrayRef<int64_t> mesh_shape,
    c10::ArrayRef<int64_t> coordinate);

// True when every rank along every sharding mesh dim gets the same size, i.e. each
// sharded extent divides evenly at every nesting level.
bool evenly_sharded(
    c10::ArrayRef<int64_t> global_shape,
    PlacementsRef placements,
    c10::ArrayRef<int64_t> mesh_shape);

}  // namespace vescale
