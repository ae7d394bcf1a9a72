#include "core/placement.h"

#include <c10/util/Exception.h>

namespace vescale {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
    case ReduceOp::Min: return "min";
  }
  return "?";
}

ReduceOp parse_reduce_op(const std::string& name) {
  if (name == "sum") return ReduceOp::Sum;
  if (name == "avg") return ReduceOp::Avg;
  if (name == "max") return ReduceOp::Max;
  if (name == "min") return ReduceOp::Min;
  TORCH_CHECK_VALUE(false, "Partial reduce op must be one of 'sum', 'avg', 'max', 'min'; got '",
                    name, "'");
}

std::string Placement::str() const {
  switch (kind) {
    case Kind::Replicate: return "Replicate()";
    case Kind::Shard: return "Shard(" + std::to_string(dim) + ")";
    case Kind::Partial: return std::string("Partial(") + reduce_op_name(op) + ")";
    case Kind::Interleaved: return "InterleavedShard(" + std::to_string(dim) + ", " + std::to_string(groups) + ")";
  }
  return "?";
}

std::string to_string(PlacementsRef placements) {
  std::string s = "[";
  for (size_t i = 0; i < placements.size(); ++i) {
    if (i) s += ", ";
    s += placements[i].str();
  }
  return s + "]";
}

bool any_partial(PlacementsRef placements) {
  for (const auto& p : placements)
    if (p.is_partial()) return true;
  return false;
}

bool all_replicate(PlacementsRef placements) {
  for (const auto& p : placements)
    if (!p.is_replicate()) return false;
  return true;
}

void replicate_groups_of_one(Placements& placements, c10::ArrayRef<int64_t> mesh_shape) {
  for (size_t m = 0; m < placements.size() && m < mesh_shape.size(); ++m)
    if (mesh_shape[m] == 1) placements[m] = Placement::replicate();
}

LocalBox local_box(
    c10::ArrayRef<int64_t> global_shape,
    PlacementsRef placements,
    c10::ArrayRef<int64_t> mesh_shape,
    c10::ArrayRef<int64_t> coordinate) {
  LocalBox box;
  box.sizes.assign(global_shape.begin(), global_shape.end());
  box.offsets.assign(global_shape.size(), 0);
  for (size_t m = 0; m < placements.size(); ++m) {
    if (placements[m].is_interleaved()) {  // even pieces, not one block (see check_interleaved)
      const auto d = static_cast<size_t>(placements[m].dim);
      box.sizes[d] /= mesh_shape[m];
      box.offsets[d] = -1;
      continue;
    }
    if (!placements[m].is_shard()) continue;
    const auto d = static_cast<size_t>(placements[m].dim);
    const int64_t extent = box.sizes[d];
    box.offsets[d] += chunk_offset(extent, mesh_shape[m], coordinate[m]);
    box.sizes[d] = chunk_size(extent, mesh_shape[m], coordinate[m]);
  }
  return box;
}

bool all_shards_same_size(
    c10::ArrayRef<int64_t> global_shape,
    PlacementsRef placements,
    c10::ArrayRef<int64_t> mesh_shape) {
  c10::SmallVector<int64_t, 6> extent(global_shape.begin(), global_shape.end());
  for (size_t m = 0; m < placements.size(); ++m) {
    if (!placements[m].splits()) continue;
    auto& e = extent[static_cast<size_t>(placements[m].dim)];
    if (e % mesh_shape[m] != 0) return false;
    e /= mesh_shape[m];
  }
  return true;
}

std::string interleaved_problem(
    c10::ArrayRef<int64_t> global_shape,
    PlacementsRef placements,
    c10::ArrayRef<int64_t> mesh_shape) {
  for (size_t m = 0; m < placements.size(); ++m) {
    const auto& p = placements[m];
    if (!p.is_interleaved()) continue;
    const std::string name = p.str();
    if (p.groups < 2 || p.groups > 63) return name + ": groups must be in [2, 63] (use Shard(d) for one group)";
    if (p.dim < 0 || p.dim >= static_cast<int64_t>(global_shape.size()))
      return name + " is out of range for a tensor with " + std::to_string(global_shape.size()) + " dims";
    const int64_t n = global_shape[static_cast<size_t>(p.dim)];
    const int64_t parts = p.groups * mesh_shape[m];
    if (n % parts != 0)
      return name + " on a mesh dim of size " + std::to_string(mesh_shape[m]) + " needs dim " +
          std::to_string(p.dim) + " (size " + std::to_string(n) + ") to divide into " + std::to_string(p.groups) +
          " x " + std::to_string(mesh_shape[m]) + " equal pieces";
    for (size_t j = 0; j < placements.size(); ++j)
      if (j != m && placements[j].splits(p.dim))
        return name + " on mesh dim " + std::to_string(m) + " and " + placements[j].str() + " on mesh dim " +
            std::to_string(j) + " split the same tensor dim; an interleaved split cannot nest: split another dim "
            "on the other mesh dim, or replicate it";
  }
  return {};
}

}  // namespace vescale
