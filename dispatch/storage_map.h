#pragma once
// A map keyed by the storage of a shard: what was derived from the data in a storage
// (a kept reduction, copies taken for views) and must hear when it is written.
//
// The storage is held weakly. A freed storage's address can be reused by a new storage,
// on some ranks and not others, so an entry only answers for the storage it was made
// for. Entries of freed storages are swept whenever the map has doubled since the last
// sweep, so a training loop that keeps making new storages does not grow it forever.
// Callers hold `mutex` around every call except size().

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>

namespace vescale {

template <typename Value>
class StorageMap {
 public:
  std::mutex mutex;

  // Entries, live or not yet swept; read without the lock to skip work when zero.
  size_t size() const { return size_.load(std::memory_order_relaxed); }

  // The value for `local`'s storage, or null.
  Value* find(const at::Tensor& local) {
    auto it = entries_.find(key(local));
    if (it == entries_.end()) return nullptr;
    if (auto alive = it->second.storage.lock(); alive && alive.get() == key(local)) return &it->second.value;
    erase(it);  // left by a freed storage whose address was reused
    return nullptr;
  }

  // The value for `local`'s storage, made empty when there is none.
  Value& get(const at::Tensor& local) {
    if (Value* v = find(local)) return *v;
    if (entries_.size() >= sweep_at_) sweep();
    auto it = entries_.try_emplace(key(local), Entry{local.storage().getWeakStorageImpl(), Value{}}).first;
    size_.store(entries_.size(), std::memory_order_relaxed);
    return it->second.value;
  }

  void erase(const at::Tensor& local) {
    if (auto it = entries_.find(key(local)); it != entries_.end()) erase(it);
  }

 private:
  struct Entry {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    Value value;
  };
  using Iterator = typename std::unordered_map<const void*, Entry>::iterator;

  static const void* key(const at::Tensor& local) { return local.storage().unsafeGetStorageImpl(); }

  void erase(Iterator it) {
    entries_.erase(it);
    size_.store(entries_.size(), std::memory_order_relaxed);
  }

  void sweep() {
    std::erase_if(entries_, [](const auto& kv) { return kv.second.storage.expired(); });
    sweep_at_ = std::max<size_t>(64, 2 * entries_.size());
    size_.store(entries_.size(), std::memory_order_relaxed);
  }

  std::unordered_map<const void*, Entry> entries_;
  std::atomic<size_t> size_{0};
  size_t sweep_at_ = 64;
};

}  // namespace vescale
