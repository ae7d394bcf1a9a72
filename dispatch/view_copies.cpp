#include "dispatch/view_copies.h"

#include "collectives/collectives.h"
#include "collectives/redistribute_plan.h"
#include "dispatch/reduce_once.h"
#include "dispatch/storage_map.h"

#include <algorithm>
#include <vector>

namespace vescale {

namespace {

using Record = DTensorImpl::CopyOf;

// Shard storage -> the copies taken from tensors with a shard in it.
using Copies = std::vector<std::weak_ptr<const Record>>;

StorageMap<Copies>& registry() {
  static StorageMap<Copies> map;
  return map;
}

// A copy's storage -> its record, for tensors that share a copy's data without having
// been made by a view op on it (from_local of a view's to_local).
StorageMap<std::weak_ptr<const Record>>& records_by_copy() {
  static StorageMap<std::weak_ptr<const Record>> map;
  return map;
}

const void* storage_key(const at::Tensor& local) {
  return local.has_storage() ? local.storage().unsafeGetStorageImpl() : nullptr;
}

// `from` laid out as `to_spec` (same global shape), copied into `to_local`.
void copy_laid_out(const at::Tensor& from, const TensorSpec& from_spec, const at::Tensor& to_local,
                   const SpecPtr& to_spec) {
  const auto plan = collectives::plan_redistribution(from_spec, to_spec->placements);
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

// Refreshes the live copies taken from tensors sharing the shard storage of `written`
// (a shard on `mesh`), except the one whose shard is `skip` (it was just pushed back, so
// it is current), and, in turn, the copies taken from each refreshed copy: a view of a
// view of a copy is a copy of a copy, and a write into the first base reaches it too.
void refresh_copies(const at::Tensor& written, const Mesh& mesh, const void* skip) {
  auto& r = registry();
  if (!written.has_storage()) return;
  std::vector<std::shared_ptr<const Record>> live;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    Copies* copies = r.find(written);
    if (copies == nullptr) return;
    for (auto& weak : *copies) live.push_back(weak.lock());  // null where gone on this rank
  }
  // Copies are registered in the same order on every rank, so position k names the
  // same copy everywhere. A copy gone on any rank is unreachable: dropped everywhere.
  std::vector<bool> here(live.size());
  for (size_t k = 0; k < live.size(); ++k) here[k] = live[k] != nullptr;
  const auto everywhere = collectives::all_ranks(mesh, here);
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (Copies* copies = r.find(written)) {
      size_t k = 0;
      std::erase_if(*copies, [&](const auto&) { return k < everywhere.size() && !everywhere[k++]; });
      if (copies->empty()) r.erase(written);
    }
  }
  // Each copy is refreshed from the tensor it was taken from (the write may have come
  // through another view of the same shard).
  for (size_t k = 0; k < live.size(); ++k) {
    if (!everywhere[k] || storage_key(live[k]->copy_local) == skip) continue;
    const auto* source = dtensor_impl(live[k]->base);
    copy_laid_out(source->local(), *source->spec(), live[k]->copy_local, live[k]->copy_spec);
    refresh_copies(live[k]->copy_local, *live[k]->copy_spec->mesh, nullptr);
  }
}

}  // namespace

void record_view_of_copy(const at::Tensor& view, const at::Tensor& base, at::Tensor copy_local, SpecPtr copy_spec) {
  auto record = std::make_shared<const Record>(Record{snapshot(base), copy_local, std::move(copy_spec)});
  dtensor_impl(view)->copy_of = record;
  if (record->copy_local.has_storage()) {
    auto& by_copy = records_by_copy();
    std::lock_guard<std::mutex> lock(by_copy.mutex);
    by_copy.get(record->copy_local) = record;
  }
  const auto& local = dtensor_impl(base)->local();
  if (!local.has_storage()) return;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.get(local).push_back(record);
}

std::optional<std::shared_ptr<const Record>> copy_record_of(const at::Tensor& local, const Mesh& mesh) {
  auto& by_copy = records_by_copy();
  if (by_copy.size() == 0 || !local.has_storage()) return std::nullopt;
  std::shared_ptr<const Record> record;
  {
    std::lock_guard<std::mutex> lock(by_copy.mutex);
    const auto* weak = by_copy.find(local);
    if (weak == nullptr) return std::nullopt;  // the same answer on every rank: the storage is alive
    record = weak->lock();
  }
  // A copy on another mesh is left alone: its ranks are not all here.
  if (record != nullptr && record->copy_spec->mesh.get() != &mesh) record = nullptr;
  return record;
}

void after_write(const at::Tensor& written, const void* skip) {
  auto* impl = dtensor_impl(written);
  const auto& shape = impl->spec()->shape;
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return;  // nothing was written
  if (registry().size() != 0) refresh_copies(impl->local(), *impl->spec()->mesh, skip);
  if (const auto record = impl->copy_of) {
    // The whole copy goes back, and a base with elements that share memory (an expanded
    // tensor) cannot take it: torch refuses such writes too. Decided from the global
    // layout, so every rank raises (a rank whose shard is empty would otherwise go on
    // to the next collective alone).
    const auto& base_spec = *dtensor_impl(record->base)->spec();
    for (size_t d = 0; d < base_spec.shape.size(); ++d)
      TORCH_CHECK(base_spec.stride[d] != 0 || base_spec.shape[d] <= 1,
                  "vescale: this write went into a view that had to be taken from a copy of a tensor whose "
                  "elements share memory (an expanded tensor, shape ", c10::IntArrayRef(base_spec.shape),
                  ", strides ", c10::IntArrayRef(base_spec.stride), "), and the copy cannot be written back into "
                  "it. As torch does for writes into expanded tensors: clone() the expanded tensor first");
    // The write went into the copy (the view's shard is part of it): the base takes
    // the whole copy back in its own layout, and what aliases the base follows.
    auto* base = dtensor_impl(record->base);
    copy_laid_out(record->copy_local, *record->copy_spec, base->local(), base->spec());
    after_write(record->base, storage_key(record->copy_local));
  }
}

void moved_shard(const at::Tensor& old_local, const at::Tensor& new_local) {
  auto& r = registry();
  if (r.size() == 0 || !old_local.has_storage() || !new_local.has_storage()) return;
  std::lock_guard<std::mutex> lock(r.mutex);
  Copies* old_copies = r.find(old_local);
  if (old_copies == nullptr) return;
  Copies moved = std::move(*old_copies);
  r.erase(old_local);
  auto& copies = r.get(new_local);
  copies.insert(copies.end(), moved.begin(), moved.end());
}

}  // namespace vescale
