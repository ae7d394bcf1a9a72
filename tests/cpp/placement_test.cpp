// Placement algebra: torch.chunk arithmetic, local blocks under nested shards, spec
// interning and validation.

#include "core/spec.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace vescale {
namespace {

TEST(Chunk, MatchesTorchChunk) {
  for (int64_t n : {0, 1, 3, 4, 5, 7, 8, 13}) {
    for (int64_t k : {1, 2, 3, 4}) {
      const auto pieces = at::arange(n).chunk(k);
      int64_t total = 0;
      for (int64_t i = 0; i < k; ++i) {
        const int64_t expect = i < static_cast<int64_t>(pieces.size()) ? pieces[i].numel() : 0;
        EXPECT_EQ(chunk_size(n, k, i), expect) << "n=" << n << " k=" << k << " i=" << i;
        if (expect > 0) EXPECT_EQ(chunk_offset(n, k, i), pieces[i][0].item<int64_t>());
        total += chunk_size(n, k, i);
      }
      EXPECT_EQ(total, n);
    }
  }
}

TEST(LocalBox, NestedShardsSplitTheOuterChunk) {
  // [Shard(0), Shard(0)] on a 2x2 mesh: mesh dim 0 halves the rows, mesh dim 1 halves those.
  const Placements p = {Placement::shard(0), Placement::shard(0)};
  const std::vector<int64_t> mesh = {2, 2};
  const std::vector<std::pair<std::vector<int64_t>, int64_t>> expect = {
      {{0, 0}, 0}, {{0, 1}, 2}, {{1, 0}, 4}, {{1, 1}, 6}};
  for (const auto& [coord, offset] : expect) {
    const auto box = local_box({8, 3}, p, mesh, coord);
    EXPECT_EQ(box.offsets[0], offset);
    EXPECT_EQ(box.sizes[0], 2);
    EXPECT_EQ(box.sizes[1], 3);
  }
}

TEST(LocalBox, UnevenShardsCanBeEmpty) {
  const Placements p = {Placement::shard(1)};
  EXPECT_EQ(local_box({2, 5}, p, {4}, {2}).sizes[1], 1);
  EXPECT_EQ(local_box({2, 5}, p, {4}, {3}).sizes[1], 0);
  EXPECT_EQ(local_box({2, 5}, p, {4}, {3}).offsets[1], 5);
}

TEST(LocalBox, EvenlySharded) {
  EXPECT_TRUE(all_shards_same_size({8}, {Placement::shard(0), Placement::shard(0)}, {2, 2}));
  EXPECT_FALSE(all_shards_same_size({6}, {Placement::shard(0), Placement::shard(0)}, {2, 2}));
  EXPECT_TRUE(all_shards_same_size({5}, {Placement::replicate()}, {4}));
}

TEST(LocalBox, InterleavedHoldsAPieceOfEveryBlock) {
  const auto p = Placement::interleaved(0, 3);
  const auto box = local_box({12, 5}, {p}, {2}, {1});
  EXPECT_EQ(box.sizes[0], 6);  // 3 blocks of 4 rows, 2 rows of each
  EXPECT_EQ(box.offsets[0], -1);  // not one block: no offset
  EXPECT_TRUE(all_shards_same_size({12, 5}, {p}, {2}));
  EXPECT_EQ(p.str(), "InterleavedShard(0, 3)");
  EXPECT_NE(p, Placement::interleaved(0, 2));
  EXPECT_NE(p, Placement::shard(0));
  EXPECT_NE(p.code(), Placement::interleaved(1, 3).code());
}

TEST(LocalBox, InterleavedNeedsEvenUnnestedPieces) {
  const auto p = Placement::interleaved(0, 3);
  EXPECT_EQ(interleaved_problem({12}, {p}, {2}), "");
  EXPECT_NE(interleaved_problem({9}, {p}, {2}).find("3 x 2 equal pieces"), std::string::npos);
  EXPECT_NE(interleaved_problem({24}, {Placement::shard(0), p}, {2, 2}).find("cannot nest"), std::string::npos);
  EXPECT_EQ(interleaved_problem({24, 4}, {Placement::shard(1), p}, {2, 2}), "");
  EXPECT_NE(interleaved_problem({12}, {Placement::interleaved(0, 1)}, {2}).find("groups"), std::string::npos);
}

TEST(Placement, EqualityAndNames) {
  EXPECT_EQ(Placement::shard(1), Placement::shard(1));
  EXPECT_NE(Placement::shard(1), Placement::shard(0));
  EXPECT_NE(Placement::partial(ReduceOp::Sum), Placement::partial(ReduceOp::Max));
  EXPECT_NE(Placement::replicate(), Placement::partial());
  EXPECT_EQ(to_string({Placement::shard(0), Placement::replicate(), Placement::partial(ReduceOp::Avg)}),
            "[Shard(0), Replicate(), Partial(avg)]");
  EXPECT_THROW(parse_reduce_op("mean"), c10::ValueError);
}

TEST(Spec, InternedAndNormalised) {
  auto mesh = make_test_mesh({2, 2}, {1, 0});
  const std::vector<int64_t> shape = {4, 6};
  const auto stride = dense_strides(shape);
  auto a = make_spec(mesh, {Placement::shard(-1), Placement::replicate()}, shape, stride, at::kFloat);
  auto b = make_spec(mesh, {Placement::shard(1), Placement::replicate()}, shape, stride, at::kFloat);
  EXPECT_EQ(a.get(), b.get());
  EXPECT_EQ(a->placements[0].dim, 1);
  EXPECT_EQ(a->local.sizes[1], 3);  // mesh dim 0 shards dim 1: coordinate 1 holds [3, 6)
  EXPECT_EQ(a->local.offsets[1], 3);
  auto c = make_spec(mesh, {Placement::shard(1), Placement::replicate()}, shape, stride, at::kDouble);
  EXPECT_NE(a.get(), c.get());
}

TEST(Spec, RejectsBadPlacements) {
  auto mesh = make_test_mesh({2}, {0});
  const std::vector<int64_t> shape = {4, 6};
  const auto stride = dense_strides(shape);
  EXPECT_THROW(make_spec(mesh, {Placement::shard(2)}, shape, stride, at::kFloat), c10::IndexError);
  EXPECT_THROW(make_spec(mesh, {Placement::shard(-3)}, shape, stride, at::kFloat), c10::IndexError);
  EXPECT_THROW(make_spec(mesh, {Placement::shard(0), Placement::shard(1)}, shape, stride, at::kFloat),
               c10::ValueError);
}

TEST(Spec, StridesLikeKeepsDimOrder) {
  // A transposed [3, 4] tensor has strides (1, 3); a [3, 2] shard of it keeps that order.
  const auto s = strides_like(std::vector<int64_t>{3, 2}, std::vector<int64_t>{1, 3});
  EXPECT_EQ(s[0], 1);
  EXPECT_EQ(s[1], 3);
  EXPECT_EQ(dense_strides(std::vector<int64_t>{2, 3, 4})[0], 12);
  // An expanded dim (stride 0) stays where contiguous order puts it: a [3, 2, 7, 4] shard
  // of k.expand(3, 4, 7, 8) (strides 56, 0, 8, 1) is packed contiguously, last stride 1.
  const auto e = strides_like(std::vector<int64_t>{3, 2, 7, 4}, std::vector<int64_t>{56, 0, 8, 1});
  EXPECT_EQ(e, (Shape{56, 28, 4, 1}));
}

TEST(Mesh, InternedAndValidated) {
  auto a = make_test_mesh({2, 2}, {0, 1});
  auto b = make_test_mesh({2, 2}, {0, 1});
  EXPECT_EQ(a.get(), b.get());
  EXPECT_NE(a.get(), make_test_mesh({4}, {1}).get());
  Mesh bad;
  bad.shape = {2, 2};
  bad.ranks = {0, 1, 2};
  bad.coordinate = {0, 0};
  EXPECT_THROW(intern_mesh(bad), c10::ValueError);
}

}  // namespace
}  // namespace vescale
