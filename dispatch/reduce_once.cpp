#include "dispatch/reduce_once.h"

#include "collectives/collectives.h"

#include "dispatch/storage_map.h"

#include <vector>

namespace vescale {

namespace {

// Shard storage -> the DTensors that keep a reduction of a shard in it.
using Keepers = std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>>;

StorageMap<Keepers>& keepers() {
  static StorageMap<Keepers> map;
  return map;
}

void remember_keeper(DTensorImpl& impl) {
  if (!impl.local().has_storage()) return;
  auto& map = keepers();
  std::lock_guard<std::mutex> lock(map.mutex);
  auto& tensors = map.get(impl.local());
  std::erase_if(tensors, [](const auto& weak) { return weak.expired(); });
  tensors.emplace_back(c10::intrusive_ptr<c10::TensorImpl>::reclaim_copy(&impl));
}

}  // namespace

void forget_reductions(const at::Tensor& written_local) {
  auto& map = keepers();
  if (map.size() == 0 || !written_local.has_storage()) return;
  std::vector<c10::intrusive_ptr<c10::TensorImpl>> alive;
  {
    std::lock_guard<std::mutex> lock(map.mutex);
    Keepers* tensors = map.find(written_local);
    if (tensors == nullptr) return;
    for (auto& weak : *tensors)
      if (auto strong = weak.lock()) alive.push_back(std::move(strong));
    map.erase(written_local);
  }
  for (auto& impl : alive) static_cast<DTensorImpl*>(impl.get())->drop_reduced();
}

at::Tensor laid_out_as(DTensorImpl& impl, const collectives::RedistPlan& plan, const SpecPtr& target) {
  const auto& src = *impl.spec();
  if (C10_LIKELY(!any_partial(src.placements)))
    return collectives::execute_redistribution(plan, *src.mesh, src.shape, src.stride, impl.local());
  // Ranks agree before using a kept reduction: the moves from it and a fresh reduction are
  // different collectives.
  const auto* kept = impl.kept_for_spec() && collectives::all_ranks(*src.mesh, impl.reduced() != nullptr)
                         ? impl.reduced()
                         : nullptr;
  if (kept != nullptr) {
    if (kept->spec == target) return kept->local;
    const auto moves = collectives::plan_redistribution(*kept->spec, target->placements);
    return collectives::execute_redistribution(moves, *src.mesh, src.shape, src.stride, kept->local);
  }
  auto local = collectives::execute_redistribution(plan, *src.mesh, src.shape, src.stride, impl.local());
  if (!any_partial(target->placements)) {
    impl.keep_reduced(local, target);
    remember_keeper(impl);
  }
  return local;
}

}  // namespace vescale
