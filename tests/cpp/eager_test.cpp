// The eager planner's C++ core: the processor-sharing pipeline timeline against timelines
// worked out by hand, the step model's pieces on a small hand-made problem, and the
// search's constraints.

#include "autoplan/eager.h"
#include "autoplan/eager_memory.h"
#include "autoplan/pipeline_sim.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <map>
#include <utility>
#include <vector>

namespace vescale::autoplan {
namespace {

using Times = std::map<std::string, std::pair<double, double>>;

Times times_of(const Timeline& t) {
  Times out;
  for (const auto& a : t.actions)
    out[std::string(1, a.action.kind) + std::to_string(a.action.stage) + "." + std::to_string(a.action.mb)] = {a.start, a.end};
  return out;
}

PipelineModel one_f_one_b_two_ranks() {
  PipelineModel m;
  m.name = "1f1b";
  m.orders = {{{'F', 0, 0}, {'F', 0, 1}, {'B', 0, 0}, {'F', 0, 2}, {'B', 0, 1}, {'B', 0, 2}},
              {{'F', 1, 0}, {'B', 1, 0}, {'F', 1, 1}, {'B', 1, 1}, {'F', 1, 2}, {'B', 1, 2}}};
  m.placement = {0, 1};
  m.microbatches = 3;
  m.send_forward = {0.5};
  m.send_backward = {0.25};
  return m;
}

TEST(SharedPipelineSim, EnoughCoresIsTheClassicTimeline) {
  const auto m = one_f_one_b_two_ranks();
  const auto classic = simulate_pipeline(m);
  for (double cores : {0.0, 2.0, 8.0}) {
    const auto shared = simulate_pipeline_shared(m, cores);
    const auto a = times_of(classic), b = times_of(shared);
    ASSERT_EQ(a.size(), b.size());
    for (const auto& [name, span] : a) {
      EXPECT_NEAR(b.at(name).first, span.first, 1e-9) << name << " cores " << cores;
      EXPECT_NEAR(b.at(name).second, span.second, 1e-9) << name << " cores " << cores;
    }
    EXPECT_NEAR(shared.makespan, classic.makespan, 1e-9);
  }
}

TEST(SharedPipelineSim, TwoRanksOnOneCoreByHand) {
  // F = 1, B = 2 on a free core; two ranks share one core, links free, GPipe order.
  // 0-1 F0.0 alone; 1-3 F0.1 and F1.0 together at half speed; 3-4.5 F1.1 and B1.0's first
  // half-second... worked out step by step:
  //   t=0   rank 0: F0.0 (1 s of work)                       -> ends 1
  //   t=1   rank 0: F0.1, rank 1: F1.0, both at rate 1/2        -> both end 3
  //   t=3   rank 0 waits for B1.0; rank 1: F1.1 alone           -> ends 4
  //   t=4   rank 1: B1.0 alone (2 s)                            -> ends 6
  //   t=6   rank 0: B0.0, rank 1: B1.1, both at 1/2              -> both end 10
  //   t=10  rank 0: B0.1 alone                                  -> ends 12
  PipelineModel m;
  m.name = "gpipe";
  m.orders = {{{'F', 0, 0}, {'F', 0, 1}, {'B', 0, 0}, {'B', 0, 1}}, {{'F', 1, 0}, {'F', 1, 1}, {'B', 1, 0}, {'B', 1, 1}}};
  m.placement = {0, 1};
  m.microbatches = 2;
  const auto t = simulate_pipeline_shared(m, 1.0);
  const Times want = {{"F0.0", {0, 1}}, {"F0.1", {1, 3}}, {"F1.0", {1, 3}}, {"F1.1", {3, 4}},
                      {"B1.0", {4, 6}}, {"B0.0", {6, 10}}, {"B1.1", {6, 10}}, {"B0.1", {10, 12}}};
  const auto got = times_of(t);
  for (const auto& [name, span] : want) {
    EXPECT_NEAR(got.at(name).first, span.first, 1e-9) << name;
    EXPECT_NEAR(got.at(name).second, span.second, 1e-9) << name;
  }
  EXPECT_NEAR(t.makespan, 12, 1e-9);
}

TEST(SharedPipelineSim, WaitsTakeNoProcessor) {
  // One core, two ranks; rank 1's forward is 1 s of compute then 1 s in a collective, in
  // which rank 0's compute runs at full speed.
  PipelineModel m;
  m.name = "waits";
  m.orders = {{{'F', 0, 0}, {'F', 0, 1}, {'B', 0, 0}, {'B', 0, 1}}, {{'F', 1, 0}, {'B', 1, 0}, {'F', 1, 1}, {'B', 1, 1}}};
  m.placement = {0, 1};
  m.microbatches = 2;
  m.costs = {{1, 1, 0, 0}, {1, 1, 0, 0}};
  const std::vector<StageCost> waits = {{0, 0, 0, 0}, {1, 0, 0, 0}};
  const auto t = simulate_pipeline_shared(m, 1.0, waits);
  const auto got = times_of(t);
  // 0-1 F0.0; 1-3 F0.1 with F1.0's compute (half speed each); 3-4 F1.0 waits, B0.? cannot
  // start (needs B1.0): rank 0 idle; 4-5 B1.0 alone; 5-7 B0.0 with F1.1's compute; F1.1
  // waits 7-8 while B0.1 needs B1.1; 8-9 B1.1; 9-10 B0.1.
  EXPECT_NEAR(got.at("F1.0").second, 4, 1e-9);
  EXPECT_NEAR(got.at("B1.0").second, 5, 1e-9);
  EXPECT_NEAR(got.at("F1.1").second, 8, 1e-9);
  EXPECT_NEAR(t.makespan, 10, 1e-9);
}

// ---- the step model and the search ------------------------------------------------------------

eager::Problem tiny() {
  eager::Problem p;
  p.world = 4;
  p.batch = 8;
  p.units = {{"emb", 0, 0, 100, true}, {"b0", 1, 10, 1000, true}, {"b1", 1, 10, 1000, true},
             {"b2", 1, 10, 1000, true}, {"b3", 1, 10, 1000, true}, {"head", 2, 0, 100, true}};
  eager::Layout l1;  // tp = 1: 1 ms + 1 ms per sample forward per block, twice that backward
  for (const auto& u : p.units) {
    eager::UnitCost c;
    const double k = u.kind == 1 ? 1.0 : 0.1;
    c.fwd_a = 1e-3 * k;
    c.fwd_b = 1e-3 * k;
    c.bwd_a = 2e-3 * k;
    c.bwd_b = 2e-3 * k;
    c.saved_b = 1e6;
    c.out_b = 1e5;
    c.param_bytes = 4e6 * k;
    c.param_numel = 1e6 * k;
    c.param_tensors = 2;
    l1.units.push_back(c);
  }
  eager::Layout l2 = l1;  // tp = 2: half the compute, one all-reduce each way per block
  l2.tp = 2;
  for (size_t i = 0; i < l2.units.size(); ++i) {
    auto& c = l2.units[i];
    c.fwd_b /= 2;
    c.bwd_b /= 2;
    c.param_bytes /= 2;
    c.param_numel /= 2;
    if (p.units[i].kind == 1) {
      c.fwd_comm = {{"all_reduce", 2, 0, 1e5}};
      c.bwd_comm = {{"all_reduce", 2, 0, 1e5}};
    }
  }
  p.layouts = {l1, l2};
  p.comm = {{"all_reduce", 2, 1e-3, 1e-9}, {"all_reduce", 4, 3e-3, 2e-9}, {"all_gather", 2, 1e-3, 1e-9},
            {"all_gather", 4, 3e-3, 2e-9}, {"reduce_scatter", 4, 3e-3, 2e-9}, {"send", 2, 5e-4, 1e-9},
            {"broadcast", 2, 1e-4, 0}};
  for (int64_t m : {1, 2, 4}) {  // GPipe on 2 ranks
    eager::Schedule s;
    s.name = "gpipe";
    s.pp = 2;
    s.microbatches = m;
    s.placement = {0, 1};
    s.orders.resize(2);
    for (int32_t r = 0; r < 2; ++r) {
      for (int32_t i = 0; i < m; ++i) s.orders[r].push_back({'F', r, i});
      for (int32_t i = 0; i < m; ++i) s.orders[r].push_back({'B', r, i});
    }
    p.schedules.push_back(s);
  }
  return p;
}

// PP2 x DP2 with GPipe over m micro-batches; the split left to the search when empty
eager::Config gpipe_pp2_dp2(int64_t m, std::vector<int64_t> split = {}) {
  eager::Config c;
  c.pp = 2;
  c.dp = 2;
  c.schedule = "gpipe";
  c.microbatches = m;
  c.blocks_per_stage = std::move(split);
  return c;
}

TEST(EagerStepModel, DataParallelStepByHand) {
  auto p = tiny();
  eager::Config c;
  c.dp = 4;
  const auto e = eager::estimate(p, c);
  ASSERT_TRUE(e.feasible) << e.reason;
  // 2 samples per rank: blocks 4 x (3 ms + 6 ms), ends 2 x 0.1 x 9 ms
  const double compute = 4 * 9e-3 + 2 * 0.9e-3;
  EXPECT_NEAR(e.breakdown.compute, compute, 1e-12);
  // one bucket of 16.8 MB of gradients all-reduced over 4 ranks, and the loss (8 bytes)
  const double grads = 4 * 4e6 + 2 * 0.4e6;
  EXPECT_NEAR(e.breakdown.dp_comm, 3e-3 + 2e-9 * grads + 3e-3 + 2e-9 * 8, 1e-12);
  EXPECT_NEAR(e.step_s, compute + e.breakdown.dp_comm, 1e-12);
  // memory: parameters, AdamW's two moments, DDP's bucket (kept from step to step, as big
  // as the gradients) and the most of the backward: its start (the activations of 2
  // samples, no gradients yet) or its end (the gradients whole; what the embedding and
  // the first block saved still there while the first block's backward runs)
  EXPECT_NEAR(e.memory.params, grads, 1e-6);
  EXPECT_NEAR(e.memory.optimizer, 2 * grads, 1e-6);
  EXPECT_NEAR(e.memory.total(), grads + 2 * grads + grads + std::max(6 * 2e6, grads + 2 * 2e6), 1e-6);
  // the collectives it priced for rank 0
  ASSERT_EQ(e.rank0_comms.size(), 1u);
  EXPECT_EQ(e.rank0_comms[0].kind, "all_reduce");
  EXPECT_NEAR(e.rank0_comms[0].bytes, grads, 1e-6);
}

TEST(EagerStepModel, PipelineIsTheTimelinePlusItsSync) {
  auto p = tiny();
  const auto e = eager::estimate(p, gpipe_pp2_dp2(2), "time");
  ASSERT_TRUE(e.feasible) << e.reason;
  EXPECT_EQ(e.config.blocks_per_stage, (std::vector<int64_t>{2, 2}));
  // 2 samples per micro-batch; stage 0: emb + 2 blocks = 0.3 + 6 = 6.3 ms forward (3 + 0.3 backward x2)
  ASSERT_EQ(e.stage_forward.size(), 2u);
  EXPECT_NEAR(e.stage_forward[0], 2 * 3e-3 + 0.3e-3, 1e-12);
  EXPECT_NEAR(e.stage_backward[0], 2 * 6e-3 + 0.6e-3, 1e-12);
  // every priced send carries a block's output for 2 samples
  int sends = 0;
  for (const auto& x : e.rank0_comms)
    if (x.kind == "send" || x.kind == "recv") {
      EXPECT_NEAR(x.bytes, 2e5, 1e-6);
      sends += static_cast<int>(x.count);
    }
  EXPECT_EQ(sends, 4);  // rank 0 sends 2 activations and receives 2 gradients
  EXPECT_GT(e.bubble, 0.0);
}

TEST(EagerStepModel, PipelineRanksOfDataParallelReplicasShareTheCores) {
  // 4 ranks on 2 cores, PP2 x DP2: each pipeline rank of the timeline is 2 processes, so
  // one stage computing already fills both cores. With no per-call costs and free sends
  // the processors never idle and never run faster, whatever the micro-batches: the
  // step is the same at m = 1, 2, 4 (pipelining cannot help when the cores are full).
  auto p = tiny();
  p.cores = 2;
  p.profiled_busy = 4;
  for (auto& u : p.layouts[0].units) u.fwd_a = u.bwd_a = 0;
  for (auto& ab : p.comm)
    if (ab.kind == "send") ab.alpha = ab.beta = 0;
  std::vector<double> steps;
  for (int64_t m : {1, 2, 4}) {
    const auto e = eager::estimate(p, gpipe_pp2_dp2(m, {2, 2}));
    ASSERT_TRUE(e.feasible) << e.reason;
    steps.push_back(e.step_s);
    // 4 samples per pipeline; each stage's forward and backward at full speed (the profile
    // ran 4 ranks on 2 cores: half speed), one stage after the other
    const double per_sample = (2 * 3e-3 + 0.3e-3) / 2;  // both stages alike, forward + backward
    EXPECT_NEAR(e.breakdown.compute + e.breakdown.idle, 2 * 4 * per_sample, 1e-9) << "m = " << m;
  }
  EXPECT_NEAR(steps[1], steps[0], 1e-9);
  EXPECT_NEAR(steps[2], steps[0], 1e-9);
}

TEST(EagerStepModel, EveryScheduleActionPaysTheRuntimesCost) {
  // GPipe over 2 equal stages, 2 micro-batches: the critical path runs 3 forward and 3
  // backward slots (F0.0 F0.1 F1.1, B1.0 B1.1 B0.1), each of them longer by the cost
  auto p = tiny();
  auto c = gpipe_pp2_dp2(2, {2, 2});
  const auto before = eager::estimate(p, c);
  p.action_seconds = 1e-3;
  const auto after = eager::estimate(p, c);
  ASSERT_TRUE(before.feasible && after.feasible);
  EXPECT_NEAR(after.step_s - before.step_s, 6e-3, 1e-12);
  c.pp = 1;  // no pipeline, no schedule actions
  c.dp = 4;
  c.schedule = "none";
  c.microbatches = 1;
  c.blocks_per_stage.clear();
  p.action_seconds = 0;
  const auto plain = eager::estimate(p, c);
  p.action_seconds = 1e-3;
  EXPECT_NEAR(eager::estimate(p, c).step_s, plain.step_s, 1e-15);
}

TEST(EagerStepModel, RecomputationByHand) {
  auto p = tiny();
  eager::Config c;
  c.dp = 4;
  c.recompute = true;
  const auto e = eager::estimate(p, c);
  ASSERT_TRUE(e.feasible) << e.reason;
  EXPECT_EQ(e.config.str(), "PP1 DP4 TP1 recompute");
  // each block's forward (3 ms) runs again in its backward; the ends are not recomputed
  EXPECT_NEAR(e.breakdown.compute, 4 * (9e-3 + 3e-3) + 2 * 0.9e-3, 1e-12);
  // a block keeps only its input (what the block before hands on: 2 x 1e5 bytes), the ends
  // their saved activations (2 x 1e6), and the block being recomputed what it saves (2 x
  // 1e6) until its backward ends; parameters, AdamW's moments and DDP's bucket besides;
  // the gradients (whole at the backward's end, with the embedding's saved activations and
  // the first block's input) outweigh the kept activations
  const double grads = 4 * 4e6 + 2 * 0.4e6;
  EXPECT_NEAR(e.memory.total(), 3 * grads + grads + std::max(4 * 2e5 + 2 * 2e6, grads + 2e6 + 2e5) + 2e6, 1e-6);
}

TEST(EagerSearch, RecomputationOnlyWhereAPlanDoesNotFitWithoutIt) {
  auto p = tiny();
  p.layouts.resize(1);  // no tensor parallelism: fewer plans
  for (size_t i = 0; i < p.units.size(); ++i)  // activations that outweigh the gradients' bucket
    if (p.units[i].kind == 1) p.layouts[0].units[i].saved_b = 1e7;
  eager::Constraints k;
  k.pp = 1;
  k.zero = 0;
  auto free = eager::search(p, k);
  ASSERT_EQ(free.ranked.size(), 1u);
  EXPECT_FALSE(free.ranked[0].config.recompute);  // it never makes a step faster
  // a limit between the plan's memory with and without recomputation
  eager::Config c;
  c.dp = 4;
  c.recompute = true;
  const double with = eager::estimate(p, c).memory.total(), without = free.ranked[0].memory.total();
  ASSERT_LT(with, without);
  k.memory_limit = 0.5 * (with + without);
  auto limited = eager::search(p, k);
  ASSERT_EQ(limited.ranked.size(), 1u);
  EXPECT_TRUE(limited.ranked[0].config.recompute);
  EXPECT_LE(limited.ranked[0].memory.total(), k.memory_limit);
  k.recompute = 0;  // refused when asked not to recompute
  EXPECT_TRUE(eager::search(p, k).ranked.empty());
}

TEST(EagerSearch, ConstraintsAndMemory) {
  auto p = tiny();
  eager::Constraints k;
  auto all = eager::search(p, k);
  ASSERT_FALSE(all.ranked.empty());
  for (size_t i = 1; i < all.ranked.size(); ++i) EXPECT_LE(all.ranked[i - 1].step_s, all.ranked[i].step_s);
  EXPECT_EQ(all.ranked[0].verdict, "best");
  EXPECT_EQ(all.ranked[1].verdict.substr(0, 1), "+");
  k.tp = 2;
  k.sp = 0;
  for (const auto& e : eager::search(p, k).ranked) EXPECT_EQ(e.config.tp, 2);
  k = {};
  k.pp = 2;
  k.microbatches = 4;
  auto pp = eager::search(p, k);
  ASSERT_FALSE(pp.ranked.empty());
  for (const auto& e : pp.ranked) {
    EXPECT_EQ(e.config.pp, 2);
    EXPECT_EQ(e.config.microbatches, 4);
  }
  k = {};
  k.memory_limit = all.ranked.back().memory.total();  // some fit, some not
  double most = 0;
  for (const auto& e : all.ranked) most = std::max(most, e.memory.total());
  auto limited = eager::search(p, k);
  for (const auto& e : limited.ranked) EXPECT_LE(e.memory.total(), k.memory_limit);
  if (most > k.memory_limit) {
    ASSERT_FALSE(limited.rejected.empty());
    EXPECT_NE(limited.rejected[0].reason.find("over the limit"), std::string::npos);
  }
}

TEST(EagerSearch, CollectiveCostsScaleToUnmeasuredGroups) {
  const eager::CommCost cost({{"all_reduce", 2, 1e-3, 1e-9}});
  EXPECT_DOUBLE_EQ(cost.time("all_reduce", 1, 1e6), 0.0);
  EXPECT_DOUBLE_EQ(cost.time("all_reduce", 2, 1e6), 1e-3 + 1e-3);
  EXPECT_DOUBLE_EQ(cost.time("all_reduce", 4, 1e6), 3 * (1e-3 + 1e-3));  // 3 ring steps for 1
  EXPECT_DOUBLE_EQ(cost.time("all_gather", 2, 1e6), 2e-3);              // no entry: as an all-reduce
}

TEST(EagerMemory, ScheduleOrdersKeepSavedTensorsAndTheSplitsGradients) {
  // saved bytes per micro-batch of stages 0 and 1, and what a split backward keeps from I to W
  const std::vector<double> saved{7, 10}, held{3, 4};
  // 1F1B on the last stage: F0 B0 F1 B1, one micro-batch at a time; the gradients meet the second
  auto k = eager::peak_kept({{'F', 1, 0}, {'B', 1, 0}, {'F', 1, 1}, {'B', 1, 1}}, saved, held);
  EXPECT_DOUBLE_EQ(k.peak, 10);
  EXPECT_DOUBLE_EQ(k.with_grads, 10);
  // zero bubble on the last stage: F0 I0 F1 W0 I1 W1; the split keeps its 4 bytes until W
  k = eager::peak_kept({{'F', 1, 0}, {'I', 1, 0}, {'F', 1, 1}, {'W', 1, 0}, {'I', 1, 1}, {'W', 1, 1}}, saved, held);
  EXPECT_DOUBLE_EQ(k.peak, 10 + 4 + 10);   // after F1: both saved, micro-batch 0's gradients for W
  EXPECT_DOUBLE_EQ(k.with_grads, 10 + 4);  // after I1
  // the first stage runs its whole backward in I and keeps nothing for its W
  k = eager::peak_kept({{'F', 0, 0}, {'F', 0, 1}, {'I', 0, 0}, {'W', 0, 0}, {'I', 0, 1}, {'W', 0, 1}}, saved, held);
  EXPECT_DOUBLE_EQ(k.peak, 14);
  EXPECT_DOUBLE_EQ(k.with_grads, 7);
  // two stages on one rank (a V schedule) count at the same moment: 17, where each stage's
  // own most (14 + 10) would say 24
  k = eager::peak_kept({{'F', 0, 0}, {'F', 1, 0}, {'B', 1, 0}, {'F', 0, 1}, {'B', 0, 0}, {'F', 1, 1},
                        {'B', 1, 1}, {'B', 0, 1}},
                       saved, held);
  EXPECT_DOUBLE_EQ(k.peak, 17);
  EXPECT_DOUBLE_EQ(k.with_grads, 17);  // after F1.1: stage 0's micro-batch 1 and stage 1's
}

}  // namespace
}  // namespace vescale::autoplan
