#include "dispatch/view_copies.h"

#include "collectives/collectives.h"
#include "collectives/redistribute_plan.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace vescale {

namespace {

using Record = DTensorImpl::CopyOf;

// Shard storage -> the copies taken from tensors with that shard storage.
struct Registry {
  std::mutex mutex;
  std::unordered_map<const void*, std::vector<std::weak_ptr<const Record>>> copies;
  std::atomic<size_t> size{0};  // read without the lock on every write
};

Registry& registry() {
  static Registry r;
  return r;
}

const void* storage_key(const at::Tensor& local) {
  return local.has_storage() ? local.storage().unsafeGetStorageImpl() : nullptr;
}

// `from` laid out as `to_spec` (same global shape), copied into `to_local`.
void copy_laid_out(const at::Tensor& from, const TensorSpec& from_spec, const at::Tensor& to_local,
                   const SpecPtr& to_spec) {
  const auto plan = plan_redistribution(from_spec, to_spec->placements);
  to_local.copy_(collectives::execute_redistribution(plan, *from_spec.mesh, from_spec.shape, from_spec.stride, from));
  if (!to_local.is_inference()) to_local.unsafeGetTensorImpl()->bump_version();
}

void check_same_shape(const TensorSpec& base, const TensorSpec& copy) {
  TORCH_CHECK(base.shape == copy.shape, "a view of a DTensor was taken from a copy of it (laid out as ", copy.str(),
              ") and the DTensor has since changed shape in place (now ", base.str(), "); the view can no longer "
              "follow it. Take views after restriding the tensor, or clone() the view.");
}

// Refreshes the live copies taken from tensors sharing `base`'s shard, except the one
// whose shard is `skip` (it was just pushed back, so it is current).
void refresh_copies(DTensorImpl& base, const void* skip) {
  auto& r = registry();
  const void* key = storage_key(base.local());
  std::vector<std::shared_ptr<const Record>> live;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.copies.find(key);
    if (it == r.copies.end()) return;
    for (auto& weak : it->second) live.push_back(weak.lock());  // null where gone on this rank
  }
  // Entries are registered in the same order on every rank, so position k names the
  // same copy everywhere. A copy gone on any rank is unreachable: dropped everywhere.
  std::vector<bool> here(live.size());
  for (size_t k = 0; k < live.size(); ++k) here[k] = live[k] != nullptr;
  const auto everywhere = collectives::all_ranks(*base.spec()->mesh, here);
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto& entries = r.copies[key];
    size_t k = 0;
    std::erase_if(entries, [&](const auto&) { return k < everywhere.size() && !everywhere[k++]; });
    r.size.fetch_sub(static_cast<size_t>(std::count(everywhere.begin(), everywhere.end(), false)));
    if (entries.empty()) r.copies.erase(key);
  }
  const auto& spec = *base.spec();
  for (size_t k = 0; k < live.size(); ++k) {
    if (!everywhere[k] || storage_key(live[k]->copy_local) == skip) continue;
    check_same_shape(spec, *live[k]->copy_spec);
    copy_laid_out(base.local(), spec, live[k]->copy_local, live[k]->copy_spec);
  }
}

}  // namespace

void record_view_of_copy(const at::Tensor& view, const at::Tensor& base, at::Tensor copy_local, SpecPtr copy_spec) {
  auto record = std::make_shared<const Record>(Record{base, copy_local, std::move(copy_spec)});
  dtensor_impl(view)->copy_of = record;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.copies[storage_key(dtensor_impl(base)->local())].push_back(record);
  r.size.fetch_add(1);
}

void after_write(const at::Tensor& written, const void* skip) {
  auto* impl = dtensor_impl(written);
  if (registry().size.load(std::memory_order_relaxed) != 0) refresh_copies(*impl, skip);
  if (const auto record = impl->copy_of) {
    // The write went into the copy (the view's shard is part of it): the base takes
    // the whole copy back in its own layout, and what aliases the base follows.
    auto* base = dtensor_impl(record->base);
    check_same_shape(*base->spec(), *record->copy_spec);
    copy_laid_out(record->copy_local, *record->copy_spec, base->local(), base->spec());
    after_write(record->base, storage_key(record->copy_local));
  }
}

void moved_shard(const at::Tensor& old_local, const at::Tensor& new_local) {
  auto& r = registry();
  if (r.size.load(std::memory_order_relaxed) == 0) return;
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.copies.find(storage_key(old_local));
  if (it == r.copies.end()) return;
  auto moved = std::move(it->second);
  r.copies.erase(it);
  auto& dst = r.copies[storage_key(new_local)];
  dst.insert(dst.end(), moved.begin(), moved.end());
}

}  // namespace vescale
