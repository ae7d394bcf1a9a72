// The matmul family's strategies come from einsum equations: they must be exactly the
// hand-written tables they replaced (same strategies, same order: ties go to the
// earlier one), and malformed equations are refused.

#include "sharding_rules/einsum.h"

#include <gtest/gtest.h>

namespace vescale {
namespace {

std::vector<std::string> strings(const DimStrategies& strategies) {
  std::vector<std::string> out;
  for (const auto& s : strategies) out.push_back(to_string(s));
  return out;
}

// The linear-in-each-operand strategies of a two-operand product, sum then avg.
std::vector<std::string> partials() {
  return {"Partial(sum), Replicate() -> Partial(sum)", "Replicate(), Partial(sum) -> Partial(sum)",
          "Partial(avg), Replicate() -> Partial(avg)", "Replicate(), Partial(avg) -> Partial(avg)"};
}

std::vector<std::string> cat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(Einsum, MmIsRowsColumnsContractionThenLinearity) {
  EXPECT_EQ(strings(einsum_strategies("mk,kn->mn")),
            cat({"Shard(0), Replicate() -> Shard(0)", "Replicate(), Shard(1) -> Shard(1)",
                 "Shard(1), Shard(0) -> Partial(sum)"},
                partials()));
}

TEST(Einsum, BmmPutsTheBatchDimLast) {
  EXPECT_EQ(strings(einsum_strategies("bmk,bkn->bmn")),
            cat(cat({"Shard(1), Replicate() -> Shard(1)", "Replicate(), Shard(2) -> Shard(2)",
                     "Shard(2), Shard(1) -> Partial(sum)"},
                    partials()),
                {"Shard(0), Shard(0) -> Shard(0)"}));
}

TEST(Einsum, MvAndDot) {
  EXPECT_EQ(strings(einsum_strategies("mk,k->m")),
            cat({"Shard(0), Replicate() -> Shard(0)", "Shard(1), Shard(0) -> Partial(sum)"}, partials()));
  EXPECT_EQ(strings(einsum_strategies("k,k->")), cat({"Shard(0), Shard(0) -> Partial(sum)"}, partials()));
}

TEST(Einsum, RefusesWhatItCannotShard) {
  EXPECT_THROW(einsum_strategies("mk,kn"), c10::Error);      // no result
  EXPECT_THROW(einsum_strategies("mk,kn->mz"), c10::Error);  // a result letter in no operand
  EXPECT_THROW(einsum_strategies("mkj,kn->mn"), c10::Error); // j summed within one operand
}

}  // namespace
}  // namespace vescale
