#include "autoplan/search.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>

namespace vescale::autoplan {

namespace {

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t k = 1; k <= n; ++k)
    if (n % k == 0) out.push_back(k);
  return out;
}

std::string seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g s", s);
  return buf;
}

}  // namespace

std::string why_slower(const StepEstimate& a, const StepEstimate& best) {
  const Breakdown &x = a.breakdown, &y = best.breakdown;
  const std::pair<const char*, double> parts[] = {
      {"compute", x.compute - y.compute},         {"recompute", x.recompute - y.recompute},
      {"TP comm", x.tp_comm - y.tp_comm},         {"CP comm", x.cp_comm - y.cp_comm},
      {"ZeRO comm", x.zero_comm - y.zero_comm},
      {"pipeline idle", x.idle - y.idle},         {"DP comm exposed", x.dp_exposed - y.dp_exposed},
      {"embedding sync", x.embedding_sync - y.embedding_sync}, {"optimizer", x.optimizer - y.optimizer}};
  std::vector<std::pair<const char*, double>> worse(std::begin(parts), std::end(parts));
  std::sort(worse.begin(), worse.end(), [](const auto& p, const auto& q) { return p.second > q.second; });
  std::ostringstream os;
  char pct[32];
  std::snprintf(pct, sizeof pct, "+%.1f%%", 100.0 * (a.step_s / best.step_s - 1.0));
  os << pct;
  int listed = 0;
  for (const auto& [name, delta] : worse) {
    if (delta <= 0.001 * best.step_s || listed == 3) break;
    os << (listed ? ", " : " (") << name << " +" << seconds(delta);
    ++listed;
  }
  if (listed) os << ")";
  return os.str();
}

SearchResult search(const Transformer& m, const Hardware& hw, const SearchConstraints& c) {
  const auto t0 = std::chrono::steady_clock::now();
  SearchResult out;
  OrdersCache cache;
  StepOptions quick;
  quick.memory_limit = c.memory_limit;
  quick.split = c.split;
  quick.simulate = false;
  StepOptions full = quick;
  full.simulate = true;

  std::vector<StepEstimate> fits;
  std::vector<StepEstimate> over;
  const int64_t max_tp = c.tp > 0 ? c.tp : (c.max_tp > 0 ? c.max_tp : hw.gpus_per_node);
  const int64_t max_cp = c.cp > 0 ? c.cp : std::max<int64_t>(1, c.max_cp);
  for (int64_t t : divisors(c.world)) {
    if ((c.tp > 0 && t != c.tp) || t > max_tp) continue;
    for (int64_t cp : divisors(c.world / t)) {
      if ((c.cp > 0 && cp != c.cp) || cp > max_cp) continue;
      for (int64_t p : divisors(c.world / (t * cp))) {
        if (c.pp > 0 && p != c.pp) continue;
        const int64_t d = c.world / (t * cp * p);
        if (c.dp > 0 && d != c.dp) continue;
        for (int64_t b = 1; b <= std::max(c.max_micro_batch, c.micro_batch); ++b) {
          if ((c.micro_batch > 0 && b != c.micro_batch) || m.global_batch % (d * b)) continue;
          const int64_t mbs = m.global_batch / (d * b);
          if (c.microbatches > 0 && mbs != c.microbatches) continue;
          std::vector<int64_t> vps;
          if (c.vp > 0) vps = {c.vp};
          else if (p == 1) vps = {1};
          else
            for (int64_t v = 1; v * p <= m.layers; ++v) vps.push_back(v);
          vps.erase(std::remove_if(vps.begin(), vps.end(), [&](int64_t v) { return v < c.min_vp; }), vps.end());
          for (int64_t v : vps) {
            // ZB-H1 is the alternative to 1F1B where a pipeline has no virtual stages
            std::vector<int> zbs;
            for (int zb : {0, 1})
              if (zb ? p > 1 && v == 1 && c.zero_bubble != 0 : !(p > 1 && c.zero_bubble == 1)) zbs.push_back(zb);
            std::vector<int> sps = c.sequence_parallel >= 0 ? std::vector<int>{c.sequence_parallel}
                                   : t > 1                 ? std::vector<int>{0, 1}
                                                           : std::vector<int>{0};
            for (int sp : sps) {
              for (int r = 0; r < 3; ++r) {
                if (c.recompute >= 0 && r != c.recompute) continue;
                // Fused attention keeps no s x s tensors: selective recomputation is no recomputation.
                if (c.recompute < 0 && m.flash_attention && r == static_cast<int>(Recompute::selective)) continue;
                for (int zb : zbs) {
                  for (int z = 0; z <= 3; ++z) {
                    if ((c.zero >= 0 && z != c.zero) || (c.zero < 0 && d * cp == 1 && z > 0)) continue;
                    ParallelConfig cfg;
                    cfg.dp = d;
                    cfg.tp = t;
                    cfg.cp = cp;
                    cfg.pp = p;
                    cfg.vp = v;
                    cfg.micro_batch = b;
                    cfg.zero = z;
                    cfg.sequence_parallel = sp != 0;
                    cfg.recompute = static_cast<Recompute>(r);
                    cfg.zero_bubble = zb != 0;
                    ++out.enumerated;
                    if (!config_problem(m, cfg).empty()) {
                      ++out.invalid;
                      continue;
                    }
                    StepEstimate e = estimate_step(m, hw, cfg, quick, &cache);
                    if (e.feasible) fits.push_back(std::move(e));
                    else {
                      ++out.over_memory;
                      over.push_back(std::move(e));
                    }
                  }
                }
              }
            }
          }
        }
      }
    }
  }

  // Simulate the best lower bounds first; stop when no lower bound left can make the top k.
  std::sort(fits.begin(), fits.end(), [](const auto& a, const auto& b) {
    return a.lower_bound_s < b.lower_bound_s || (a.lower_bound_s == b.lower_bound_s && a.config.str() < b.config.str());
  });
  std::vector<StepEstimate> ranked, outside;
  const auto k = static_cast<size_t>(std::max<int64_t>(1, c.top_k));
  size_t next = 0;
  for (; next < fits.size(); ++next) {
    if (ranked.size() >= k && fits[next].lower_bound_s >= ranked.back().step_s) break;
    ParallelConfig cfg = fits[next].config;
    cfg.layers_per_stage.clear();  // let the simulation pick the split again, among the same choices
    StepEstimate e = estimate_step(m, hw, cfg, full, &cache);
    ++out.simulated;
    const auto at = std::upper_bound(ranked.begin(), ranked.end(), e.step_s,
                                     [](double s, const StepEstimate& x) { return s < x.step_s; });
    ranked.insert(at, std::move(e));
    if (ranked.size() > k) {
      outside.push_back(std::move(ranked.back()));
      ranked.pop_back();
    }
  }
  for (size_t i = 0; i < ranked.size(); ++i)
    out.ranked.push_back({ranked[i], i == 0 ? "best" : why_slower(ranked[i], ranked[0])});

  // What lost without a place: over memory (least over first), then simulated outside the
  // top k, then pruned by their lower bound.
  std::sort(over.begin(), over.end(), [](const auto& a, const auto& b) { return a.memory.total() < b.memory.total(); });
  const auto keep = static_cast<size_t>(std::max<int64_t>(0, c.keep_rejected));
  for (size_t i = 0; i < over.size() && i < keep; ++i) out.rejected.push_back({over[i], over[i].reason});
  for (size_t i = 0; i < outside.size() && i < keep; ++i)
    out.rejected.push_back({outside[i], "simulated " + seconds(outside[i].step_s) + ", outside the top " +
                                            std::to_string(k) + ": " + why_slower(outside[i], ranked[0])});
  out.pruned = static_cast<int64_t>(fits.size() - next);
  for (size_t i = next; i < fits.size() && i - next < keep; ++i)
    out.rejected.push_back({fits[i], "lower bound " + seconds(fits[i].lower_bound_s) + " >= the top " +
                                         std::to_string(k) + "'s slowest " + seconds(ranked.back().step_s)});
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

}  // namespace vescale::autoplan
