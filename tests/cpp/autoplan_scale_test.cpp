// The planner at scale (autoplan/): costs of a tiny transformer worked out by hand, the
// paper's activation formulas, collectives on NVLink / InfiniBand, the split against
// brute force, the orders' memory, and the search against every candidate simulated.

#include "autoplan/comm_time.h"
#include "autoplan/hardware.h"
#include "autoplan/schedule_orders.h"
#include "autoplan/search.h"
#include "autoplan/split.h"
#include "autoplan/step_model.h"
#include "autoplan/transformer.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <limits>
#include <numeric>
#include <random>

namespace vescale::autoplan {
namespace {

// GPT as Korthikanti et al. count it: dropout, biases, learned positions, MLP 4h.
Transformer tiny_gpt() {
  Transformer m;
  m.name = "tiny";
  m.layers = 4;
  m.hidden = 8;
  m.heads = 2;
  m.kv_heads = 2;
  m.ffn = 32;
  m.vocab = 16;
  m.seq = 4;
  m.global_batch = 8;
  return m;
}

TEST(AutoplanTransformer, GptLayerByHand) {
  const Transformer m = tiny_gpt();
  const double s = 4, b = 1, h = 8, a = 2;
  const LayerWork w = layer_work(m, {1, 1, false, Recompute::none});
  // Narayanan et al. 2021: 24 b s h^2 + 4 b s^2 h forward FLOPs of a layer with MLP 4h.
  EXPECT_DOUBLE_EQ(w.forward.gemm_flops, 24 * b * s * h * h + 4 * b * s * s * h);
  EXPECT_DOUBLE_EQ(w.backward.gemm_flops, 2 * w.forward.gemm_flops);
  EXPECT_DOUBLE_EQ(w.forward.attn_flops, 0);
  // 12 h^2 + 13 h parameters.
  EXPECT_DOUBLE_EQ(layer_params(m, 1), 12 * h * h + 13 * h);
  // Korthikanti et al. 2022, eq. (1)-(5): bytes saved per layer per micro-batch.
  const double sbh = s * b * h;
  EXPECT_DOUBLE_EQ(w.saved_bytes, sbh * (34 + 5 * a * s / h));
  const double t = 2;
  EXPECT_DOUBLE_EQ(layer_work(m, {1, 2, false, Recompute::none}).saved_bytes,
                   sbh * (10 + 24 / t + 5 * a * s / (h * t)));
  EXPECT_DOUBLE_EQ(layer_work(m, {1, 2, true, Recompute::none}).saved_bytes, sbh / t * (34 + 5 * a * s / h));
  EXPECT_DOUBLE_EQ(layer_work(m, {1, 2, true, Recompute::selective}).saved_bytes, sbh / t * 34);
  EXPECT_DOUBLE_EQ(layer_work(m, {1, 2, false, Recompute::full}).saved_bytes, 2 * sbh);
  EXPECT_DOUBLE_EQ(layer_work(m, {1, 2, true, Recompute::full}).saved_bytes, 2 * sbh / t);
  // Tensor parallelism: two all-reduces each way of the b s h activation; with sequence
  // parallelism two all-gathers and two reduce-scatters; full recompute redoes the forward's.
  const LayerWork tp = layer_work(m, {1, 2, false, Recompute::full});
  EXPECT_EQ(tp.tp_forward.all_reduce, 2);
  EXPECT_EQ(tp.tp_backward.all_reduce, 2);
  EXPECT_EQ(tp.tp_recompute.all_reduce, 2);
  EXPECT_DOUBLE_EQ(tp.tp_bytes, 2 * sbh);
  EXPECT_DOUBLE_EQ(tp.recompute.gemm_flops, tp.forward.gemm_flops);
  const LayerWork seq = layer_work(m, {1, 2, true, Recompute::none});
  EXPECT_EQ(seq.tp_forward.all_gather, 2);
  EXPECT_EQ(seq.tp_forward.reduce_scatter, 2);
  EXPECT_EQ(seq.tp_forward.all_reduce, 0);
  EXPECT_DOUBLE_EQ(seq.recompute.gemm_flops, 0);
}

TEST(AutoplanTransformer, LlamaShapes) {
  // GQA, SwiGLU, no biases, fused attention: q, k, v, o and three MLP matrices.
  Transformer m = tiny_gpt();
  m.kv_heads = 1;
  m.gated_mlp = true;
  m.biases = false;
  m.dropout = false;
  m.learned_positions = false;
  m.flash_attention = true;
  m.tied_embeddings = false;
  const double h = 8, f = 32, kv = 4, s = 4;  // kv: one KV head of dim 4
  EXPECT_DOUBLE_EQ(layer_params(m, 1), h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h);
  EXPECT_DOUBLE_EQ(layer_params(m, 2), (h * (h + 2 * kv) + h * h + 3 * h * f) / 2 + 2 * h);
  const LayerWork w = layer_work(m, {1, 1, false, Recompute::none});
  EXPECT_DOUBLE_EQ(w.forward.gemm_flops, 2 * s * h * (h + 2 * kv) + 2 * s * h * h + 6 * s * h * f);
  EXPECT_DOUBLE_EQ(w.forward.attn_flops, 0.5 * 4 * s * s * h);  // causal: half the blocks
  // Fused attention stores no s x s tensor: selective recomputation changes nothing.
  EXPECT_DOUBLE_EQ(layer_work(m, {1, 1, false, Recompute::selective}).saved_bytes, w.saved_bytes);
  EXPECT_DOUBLE_EQ(total_params(m), 4 * layer_params(m, 1) + 2 * 16 * h + h);
}

Hardware round_hardware() {
  Hardware hw;
  hw.name = "round";
  hw.gpus_per_node = 8;
  hw.hbm_bytes = 1e12;
  hw.peak_flops = 1e6;
  hw.gemm_efficiency = 0.5;
  hw.attention_efficiency = 0.25;
  hw.hbm_bw = 1e5;
  hw.hbm_efficiency = 0.5;
  hw.nvlink_bw = 1e4;
  hw.nvlink_efficiency = 1;
  hw.nvlink_latency = 1e-3;
  hw.ib_bw = 1e3;
  hw.ib_efficiency = 1;
  hw.ib_latency = 1e-2;
  return hw;
}

TEST(AutoplanComm, RingsOnNvlinkAndHierarchicalAcrossNodes) {
  const Hardware hw = round_hardware();
  const double bytes = 8e4;
  // Inside a node: a ring all-reduce over 4, 2 (k - 1) latencies and 2 (k - 1) / k of the bytes.
  EXPECT_DOUBLE_EQ(collective_time(hw, Collective::all_reduce, bytes, {4, 1}), 2 * 3 * 1e-3 + 2 * bytes * 3 / 4 / 1e4);
  EXPECT_DOUBLE_EQ(collective_time(hw, Collective::all_gather, bytes, {4, 2}), 3 * 1e-3 + bytes * 3 / 4 / 1e4);
  // 16 ranks stride 1: two nodes of 8. Reduce-scatter in the node, all-reduce of an
  // eighth across the two nodes, all-gather in the node.
  const double intra = 7 * 1e-3 + bytes * 7 / 8 / 1e4;
  const double inter = 2 * 1 * 1e-2 + 2 * (bytes / 8) * 1 / 2 / 1e3;
  EXPECT_DOUBLE_EQ(collective_time(hw, Collective::all_reduce, bytes, {16, 1}), intra + inter + intra);
  // Stride 8: one member per node, everything over InfiniBand.
  EXPECT_EQ(members_per_node(hw, {4, 8}), 1);
  EXPECT_DOUBLE_EQ(collective_time(hw, Collective::reduce_scatter, bytes, {4, 8}), 3 * 1e-2 + bytes * 3 / 4 / 1e3);
  EXPECT_DOUBLE_EQ(collective_time(hw, Collective::all_reduce, bytes, {1, 1}), 0);
  EXPECT_DOUBLE_EQ(p2p_time(hw, bytes, false), 1e-2 + bytes / 1e3);
}

TEST(AutoplanStep, OneRankStepByHand) {
  // No parallelism: the step is m x (F + B) plus Adam over every parameter.
  const Hardware hw = round_hardware();
  const Transformer m = tiny_gpt();
  ParallelConfig c;
  c.micro_batch = 2;  // 4 micro-batches of 2 sequences
  const StepEstimate e = estimate_step(m, hw, c);
  ASSERT_TRUE(e.feasible) << e.reason;
  EXPECT_EQ(e.microbatches, 4);
  const Shard sh{2, 1, false, Recompute::none};
  auto secs = [&](const Work& w) { return w.gemm_flops / 5e5 + w.attn_flops / 2.5e5 + w.hbm_bytes / 5e4; };
  const LayerWork l = layer_work(m, sh), emb = embedding_work(m, sh), head = head_work(m, sh);
  const double F = 4 * secs(l.forward) + secs(emb.forward) + secs(head.forward);
  const double B = 4 * secs(l.backward) + secs(emb.backward) + secs(head.backward);
  EXPECT_NEAR(e.stage_forward[0], F, 1e-12 * F);
  EXPECT_NEAR(e.stage_backward[0], B, 1e-12 * B);
  const double params = total_params(m);
  const double adam = params * (2 * 12 + 2 * 4 + 2) / 5e4;
  EXPECT_NEAR(e.step_s, 4 * (F + B) + adam, 1e-9 * e.step_s);
  EXPECT_NEAR(e.breakdown.optimizer, adam, 1e-12);
  EXPECT_NEAR(e.lower_bound_s, e.step_s, 1e-9 * e.step_s);  // nothing waits on one rank
  // Memory: 2 + 4 + 12 bytes per parameter, one micro-batch in flight, a layer's backward working set.
  EXPECT_NEAR(e.memory.params + e.memory.grads + e.memory.optimizer, 18 * params, 1e-6);
  EXPECT_NEAR(e.memory.activations, 4 * l.saved_bytes + emb.saved_bytes + head.saved_bytes, 1e-6);
  EXPECT_NEAR(e.memory.other, l.peak_extra_bytes, 1e-9);
}

TEST(AutoplanStep, ZeroStagesShardWhatTheySay) {
  const Hardware hw = round_hardware();
  const Transformer m = tiny_gpt();
  ParallelConfig c;
  c.dp = 4;
  c.micro_batch = 2;
  double last = 1e300;
  for (int z = 0; z <= 3; ++z) {
    c.zero = z;
    const StepEstimate e = estimate_step(m, hw, c);
    ASSERT_TRUE(e.feasible) << e.reason;
    const double p = total_params(m);
    EXPECT_NEAR(e.memory.params, p * (z >= 3 ? 2.0 / 4 : 2.0), 1e-6);
    EXPECT_NEAR(e.memory.grads, p * (z >= 2 ? 4.0 / 4 : 4.0), 1e-6);
    EXPECT_NEAR(e.memory.optimizer, p * (z >= 1 ? 12.0 / 4 : 12.0), 1e-6);
    const double state = e.memory.params + e.memory.grads + e.memory.optimizer;
    EXPECT_LT(state, last);
    last = state;
  }
}

TEST(AutoplanStep, TensorParallelOverlapHidesWhatTheGemmsCover) {
  // TP 2 on one pipeline stage: whatever the overlap hides leaves the TP time, the step
  // gets shorter by just that, and the GEMMs beside it slow by the share it takes.
  Hardware hw = round_hardware();
  const Transformer m = tiny_gpt();
  ParallelConfig c;
  c.tp = 2;
  c.micro_batch = 2;
  const StepEstimate plain = estimate_step(m, hw, c);
  hw.tp_overlap = 1.0;
  hw.overlap_compute_share = 0.0;
  const StepEstimate free = estimate_step(m, hw, c);
  ASSERT_TRUE(plain.feasible && free.feasible);
  const double hidden = plain.breakdown.tp_comm - free.breakdown.tp_comm;
  EXPECT_GT(hidden, 0.0);
  EXPECT_NEAR(free.breakdown.compute, plain.breakdown.compute, 1e-12);
  EXPECT_NEAR(plain.step_s - free.step_s, hidden, 1e-9 * plain.step_s);
  hw.overlap_compute_share = 0.25;
  const StepEstimate shared = estimate_step(m, hw, c);
  EXPECT_NEAR(shared.breakdown.tp_comm, free.breakdown.tp_comm, 1e-12);
  EXPECT_NEAR(shared.breakdown.compute - plain.breakdown.compute, 0.25 * hidden, 1e-9 * plain.step_s);
}

TEST(AutoplanStep, ZeroBubbleSplitsTheBackwardAndFillsTheCoolDown) {
  // ZB-H1 on 2 stages of 2 layers, 8 micro-batches: the weight pass is each layer's
  // weight-gradient matmuls (the head's too); the held-back W's fill 1F1B's cool-down.
  const Hardware hw = round_hardware();
  const Transformer m = tiny_gpt();
  ParallelConfig c;
  c.pp = 2;
  const StepEstimate one = estimate_step(m, hw, c);
  c.zero_bubble = true;
  const StepEstimate zb = estimate_step(m, hw, c);
  ASSERT_TRUE(one.feasible && zb.feasible) << one.reason << zb.reason;
  const Shard sh{1, 1, false, Recompute::none};
  auto secs = [&](const Work& w) { return w.gemm_flops / 5e5 + w.attn_flops / 2.5e5 + w.hbm_bytes / 5e4; };
  const LayerWork l = layer_work(m, sh), head = head_work(m, sh);
  // the four linear layers' weight gradients: 2 T h (3h + h + 4h + 4h) / t flops, T = 4 tokens
  EXPECT_NEAR(l.wgrad.gemm_flops, 2.0 * 4 * 8 * (24 + 8 + 32 + 32), 1e-9);
  EXPECT_NEAR(zb.stage_weight_backward[0], 2 * secs(l.wgrad), 1e-15);
  EXPECT_NEAR(zb.stage_weight_backward[1], 2 * secs(l.wgrad) + secs(head.wgrad), 1e-15);
  EXPECT_EQ(zb.stage_backward, one.stage_backward);  // the same work, in two passes
  EXPECT_LT(zb.pipeline_s, one.pipeline_s);
  EXPECT_LT(zb.bubble, one.bubble);
  // the fullest rank (0) runs each W right after its I: ZB-H1's peak is 1F1B's, as the
  // paper says; rank 1 holds back a W, and what it reads, longer
  EXPECT_EQ(zb.memory.activations, one.memory.activations);
  EXPECT_GT(zb.rank_memory[1], one.rank_memory[1]);
  EXPECT_NE(zb.config.str().find("zb-h1"), std::string::npos);
  c.vp = 2;
  EXPECT_NE(estimate_step(m, hw, c).reason.find("ZB-H1 is a schedule of PP > 1 without virtual stages"),
            std::string::npos);
}

TEST(AutoplanStep, ShapesThatDoNotDivideAreRefusedWithAReason) {
  const Hardware hw = round_hardware();
  const Transformer m = tiny_gpt();
  ParallelConfig c;
  c.tp = 4;  // 2 heads
  EXPECT_NE(estimate_step(m, hw, c).reason.find("does not divide the 2 attention heads"), std::string::npos);
  c = {};
  c.dp = 3;
  EXPECT_NE(estimate_step(m, hw, c).reason.find("not a multiple of DP 3"), std::string::npos);
  c = {};
  c.pp = 2;
  c.vp = 2;
  c.micro_batch = 8;  // one micro-batch: not a multiple of PP
  EXPECT_NE(estimate_step(m, hw, c).reason.find("multiple of PP 2"), std::string::npos);
  c = {};
  c.pp = 2;
  c.layers_per_stage = {1, 2};
  EXPECT_NE(estimate_step(m, hw, c).reason.find("adding up to 4"), std::string::npos);
}

TEST(AutoplanOrders, OneFOneBByHandAndItsMemory) {
  const Orders o = one_f_one_b(2, 3);
  const std::vector<std::vector<Action>> want = {
      {{'F', 0, 0}, {'F', 0, 1}, {'B', 0, 0}, {'F', 0, 2}, {'B', 0, 1}, {'B', 0, 2}},
      {{'F', 1, 0}, {'B', 1, 0}, {'F', 1, 1}, {'B', 1, 1}, {'F', 1, 2}, {'B', 1, 2}}};
  ASSERT_EQ(o.orders.size(), 2u);
  for (size_t r = 0; r < 2; ++r) {
    ASSERT_EQ(o.orders[r].size(), want[r].size());
    for (size_t i = 0; i < want[r].size(); ++i) {
      EXPECT_EQ(o.orders[r][i].kind, want[r][i].kind);
      EXPECT_EQ(o.orders[r][i].stage, want[r][i].stage);
      EXPECT_EQ(o.orders[r][i].mb, want[r][i].mb);
    }
  }
  // ZB-H1 by hand, 1 byte saved per F and 0.5 kept from each I to its W: rank 0
  // F0 F1 I0 W0 F2 I1 W1 I2 W2 peaks at 2; rank 1 F0 I0 F1 I1 W0 F2 I2 W1 W2 at 1.5.
  EXPECT_EQ(peak_held(zb_h1(2, 3), {1, 1}, {0.5, 0.5}), (std::vector<double>{2, 1.5}));
  // 1F1B: rank r holds min(p - r, m) micro-batches.
  const auto held = peak_held(one_f_one_b(4, 8), {1, 1, 1, 1});
  EXPECT_EQ(held, (std::vector<double>{4, 3, 2, 1}));
  // Interleaved: rank 0 holds p v + p - 1 chunk-micro-batches, 1 + (p - 1) / (p v) times
  // 1F1B's p micro-batches of the whole stage (Narayanan et al. 2021, Korthikanti et al. 2022).
  const int p = 4, v = 3;
  const auto il = peak_held(one_f_one_b(p, 8, v), std::vector<double>(p * v, 1.0));
  EXPECT_EQ(il[0], p * v + p - 1);
  // Every order runs: the simulator raises on orders that cannot finish.
  PipelineModel pm;
  const Orders big = one_f_one_b(8, 16, 5);
  pm.orders = big.orders;
  pm.placement = big.placement;
  pm.microbatches = 16;
  EXPECT_NEAR(simulate_pipeline(pm).bubble(), 7.0 / (5 * 16 + 7), 1e-12);  // (p - 1) / (v m + p - 1)
}

SplitProblem random_problem(std::mt19937& rng, int blocks, int stages, bool memory) {
  std::uniform_real_distribution<double> u(0.5, 2.0);
  SplitProblem p;
  for (int i = 0; i < blocks; ++i) {
    p.block_time.push_back(u(rng));
    p.block_static.push_back(u(rng));
    p.block_saved.push_back(u(rng));
  }
  for (int s = 0; s < stages; ++s) {
    p.stage_time.push_back(s == 0 || s == stages - 1 ? u(rng) : 0);
    p.stage_bytes.push_back(u(rng));
    p.in_flight.push_back(stages - s);
  }
  if (memory) {  // about what an even split needs, so that the limit bites
    double total = 0;
    for (int i = 0; i < blocks; ++i) total += p.block_static[static_cast<size_t>(i)] + p.block_saved[static_cast<size_t>(i)] * stages / 2.0;
    p.memory_limit = total / stages * std::uniform_real_distribution<double>(0.8, 1.6)(rng) + 1;
  }
  return p;
}

TEST(AutoplanSplit, DynamicProgrammingMatchesBruteForce) {
  std::mt19937 rng(7);
  int feasible = 0, infeasible = 0, binding = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int blocks = 3 + trial % 9, stages = 1 + trial % std::min(blocks, 5);
    const SplitProblem p = random_problem(rng, blocks, stages, trial % 2 == 1);
    const Split dp = split_stages(p, stages), bf = split_brute_force(p, stages);
    SplitProblem unlimited = p;
    unlimited.memory_limit = std::numeric_limits<double>::infinity();
    if (dp.feasible && split_stages(unlimited, stages).bottleneck < dp.bottleneck) ++binding;
    ASSERT_EQ(dp.feasible, bf.feasible) << "trial " << trial;
    if (!dp.feasible) {
      ++infeasible;
      continue;
    }
    ++feasible;
    EXPECT_NEAR(dp.bottleneck, bf.bottleneck, 1e-12) << "trial " << trial;
    int64_t sum = 0;
    for (auto n : dp.blocks) {
      EXPECT_GE(n, 1);
      sum += n;
    }
    EXPECT_EQ(sum, blocks);
  }
  EXPECT_GT(feasible, 100);
  EXPECT_GT(infeasible, 5);  // no split fits
  EXPECT_GT(binding, 10);    // the limit moves the split off the fastest one
}

TEST(AutoplanSplit, IdenticalLayersGiveTheHeadStageFewer) {
  // 10 equal layers, 3 stages, the last stage also runs a head worth 2 layers.
  SplitProblem p;
  p.block_time.assign(10, 1.0);
  p.stage_time = {0, 0, 2};
  const Split s = split_stages(p, 3);
  EXPECT_EQ(s.blocks, (std::vector<int64_t>{4, 4, 2}));
  EXPECT_DOUBLE_EQ(s.bottleneck, 4);
}

Transformer small_llama() {
  Transformer m;
  m.name = "small";
  m.layers = 8;
  m.hidden = 1024;
  m.heads = 8;
  m.kv_heads = 4;
  m.ffn = 4096;
  m.vocab = 32000;
  m.seq = 2048;
  m.global_batch = 32;
  m.gated_mlp = true;
  m.flash_attention = true;
  m.dropout = false;
  m.biases = false;
  m.learned_positions = false;
  m.tied_embeddings = false;
  return m;
}

TEST(AutoplanSplit, InterleavedRanksGiveTheHeadRankFewerLayers) {
  // 8 chunks of 2 layers over 4 ranks (rank r runs chunks r and r + 4); the last chunk also
  // runs a head worth 1.6 layers. By hand: rank 3 (5.6) gives a layer of its last chunk
  // to rank 0's first (4 -> 5); then no move lowers the busiest rank (5) any more.
  std::vector<double> extra(8, 0);
  extra[7] = 1.6;
  EXPECT_EQ(balance_ranks(std::vector<int64_t>(8, 2), 1.0, extra, 4), (std::vector<int64_t>{3, 2, 2, 2, 2, 2, 2, 1}));
  // Every stage keeps a layer, and nothing moves when the ranks are even already.
  extra[7] = 30;
  const auto out = balance_ranks(std::vector<int64_t>(8, 2), 1.0, extra, 4);
  EXPECT_EQ(out[3], 1);
  EXPECT_EQ(out[7], 1);
  EXPECT_EQ(std::accumulate(out.begin(), out.end(), int64_t{0}), 16);
  EXPECT_EQ(balance_ranks(std::vector<int64_t>(8, 2), 1.0, {}, 4), std::vector<int64_t>(8, 2));
  // In the step model, an interleaved plan's split is never slower than equal counts.
  Transformer m = small_llama();
  m.layers = 16;
  m.vocab = 256000;  // a head worth a few layers
  m.global_batch = 64;
  ParallelConfig c;
  c.pp = 4;
  c.vp = 2;
  const Hardware& hw = hardware("h100_sxm");
  const StepEstimate chosen = estimate_step(m, hw, c);
  c.layers_per_stage = std::vector<int64_t>(8, 2);
  const StepEstimate even = estimate_step(m, hw, c);
  ASSERT_TRUE(chosen.feasible && even.feasible);
  EXPECT_NE(chosen.config.layers_per_stage, c.layers_per_stage);
  EXPECT_LT(chosen.step_s, even.step_s);
}

TEST(AutoplanTransformer, ContextParallelSplitsTheTokensAndPassesKvBlocks) {
  // CP 2 on a Llama-like layer: every per-token cost and saved byte halves (the causal
  // load balance gives each rank half the attention), and one ring step each way moves
  // this rank's K and V.
  Transformer m = small_llama();
  const LayerWork one = layer_work(m, {1, 2, true, Recompute::none, 1});
  const LayerWork two = layer_work(m, {1, 2, true, Recompute::none, 2});
  EXPECT_DOUBLE_EQ(two.forward.gemm_flops, one.forward.gemm_flops / 2);
  EXPECT_DOUBLE_EQ(two.forward.attn_flops, one.forward.attn_flops / 2);
  EXPECT_DOUBLE_EQ(two.forward.hbm_bytes, one.forward.hbm_bytes / 2);
  EXPECT_DOUBLE_EQ(two.saved_bytes, one.saved_bytes / 2);
  EXPECT_DOUBLE_EQ(two.tp_bytes, one.tp_bytes / 2);
  EXPECT_EQ(one.cp_forward, 0);
  EXPECT_EQ(two.cp_forward, 1);
  EXPECT_EQ(two.cp_backward, 1);
  EXPECT_EQ(two.cp_recompute, 0);
  const double kv_bytes = 1 * (2048 / 2) * 2 * (4 * 128) / 2 * 2.0;  // tokens x (K, V) x KV dims / TP x bf16
  EXPECT_DOUBLE_EQ(two.cp_bytes, kv_bytes);
  EXPECT_DOUBLE_EQ(two.peak_extra_bytes, two.saved_bytes + 4 * kv_bytes);
  EXPECT_EQ(layer_work(m, {1, 2, true, Recompute::full, 4}).cp_recompute, 3);
}

TEST(AutoplanStep, ContextParallelRingByHand) {
  // CP 2, one stage: each layer's ring step waits for what its block of attention does not
  // cover; gradients are reduced and ZeRO shards over DP x CP; twice the micro-batches of
  // CP's share of the world as DP.
  Hardware hw = round_hardware();
  hw.overlap_compute_share = 0;
  Transformer m = tiny_gpt();
  m.flash_attention = true;
  m.dropout = false;
  ParallelConfig c;
  c.cp = 2;
  c.zero = 1;
  EXPECT_EQ(c.world(), 2);
  const StepEstimate e = estimate_step(m, hw, c);
  ASSERT_TRUE(e.feasible) << e.reason;
  EXPECT_EQ(e.microbatches, 8);
  const LayerWork l = layer_work(m, {1, 1, false, Recompute::none, 2});
  const double block_f = l.forward.attn_flops / 2.5e5 / 2, block_b = l.backward.attn_flops / 2.5e5 / 2;
  const double exposed = std::max(0.0, p2p_time(hw, l.cp_bytes, true) - block_f) +
                         std::max(0.0, p2p_time(hw, 2 * l.cp_bytes, true) - block_b);
  EXPECT_GT(exposed, 0.0);  // the slow link of this table cannot hide it
  EXPECT_NEAR(e.breakdown.cp_comm, 8 * 4 * exposed, 1e-9 * e.step_s);
  EXPECT_NEAR(e.memory.optimizer, total_params(m) * 12 / 2, 1e-6);  // ZeRO-1 over DP 1 x CP 2
  EXPECT_GT(e.breakdown.dp_exposed, 0.0);  // CP ranks' gradients are summed
  // Refused: unfused attention, and a sequence the 2 x CP chunks do not divide.
  EXPECT_NE(estimate_step(tiny_gpt(), hw, c).reason.find("needs fused attention"), std::string::npos);
  c.cp = 4;  // sequence 4 into 8 chunks
  EXPECT_NE(estimate_step(m, hw, c).reason.find("multiple of 2 x CP"), std::string::npos);
}

TEST(AutoplanTransformer, Fp8RunsTheLinearLayersAndKeepsTheirInputsInOneByte) {
  // TP 2 with sequence parallelism on a Llama-like layer, by hand: the linear layers' FLOPs
  // move to FP8 (attention stays), their saved inputs take 1 byte instead of 2, the
  // all-gathers move FP8 copies, and every FP8 operand is quantised (2e + 2 bytes).
  Transformer m = small_llama();
  const Shard sh{1, 2, true, Recompute::none};
  const LayerWork bf16 = layer_work(m, sh);
  m.fp8 = true;
  const LayerWork fp8 = layer_work(m, sh);
  const double T = 2048, h = 1024, f = 4096, t = 2, hq = 1024, hkv = 512, e = 2;
  EXPECT_DOUBLE_EQ(fp8.forward.gemm_flops, 0);
  EXPECT_DOUBLE_EQ(fp8.forward.fp8_gemm_flops, bf16.forward.gemm_flops);
  EXPECT_DOUBLE_EQ(fp8.backward.fp8_gemm_flops, 2 * bf16.forward.gemm_flops);
  EXPECT_DOUBLE_EQ(fp8.forward.attn_flops, bf16.forward.attn_flops);
  const double cast = 2 * e + 2;
  EXPECT_DOUBLE_EQ(fp8.forward.hbm_bytes - bf16.forward.hbm_bytes, cast * T * (2 * h / t + hq / t + f / t));
  EXPECT_DOUBLE_EQ(fp8.backward.hbm_bytes - bf16.backward.hbm_bytes,
                   cast * T * ((hq + 2 * hkv) / t + 2 * f / t + 2 * h / t));
  // Saved: QKV and MLP inputs (local shards) and the MLP output's input halve; the output
  // projection keeps an FP8 copy beside the attention output flash attention keeps.
  const double saved_delta = -(2 * T * h / t) * (e - 1) - T * f / t * (e - 1) + T * hq / t;
  EXPECT_DOUBLE_EQ(fp8.saved_bytes - bf16.saved_bytes, saved_delta);
  EXPECT_DOUBLE_EQ(fp8.tp_bytes, bf16.tp_bytes);
  EXPECT_DOUBLE_EQ(fp8.tp_gather_bytes, bf16.tp_bytes / e);
  // The head and the embedding stay in bf16.
  EXPECT_DOUBLE_EQ(head_work(m, sh).forward.gemm_flops, head_work(small_llama(), sh).forward.gemm_flops);
  EXPECT_DOUBLE_EQ(head_work(m, sh).tp_gather_bytes, head_work(m, sh).tp_bytes);
  EXPECT_DOUBLE_EQ(layer_fp8_weight_bytes(m, 2), 2 * (h * (hq + 2 * hkv) + hq * h + 3 * h * f) / t);
  EXPECT_DOUBLE_EQ(layer_fp8_weight_bytes(small_llama(), 2), 0);
}

TEST(AutoplanStep, Fp8TimesItsGemmsAtFp8RateAndCachesItsWeights) {
  // One rank: FP8 GEMMs at fp8_peak_flops x fp8_gemm_efficiency; every layer's FP8 weight
  // copies counted with the parameters (ZeRO-3: only the two gathered layers' ones).
  Hardware hw = round_hardware();
  hw.fp8_peak_flops = 4e6;
  hw.fp8_gemm_efficiency = 0.25;
  Transformer m = small_llama();
  m.fp8 = true;
  ParallelConfig c;
  c.micro_batch = 4;
  const StepEstimate e = estimate_step(m, hw, c);
  ASSERT_TRUE(e.feasible) << e.reason;
  const Shard sh{4, 1, false, Recompute::none};
  auto secs = [&](const Work& w) {
    return w.gemm_flops / 5e5 + w.fp8_gemm_flops / 1e6 + w.attn_flops / 2.5e5 + w.hbm_bytes / 5e4;
  };
  const LayerWork l = layer_work(m, sh), emb = embedding_work(m, sh), head = head_work(m, sh);
  const double F = 8 * secs(l.forward) + secs(emb.forward) + secs(head.forward);
  EXPECT_NEAR(e.stage_forward[0], F, 1e-12 * F);
  EXPECT_NEAR(e.memory.params, total_params(m) * 2 + 8 * layer_fp8_weight_bytes(m, 1), 1e-3);
  c.dp = 2;
  c.micro_batch = 2;
  c.zero = 3;
  const StepEstimate z3 = estimate_step(m, hw, c);
  ASSERT_TRUE(z3.feasible) << z3.reason;
  EXPECT_NEAR(z3.memory.params, total_params(m), 1e-3);
  EXPECT_NEAR(z3.memory.other, l.peak_extra_bytes / 2 + 2 * (layer_params(m, 1) * 2 + layer_fp8_weight_bytes(m, 1)),
              1e-3);
  // Hardware without FP8 refuses it, saying why.
  EXPECT_NE(estimate_step(m, round_hardware(), c).reason.find("FP8 tensor cores"), std::string::npos);
}

TEST(AutoplanSearch, ContextParallelOnlyWhenAsked) {
  const Hardware& hw = hardware("h100_sxm");
  const Transformer m = small_llama();
  SearchConstraints c;
  c.world = 16;
  c.top_k = 1000;
  const SearchResult plain = search(m, hw, c);
  for (const auto& x : plain.ranked) EXPECT_EQ(x.estimate.config.cp, 1);
  c.max_cp = 4;
  const SearchResult open = search(m, hw, c);
  EXPECT_GT(open.enumerated, plain.enumerated);
  bool some = false;
  for (const auto& x : open.ranked) {
    EXPECT_LE(x.estimate.config.cp, 4);
    EXPECT_EQ(x.estimate.config.world(), 16);
    some = some || x.estimate.config.cp > 1;
  }
  EXPECT_TRUE(some);
  c.cp = 2;
  for (const auto& x : search(m, hw, c).ranked) EXPECT_EQ(x.estimate.config.cp, 2);
}

TEST(AutoplanSearch, RespectsEveryConstraintAndTheMemoryLimit) {
  const Hardware& hw = hardware("h100_sxm");
  const Transformer m = small_llama();
  SearchConstraints c;
  c.world = 32;
  c.top_k = 50;
  c.tp = 2;
  c.pp = 2;
  c.zero = 1;
  c.recompute = static_cast<int>(Recompute::full);
  c.sequence_parallel = 1;
  c.micro_batch = 1;
  const SearchResult r = search(m, hw, c);
  ASSERT_FALSE(r.ranked.empty());
  for (const auto& x : r.ranked) {
    const auto& cfg = x.estimate.config;
    EXPECT_EQ(cfg.tp, 2);
    EXPECT_EQ(cfg.pp, 2);
    EXPECT_EQ(cfg.dp, 8);
    EXPECT_EQ(cfg.zero, 1);
    EXPECT_EQ(cfg.recompute, Recompute::full);
    EXPECT_TRUE(cfg.sequence_parallel);
    EXPECT_EQ(cfg.micro_batch, 1);
    EXPECT_GE(x.estimate.step_s, x.estimate.lower_bound_s);
  }
  // A limit that only some plans meet: every ranked plan under it, some refused for it.
  SearchConstraints tight;
  tight.world = 32;
  tight.top_k = 1000;
  tight.memory_limit = 2e9;
  const SearchResult t = search(m, hw, tight);
  ASSERT_FALSE(t.ranked.empty());
  EXPECT_GT(t.over_memory, 0);
  for (const auto& x : t.ranked) EXPECT_LE(x.estimate.memory.total(), 2e9);
  for (const auto& x : t.rejected)
    if (x.verdict.find("needs") != std::string::npos) EXPECT_GT(x.estimate.memory.total(), 2e9);
}

TEST(AutoplanSearch, PruningNeverLosesTheBest) {
  // Simulate every candidate that fits and compare with the pruned search's top 3.
  const Hardware& hw = hardware("h100_sxm");
  const Transformer m = small_llama();
  SearchConstraints c;
  c.world = 16;
  c.top_k = 3;
  c.memory_limit = 20e9;
  const SearchResult r = search(m, hw, c);
  ASSERT_EQ(r.ranked.size(), 3u);
  EXPECT_GT(r.pruned, 0);  // otherwise this test shows nothing
  std::vector<double> all;
  StepOptions opt;
  opt.memory_limit = 20e9;
  for (int64_t t : {1, 2, 4, 8})
    for (int64_t p : {1, 2, 4, 8})
      for (int64_t v = 1; v * p <= m.layers; ++v)
        for (int64_t b : {1, 2, 4, 8})
          for (int z = 0; z <= 3; ++z)
            for (int sp = 0; sp <= 1; ++sp)
              for (Recompute rc : {Recompute::none, Recompute::full})
                for (bool zb : {false, true}) {
                if (16 % (t * p) || (p == 1 && v > 1) || (t == 1 && sp) || (16 / (t * p) == 1 && z > 0)) continue;
                if (zb && (p == 1 || v > 1)) continue;
                ParallelConfig cfg;
                cfg.tp = t;
                cfg.pp = p;
                cfg.dp = 16 / (t * p);
                cfg.vp = v;
                cfg.micro_batch = b;
                cfg.zero = z;
                cfg.sequence_parallel = sp;
                cfg.recompute = rc;
                cfg.zero_bubble = zb;
                if (!config_problem(m, cfg).empty()) continue;
                const StepEstimate e = estimate_step(m, hw, cfg, opt);
                if (e.feasible) all.push_back(e.step_s);
              }
  std::sort(all.begin(), all.end());
  ASSERT_GE(all.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_DOUBLE_EQ(r.ranked[i].estimate.step_s, all[i]) << i;
  EXPECT_EQ(r.simulated + r.pruned, static_cast<int64_t>(all.size()));
}

}  // namespace
}  // namespace vescale::autoplan
