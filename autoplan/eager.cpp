#include "autoplan/eager.h"
#include "autoplan/eager_memory.h"

#include "autoplan/split.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <sstream>

namespace vescale::autoplan::eager {

namespace {

std::string canonical(const std::string& kind) {
  if (kind == "recv") return "send";
  return kind;
}

std::string mib(double b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1 << 20));
  return buf;
}

// Which units a stage holds: blocks [start, end), plus the units before the blocks on the
// first stage and those after them on the last.
struct StagePlan {
  std::vector<std::vector<size_t>> units;  // per stage: indices into Problem::units
};

StagePlan stage_units(const Problem& p, const std::vector<int64_t>& blocks_per_stage) {
  StagePlan out;
  const auto S = blocks_per_stage.size();
  out.units.resize(S);
  std::vector<size_t> blocks;
  for (size_t i = 0; i < p.units.size(); ++i)
    if (p.units[i].kind == 1) blocks.push_back(i);
  size_t next = 0;
  for (size_t s = 0; s < S; ++s) {
    for (int64_t k = 0; k < blocks_per_stage[s]; ++k) out.units[s].push_back(blocks[next++]);
  }
  for (size_t i = 0; i < p.units.size(); ++i) {
    if (p.units[i].kind == 0) out.units[0].push_back(i);
    if (p.units[i].kind == 2) out.units[S - 1].push_back(i);
  }
  return out;
}

// Blocks grouped so that a stage may only start where a cut is legal.
std::vector<std::pair<int64_t, int64_t>> segments(const Problem& p) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t b = 0;
  for (const auto& u : p.units) {
    if (u.kind != 1) continue;
    if (out.empty() || u.cut_before) out.push_back({b, b + 1});
    else out.back().second = b + 1;
    ++b;
  }
  return out;
}

double comm_time(const CommCost& cost, const std::vector<Comm>& comms, double n) {
  double t = 0;
  for (const auto& c : comms) t += cost.time(c.kind, c.group, c.bytes_a + c.bytes_b * n);
  return t;
}

// The reduction of gradients that arrive Partial over TP (`bytes` of them on this
// rank), in buckets, as vescale/parallel/tp_grads.py and DDP do it: under DDP without a
// pipeline over DP x TP at once (all ranks; DDP's own buckets leave them out); under
// ZeRO-2/3 over TP on each rank's 1/DP slices; otherwise over TP, once per step under
// DDP and once per backward (micro-batch) without it.
double partial_grad_reduction(const CommCost& cost, const Config& c, double bucket, double bytes,
                              std::vector<Priced>* rank0) {
  if (c.tp <= 1 || bytes <= 0) return 0;
  int64_t group = c.tp, runs = 1;
  if (c.dp > 1 && c.zero >= 2) {
    bytes /= static_cast<double>(c.dp);
  } else if (c.dp > 1 && c.pp == 1) {
    group = c.dp * c.tp;
  } else if (c.dp == 1) {
    runs = c.microbatches;
  }
  const double nb = std::max(1.0, std::ceil(bytes / bucket));
  if (rank0) rank0->push_back({"all_reduce", group, bytes / nb, static_cast<int64_t>(nb) * runs, "tp grads"});
  return static_cast<double>(runs) * nb * cost.time("all_reduce", group, bytes / nb);
}

}  // namespace

CommCost::CommCost(std::vector<AlphaBeta> table) : table_(std::move(table)) {
  for (auto& e : table_) e.kind = canonical(e.kind);
}

double CommCost::time(const std::string& kind_in, int64_t group, double bytes) const {
  if (group <= 1) return 0;
  const std::string kind = canonical(kind_in);
  const AlphaBeta* best = nullptr;
  double best_d = std::numeric_limits<double>::infinity();
  for (int pass = 0; pass < 2 && !best; ++pass) {
    const std::string want = pass == 0 ? kind : "all_reduce";
    for (const auto& e : table_) {
      if (e.kind != want) continue;
      const double d = std::abs(std::log(static_cast<double>(e.group) / static_cast<double>(group)));
      if (d < best_d) {
        best_d = d;
        best = &e;
      }
    }
  }
  TORCH_CHECK_VALUE(best != nullptr, "the communication model has no entries (kind ", kind, ")");
  const double scale = best->group == group ? 1.0
                                            : static_cast<double>(group - 1) / static_cast<double>(std::max<int64_t>(best->group - 1, 1));
  return scale * (best->alpha + best->beta * bytes);
}

std::string Config::str() const {
  std::ostringstream os;
  os << "PP" << pp << " DP" << dp << " TP" << tp;
  if (sp) os << " SP";
  if (zero) os << " ZeRO-" << zero;
  if (recompute) os << " recompute";
  if (pp > 1) {
    os << " " << schedule << " m" << microbatches;
    if (vp > 1) os << " v" << vp;
    if (!blocks_per_stage.empty()) {
      os << " [";
      for (size_t i = 0; i < blocks_per_stage.size(); ++i) os << (i ? "," : "") << blocks_per_stage[i];
      os << "]";
    }
  }
  return os.str();
}

const Layout* find_layout(const Problem& p, int64_t tp, bool sp) {
  for (const auto& l : p.layouts)
    if (l.tp == tp && l.sp == sp) return &l;
  return nullptr;
}

namespace {

const Schedule* find_schedule(const Problem& p, const Config& c) {
  for (const auto& s : p.schedules)
    if (s.name == c.schedule && s.pp == c.pp && s.microbatches == c.microbatches && s.vp == c.vp) return &s;
  return nullptr;
}

// Per-stage block counts by `split` (time: balanced measured time under the memory limit).
std::vector<int64_t> choose_split(const Problem& p, const Layout& l, const Config& c, const std::string& split,
                                  double n, const std::vector<double>& flight, double memory_limit,
                                  double static_factor) {
  const int64_t S = c.pp * c.vp;
  const auto segs = segments(p);
  const auto nseg = static_cast<int64_t>(segs.size());
  std::vector<size_t> blocks;
  for (size_t i = 0; i < p.units.size(); ++i)
    if (p.units[i].kind == 1) blocks.push_back(i);
  auto block_cost = [&](size_t b) {
    const auto& u = l.units[blocks[b]];
    if (split == "flops") return p.units[blocks[b]].flops;
    if (split == "parameters") return p.units[blocks[b]].params;
    return (c.recompute ? 2.0 : 1.0) * (u.fwd_a + u.fwd_b * n) + u.bwd_a + u.bwd_b * n;
  };
  std::vector<int64_t> seg_counts;
  if (split == "uniform") {
    for (int64_t s = 0; s < S; ++s)
      seg_counts.push_back(static_cast<int64_t>(std::llround(static_cast<double>((s + 1) * nseg) / S)) -
                           static_cast<int64_t>(std::llround(static_cast<double>(s * nseg) / S)));
  } else {
    SplitProblem sp;
    double pre_t = 0, post_t = 0, pre_b = 0, post_b = 0;
    for (size_t i = 0; i < p.units.size(); ++i) {
      const auto& u = l.units[i];
      const double t = split == "flops" ? p.units[i].flops : split == "parameters" ? p.units[i].params
                                                                                    : u.fwd_a + u.fwd_b * n + u.bwd_a + u.bwd_b * n;
      if (p.units[i].kind == 0) pre_t += t, pre_b += u.param_bytes * static_factor;
      if (p.units[i].kind == 2) post_t += t, post_b += u.param_bytes * static_factor;
    }
    for (const auto& [a, b] : segs) {
      double t = 0, st = 0, sv = 0;
      for (int64_t k = a; k < b; ++k) {
        t += block_cost(static_cast<size_t>(k));
        const auto& u = l.units[blocks[static_cast<size_t>(k)]];
        st += u.param_bytes * static_factor;
        sv += c.recompute ? u.out_a + u.out_b * n : u.saved_a + u.saved_b * n;
      }
      sp.block_time.push_back(t);
      sp.block_static.push_back(split == "time" ? st : 0.0);
      sp.block_saved.push_back(split == "time" ? sv : 0.0);
    }
    sp.stage_time.assign(static_cast<size_t>(S), 0.0);
    sp.stage_bytes.assign(static_cast<size_t>(S), 0.0);
    sp.stage_time.front() += pre_t;
    sp.stage_time.back() += post_t;
    if (split == "time") {
      sp.stage_bytes.front() += pre_b;
      sp.stage_bytes.back() += post_b;
      sp.in_flight = flight;
      if (memory_limit > 0) sp.memory_limit = memory_limit / static_cast<double>(c.vp);
    }
    const Split out = split_stages(sp, S);
    if (!out.feasible) return {};
    seg_counts = out.blocks;
  }
  std::vector<int64_t> counts;
  int64_t seg = 0;
  for (const auto k : seg_counts) {
    int64_t blocks_in = 0;
    for (int64_t j = 0; j < k; ++j, ++seg) blocks_in += segs[static_cast<size_t>(seg)].second - segs[static_cast<size_t>(seg)].first;
    counts.push_back(blocks_in);
  }
  return counts;
}

}  // namespace

Estimate estimate(const Problem& p, const Config& cin, const std::string& split, double memory_limit) {
  Estimate e;
  e.config = cin;
  Config& c = e.config;
  const CommCost cost(p.comm);
  auto fail = [&](const std::string& why) {
    e.feasible = false;
    e.reason = why;
    return e;
  };
  if (c.pp * c.dp * c.tp != p.world) return fail("the mesh does not cover the world");
  if (p.batch % c.dp) return fail("the batch of " + std::to_string(p.batch) + " does not split over DP " + std::to_string(c.dp));
  const Layout* lp = find_layout(p, c.tp, c.sp);
  if (!lp) return fail("no tensor-parallel layout for TP " + std::to_string(c.tp) + (c.sp ? " with SP" : ""));
  const Layout& l = *lp;
  if (c.zero < 0 || c.zero > 3 || (c.zero > 0 && c.dp == 1)) return fail("ZeRO needs data parallelism");
  const int64_t local_batch = p.batch / c.dp;
  if (local_batch % c.microbatches) return fail("micro-batches do not divide the local batch");
  const double n = static_cast<double>(local_batch / c.microbatches);
  const int64_t S = c.pp * c.vp;
  const auto segs = segments(p);
  if (S > static_cast<int64_t>(segs.size()))
    return fail(std::to_string(S) + " stages from " + std::to_string(segs.size()) + " blocks that can be cut between");
  const Schedule* sched = nullptr;
  std::vector<double> flight(static_cast<size_t>(S), 1.0);
  if (c.pp > 1) {
    sched = find_schedule(p, c);
    if (!sched) return fail("no orders for schedule " + c.schedule);
    flight = in_flight(*sched, S);
  }
  const double dpd = static_cast<double>(c.dp);
  // bytes per parameter byte that stay put whatever the micro-batches: parameters,
  // gradients, optimizer state (per element: the parameters are fp32, 4 bytes)
  const double per_elem_state = c.zero >= 1 ? (p.state_bytes_per_element + p.master_bytes_per_element) / dpd
                                            : p.state_bytes_per_element;
  const double static_factor = (c.zero == 3 ? 1.0 / dpd : 1.0) + p.grad_bytes_per_param_byte + per_elem_state / 4.0;
  if (c.blocks_per_stage.empty()) {
    if (c.pp == 1) {
      int64_t L = 0;
      for (const auto& u : p.units) L += u.kind == 1;
      c.blocks_per_stage = {L};
    } else {
      c.blocks_per_stage = choose_split(p, l, c, split, n, flight, memory_limit, static_factor);
      if (c.blocks_per_stage.empty()) return fail("no split of the blocks fits the memory limit");
    }
  }
  const StagePlan stages = stage_units(p, c.blocks_per_stage);

  // per stage, one micro-batch
  std::vector<StageCost> sc(static_cast<size_t>(S)), waits(static_cast<size_t>(S)), shared(static_cast<size_t>(S));
  std::vector<double> compute_f(static_cast<size_t>(S)), compute_b(static_cast<size_t>(S)), tp_s(static_cast<size_t>(S)),
      zero_s(static_cast<size_t>(S)), saved(static_cast<size_t>(S)), pbytes(static_cast<size_t>(S)), pnumel(static_cast<size_t>(S)),
      ptensors(static_cast<size_t>(S)), pgrad(static_cast<size_t>(S)),
      rematerialized(static_cast<size_t>(S)), held_for_w(static_cast<size_t>(S)),
      saved_at_end(static_cast<size_t>(S));  // what the stage's last backward (of its first block) still has
  double root_bytes = 0;  // parameters outside the blocks: ZeRO-3 gathers them with the root module
  for (size_t i = 0; i < p.units.size(); ++i)
    if (p.units[i].kind != 1) root_bytes += l.units[i].param_bytes;
  root_bytes += p.glue_param_bytes / static_cast<double>(c.tp);
  bool splits_backward = false;
  if (sched)
    for (const auto& o : sched->orders)
      for (const auto& a : o) splits_backward |= a.kind == 'I';
  // vescale's limit: a split backward (ZB-H1, ZB-V) of checkpointed blocks recomputes them
  // once per weight-gradient pass (measured: 8 forwards of a block per micro-batch, 1F1B 2)
  if (splits_backward && c.recompute) return fail("vescale does not recompute under a zero-bubble schedule");
  for (int64_t s = 0; s < S; ++s) {
    const auto us = static_cast<size_t>(s);
    double f = 0, b = 0, bi = 0, tpf = 0, tpb = 0, z = 0;
    if (s > 0) {  // the units before this stage run as shadows on meta in its forward
      for (size_t i = 0; i < p.units.size(); ++i) {
        const bool before = p.units[i].kind == 0 ||
                            (p.units[i].kind == 1 && std::find(stages.units[us].begin(), stages.units[us].end(), i) ==
                                                         stages.units[us].end() && i < stages.units[us].front());
        if (before) f += l.units[i].shadow;
      }
    }
    bool block_seen = false;
    for (const auto i : stages.units[us]) {
      const auto& u = l.units[i];
      const bool block = p.units[i].kind == 1, again = c.recompute && block;
      const double uf = u.fwd_a + u.fwd_b * n;
      const double ub = (u.bwd_a + u.bwd_b * n) * (splits_backward && block ? u.split_cost : 1.0);
      const double uc = comm_time(cost, u.fwd_comm, n);
      f += uf;
      b += ub + (again ? uf : 0.0);  // a recomputed block runs its forward again first
      bi += ub * (block ? u.input_share : 0.5) + (again ? uf : 0.0);
      tpf += uc;
      tpb += comm_time(cost, u.bwd_comm, n) + (again ? uc : 0.0);
      const double keeps = again ? u.out_a + u.out_b * n : u.saved_a + u.saved_b * n;
      saved[us] += keeps;
      if (p.units[i].kind == 0 || (block && !block_seen)) saved_at_end[us] += keeps;
      block_seen |= block;
      held_for_w[us] += u.held_a + u.held_b * n;
      // a recomputed block's forward runs again in its backward: what it saves lives until then
      if (again) rematerialized[us] = std::max(rematerialized[us], u.saved_a + u.saved_b * n);
      pbytes[us] += u.param_bytes;
      pnumel[us] += u.param_numel;
      pgrad[us] += u.partial_grad_bytes;
      ptensors[us] += static_cast<double>(u.param_tensors);
      if (c.zero == 3 && p.units[i].kind == 1) {
        // gathered (and unpacked into the parameters) for the forward and the backward
        z += 2 * (cost.time("all_gather", c.dp, std::ceil(u.param_bytes / dpd)) + p.copy_per_byte * u.param_bytes);
      }
    }
    if (c.zero == 3 && c.pp == 1) {  // the root's parameters, gathered for the forward and the backward
      z += 2 * (cost.time("all_gather", c.dp, std::ceil(root_bytes / dpd)) + p.copy_per_byte * root_bytes);
    }
    if ((c.pp > 1 ? sched->placement[us] : 0) == 0) {
      const auto mi = c.microbatches;
      for (const auto i : stages.units[us]) {
        const auto& u = l.units[i];
        const int64_t fwd_runs = c.recompute && p.units[i].kind == 1 ? 2 : 1;
        for (const auto& x : u.fwd_comm) e.rank0_comms.push_back({x.kind, x.group, x.bytes_a + x.bytes_b * n, fwd_runs * mi, "tp"});
        for (const auto& x : u.bwd_comm) e.rank0_comms.push_back({x.kind, x.group, x.bytes_a + x.bytes_b * n, mi, "tp"});
        if (c.zero == 3 && p.units[i].kind == 1)
          e.rank0_comms.push_back({"all_gather", c.dp, std::ceil(u.param_bytes / dpd / 4) * 4, 2 * mi, "zero3"});
      }
      if (c.zero == 3 && c.pp == 1)
        e.rank0_comms.push_back({"all_gather", c.dp, std::ceil(root_bytes / dpd / 4) * 4, 2 * mi, "zero3"});
    }
    compute_f[us] = f;
    compute_b[us] = b;
    tp_s[us] = tpf + tpb;
    zero_s[us] = z;
    // the pipeline runtime's own work per schedule action (processor time at full speed)
    const double act = c.pp > 1 ? p.action_seconds : 0.0;
    sc[us].forward = f + tpf + z / 2 + act;
    sc[us].backward = b + tpb + z / 2 + act;
    sc[us].input_backward = bi + tpb + z / 2 + act;
    sc[us].weight_backward = b - bi + act;
    // on shared processors: compute at full speed, then the collectives (no processor)
    const double slow = p.cores > 0 ? std::max(1.0, static_cast<double>(p.profiled_busy) / p.cores) : 1.0;
    waits[us] = {tpf + z / 2, tpb + z / 2, tpb + z / 2, 0.0};
    shared[us] = {f / slow + act, b / slow + act, bi / slow + act, (b - bi) / slow + act};
    e.stage_forward.push_back(sc[us].forward);
    e.stage_backward.push_back(sc[us].backward);
  }

  // the timeline of forward and backward
  const int64_t m = c.microbatches;
  std::vector<double> finish(static_cast<size_t>(c.pp), 0.0), busy(static_cast<size_t>(c.pp), 0.0);
  double makespan = 0;
  // every rank computing at once (no pipeline; the optimizer) against how the profile ran
  auto slowdown = [&](double busy_ranks) { return p.cores > 0 ? std::max(1.0, busy_ranks / p.cores) : 1.0; };
  const double all_busy = slowdown(static_cast<double>(p.world)) / slowdown(static_cast<double>(p.profiled_busy));
  if (c.pp == 1) {
    makespan = (compute_f[0] + compute_b[0]) * all_busy + tp_s[0] + zero_s[0];
    finish[0] = busy[0] = makespan;
  } else {
    PipelineModel pm;
    pm.name = c.str();
    pm.orders = sched->orders;
    pm.placement = sched->placement;
    pm.microbatches = static_cast<int32_t>(m);
    pm.costs = sc;
    for (int64_t s = 0; s + 1 < S; ++s) {
      // what the stage's last block hands on
      const auto& last = l.units[stages.units[static_cast<size_t>(s)].front() + c.blocks_per_stage[static_cast<size_t>(s)] - 1];
      const double bytes = last.out_a + last.out_b * n;
      const bool same = sched->placement[static_cast<size_t>(s)] == sched->placement[static_cast<size_t>(s + 1)];
      const double t = same ? 0.0 : cost.time("send", 2, bytes);
      pm.send_forward.push_back(t);
      pm.send_backward.push_back(t);
      if (!same) {  // the activation forward, its gradient back: rank 0's sends and receives
        const auto m32 = c.microbatches;
        if (sched->placement[static_cast<size_t>(s)] == 0) {
          e.rank0_comms.push_back({"send", c.pp, bytes, m32, "pipeline"});
          e.rank0_comms.push_back({"recv", c.pp, bytes, m32, "pipeline"});
        }
        if (sched->placement[static_cast<size_t>(s + 1)] == 0) {
          e.rank0_comms.push_back({"recv", c.pp, bytes, m32, "pipeline"});
          e.rank0_comms.push_back({"send", c.pp, bytes, m32, "pipeline"});
        }
      }
    }
    Timeline tl;
    if (p.cores > 0) {
      // each pipeline rank of the timeline stands for its dp x tp processes, which compute
      // in step with it: k busy pipeline ranks keep k * dp * tp processes busy
      pm.costs = shared;
      tl = simulate_pipeline_shared(pm, p.cores / static_cast<double>(c.dp * c.tp), waits);
    } else {
      tl = simulate_pipeline(pm);
    }
    makespan = tl.makespan;
    for (const auto& a : tl.actions) {
      auto& fr = finish[static_cast<size_t>(a.rank)];
      fr = std::max(fr, a.end);
    }
    busy = tl.busy;
    e.bubble = tl.bubble();
  }

  // after the timeline, per pipeline rank
  const int64_t first_rank = c.pp > 1 ? sched->placement.front() : 0;
  const int64_t last_rank = c.pp > 1 ? sched->placement.back() : 0;
  double step = 0;
  Breakdown worst;
  e.rank_memory.assign(static_cast<size_t>(c.pp), Memory{});
  for (int64_t r = 0; r < c.pp; ++r) {
    double rb = 0, rn = 0, rt = 0, rf = 0, rbk = 0, rtp = 0, rz = 0, rpg = 0, rremat = 0;
    // ZeRO's units on this rank (vescale/parallel/ddp.py shard_gradients reduce-scatters
    // one unit's gradients per bucket): each block, then the root (everything outside them)
    std::vector<double> zero_units;
    double root_unit_bytes = 0, head_bytes = 0;  // head: the units after the blocks
    for (int64_t s = 0; s < S; ++s) {
      const auto us = static_cast<size_t>(s);
      if ((c.pp > 1 ? sched->placement[us] : 0) != r) continue;
      for (const auto i : stages.units[us]) {
        if (p.units[i].kind == 1) zero_units.push_back(l.units[i].param_bytes);
        else root_unit_bytes += l.units[i].param_bytes;
        if (p.units[i].kind == 2) head_bytes += l.units[i].param_bytes;
      }
      rb += pbytes[us];
      rn += pnumel[us];
      rt += ptensors[us];
      rremat = std::max(rremat, rematerialized[us]);
      rf += compute_f[us] * static_cast<double>(m) * (c.pp == 1 ? all_busy : 1.0);
      rbk += compute_b[us] * static_cast<double>(m) * (c.pp == 1 ? all_busy : 1.0);
      rtp += tp_s[us] * static_cast<double>(m);
      rz += zero_s[us] * static_cast<double>(m);
      rpg += pgrad[us];
    }
    // without a pipeline (one stage) the gradients come as the saved tensors go: whole,
    // they meet what the first block's backward still has
    const Kept kept = c.pp > 1 ? peak_kept(sched->orders[static_cast<size_t>(r)], saved, held_for_w)
                               : Kept{saved[0], saved_at_end[0]};
    rb += p.glue_param_bytes / static_cast<double>(c.tp);
    root_unit_bytes += p.glue_param_bytes / static_cast<double>(c.tp);
    if (c.pp > 1 && r == last_rank && first_rank != last_rank) {  // its own copy of a tensor tied to the first stage
      rb += p.tied_param_bytes / static_cast<double>(c.tp);
      root_unit_bytes += p.tied_param_bytes / static_cast<double>(c.tp);
      rn += p.tied_param_bytes / 4.0 / static_cast<double>(c.tp);
      rt += 1;
    }
    RankHoldings held;
    held.blocks = zero_units;
    zero_units.push_back(root_unit_bytes);
    // the gradient bytes that go through data parallelism's buckets: Partial (TP) gradients
    // summed over DP x TP at once (no pipeline, ZeRO-0/1) are not in DDP's own buckets
    const bool composed = c.pp == 1 && c.zero <= 1;
    const double bucketed = rb * p.grad_bytes_per_param_byte - (composed ? rpg : 0.0);
    // data parallelism: the gradients' reduction, the parameters' gather after a ZeRO-1/2 step, the loss
    double dp_t = partial_grad_reduction(cost, c, p.bucket_bytes, rpg, r == 0 ? &e.rank0_comms : nullptr);
    if (c.dp > 1) {
      const double grads = bucketed;
      std::vector<double> buckets;
      if (c.zero >= 2) {
        for (const double u : zero_units)
          for (const double b : buckets_of(u * p.grad_bytes_per_param_byte, p.bucket_bytes)) buckets.push_back(b);
      } else {
        buckets = buckets_of(grads, p.bucket_bytes);
      }
      const auto nb = static_cast<double>(std::max<size_t>(1, buckets.size()));
      const char* kind = c.zero >= 2 ? "reduce_scatter" : "all_reduce";
      double red = 0;
      for (const double b : buckets) {
        red += cost.time(kind, c.dp, b);
        if (r == 0) e.rank0_comms.push_back({kind, c.dp, b, 1, "dp"});
      }
      // without a pipeline the buckets but the last overlap the rest of the backward
      const double hidden = c.pp == 1 && nb > 1 ? std::min(red * (nb - 1) / nb, 0.5 * rbk) : 0.0;
      dp_t += red - hidden;
      // DDP packs the gradients into its bucket, averages and unpacks them (ZeRO-2/3 keep a slice)
      dp_t += p.copy_per_byte * grads * (c.zero >= 2 ? 2.0 + 1.0 / dpd : 3.0);
      // ZeRO-1/2: the updated slices gathered (ZeRO-2: bucket by bucket) and unpacked into the parameters
      std::vector<double> gathered;
      if (c.zero == 1) gathered.push_back(rb / dpd);
      if (c.zero == 2)
        for (const double b : buckets) gathered.push_back(b / p.grad_bytes_per_param_byte / dpd);
      for (const double g : gathered) {
        dp_t += cost.time("all_gather", c.dp, std::ceil(g));
        if (r == 0) e.rank0_comms.push_back({"all_gather", c.dp, g, 1, "zero"});
      }
      if (!gathered.empty()) dp_t += p.copy_per_byte * (rb + rb / dpd);
      if (c.zero == 3) dp_t += p.copy_per_byte * rb / dpd;  // the updated slices into the parameters' slices
      dp_t += cost.time("all_reduce", c.dp, 8);
    }
    double pp_t = 0;
    if (c.pp > 1) {
      // ZeRO-3: the root's parameters this rank holds (embeddings, final norm, head, glue)
      // are gathered once and held for the whole schedule (vescale/parallel/pipeline/engine.py)
      if (c.zero == 3 && root_unit_bytes > 0) {
        const double t = cost.time("all_gather", c.dp, std::ceil(root_unit_bytes / dpd)) + p.copy_per_byte * root_unit_bytes;
        pp_t += t;
        rz += t;
        if (r == 0) e.rank0_comms.push_back({"all_gather", c.dp, std::ceil(root_unit_bytes / dpd / 4) * 4, 1, "zero3"});
      }
      if (p.tied_param_bytes > 0 && (r == first_rank || r == last_rank) && first_rank != last_rank) {
        pp_t += cost.time("all_reduce", 2, p.tied_param_bytes / static_cast<double>(c.tp));
        if (r == 0) e.rank0_comms.push_back({"all_reduce", 2, p.tied_param_bytes / static_cast<double>(c.tp), 1, "stage sync"});
      }
      if (p.glue_param_bytes > 0) pp_t += cost.time("all_reduce", c.pp, p.glue_param_bytes / static_cast<double>(c.tp));
      pp_t += cost.time("broadcast", c.pp, 8);
    }
    const double elements = c.zero >= 1 ? rn / dpd : rn;
    const double opt_t = (p.optimizer_per_tensor * rt + p.optimizer_per_element * elements) * all_busy;
    const double end = finish[static_cast<size_t>(r)] + dp_t + pp_t + opt_t;
    // memory
    held.param_bytes = rb;
    held.optimizer_elements = elements;
    held.root_bytes = root_unit_bytes;
    held.head_bytes = head_bytes;
    held.saved = kept.peak;
    held.saved_with_grads = kept.with_grads;
    held.rematerialized = rremat;
    held.bucketed = bucketed;
    if (r == last_rank) {
      // the forward's and backward's temporaries (logits, gradients of activations): the
      // peak of a forward + backward beyond what the units save, as measured at this
      // layout's shards, or the unsharded one's split over TP (the loss may gather the
      // logits whole: measured, TP4 GPT's are 3.7 MiB more than a quarter)
      const Layout& at = l.has_working ? l : p.layouts.front();
      const double working = l.has_working ? l.working_a + l.working_b * n : p.working_a + p.working_b * n;
      double all_saved = 0;
      for (const auto& u : at.units) all_saved += u.saved_a + u.saved_b * n;
      held.transient = std::max(0.0, working - all_saved) / static_cast<double>(l.has_working ? 1 : c.tp);
    }
    const Memory mem = rank_memory(p, c, held);
    e.rank_memory[static_cast<size_t>(r)] = mem;
    if (mem.total() > e.memory.total()) e.memory = mem;
    if (end > step) {
      step = end;
      // the timeline's busy time holds the rank's compute at the speed it ran (processors
      // shared) and its actions' collectives
      worst.compute = c.pp > 1 ? std::max(0.0, busy[static_cast<size_t>(r)] - rtp - rz) : rf + rbk;
      worst.tp_comm = rtp;
      worst.zero_comm = rz;
      worst.idle = std::max(0.0, finish[static_cast<size_t>(r)] - busy[static_cast<size_t>(r)]);
      worst.dp_comm = dp_t;
      worst.pp_sync = pp_t;
      worst.optimizer = opt_t;
    }
  }
  worst.other = p.step_overhead;
  e.breakdown = worst;
  e.step_s = step + p.step_overhead;
  e.feasible = true;
  if (memory_limit > 0 && e.memory.total() > memory_limit) {
    e.feasible = false;
    e.reason = "needs " + mib(e.memory.total()) + " per rank, over the limit of " + mib(memory_limit);
  }
  return e;
}

}  // namespace vescale::autoplan::eager
