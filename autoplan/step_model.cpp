#include "autoplan/step_model.h"

#include "autoplan/comm_time.h"
#include "autoplan/pipeline_sim.h"
#include "autoplan/split.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <sstream>

namespace vescale::autoplan {

std::string ParallelConfig::str() const {
  std::ostringstream os;
  os << "dp" << dp << " tp" << tp << " pp" << pp;
  if (cp > 1) os << " cp" << cp;
  if (vp > 1) os << " vp" << vp;
  if (zero_bubble) os << " zb-h1";
  os << " mb" << micro_batch << " zero" << zero << (sequence_parallel ? " sp" : "") << " recompute=" << recompute_name(recompute);
  return os.str();
}

std::shared_ptr<const Orders> OrdersCache::get(int32_t ranks, int32_t microbatches, int32_t virtual_stages,
                                               bool zero_bubble) {
  const auto key = std::make_tuple(ranks, microbatches, virtual_stages, zero_bubble);
  for (const auto& [k, o] : made_)
    if (k == key) return o;
  auto o = std::make_shared<const Orders>(zero_bubble ? zb_h1(ranks, microbatches)
                                                      : one_f_one_b(ranks, microbatches, virtual_stages));
  made_.emplace_back(key, o);
  return o;
}

std::string config_problem(const Transformer& m, const ParallelConfig& c) {
  std::ostringstream os;
  if (c.dp < 1 || c.tp < 1 || c.pp < 1 || c.cp < 1 || c.vp < 1 || c.micro_batch < 1) {
    os << "sizes must be >= 1 (" << c.str() << ")";
  } else if (c.zero < 0 || c.zero > 3) {
    os << "ZeRO stage " << c.zero << " is not 0-3";
  } else if (m.global_batch % (c.dp * c.micro_batch)) {
    os << "global batch " << m.global_batch << " is not a multiple of DP " << c.dp << " x micro-batch " << c.micro_batch;
  } else if (m.heads % c.tp || m.kv_heads % c.tp) {
    os << "TP " << c.tp << " does not divide the " << m.heads << " attention heads and " << m.kv_heads << " KV heads";
  } else if (m.ffn % c.tp) {
    os << "TP " << c.tp << " does not divide the MLP width " << m.ffn;
  } else if (c.cp > 1 && !m.flash_attention) {
    os << "context parallelism needs fused attention (its ring runs attention block by block inside the kernel)";
  } else if (c.cp > 1 && m.seq % (2 * c.cp)) {
    os << "CP " << c.cp << " needs the sequence (" << m.seq << ") to be a multiple of 2 x CP (the causal load "
       << "balance cuts it into 2 x CP chunks)";
  } else if (c.stages() > m.layers) {
    os << "PP " << c.pp << " x " << c.vp << " virtual stages is more stages than the " << m.layers << " layers";
  } else if (c.vp > 1 && c.pp == 1) {
    os << "virtual stages need pipeline parallelism (PP > 1)";
  } else if (c.zero_bubble && (c.pp == 1 || c.vp > 1)) {
    os << "ZB-H1 is a schedule of PP > 1 without virtual stages";
  } else if (c.vp > 1 && (m.global_batch / (c.dp * c.micro_batch)) % c.pp) {
    os << "interleaved 1F1B needs the micro-batches (" << m.global_batch / (c.dp * c.micro_batch)
       << ") to be a multiple of PP " << c.pp;
  } else if (!c.layers_per_stage.empty()) {
    const auto sum = std::accumulate(c.layers_per_stage.begin(), c.layers_per_stage.end(), int64_t{0});
    const bool positive = std::all_of(c.layers_per_stage.begin(), c.layers_per_stage.end(), [](int64_t n) { return n >= 1; });
    if (static_cast<int64_t>(c.layers_per_stage.size()) != c.stages() || sum != m.layers || !positive)
      os << "layers per stage must be " << c.stages() << " counts >= 1 adding up to " << m.layers;
  }
  return os.str();
}

namespace {

constexpr double GiB = 1024.0 * 1024.0 * 1024.0;

// Seconds of one piece (a layer, the embedding, the head), split by what they are.
struct PieceTime {
  double f_comp = 0, f_tp = 0, b_comp = 0, b_tp = 0, r_comp = 0, r_tp = 0;
  double f_cp = 0, b_cp = 0, r_cp = 0;  // context-parallel ring transfers not hidden
  double w_comp = 0;                     // the weight-gradient matmuls, part of b_comp
  double forward() const { return f_comp + f_tp + f_cp; }
  double backward() const { return b_comp + b_tp + r_comp + r_tp + b_cp + r_cp; }
  double weight_backward() const { return w_comp; }
  PieceTime& operator+=(const PieceTime& x) {
    f_comp += x.f_comp; f_tp += x.f_tp; b_comp += x.b_comp; b_tp += x.b_tp; r_comp += x.r_comp; r_tp += x.r_tp;
    f_cp += x.f_cp; b_cp += x.b_cp; r_cp += x.r_cp; w_comp += x.w_comp;
    return *this;
  }
  PieceTime times(double n) const {
    return {n * f_comp, n * f_tp, n * b_comp, n * b_tp, n * r_comp, n * r_tp, n * f_cp, n * b_cp, n * r_cp, n * w_comp};
  }
};

std::vector<int64_t> uniform_split(int64_t layers, int64_t stages) {
  // Equal counts; what does not divide goes to the middle stages first, since the first
  // and the last also hold the embedding and the head.
  std::vector<int64_t> out(static_cast<size_t>(stages), layers / stages);
  int64_t rest = layers % stages;
  for (int64_t s = 1; s + 1 < stages && rest > 0; ++s, --rest) ++out[static_cast<size_t>(s)];
  for (int64_t s = 0; rest > 0; s = (s == 0 ? stages - 1 : 0), --rest) ++out[static_cast<size_t>(s)];
  return out;
}

std::string gib(double bytes) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(1);
  os << bytes / GiB << " GiB";
  return os.str();
}

}  // namespace

StepEstimate estimate_step(const Transformer& m, const Hardware& hw, const ParallelConfig& c, const StepOptions& opt,
                           OrdersCache* cache) {
  StepEstimate est;
  est.config = c;
  if (auto problem = config_problem(m, c); !problem.empty()) {
    est.reason = problem;
    return est;
  }
  const int64_t mbs = m.global_batch / (c.dp * c.micro_batch);
  est.microbatches = mbs;
  const int64_t S = c.stages(), L = m.layers, p = c.pp;
  const bool sp = c.sequence_parallel && c.tp > 1;
  est.config.sequence_parallel = sp;
  const Shard shard{c.micro_batch, c.tp, sp, c.recompute, c.cp};
  const LayerWork layer = layer_work(m, shard), emb = embedding_work(m, shard), head = head_work(m, shard);

  // ---- seconds per piece ----
  if (m.fp8 && hw.fp8_peak_flops <= 0) {
    est.reason = "FP8 needs FP8 tensor cores, which " + hw.name + " has none of (no fp8_peak_flops)";
    return est;
  }
  auto compute = [&](const Work& w) {
    return w.gemm_flops / (hw.peak_flops * hw.gemm_efficiency) +
           (w.fp8_gemm_flops > 0 ? w.fp8_gemm_flops / (hw.fp8_peak_flops * hw.fp8_gemm_efficiency) : 0) +
           w.attn_flops / (hw.peak_flops * hw.attention_efficiency) + w.hbm_bytes / (hw.hbm_bw * hw.hbm_efficiency);
  };
  // Gradients are reduced (and ZeRO shards) over DP x CP: CP ranks hold the same weights.
  const Group tp_group{c.tp, 1}, dp_group{c.dp * c.cp, c.tp};
  auto tp_time = [&](const TpCollectives& k, const LayerWork& w) {
    return k.all_reduce * collective_time(hw, Collective::all_reduce, w.tp_bytes, tp_group) +
           k.all_gather * collective_time(hw, Collective::all_gather, w.tp_gather_bytes, tp_group) +
           k.reduce_scatter * collective_time(hw, Collective::reduce_scatter, w.tp_bytes, tp_group);
  };
  // Collectives overlapped with the GEMMs beside them (hw.tp_overlap of what those cover)
  // leave their hidden part off the critical path and slow the GEMMs by the share of the
  // GPU they take.
  auto overlap = [&](double& comp, double& tp) {
    const double hidden = hw.tp_overlap * std::min(comp, tp);
    comp += hw.overlap_compute_share * hidden;
    tp -= hidden;
  };
  // A context-parallel ring step passes a K/V block to the neighbour while the attention
  // computes on the current one: what the block's attention does not cover waits; the
  // covered part slows the attention by the share of the GPU the transfer takes. The
  // ring spans nodes when TP x CP does not fit in one.
  const bool ring_in_node = c.tp * c.cp <= hw.gpus_per_node;
  auto ring = [&](int steps, double bytes, const Work& w, double& comp) {
    if (steps == 0) return 0.0;
    const double transfer = p2p_time(hw, bytes, ring_in_node);
    const double block = w.attn_flops / (hw.peak_flops * hw.attention_efficiency) / static_cast<double>(c.cp);
    const double hidden = std::min(transfer, block);
    comp += steps * hw.overlap_compute_share * hidden;
    return steps * (transfer - hidden);
  };
  auto piece = [&](const LayerWork& w) {
    PieceTime t{compute(w.forward),   tp_time(w.tp_forward, w),   compute(w.backward),
                tp_time(w.tp_backward, w), compute(w.recompute), tp_time(w.tp_recompute, w)};
    overlap(t.f_comp, t.f_tp);
    overlap(t.b_comp, t.b_tp);
    overlap(t.r_comp, t.r_tp);
    t.f_cp = ring(w.cp_forward, w.cp_bytes, w.forward, t.f_comp);
    t.b_cp = ring(w.cp_backward, 2 * w.cp_bytes, w.backward, t.b_comp);
    t.r_cp = ring(w.cp_recompute, w.cp_bytes, w.recompute, t.r_comp);
    t.w_comp = compute(w.wgrad);
    return t;
  };
  const PieceTime tl = piece(layer), te = piece(emb), th = piece(head);

  // ---- bytes per parameter, by ZeRO stage ----
  const double d = static_cast<double>(c.dp * c.cp);  // ZeRO shards over DP x CP
  const double param_b = c.zero >= 3 ? m.dtype_bytes / d : m.dtype_bytes;
  const double grad_b = c.zero >= 2 ? m.grad_bytes / d : m.grad_bytes;
  const double opt_b = c.zero >= 1 ? m.optimizer_bytes / d : m.optimizer_bytes;
  const double per_param = param_b + grad_b + opt_b;
  const double lp = layer_params(m, c.tp);
  const double emb_p = embedding_params(m, c.tp);
  // With a pipeline, the last stage keeps its own copy of a tied embedding (and its
  // gradient and optimizer state), summed with the first stage's gradient every step.
  const double head_p = head_params(m, c.tp) + (m.tied_embeddings && S > 1
                                                    ? static_cast<double>(m.vocab * m.hidden) / static_cast<double>(c.tp)
                                                    : 0);
  // FP8 copies of the linear weights, cached over the step: per layer held, or (ZeRO-3)
  // of the gathered layers only.
  const double fp8_weights = layer_fp8_weight_bytes(m, c.tp);
  const double fp8_held = c.zero >= 3 ? 0 : fp8_weights;
  const double zero3_buffer = c.zero >= 3 ? 2 * (lp * m.dtype_bytes + fp8_weights) : 0;  // gathered layer + prefetched next
  const double layer_static = lp * per_param + fp8_held;

  OrdersCache local;
  const auto orders = (cache ? cache : &local)->get(static_cast<int32_t>(p), static_cast<int32_t>(mbs),
                                                    static_cast<int32_t>(c.vp), c.zero_bubble);
  const double limit = opt.memory_limit > 0 ? opt.memory_limit : hw.hbm_bytes - hw.reserved_bytes;

  // ---- split ----
  std::vector<int64_t> layers = c.layers_per_stage;
  if (layers.empty()) {
    if (opt.split == "uniform" || S == 1) {
      layers = uniform_split(L, S);
    } else {
      TORCH_CHECK_VALUE(opt.split == "balanced", "unknown split '", opt.split, "'; use 'balanced' or 'uniform'");
      SplitProblem sp_problem;
      sp_problem.block_time.assign(static_cast<size_t>(L), tl.forward() + tl.backward());
      sp_problem.block_static.assign(static_cast<size_t>(L), layer_static);
      sp_problem.block_saved.assign(static_cast<size_t>(L), layer.saved_bytes);
      sp_problem.stage_time.assign(static_cast<size_t>(S), 0);
      sp_problem.stage_bytes.assign(static_cast<size_t>(S), layer.peak_extra_bytes + zero3_buffer);
      sp_problem.in_flight.assign(static_cast<size_t>(S), 1);
      for (int64_t s = 0; s < S; ++s) {
        // 1F1B: stage s holds min(p - s, m) micro-batches. With virtual stages a rank's
        // memory is the sum over its chunks: the split then balances time only and the
        // exact check below decides.
        const double held = c.vp == 1 ? static_cast<double>(std::min(p - s, mbs)) : 1.0;
        sp_problem.in_flight[static_cast<size_t>(s)] = held;
        if (s == 0) {
          sp_problem.stage_time[0] += te.forward() + te.backward();
          sp_problem.stage_bytes[0] += emb_p * per_param + held * emb.saved_bytes;
        }
        if (s == S - 1) {
          sp_problem.stage_time[static_cast<size_t>(s)] += th.forward() + th.backward();
          sp_problem.stage_bytes[static_cast<size_t>(s)] += head_p * per_param + held * head.saved_bytes;
        }
      }
      sp_problem.memory_limit = c.vp == 1 ? limit : std::numeric_limits<double>::infinity();
      const Split split = split_stages(sp_problem, S);
      // No split fits: fall back to equal counts, so that the memory check below says by how much.
      layers = split.feasible ? split.blocks : uniform_split(L, S);
      if (c.vp > 1) {
        // A rank runs all its chunks: evening out the slowest chunk can load one rank more
        // than equal counts do, or stall the interleaved rounds less; evening out the ranks
        // (balance_ranks, from equal counts: the head's rank gives layers to the others)
        // can stall the rounds more. Each is evaluated (simulated when simulating) and the
        // fastest kept; without a timeline the smallest lower bound, which stays a lower
        // bound of the step kept when simulating.
        std::vector<double> extra(static_cast<size_t>(S), 0);
        extra.front() += te.forward() + te.backward();
        extra.back() += th.forward() + th.backward();
        const auto even = uniform_split(L, S);
        std::vector<std::vector<int64_t>> splits = {even};
        for (auto cand : {layers, balance_ranks(even, tl.forward() + tl.backward(), extra, p)})
          if (std::find(splits.begin(), splits.end(), cand) == splits.end()) splits.push_back(cand);
        if (splits.size() > 1) {
          const auto time = [&](const StepEstimate& y) { return opt.simulate ? y.step_s : y.lower_bound_s; };
          std::optional<StepEstimate> best;  // none feasible: equal counts' reason
          for (const auto& cand : splits) {
            ParallelConfig x = c;
            x.layers_per_stage = cand;
            StepEstimate e = estimate_step(m, hw, x, opt, cache);
            if (!best || (e.feasible && (!best->feasible || time(e) < time(*best)))) best = std::move(e);
          }
          return *best;
        }
      }
    }
  }
  est.config.layers_per_stage = layers;

  // ---- per-stage costs ----
  std::vector<double> stage_params(static_cast<size_t>(S)), saved(static_cast<size_t>(S));
  std::vector<PieceTime> stage_time(static_cast<size_t>(S));
  std::vector<double> zero_comm(static_cast<size_t>(S), 0);
  // ZB-H1: what each stage's W reads, kept from its I (empty otherwise: nothing kept)
  std::vector<double> weight_held(c.zero_bubble ? static_cast<size_t>(S) : 0);
  est.stage_forward.resize(static_cast<size_t>(S));
  est.stage_backward.resize(static_cast<size_t>(S));
  est.stage_weight_backward.assign(static_cast<size_t>(S), 0);
  for (int64_t s = 0; s < S; ++s) {
    const auto us = static_cast<size_t>(s);
    const double n = static_cast<double>(layers[us]);
    PieceTime t = tl.times(n);
    stage_params[us] = n * lp;
    saved[us] = n * layer.saved_bytes;
    if (c.zero_bubble) weight_held[us] = n * layer.wgrad_held_bytes + (s == S - 1 ? head.wgrad_held_bytes : 0);
    if (s == 0) {
      t += te;
      stage_params[us] += emb_p;
      saved[us] += emb.saved_bytes;
    }
    if (s == S - 1) {
      t += th;
      stage_params[us] += head_p;
      saved[us] += head.saved_bytes;
    }
    stage_time[us] = t;
    double F = t.forward(), B = t.backward();
    // ZB-H1's weight pass: the weight-gradient matmuls (the rest of B is its input pass)
    double W = c.zero_bubble ? t.weight_backward() : 0;
    // ZeRO-3 gathers a stage's parameters before its forward and its backward and
    // reduce-scatters its gradients after every backward; ZeRO-2 reduce-scatters after
    // every backward (gradients are sharded, so they cannot accumulate over
    // micro-batches). Prefetching hides them behind compute as far as bandwidth allows.
    if (d > 1 && c.zero >= 2) {
      const double rs = collective_time(hw, Collective::reduce_scatter, stage_params[us] * m.grad_bytes, dp_group);
      const double ag = c.zero >= 3 ? collective_time(hw, Collective::all_gather, stage_params[us] * m.dtype_bytes, dp_group) : 0;
      const double u = hw.overlap_compute_share;
      const double F2 = std::max(ag, F + u * ag), B2 = std::max(ag + rs, B + u * (ag + rs));
      zero_comm[us] = (F2 - F) + (B2 - B);
      if (c.zero_bubble) W += B2 - B;  // the gradients leave after the weight pass
      F = F2;
      B = B2;
    }
    est.stage_forward[us] = F;
    est.stage_backward[us] = B;
    est.stage_weight_backward[us] = W;
  }

  // ---- memory of every pipeline rank ----
  const auto held = peak_held(*orders, saved, weight_held);
  const double extra = layer.peak_extra_bytes + zero3_buffer;
  double worst = -1;
  for (int64_t q = 0; q < p; ++q) {
    Memory mem;
    double params = 0, rank_layers = 0;
    for (int64_t s = q; s < S; s += p) {
      params += stage_params[static_cast<size_t>(s)];
      rank_layers += static_cast<double>(layers[static_cast<size_t>(s)]);
    }
    mem.params = params * param_b + rank_layers * fp8_held;
    mem.grads = params * grad_b;
    mem.optimizer = params * opt_b;
    mem.activations = held[static_cast<size_t>(q)];
    mem.other = extra;
    est.rank_memory.push_back(mem.total());
    if (mem.total() > worst) {
      worst = mem.total();
      est.memory = mem;
      est.memory_rank = q;
    }
  }
  if (worst > limit) {
    std::ostringstream os;
    os << "pipeline rank " << est.memory_rank << " needs " << gib(worst) << " > " << gib(limit) << " (parameters "
       << gib(est.memory.params) << ", gradients " << gib(est.memory.grads) << ", optimizer "
       << gib(est.memory.optimizer) << ", activations " << gib(est.memory.activations) << ", other "
       << gib(est.memory.other) << ")";
    est.reason = os.str();
    return est;
  }

  // ---- what happens outside the pipeline timeline ----
  std::vector<double> busy(static_cast<size_t>(p), 0), opt_time(static_cast<size_t>(p), 0),
      rank_params(static_cast<size_t>(p), 0);
  for (int64_t s = 0; s < S; ++s) {
    const auto q = static_cast<size_t>(s % p);
    busy[q] += static_cast<double>(mbs) * (est.stage_forward[static_cast<size_t>(s)] + est.stage_backward[static_cast<size_t>(s)]);
    rank_params[q] += stage_params[static_cast<size_t>(s)];
  }
  // Adam: read and write fp32 master weights and both moments, read the gradient twice
  // (norm, update), write the low-precision weights; over this rank's share of the state.
  const double opt_bytes_per_param = 2 * m.optimizer_bytes + 2 * m.grad_bytes + m.dtype_bytes;
  for (int64_t q = 0; q < p; ++q)
    opt_time[static_cast<size_t>(q)] = rank_params[static_cast<size_t>(q)] / (c.zero >= 1 ? d : 1.0) *
                                       opt_bytes_per_param / (hw.hbm_bw * hw.hbm_efficiency);
  const double optimizer = *std::max_element(opt_time.begin(), opt_time.end());
  const double tied_sync =
      m.tied_embeddings && S > 1
          ? collective_time(hw, Collective::all_reduce,
                            static_cast<double>(m.vocab * m.hidden) / static_cast<double>(c.tp) * m.grad_bytes,
                            Group{2, (p - 1) * c.tp * c.cp * c.dp})
          : 0;
  est.lower_bound_s = *std::max_element(busy.begin(), busy.end()) + tied_sync + optimizer;
  est.model_flops = [&] {
    const Shard one{1, 1, false, Recompute::none};
    const LayerWork l1 = layer_work(m, one), h1 = head_work(m, one);
    return 3.0 * static_cast<double>(m.global_batch) *
           (static_cast<double>(L) * (l1.forward.gemm_flops + l1.forward.fp8_gemm_flops + l1.forward.attn_flops) +
            h1.forward.gemm_flops);
  }();
  est.feasible = true;
  if (!opt.simulate) {
    est.step_s = est.lower_bound_s;
    return est;
  }

  // ---- the pipeline timeline ----
  PipelineModel pm;
  pm.name = c.str();
  pm.orders = orders->orders;
  pm.placement = orders->placement;
  pm.microbatches = static_cast<int32_t>(mbs);
  for (int64_t s = 0; s < S; ++s)
    pm.costs.push_back({est.stage_forward[static_cast<size_t>(s)], est.stage_backward[static_cast<size_t>(s)],
                        est.stage_backward[static_cast<size_t>(s)] - est.stage_weight_backward[static_cast<size_t>(s)],
                        est.stage_weight_backward[static_cast<size_t>(s)]});
  if (S > 1) {
    // An activation (or its gradient) crosses as 1/tp of it per tensor-parallel rank
    // (Megatron's scatter-gather; with sequence parallelism it is already split), and is
    // gathered again over NVLink on arrival when the next stage wants it whole.
    const double x = static_cast<double>(c.micro_batch * m.seq / c.cp * m.hidden) * m.dtype_bytes;
    const double regather = c.tp > 1 && !sp ? collective_time(hw, Collective::all_gather, x, tp_group) : 0;
    const int64_t stride = c.tp * c.cp * c.dp;
    for (int64_t s = 0; s + 1 < S; ++s) {
      const int64_t a = (s % p) * stride, b = ((s + 1) % p) * stride;
      const bool same_node = a / hw.gpus_per_node == b / hw.gpus_per_node;
      const double t = p2p_time(hw, x / static_cast<double>(c.tp), same_node) + regather;
      pm.send_forward.push_back(t);
      pm.send_backward.push_back(t);
    }
  }
  const Timeline timeline = simulate_pipeline(pm);
  est.pipeline_s = timeline.makespan;
  est.bubble = timeline.bubble();

  std::vector<double> rank_end(static_cast<size_t>(p), 0), first_f_end(static_cast<size_t>(p), -1);
  std::vector<double> last_b_start(static_cast<size_t>(S), 0), last_b_end(static_cast<size_t>(S), 0);
  for (const auto& a : timeline.actions) {
    const auto q = static_cast<size_t>(a.rank);
    rank_end[q] = std::max(rank_end[q], a.end);
    if (a.action.kind == 'F' && first_f_end[q] < 0) first_f_end[q] = a.end;
    // a stage's gradients are done with its last backward: B, or under ZB-H1 its last W
    if (a.action.kind == (c.zero_bubble ? 'W' : 'B') && a.action.mb == mbs - 1) {
      last_b_start[static_cast<size_t>(a.action.stage)] = a.start;
      last_b_end[static_cast<size_t>(a.action.stage)] = a.end;
    }
  }

  // DP gradient reduction after the last micro-batch, bucket by bucket as the backward
  // makes them (Megatron's overlap_grad_reduce): a stage's reduction starts with its
  // last backward and cannot end before that backward plus its last bucket. ZeRO-2/3
  // reduced every micro-batch already. ZeRO-1/2 gather the updated parameters behind the
  // next step's first forward (overlap_param_gather).
  double step = 0;
  int64_t slowest = 0;
  std::vector<double> dp_exposed(static_cast<size_t>(p), 0);
  for (int64_t q = 0; q < p; ++q) {
    const auto uq = static_cast<size_t>(q);
    double exposed = 0;
    if (d > 1 && c.zero <= 1) {
      std::vector<int64_t> mine;
      for (int64_t s = q; s < S; s += p) mine.push_back(s);
      std::sort(mine.begin(), mine.end(), [&](int64_t a, int64_t b) {
        return last_b_start[static_cast<size_t>(a)] < last_b_start[static_cast<size_t>(b)];
      });
      double stream = 0, overlapped = 0;
      for (int64_t s : mine) {
        const auto us = static_cast<size_t>(s);
        const double bytes = stage_params[us] * m.grad_bytes;
        const double dur = collective_time(hw, c.zero == 0 ? Collective::all_reduce : Collective::reduce_scatter,
                                           bytes, dp_group);
        const double start = std::max(stream, last_b_start[us]);
        stream = std::max(start + dur, last_b_end[us] + dur * std::min(1.0, opt.bucket_bytes / bytes));
        overlapped += std::max(0.0, std::min(stream, rank_end[uq]) - start);
      }
      // The backward it overlaps runs slower by the share of the GPU the reduction takes.
      const double end = rank_end[uq] + hw.overlap_compute_share * overlapped;
      exposed += std::max(0.0, stream - end) + (end - rank_end[uq]);
    }
    if (d > 1 && (c.zero == 1 || c.zero == 2)) {
      const double ag = collective_time(hw, Collective::all_gather, rank_params[uq] * m.dtype_bytes, dp_group);
      exposed += std::max(0.0, ag - first_f_end[uq]) + hw.overlap_compute_share * std::min(ag, first_f_end[uq]);
    }
    dp_exposed[uq] = exposed;
    if (rank_end[uq] + exposed > step) {
      step = rank_end[uq] + exposed;
      slowest = q;
    }
  }
  est.step_s = step + tied_sync + optimizer;

  Breakdown& bd = est.breakdown;
  double work = 0;
  for (int64_t s = slowest; s < S; s += p) {
    const auto us = static_cast<size_t>(s);
    const auto& t = stage_time[us];
    const double k = static_cast<double>(mbs);
    bd.compute += k * (t.f_comp + t.b_comp);
    bd.recompute += k * t.r_comp;
    bd.tp_comm += k * (t.f_tp + t.b_tp + t.r_tp);
    bd.cp_comm += k * (t.f_cp + t.b_cp + t.r_cp);
    bd.zero_comm += k * zero_comm[us];
    work += k * (est.stage_forward[us] + est.stage_backward[us]);
  }
  bd.idle = rank_end[static_cast<size_t>(slowest)] - work;
  bd.dp_exposed = dp_exposed[static_cast<size_t>(slowest)];
  bd.embedding_sync = tied_sync;
  bd.optimizer = optimizer;
  return est;
}

}  // namespace vescale::autoplan
