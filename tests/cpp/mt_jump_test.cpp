// MT19937 jump-ahead: jumping or streaming n outputs gives the state that n calls of
// at::mt19937 give, from fresh and mid-block states.
#include "sharding_rules/mt_jump.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>

namespace {

void expect_same(const at::mt19937_data_pod& a, const at::mt19937_data_pod& b, uint64_t n, const char* how) {
  EXPECT_EQ(a.left_, b.left_) << how << " n=" << n;
  EXPECT_EQ(a.next_, b.next_) << how << " n=" << n;
  EXPECT_EQ(a.seed_, b.seed_) << how << " n=" << n;
  EXPECT_TRUE(a.state_ == b.state_) << how << " n=" << n;
  at::mt19937 x, y;
  x.set_data(a);
  y.set_data(b);
  for (int i = 0; i < 2000; ++i) ASSERT_EQ(x(), y()) << how << " n=" << n << " output " << i;
}

void check(uint64_t seed, uint64_t pre, uint64_t n) {
  at::mt19937 ref(seed);
  for (uint64_t i = 0; i < pre; ++i) ref();
  const auto start = ref.data();
  for (uint64_t i = 0; i < n; ++i) ref();
  auto jumped = start, streamed = start, advanced = start;
  vescale::mt::jump(jumped, n);
  vescale::mt::stream(streamed, n);
  vescale::mt::advance(advanced, n);
  expect_same(jumped, ref.data(), n, "jump");
  expect_same(streamed, ref.data(), n, "stream");
  expect_same(advanced, ref.data(), n, "advance");
}

TEST(MtJump, EqualsSteppingFromAFreshState) {
  for (uint64_t n : {0ULL, 1ULL, 2ULL, 623ULL, 624ULL, 625ULL, 1247ULL, 1248ULL, 1249ULL, 19937ULL, 1000000ULL})
    check(0, 0, n);
}

TEST(MtJump, EqualsSteppingFromMidBlock) {
  for (uint64_t pre : {1ULL, 300ULL, 623ULL, 624ULL, 625ULL})
    for (uint64_t n : {0ULL, 1ULL, 323ULL, 324ULL, 623ULL, 624ULL, 625ULL, 1000000ULL}) check(42, pre, n);
}

TEST(MtJump, EqualsSteppingForRandomSkips) {
  std::mt19937_64 pick(7);
  for (int t = 0; t < 6; ++t) {
    const uint64_t pre = pick() % 5000, n = pick() % 3000000;
    check(pick() % 100000, pre, n);
  }
}

TEST(MtJump, LongJumpsCompose) {
  // 10^8 outputs: a jump of 10^8 equals two jumps of 5*10^7 and one of 3*10^7 + 7*10^7 streamed
  at::mt19937 e(3);
  auto a = e.data(), b = e.data(), c = e.data();
  vescale::mt::jump(a, 100000000ULL);
  vescale::mt::jump(b, 50000000ULL);
  vescale::mt::jump(b, 50000000ULL);
  vescale::mt::jump(c, 30000000ULL);
  vescale::mt::stream(c, 70000000ULL);
  expect_same(a, b, 100000000ULL, "jump twice");
  expect_same(a, c, 100000000ULL, "jump + stream");
}

}  // namespace
