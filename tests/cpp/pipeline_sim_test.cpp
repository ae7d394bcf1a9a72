// The pipeline timeline simulator against timelines worked out by hand.

#include "autoplan/pipeline_sim.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <map>

namespace vescale::autoplan {
namespace {

using Times = std::map<std::string, std::pair<double, double>>;

Times times_of(const Timeline& t) {
  Times out;
  for (const auto& a : t.actions)
    out[std::string(1, a.action.kind) + std::to_string(a.action.stage) + "." + std::to_string(a.action.mb)] = {a.start, a.end};
  return out;
}

PipelineModel two_ranks(std::vector<std::vector<Action>> orders, int32_t mbs) {
  PipelineModel m;
  m.name = "test";
  m.orders = std::move(orders);
  m.placement = {0, 1};
  m.microbatches = mbs;
  return m;
}

TEST(PipelineSim, OneFOneBOnTwoRanksByHand) {
  // F = 1, B = 2, free links; rank 0: F F B F B B (one warm-up forward), rank 1 alternates.
  auto m = two_ranks({{{'F', 0, 0}, {'F', 0, 1}, {'B', 0, 0}, {'F', 0, 2}, {'B', 0, 1}, {'B', 0, 2}},
                      {{'F', 1, 0}, {'B', 1, 0}, {'F', 1, 1}, {'B', 1, 1}, {'F', 1, 2}, {'B', 1, 2}}}, 3);
  const auto t = simulate_pipeline(m);
  const Times want = {{"F0.0", {0, 1}}, {"F0.1", {1, 2}}, {"F1.0", {1, 2}},  {"B1.0", {2, 4}},
                      {"B0.0", {4, 6}}, {"F1.1", {4, 5}}, {"B1.1", {5, 7}},  {"F0.2", {6, 7}},
                      {"B0.1", {7, 9}}, {"F1.2", {7, 8}}, {"B1.2", {8, 10}}, {"B0.2", {10, 12}}};
  EXPECT_EQ(times_of(t), want);
  EXPECT_DOUBLE_EQ(t.makespan, 12);  // (m + p - 1)(F + B)
  EXPECT_DOUBLE_EQ(t.bubble(), 0.25);  // (p - 1) / (m + p - 1)
}

TEST(PipelineSim, SendsDelayTheReceiverOnly) {
  // F = 1, B = 2; an activation takes 0.5 to cross, a gradient 0.25.
  auto m = two_ranks({{{'F', 0, 0}, {'F', 0, 1}, {'B', 0, 0}, {'B', 0, 1}},
                      {{'F', 1, 0}, {'B', 1, 0}, {'F', 1, 1}, {'B', 1, 1}}}, 2);
  m.send_forward = {0.5};
  m.send_backward = {0.25};
  const auto t = simulate_pipeline(m);
  const Times want = {{"F0.0", {0, 1}},       {"F0.1", {1, 2}},     {"F1.0", {1.5, 2.5}}, {"B1.0", {2.5, 4.5}},
                      {"F1.1", {4.5, 5.5}},   {"B1.1", {5.5, 7.5}}, {"B0.0", {4.75, 6.75}}, {"B0.1", {7.75, 9.75}}};
  EXPECT_EQ(times_of(t), want);
  EXPECT_DOUBLE_EQ(t.makespan, 9.75);
  EXPECT_NEAR(t.bubble(), 1.0 - 12.0 / 19.5, 1e-12);
}

TEST(PipelineSim, StageCostsAndSplitBackward) {
  // One rank, two stages (a V shape folded onto one rank): no sends, W after I.
  PipelineModel m;
  m.name = "split";
  m.placement = {0, 0};
  m.microbatches = 1;
  m.costs = {{1, 0, 2, 3}, {4, 0, 5, 6}};
  m.orders = {{{'F', 0, 0}, {'F', 1, 0}, {'I', 1, 0}, {'I', 0, 0}, {'W', 1, 0}, {'W', 0, 0}}};
  m.send_forward = {100};  // same rank: never paid
  const auto t = simulate_pipeline(m);
  EXPECT_EQ(times_of(t), (Times{{"F0.0", {0, 1}}, {"F1.0", {1, 5}}, {"I1.0", {5, 10}}, {"I0.0", {10, 12}},
                                {"W1.0", {12, 18}}, {"W0.0", {18, 21}}}));
  EXPECT_DOUBLE_EQ(t.bubble(), 0.0);
}

TEST(PipelineSim, OrdersThatCannotFinishAreNamed) {
  // Rank 1 wants its backward before the forward it depends on ever ran.
  auto hang = two_ranks({{{'F', 0, 0}, {'B', 0, 0}}, {{'B', 1, 0}, {'F', 1, 0}}}, 1);
  try {
    simulate_pipeline(hang);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot finish: ranks wait on each other (rank 0 at B0.0, rank 1 at B1.0)"),
              std::string::npos) << e.what();
  }
  auto missing = two_ranks({{{'F', 0, 0}, {'B', 0, 0}}, {{'F', 1, 0}}}, 1);
  EXPECT_THROW(simulate_pipeline(missing), c10::Error);  // B1.0 never runs: B0.0 waits forever
  auto misplaced = two_ranks({{{'F', 1, 0}}, {}}, 1);
  EXPECT_THROW(simulate_pipeline(misplaced), c10::ValueError);
  auto never = two_ranks({{{'F', 0, 0}, {'B', 0, 0}}, {{'F', 1, 0}, {'B', 1, 0}}}, 2);
  try {
    simulate_pipeline(never);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("never runs F0.1"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace vescale::autoplan
