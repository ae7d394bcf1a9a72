#include "dispatch/placement.h"

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

LocalBox local_box(
    c10::ArrayRef<int64_t> global_shape,
    PlacementsRef placements,
    c10::ArrayRef<int64_t> mesh_shape,
    c10::ArrayRef<int64_t> coordinate) {
  LocalBox box;
  box.sizes.assign(global_shape.begin(), global_shape.end());
  box.offsets.assign(global_shape.size(), 0);
  for (size_t m = 0; m < placements.size(); ++m) {
    if (!placements[m].is_shard()) continue;
    const auto d = static_cast<size_t>(placements[m].dim);
    const int64_t extent = box.sizes[d];
    box.offsets[d] += chunk_offset(extent, mesh_shape[m], coordinate[m]);
    box.sizes[d] = chunk_size(extent, mesh_shape[m], coordinate[m]);
  }
  return box;
}

bool evenly_sharded(
    c10::ArrayRef<int64_t> global_shape,
    PlacementsRef placements,
    c10::ArrayRef<int64_t> mesh_shape) {
  c10::SmallVector<int64_t, 6> extent(global_shape.begin(), global_shape.end());
  for (size_t m = 0; m < placements.size(); ++m) {
    if (!placements[m].is_shard()) continue;
    auto& e = extent[static_cast<size_t>(placements[m].dim)];
    if (e % mesh_shape[m] != 0) return false;
    e /= mesh_shape[m];
  }
  return true;
}

}  // namespace vescale
