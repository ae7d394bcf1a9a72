#include "dispatch/storage_map.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

namespace vescale {
namespace {

TEST(StorageMap, AnswersForTheStorageAndItsViewsOnly) {
  StorageMap<int> map;
  auto base = at::zeros({4, 4});
  map.get(base) = 7;
  ASSERT_NE(map.find(base[1]), nullptr);  // a view shares the storage
  EXPECT_EQ(*map.find(base.t()), 7);
  EXPECT_EQ(map.find(at::zeros({4, 4})), nullptr);
  map.erase(base);
  EXPECT_EQ(map.find(base), nullptr);
  EXPECT_EQ(map.size(), 0u);
}

TEST(StorageMap, AFreedStorageNeverAnswers) {
  StorageMap<int> map;
  const void* address = nullptr;
  {
    auto gone = at::zeros({16});
    address = gone.storage().unsafeGetStorageImpl();
    map.get(gone) = 1;
  }
  // Whether or not the allocator hands the address out again, the new storage is not the old one.
  for (int i = 0; i < 64; ++i) {
    auto fresh = at::zeros({16});
    if (fresh.storage().unsafeGetStorageImpl() == address) {
      EXPECT_EQ(map.find(fresh), nullptr);
      return;
    }
  }
}

TEST(StorageMap, EntriesOfFreedStoragesAreSwept) {
  StorageMap<int> map;
  std::vector<at::Tensor> alive;
  for (int i = 0; i < 1000; ++i) {
    auto t = at::zeros({i + 1});  // freed at the end of the iteration
    map.get(t) = i;
    if (i % 100 == 0) alive.push_back(t);
  }
  EXPECT_LT(map.size(), 200u);  // swept whenever it doubled, instead of 1000 entries
  for (const auto& t : alive) EXPECT_NE(map.find(t), nullptr);
}

}  // namespace
}  // namespace vescale
