#include "dispatch/reduce_once.h"

#include "collectives/collectives.h"

#include <atomic>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace vescale {

namespace {

// Shard storage -> the DTensors that keep a reduction of a shard in it. The storage is
// held weakly, so a freed storage's reused address does not match.
struct Keepers {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> tensors;
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<const void*, Keepers> by_storage;
  std::atomic<size_t> size{0};
};

Registry& registry() {
  static Registry r;
  return r;
}

void remember_keeper(DTensorImpl& impl) {
  const auto& local = impl.local();
  if (!local.has_storage()) return;
  const void* key = local.storage().unsafeGetStorageImpl();
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto [it, fresh] = r.by_storage.try_emplace(key, Keepers{local.storage().getWeakStorageImpl(), {}});
  if (!fresh && it->second.storage.lock().get() != key) it->second = Keepers{local.storage().getWeakStorageImpl(), {}};
  std::erase_if(it->second.tensors, [](const auto& weak) { return weak.expired(); });
  it->second.tensors.emplace_back(c10::intrusive_ptr<c10::TensorImpl>::reclaim_copy(&impl));
  r.size.store(r.by_storage.size(), std::memory_order_relaxed);
}

}  // namespace

void forget_reductions(const at::Tensor& written_local) {
  auto& r = registry();
  if (r.size.load(std::memory_order_relaxed) == 0 || !written_local.has_storage()) return;
  const void* key = written_local.storage().unsafeGetStorageImpl();
  std::vector<c10::intrusive_ptr<c10::TensorImpl>> keepers;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.by_storage.find(key);
    if (it == r.by_storage.end()) return;
    if (it->second.storage.lock().get() == key)
      for (auto& weak : it->second.tensors)
        if (auto strong = weak.lock()) keepers.push_back(std::move(strong));
    r.by_storage.erase(it);
    r.size.store(r.by_storage.size(), std::memory_order_relaxed);
  }
  for (auto& impl : keepers) static_cast<DTensorImpl*>(impl.get())->drop_reduced();
}

at::Tensor laid_out_as(DTensorImpl& impl, const RedistPlan& plan, const SpecPtr& target, bool keep) {
  const auto& src = *impl.spec();
  if (C10_LIKELY(!any_partial(src.placements)))
    return collectives::execute_redistribution(plan, *src.mesh, src.shape, src.stride, impl.local());
  if (const auto* kept = impl.reduced()) {
    if (kept->spec == target) return kept->local;
    const auto moves = plan_redistribution(*kept->spec, target->placements);
    return collectives::execute_redistribution(moves, *src.mesh, src.shape, src.stride, kept->local);
  }
  auto local = collectives::execute_redistribution(plan, *src.mesh, src.shape, src.stride, impl.local());
  if (keep && !any_partial(target->placements)) {
    impl.keep_reduced(local, target);
    remember_keeper(impl);
  }
  return local;
}

}  // namespace vescale
