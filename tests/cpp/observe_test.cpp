// Seeing into the engine: the collective recorder, the candidate log behind
// vescale.explain, readable decisions, the bounded caches and the rule registry's
// check of operator names. No process group: decisions only, on test meshes.

#include "collectives/trace.h"
#include "dispatch/call_scan.h"
#include "dispatch/dtensor_impl.h"
#include "dispatch/propagation.h"
#include "sharding_rules/rule.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>

namespace vescale {

namespace trace = collectives::trace;

namespace {

const Placement R = Placement::replicate();
Placement S(int32_t d) { return Placement::shard(d); }

at::Tensor dt(const MeshPtr& mesh, std::vector<int64_t> shape, Placements p) {
  auto spec = make_spec(mesh, p, shape, dense_strides(shape), at::kFloat);
  return make_dtensor(at::zeros(c10::IntArrayRef(spec->local.sizes)), spec);
}

struct Call {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;
  CallScan scan;
  Call(const char* name, const char* overload, std::vector<c10::IValue> a)
      : op(c10::Dispatcher::singleton().findSchemaOrThrow(name, overload)), args(std::move(a)) {
    scan.run(op, op_info(op), args);
  }
  const OpInfo& info() const { return op_info(op); }
};

// ---- the recorder ----------------------------------------------------------------------

TEST(Trace, RecordsOnlyWhileOnAndCountsNestedUsers) {
  trace::clear_events();
  const std::string group = "g", dim = "TP";
  { trace::Timed off("all_gather", group, 2, 0, &dim, 48); }
  EXPECT_EQ(trace::event_count(), 0u) << "recorded while off";

  trace::enable(trace::kCollectives);
  trace::enable(trace::kCollectives);  // a second user
  trace::disable(trace::kCollectives);
  EXPECT_TRUE(trace::flags() & trace::kCollectives) << "one user left, the recorder must stay on";
  {
    static const std::string op = "aten::mm";
    trace::OpContext context(op);
    trace::set_scope(7);
    trace::Timed on("all_gather", group, 2, 0, &dim, 48);
  }
  trace::set_scope(0);
  trace::disable(trace::kCollectives);
  EXPECT_EQ(trace::flags() & trace::kCollectives, 0u);
  const auto events = trace::events();
  ASSERT_EQ(events.size(), 1u);
  const auto& e = events[0];
  EXPECT_EQ(e.kind, "all_gather");
  EXPECT_EQ(e.group, group);
  EXPECT_EQ(e.group_size, 2);
  EXPECT_EQ(e.mesh_dim, 0);
  EXPECT_EQ(e.mesh_dim_name, dim);
  EXPECT_EQ(e.bytes, 48u);
  EXPECT_EQ(e.op, "aten::mm");
  EXPECT_EQ(e.scope, 7);
  EXPECT_LE(e.start_ns, e.end_ns);
  EXPECT_EQ(trace::current_op(), "") << "the op context outlived its scope";
  trace::clear_events();
}

TEST(Trace, ListenerSeesItsThreadsEventsWithoutTheRecorder) {
  const std::string group = "g";
  trace::enable(trace::kExplain);  // any observer makes Timed look; only the listener takes it
  trace::Listener listener;
  { trace::Timed t("all_reduce", group, 4, 1, nullptr, 16); }
  trace::disable(trace::kExplain);
  ASSERT_EQ(listener.events.size(), 1u);
  EXPECT_EQ(listener.events[0].kind, "all_reduce");
  EXPECT_EQ(listener.events[0].group_size, 4);
  EXPECT_EQ(trace::event_count(), 0u) << "the process record is for comm_trace only";
}

// ---- what the rule weighed -------------------------------------------------------------

TEST(Explain, CandidateLogPricesEveryStrategyAndMarksTheCheapest) {
  auto m1 = make_test_mesh({2}, {0});
  // A [4, 6] row-split times B [6, 8] column-split: gathering A (the smaller) wins.
  Call call("aten::mm", "", {dt(m1, {4, 6}, {S(0)}), dt(m1, {6, 8}, {S(1)})});
  auto traced = trace_decision(call.op, call.info(), call.args, call.scan);
  const auto& log = traced.candidates;
  ASSERT_FALSE(log.candidates.empty());
  ASSERT_GE(log.chosen, 0);
  const auto& chosen = log.candidates[static_cast<size_t>(log.chosen)];
  double cheapest = std::numeric_limits<double>::infinity();
  for (const auto& c : log.candidates) cheapest = std::min(cheapest, c.cost);
  EXPECT_EQ(chosen.cost, cheapest);
  EXPECT_EQ(to_string(chosen), "[Replicate()], [Shard(1)] -> [Shard(1)]");
  // The logged cost is the planner's price of the moves the decision makes.
  const auto gather_a = collectives::plan_redistribution(*m1, Placements{S(0)}, Placements{R}, std::vector<int64_t>{4, 6},
                                            at::kFloat);
  EXPECT_EQ(chosen.cost, gather_a.cost);
  EXPECT_EQ(to_string(*traced.decision),
            "Decision(inputs [Shard(0)] -> [Replicate()] by all_gather(dim=0, mesh_dim=0); [Shard(1)]; "
            "results [Shard(1)])");
  EXPECT_TRUE(traced.fallback_reason.empty());
}

TEST(Explain, CombinationsCoverTheMesh) {
  auto m2 = make_test_mesh({2, 2}, {0, 1});
  Call call("aten::mm", "", {dt(m2, {4, 6}, {S(0), R}), dt(m2, {6, 8}, {R, S(1)})});
  auto traced = trace_decision(call.op, call.info(), call.args, call.scan);
  const size_t strategies = static_cast<size_t>(std::sqrt(static_cast<double>(traced.candidates.candidates.size())));
  EXPECT_EQ(strategies * strategies, traced.candidates.candidates.size())
      << "a 2-d mesh prices every pair of per-dim strategies";
  const auto& chosen = traced.candidates.candidates[static_cast<size_t>(traced.candidates.chosen)];
  EXPECT_EQ(chosen.cost, 0.0) << "the inputs already fit a strategy: nothing moves";
}

TEST(Explain, StrategyToString) {
  DimStrategy s{{S(0), R}, {S(0)}};
  EXPECT_EQ(to_string(s), "Shard(0), Replicate() -> Shard(0)");
}

TEST(Explain, TracingLeavesTheCacheAlone) {
  auto m1 = make_test_mesh({2}, {1});
  Call call("aten::mm", "", {dt(m1, {10, 6}, {S(0)}), dt(m1, {6, 3}, {R})});
  clear_decision_cache();
  const auto misses = decision_cache_misses();
  EXPECT_FALSE(trace_decision(call.op, call.info(), call.args, call.scan).cached);
  EXPECT_EQ(decision_cache_misses(), misses) << "explaining must not decide through the cache";
  lookup_decision(call.op, call.info(), call.args, call.scan);
  EXPECT_TRUE(trace_decision(call.op, call.info(), call.args, call.scan).cached);
}

// ---- bounded global state ----------------------------------------------------------------

TEST(Bounds, DecisionCacheIsClearedWhenFull) {
  auto m1 = make_test_mesh({2}, {0});
  const size_t limit = 16;
  set_decision_cache_limit(limit);
  clear_decision_cache();
  const auto before = decision_cache_size().evictions;
  for (int64_t n = 1; n <= static_cast<int64_t>(4 * limit); ++n) {
    Call call("aten::mm", "", {dt(m1, {2 * n, 4}, {S(0)}), dt(m1, {4, 3}, {R})});
    lookup_decision(call.op, call.info(), call.args, call.scan);
    EXPECT_LE(static_cast<size_t>(decision_cache_size().entries), limit);
  }
  EXPECT_GE(decision_cache_size().evictions - before, 3) << "4 x limit distinct calls fill the cache 3 times";
  set_decision_cache_limit(default_decision_cache_limit());
}

TEST(Bounds, InternedSpecsLiveOnlyWhileHeld) {
  auto m1 = make_test_mesh({2}, {0});
  clear_decision_cache();
  const auto held = make_spec(m1, {S(0)}, std::vector<int64_t>{4, 5}, std::vector<int64_t>{5, 1}, at::kFloat);
  EXPECT_EQ(held, make_spec(m1, {S(0)}, std::vector<int64_t>{4, 5}, std::vector<int64_t>{5, 1}, at::kFloat))
      << "equal live specs must be one object";
  const auto live_before = spec_table_size().live;
  const auto sweep = spec_table_size().min_sweep;
  for (int64_t n = 1; n <= 10000; ++n) {
    auto s = make_spec(m1, {R}, std::vector<int64_t>{n, 3}, std::vector<int64_t>{3, 1}, at::kFloat);
    ASSERT_EQ(s->shape[0], n);
  }
  const auto size = spec_table_size();
  EXPECT_LE(size.entries, 2 * live_before + sweep) << "dead specs piled up in the table";
  EXPECT_EQ(size.live, live_before) << "the 10,000 specs nobody holds must be gone";
  // The held spec is still the canonical one.
  EXPECT_EQ(held, make_spec(m1, {S(0)}, std::vector<int64_t>{4, 5}, std::vector<int64_t>{5, 1}, at::kFloat));
}

// ---- the registry checks names -------------------------------------------------------------

TEST(Registry, MisspelledNamesAreReportedNotIgnored) {
  RuleTable table;  // its own list of missing names (rules would go into the shared table)
  table.add("aten::mmm", [](const OpCall& call) { return replicate_all(call); });
  table.add("aten::add.Tensorr", [](const OpCall& call) { return replicate_all(call); });
  table.add_overloads("aten::relux", [](const OpCall& call) { return replicate_all(call); });
  table.key_on_scalar_values("aten::nrom");
  table.add_shape_fn("aten::_grouped_mmm", [](const OpCall&) { return std::vector<TensorArg>{}; });
  const std::vector<std::string> want = {"aten::mmm", "aten::add.Tensorr", "aten::relux", "aten::nrom",
                                         "aten::_grouped_mmm"};
  EXPECT_EQ(table.missing(), want);
  EXPECT_EQ(rules().find("aten::mmm"), nullptr);
}

TEST(Registry, EveryRegisteredNameIsAnOperator) {
  EXPECT_TRUE(rules().missing().empty()) << "first: " << (rules().missing().empty() ? "" : rules().missing()[0]);
  for (const auto& name : rules().names()) {
    const auto dot = name.find('.', name.find("::"));
    const c10::OperatorName op(name.substr(0, dot), dot == std::string::npos ? "" : name.substr(dot + 1));
    EXPECT_TRUE(c10::Dispatcher::singleton().findSchema(op).has_value()) << name;
  }
}

}  // namespace
}  // namespace vescale
