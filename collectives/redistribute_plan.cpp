#include "collectives/redistribute_plan.h"

#include "collectives/cost_model.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace vescale::collectives {

std::string RedistStep::str() const {
  std::ostringstream os;
  switch (kind) {
    case Kind::AllGather: os << "all_gather(dim=" << dim; break;
    case Kind::AllToAll: os << "all_to_all(dim=" << dim << "->" << to_dim; break;
    case Kind::AllReduce: os << "all_reduce(" << reduce_op_name(op); break;
    case Kind::ReduceScatter: os << "reduce_scatter(" << reduce_op_name(op) << ", dim=" << dim; break;
    case Kind::Chunk: os << "chunk(dim=" << dim; break;
    case Kind::ToPartial: os << "to_partial(" << reduce_op_name(op); break;
  }
  if (groups > 1) os << ", groups=" << groups;
  os << ", mesh_dim=" << mesh_dim << ")";
  return os.str();
}

std::string RedistPlan::str() const {
  std::string s;
  for (const auto& step : steps) s += (s.empty() ? "" : "; ") + step.str();
  return s.empty() ? "(nothing)" : s;
}

namespace {

// Every step costs a little even when it moves nothing (a group of one), so that
// among equally priced layouts the one that changes least wins.
constexpr double kStepCost = 1e-9;

class Planner {
 public:
  Planner(const Mesh& mesh, PlacementsRef src, PlacementsRef dst, c10::ArrayRef<int64_t> shape,
          c10::ScalarType dtype)
      : mesh_(mesh),
        cur_(src.begin(), src.end()),
        dst_(dst.begin(), dst.end()),
        shape_(shape),
        link_(link_cost(mesh.device_type)) {
    bytes_ = static_cast<double>(c10::elementSize(dtype));
    for (auto s : shape) bytes_ *= static_cast<double>(s);
  }

  RedistPlan run() {
    const auto n = static_cast<int32_t>(cur_.size());
    for (int32_t i = n - 1; i >= 0; --i) unshard(i);
    if (mixed_partials_change()) {
      // Partials of different ops on several mesh dims reduce innermost first and do
      // not commute: reduce them all in that order, then lay out the targets.
      for (int32_t i = n - 1; i >= 0; --i)
        if (cur_[i].is_partial())
          emit(RedistStep::Kind::AllReduce, i, -1, -1, cur_[i].op, Placement::replicate());
    }
    for (int32_t i = 0; i < n; ++i) reach_target(i);
    return std::move(plan_);
  }

 private:
  // Phase 1: take the shard on mesh dim i away when it changes, or when an outer
  // mesh dim changes how the same tensor dim is sharded.
  void unshard(int32_t i) {
    if (!cur_[i].splits()) return;
    const int32_t d = cur_[i].dim;
    bool must = cur_[i] != dst_[i];
    for (int32_t j = 0; j < i && !must; ++j)
      must = cur_[j] != dst_[j] && (cur_[j].splits(d) || dst_[j].splits(d));
    if (!must) return;
    if (cur_[i].is_shard() && dst_[i].is_shard() && can_all_to_all(i, d, dst_[i].dim)) {
      emit(RedistStep::Kind::AllToAll, i, d, dst_[i].dim, ReduceOp::Sum, dst_[i]);
    } else {
      emit(RedistStep::Kind::AllGather, i, d, -1, ReduceOp::Sum, Placement::replicate(), cur_[i].groups);
    }
  }

  bool mixed_partials_change() const {
    bool changes = false, mixed = false;
    const Placement* first = nullptr;
    for (size_t i = 0; i < cur_.size(); ++i) {
      if (!cur_[i].is_partial()) continue;
      changes |= cur_[i] != dst_[i];
      if (first == nullptr) first = &cur_[i];
      else mixed |= cur_[i].op != first->op;
    }
    return changes && mixed;
  }

  // All-to-all moves one shard between tensor dims when nothing else shards either
  // dim and both divide evenly (so every rank exchanges equal blocks).
  bool can_all_to_all(int32_t i, int32_t from, int32_t to) const {
    for (size_t j = 0; j < cur_.size(); ++j) {
      if (static_cast<int32_t>(j) == i) continue;
      for (const auto& p : {cur_[j], dst_[j]})
        if (p.splits(from) || p.splits(to)) return false;
    }
    const int64_t k = mesh_.shape[static_cast<size_t>(i)];
    return shape_[static_cast<size_t>(from)] % k == 0 && shape_[static_cast<size_t>(to)] % k == 0;
  }

  // Phase 2: every remaining difference starts from Replicate or Partial.
  void reach_target(int32_t i) {
    const Placement from = cur_[i];
    const Placement to = dst_[i];
    if (from == to) return;
    TORCH_INTERNAL_ASSERT(!from.splits(), "planner left a shard in place: ", from.str());
    using K = RedistStep::Kind;
    if (from.is_replicate()) {
      if (to.splits()) emit(K::Chunk, i, to.dim, -1, ReduceOp::Sum, to, to.groups);
      else emit(K::ToPartial, i, -1, -1, to.op, to);
      return;
    }
    if (to.splits()) {
      emit(K::ReduceScatter, i, to.dim, -1, from.op, to, to.groups);
    } else {
      emit(K::AllReduce, i, -1, -1, from.op, Placement::replicate());
      if (to.is_partial()) emit(K::ToPartial, i, -1, -1, to.op, to);
    }
  }

  // Bytes of this rank's block under the current placements (even-split estimate).
  double local_bytes() const {
    double b = bytes_;
    for (size_t j = 0; j < cur_.size(); ++j)
      if (cur_[j].splits()) b /= static_cast<double>(mesh_.shape[j]);
    return b;
  }

  void emit(RedistStep::Kind kind, int32_t i, int32_t dim, int32_t to_dim, ReduceOp op,
            Placement after, int32_t groups = 1) {
    const int64_t k = mesh_.shape[static_cast<size_t>(i)];
    const double before_bytes = local_bytes();
    plan_.steps.push_back(RedistStep{kind, i, dim, to_dim, op, groups, cur_});
    plan_.cost += kStepCost;
    cur_[i] = after;
    const double after_bytes = local_bytes();
    using K = RedistStep::Kind;
    switch (kind) {
      case K::AllGather: plan_.cost += all_gather_cost(link_, after_bytes, k); break;
      case K::AllToAll: plan_.cost += all_to_all_cost(link_, before_bytes, k); break;
      case K::AllReduce: plan_.cost += all_reduce_cost(link_, before_bytes, k); break;
      case K::ReduceScatter: plan_.cost += reduce_scatter_cost(link_, before_bytes, k); break;
      case K::Chunk: plan_.cost += local_copy_cost(link_, after_bytes); break;
      case K::ToPartial: plan_.cost += local_copy_cost(link_, after_bytes); break;
    }
  }

  const Mesh& mesh_;
  Placements cur_;
  Placements dst_;
  c10::ArrayRef<int64_t> shape_;
  const LinkCost& link_;
  double bytes_ = 0;
  RedistPlan plan_;
};

}  // namespace

RedistPlan plan_redistribution(
    const Mesh& mesh,
    PlacementsRef src,
    PlacementsRef dst,
    c10::ArrayRef<int64_t> shape,
    c10::ScalarType dtype) {
  TORCH_CHECK_VALUE(src.size() == dst.size() && static_cast<int64_t>(dst.size()) == mesh.ndim(),
                    "redistribute: need one placement per mesh dim (mesh has ", mesh.ndim(),
                    " dims), got ", to_string(dst));
  for (const auto& p : dst)
    TORCH_CHECK_INDEX(!p.splits() || (p.dim >= 0 && p.dim < static_cast<int64_t>(shape.size())),
                      "redistribute: target ", p.str(), " is out of range for a tensor with ",
                      shape.size(), " dims");
  const auto problem = interleaved_problem(shape, dst, mesh.shape);
  TORCH_CHECK_VALUE(problem.empty(), "redistribute: ", problem);
  Placements from(src.begin(), src.end()), to(dst.begin(), dst.end());
  replicate_groups_of_one(from, mesh.shape);
  replicate_groups_of_one(to, mesh.shape);
  return Planner(mesh, from, to, shape, dtype).run();
}

}  // namespace vescale::collectives
