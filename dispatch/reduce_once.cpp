#include "dispatch/reduce_once.h"

#include "collectives/collectives.h"

#include "dispatch/storage_map.h"

#include <vector>

namespace vescale {

namespace {

// Shard storage -> the reductions kept of the values in it (shared by a tensor's
// aliases, so held apart from any one of them).
using Keepers = std::vector<std::weak_ptr<DTensorImpl::Kept>>;

StorageMap<Keepers>& keepers() {
  static StorageMap<Keepers> map;
  return map;
}

// Registers `kept` under the storage of the shard and under that of the kept tensor: a
// write into either drops the reduction (the kept tensor may have been handed out by
// redistribute()).
void remember_keeper(const std::shared_ptr<DTensorImpl::Kept>& kept, const at::Tensor& shard) {
  auto& map = keepers();
  std::lock_guard<std::mutex> lock(map.mutex);
  const auto& reduced = kept->reduced.local;
  for (const auto* local : {&shard, &reduced}) {
    if (!local->has_storage() || (local == &reduced && reduced.is_alias_of(shard))) continue;
    auto& states = map.get(*local);
    std::erase_if(states, [](const auto& weak) { return weak.expired(); });
    states.emplace_back(kept);
  }
}

}  // namespace

void forget_reductions(const at::Tensor& written_local) {
  auto& map = keepers();
  if (map.size() == 0 || !written_local.has_storage()) return;
  std::vector<std::shared_ptr<DTensorImpl::Kept>> alive;
  {
    std::lock_guard<std::mutex> lock(map.mutex);
    Keepers* states = map.find(written_local);
    if (states == nullptr) return;
    for (auto& weak : *states)
      if (auto strong = weak.lock()) alive.push_back(std::move(strong));
    map.erase(written_local);
  }
  for (auto& kept : alive) kept->drop();
}

at::Tensor laid_out_as(DTensorImpl& impl, const collectives::RedistPlan& plan, const SpecPtr& target,
                       bool written_or_aliased) {
  const auto& src = *impl.spec();
  if (C10_LIKELY(!any_partial(src.placements)))
    return collectives::execute_redistribution(plan, *src.mesh, src.shape, src.stride, impl.local());
  // Ranks agree before using a kept reduction: the moves from it and a fresh reduction are
  // different collectives.
  const auto* kept = impl.kept_for_spec() && collectives::all_ranks(*src.mesh, impl.reduced() != nullptr)
                         ? impl.reduced()
                         : nullptr;
  if (kept != nullptr) {
    // The kept tensor itself may be another tensor's shard (redistribute handed it out):
    // a caller that writes into it, or makes it a shard, gets a copy.
    if (kept->spec == target) return written_or_aliased ? kept->local.clone() : kept->local;
    const auto moves = collectives::plan_redistribution(*kept->spec, target->placements);
    return collectives::execute_redistribution(moves, *src.mesh, src.shape, src.stride, kept->local);
  }
  auto local = collectives::execute_redistribution(plan, *src.mesh, src.shape, src.stride, impl.local());
  if (!any_partial(target->placements)) {
    if (auto kept = impl.keep_reduced(local, target)) remember_keeper(kept, impl.local());
  }
  return local;
}

}  // namespace vescale
