// The eager planner's search: every mesh factorisation, ZeRO stage, sequence parallelism
// and schedule the constraints leave, each estimated (eager.cpp), ranked by step time
// with why each lost to the best.

#include "autoplan/eager.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>

namespace vescale::autoplan::eager {

namespace {

std::string ms(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f ms", 1e3 * s);
  return buf;
}

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t k = 1; k <= n; ++k)
    if (n % k == 0) out.push_back(k);
  return out;
}

}  // namespace

std::string why_slower(const Estimate& a, const Estimate& best) {
  const Breakdown &x = a.breakdown, &y = best.breakdown;
  std::vector<std::pair<const char*, double>> parts = {
      {"compute", x.compute - y.compute},       {"TP comm", x.tp_comm - y.tp_comm},
      {"ZeRO-3 gathers", x.zero_comm - y.zero_comm}, {"pipeline idle", x.idle - y.idle},
      {"DP comm", x.dp_comm - y.dp_comm},       {"stage sync", x.pp_sync - y.pp_sync},
      {"optimizer", x.optimizer - y.optimizer}};
  std::sort(parts.begin(), parts.end(), [](const auto& p, const auto& q) { return p.second > q.second; });
  std::ostringstream os;
  char pct[32];
  std::snprintf(pct, sizeof pct, "+%.1f%%", 100.0 * (a.step_s / best.step_s - 1.0));
  os << pct;
  int listed = 0;
  for (const auto& [name, d] : parts) {
    if (d <= 0.02 * best.step_s || listed == 3) break;
    os << (listed ? ", " : ": ") << name << " +" << ms(d);
    ++listed;
  }
  return os.str();
}

Result search(const Problem& p, const Constraints& k) {
  const auto t0 = std::chrono::steady_clock::now();
  Result r;
  std::vector<Estimate> feasible;
  for (const int64_t pp : divisors(p.world)) {
    if (k.pp > 0 && pp != k.pp) continue;
    for (const int64_t tp : divisors(p.world / pp)) {
      if (k.tp > 0 && tp != k.tp) continue;
      const int64_t dp = p.world / (pp * tp);
      if (k.dp > 0 && dp != k.dp) continue;
      for (int sp = 0; sp <= (tp > 1 ? 1 : 0); ++sp) {
        if (k.sp >= 0 && sp != k.sp) continue;
        for (int zero = 0; zero <= (dp > 1 ? 3 : 0); ++zero) {
          if (k.zero >= 0 && zero != k.zero) continue;
          std::vector<Config> configs;
          Config c;
          c.pp = pp;
          c.dp = dp;
          c.tp = tp;
          c.sp = sp;
          c.zero = zero;
          if (pp == 1) {
            if (k.microbatches > 1 || k.vp > 1) continue;
            configs.push_back(c);
          } else {
            for (const auto& s : p.schedules) {
              if (s.pp != pp || (!k.schedule.empty() && s.name != k.schedule)) continue;
              if (k.microbatches > 0 && s.microbatches != k.microbatches) continue;
              if (k.vp > 0 && s.vp != k.vp) continue;
              if (p.batch % dp || (p.batch / dp) % s.microbatches) continue;
              Config cc = c;
              cc.schedule = s.name;
              cc.microbatches = s.microbatches;
              cc.vp = s.vp;
              configs.push_back(cc);
            }
          }
          for (auto cc : configs) {
            ++r.enumerated;
            cc.recompute = k.recompute == 1;
            Estimate e = estimate(p, cc, k.split, k.memory_limit);
            if (!e.feasible && k.recompute < 0 && k.memory_limit > 0) {  // over the limit: recomputation may fit
              cc.recompute = true;
              ++r.enumerated;
              Estimate again = estimate(p, cc, k.split, k.memory_limit);
              if (again.feasible) e = std::move(again);
            }
            if (e.feasible) feasible.push_back(std::move(e));
            else r.rejected.push_back(std::move(e));
          }
        }
      }
    }
  }
  std::stable_sort(feasible.begin(), feasible.end(), [](const Estimate& a, const Estimate& b) { return a.step_s < b.step_s; });
  for (size_t i = 0; i < feasible.size(); ++i) feasible[i].verdict = i == 0 ? "best" : why_slower(feasible[i], feasible[0]);
  for (auto& e : r.rejected) e.verdict = e.reason;
  r.ranked = std::move(feasible);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace vescale::autoplan::eager
