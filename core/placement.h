#pragma once
// Placements: how one mesh dimension lays out a tensor.
//
//   Shard(d)     the tensor is split along tensor dim d (torch.chunk semantics, so
//                uneven sizes leave the last shards smaller or empty)
//   Replicate()  every rank holds the whole tensor
//   Partial(op)  every rank holds a partial value; the tensor is the reduction (op)
//                of all of them
//   InterleavedShard(d, g)
//                tensor dim d is g equal blocks laid end to end (the q, k and v of a
//                fused projection: g = 3), and every block is split evenly: rank r
//                holds piece r of each block, the pieces side by side. It equals
//                Shard(d) on a virtual mesh dim g times larger whose rank j*k + r
//                is real rank r, so ops that treat dim d element by element (and
//                views that keep it outermost) run on it locally. Sizes must divide
//                evenly, and no other mesh dim may split the same tensor dim.
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
  enum class Kind : uint8_t { Replicate, Shard, Partial, Interleaved };

  Kind kind = Kind::Replicate;
  ReduceOp op = ReduceOp::Sum;  // meaningful for Partial only
  int32_t dim = -1;             // meaningful for Shard and Interleaved
  int32_t groups = 1;           // meaningful for Interleaved only

  static constexpr Placement replicate() { return {}; }
  static constexpr Placement shard(int32_t d) { return {Kind::Shard, ReduceOp::Sum, d}; }
  static constexpr Placement partial(ReduceOp op = ReduceOp::Sum) {
    return {Kind::Partial, op, -1};
  }
  static constexpr Placement interleaved(int32_t d, int32_t groups) {
    return {Kind::Interleaved, ReduceOp::Sum, d, groups};
  }

  bool is_replicate() const { return kind == Kind::Replicate; }
  bool is_shard() const { return kind == Kind::Shard; }
  bool is_shard(int64_t d) const { return kind == Kind::Shard && dim == d; }
  bool is_partial() const { return kind == Kind::Partial; }
  bool is_partial(ReduceOp o) const { return kind == Kind::Partial && op == o; }
  bool is_interleaved() const { return kind == Kind::Interleaved; }
  // Shard or Interleaved: some split of tensor dim `dim`.
  bool splits() const { return kind == Kind::Shard || kind == Kind::Interleaved; }
  bool splits(int64_t d) const { return splits() && dim == d; }

  friend bool operator==(const Placement& a, const Placement& b) {
    return a.kind == b.kind && (!a.splits() || a.dim == b.dim) &&
        (a.kind != Kind::Partial || a.op == b.op) && (a.kind != Kind::Interleaved || a.groups == b.groups);
  }
  friend bool operator!=(const Placement& a, const Placement& b) { return !(a == b); }

  // A small integer (< 4096 for dims < 64 and groups < 64) that identifies the
  // placement; used for hashing.
  uint32_t code() const {
    switch (kind) {
      case Kind::Replicate: return 0;
      case Kind::Partial: return 1 + static_cast<uint32_t>(op);
      case Kind::Shard: return 8 + static_cast<uint32_t>(dim);
      case Kind::Interleaved: return 64 * static_cast<uint32_t>(groups) + static_cast<uint32_t>(dim);
    }
    return 0;
  }

  std::string str() const;  // "Shard(0)", "Replicate()", "Partial(sum)", "InterleavedShard(0, 3)"
};

// One placement per mesh dimension.
using Placements = c10::SmallVector<Placement, 4>;
using PlacementsRef = c10::ArrayRef<Placement>;

std::string to_string(PlacementsRef placements);  // "[Shard(0), Replicate()]"

inline std::ostream& operator<<(std::ostream& os, const Placement& p) { return os << p.str(); }

bool any_partial(PlacementsRef placements);
bool all_replicate(PlacementsRef placements);

// A group of one rank holds the whole tensor whatever its placement says (a shard of
// one piece, a sum over one rank): every placement on a mesh dim of size 1 becomes
// Replicate, so that specs, rules and redistributions see one form (no vocabulary-
// parallel loss or masked embedding where the vocabulary is not split at all).
void replicate_groups_of_one(Placements& placements, c10::ArrayRef<int64_t> mesh_shape);

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
// its offset in the global tensor. An InterleavedShard dim holds several pieces: its
// size is their sum and its offset is -1 (code that needs offsets must not see one).
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

// True when `placements` give every rank a block of the same shape: each sharded
// extent divides evenly at every nesting level (empty parts allowed when all are).
bool all_shards_same_size(
    c10::ArrayRef<int64_t> global_shape,
    PlacementsRef placements,
    c10::ArrayRef<int64_t> mesh_shape);

// Why `placements` cannot lay out `global_shape` because of an InterleavedShard
// (groups out of range, uneven pieces, nested with another split of the same dim), or
// an empty string when they can.
std::string interleaved_problem(
    c10::ArrayRef<int64_t> global_shape,
    PlacementsRef placements,
    c10::ArrayRef<int64_t> mesh_shape);

}  // namespace vescale
