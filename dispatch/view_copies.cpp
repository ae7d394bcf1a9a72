#include "dispatch/view_copies.h"

#include "collectives/collectives.h"
#include "collectives/redistribute_plan.h"
#include "dispatch/reduce_once.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace vescale {

namespace {

using Record = DTensorImpl::CopyOf;

// The copies taken from tensors sharing one shard storage. The storage is held weakly:
// an address can be reused by a new storage after the old one is freed, on some ranks
// and not others, so a key only counts while its storage is the one registered. (The
// records hold their base, so a dead storage means every copy under it is dead too, on
// every rank: such an entry can go without asking the others.)
struct Entry {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  std::vector<std::weak_ptr<const Record>> copies;
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<const void*, Entry> entries;
  std::atomic<size_t> size{0};  // entries; read without the lock on every write
};

Registry& registry() {
  static Registry r;
  return r;
}

const void* storage_key(const at::Tensor& local) {
  return local.has_storage() ? local.storage().unsafeGetStorageImpl() : nullptr;
}

// The entry of `local`'s storage, or null; drops an entry left by a freed storage whose
// address was reused. Call with the lock held.
Entry* find_entry(Registry& r, const at::Tensor& local) {
  const void* key = storage_key(local);
  auto it = r.entries.find(key);
  if (it == r.entries.end()) return nullptr;
  auto alive = it->second.storage.lock();
  if (alive && alive.get() == key) return &it->second;
  r.entries.erase(it);
  r.size.fetch_sub(1);
  return nullptr;
}

// `from` laid out as `to_spec` (same global shape), copied into `to_local`.
void copy_laid_out(const at::Tensor& from, const TensorSpec& from_spec, const at::Tensor& to_local,
                   const SpecPtr& to_spec) {
  const auto plan = plan_redistribution(from_spec, to_spec->placements);
  to_local.copy_(collectives::execute_redistribution(plan, *from_spec.mesh, from_spec.shape, from_spec.stride, from));
  if (!to_local.is_inference()) to_local.unsafeGetTensorImpl()->bump_version();
  forget_reductions(to_local);
}

// The base as it is now: its shard (the same tensor object, over the same storage) and
// spec. An in-place view op may restride the base later; the copy keeps following the
// elements it was taken from, as a torch view does.
at::Tensor snapshot(const at::Tensor& base) {
  auto* impl = dtensor_impl(base);
  auto taken = make_dtensor(impl->local(), impl->spec());
  dtensor_impl(taken)->copy_of = impl->copy_of;
  return taken;
}

// Refreshes the live copies taken from tensors sharing `written`'s shard storage, except
// the one whose shard is `skip` (it was just pushed back, so it is current).
void refresh_copies(DTensorImpl& written, const void* skip) {
  auto& r = registry();
  std::vector<std::shared_ptr<const Record>> live;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    Entry* entry = find_entry(r, written.local());
    if (entry == nullptr) return;
    for (auto& weak : entry->copies) live.push_back(weak.lock());  // null where gone on this rank
  }
  // Copies are registered in the same order on every rank, so position k names the
  // same copy everywhere. A copy gone on any rank is unreachable: dropped everywhere.
  std::vector<bool> here(live.size());
  for (size_t k = 0; k < live.size(); ++k) here[k] = live[k] != nullptr;
  const auto everywhere = collectives::all_ranks(*written.spec()->mesh, here);
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (Entry* entry = find_entry(r, written.local())) {
      size_t k = 0;
      std::erase_if(entry->copies, [&](const auto&) { return k < everywhere.size() && !everywhere[k++]; });
      if (entry->copies.empty()) {
        r.entries.erase(storage_key(written.local()));
        r.size.fetch_sub(1);
      }
    }
  }
  // Each copy is refreshed from the tensor it was taken from (the write may have come
  // through another view of the same shard).
  for (size_t k = 0; k < live.size(); ++k) {
    if (!everywhere[k] || storage_key(live[k]->copy_local) == skip) continue;
    const auto* source = dtensor_impl(live[k]->base);
    copy_laid_out(source->local(), *source->spec(), live[k]->copy_local, live[k]->copy_spec);
  }
}

}  // namespace

void record_view_of_copy(const at::Tensor& view, const at::Tensor& base, at::Tensor copy_local, SpecPtr copy_spec) {
  auto record = std::make_shared<const Record>(Record{snapshot(base), copy_local, std::move(copy_spec)});
  dtensor_impl(view)->copy_of = record;
  const auto& local = dtensor_impl(base)->local();
  if (!local.has_storage()) return;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  Entry* entry = find_entry(r, local);
  if (entry == nullptr) {
    entry = &r.entries.try_emplace(storage_key(local), Entry{local.storage().getWeakStorageImpl(), {}}).first->second;
    r.size.fetch_add(1);
  }
  entry->copies.push_back(record);
}

void after_write(const at::Tensor& written, const void* skip) {
  auto* impl = dtensor_impl(written);
  if (registry().size.load(std::memory_order_relaxed) != 0) refresh_copies(*impl, skip);
  if (const auto record = impl->copy_of) {
    // The write went into the copy (the view's shard is part of it): the base takes
    // the whole copy back in its own layout, and what aliases the base follows.
    auto* base = dtensor_impl(record->base);
    copy_laid_out(record->copy_local, *record->copy_spec, base->local(), base->spec());
    after_write(record->base, storage_key(record->copy_local));
  }
}

void moved_shard(const at::Tensor& old_local, const at::Tensor& new_local) {
  auto& r = registry();
  if (r.size.load(std::memory_order_relaxed) == 0 || !new_local.has_storage()) return;
  std::lock_guard<std::mutex> lock(r.mutex);
  Entry* old_entry = find_entry(r, old_local);
  if (old_entry == nullptr) return;
  auto moved = std::move(old_entry->copies);
  r.entries.erase(storage_key(old_local));
  r.size.fetch_sub(1);
  Entry* entry = find_entry(r, new_local);
  if (entry == nullptr) {
    entry = &r.entries.try_emplace(storage_key(new_local), Entry{new_local.storage().getWeakStorageImpl(), {}}).first->second;
    r.size.fetch_add(1);
  }
  entry->copies.insert(entry->copies.end(), moved.begin(), moved.end());
}

}  // namespace vescale
