#include "autoplan/split.h"

#include <c10/util/Exception.h>

#include <functional>

namespace vescale::autoplan {

namespace {

// Stage times and memory from prefix sums.
class Stages {
 public:
  Stages(const SplitProblem& p, int64_t stages) : p_(p), stages_(stages) {
    const size_t L = p.block_time.size();
    TORCH_CHECK_VALUE(p.block_static.empty() || p.block_static.size() == L, "split: one static size per block");
    TORCH_CHECK_VALUE(p.block_saved.empty() || p.block_saved.size() == L, "split: one saved size per block");
    for (const auto* v : {&p.stage_time, &p.stage_bytes, &p.in_flight})
      TORCH_CHECK_VALUE(v->empty() || static_cast<int64_t>(v->size()) == stages, "split: give one value per stage (",
                        stages, "), got ", v->size());
    time_.assign(L + 1, 0);
    stat_.assign(L + 1, 0);
    saved_.assign(L + 1, 0);
    for (size_t i = 0; i < L; ++i) {
      time_[i + 1] = time_[i] + p.block_time[i];
      stat_[i + 1] = stat_[i] + (p.block_static.empty() ? 0 : p.block_static[i]);
      saved_[i + 1] = saved_[i] + (p.block_saved.empty() ? 0 : p.block_saved[i]);
    }
  }
  // Seconds of stage s holding blocks [a, b), or infinity when it does not fit in memory.
  double time(int64_t s, int64_t a, int64_t b) const {
    const auto us = static_cast<size_t>(s);
    const double bytes = (p_.stage_bytes.empty() ? 0 : p_.stage_bytes[us]) + stat_[b] - stat_[a] +
                         (p_.in_flight.empty() ? 1 : p_.in_flight[us]) * (saved_[b] - saved_[a]);
    if (bytes > p_.memory_limit) return std::numeric_limits<double>::infinity();
    return (p_.stage_time.empty() ? 0 : p_.stage_time[us]) + time_[b] - time_[a];
  }

 private:
  const SplitProblem& p_;
  int64_t stages_;
  std::vector<double> time_, stat_, saved_;
};

}  // namespace

Split split_stages(const SplitProblem& p, int64_t S) {
  const auto L = static_cast<int64_t>(p.block_time.size());
  TORCH_CHECK_VALUE(S >= 1 && S <= L, "split: ", S, " stages for ", L, " blocks (each stage needs one)");
  const Stages st(p, S);
  constexpr double inf = std::numeric_limits<double>::infinity();
  // best[s][k]: stages 0..s over blocks [0, k); from[s][k]: where stage s starts.
  std::vector<std::vector<double>> best(static_cast<size_t>(S), std::vector<double>(static_cast<size_t>(L + 1), inf));
  std::vector<std::vector<int64_t>> from(static_cast<size_t>(S), std::vector<int64_t>(static_cast<size_t>(L + 1), -1));
  for (int64_t k = 1; k <= L - (S - 1); ++k) {
    best[0][static_cast<size_t>(k)] = st.time(0, 0, k);
    from[0][static_cast<size_t>(k)] = 0;
  }
  for (int64_t s = 1; s < S; ++s) {
    auto& row = best[static_cast<size_t>(s)];
    const auto& prev = best[static_cast<size_t>(s - 1)];
    // Stages after s need one block each.
    for (int64_t k = s + 1; k <= L - (S - 1 - s); ++k) {
      double b = inf;
      int64_t arg = -1;
      for (int64_t j = k - 1; j >= s; --j) {  // stage s holds [j, k): grows as j falls
        const double mine = st.time(s, j, k);
        if (mine >= b) break;  // only slower (or out of memory) from here on
        const double v = std::max(prev[static_cast<size_t>(j)], mine);
        if (v < b) {
          b = v;
          arg = j;
        }
      }
      row[static_cast<size_t>(k)] = b;
      from[static_cast<size_t>(s)][static_cast<size_t>(k)] = arg;
    }
  }
  Split out;
  out.bottleneck = best[static_cast<size_t>(S - 1)][static_cast<size_t>(L)];
  out.feasible = out.bottleneck < inf;
  if (!out.feasible) return out;
  out.blocks.assign(static_cast<size_t>(S), 0);
  int64_t k = L;
  for (int64_t s = S - 1; s >= 0; --s) {
    const int64_t j = from[static_cast<size_t>(s)][static_cast<size_t>(k)];
    out.blocks[static_cast<size_t>(s)] = k - j;
    k = j;
  }
  return out;
}

std::vector<int64_t> balance_ranks(std::vector<int64_t> counts, double layer_time,
                                   const std::vector<double>& stage_extra, int64_t ranks) {
  const auto S = static_cast<int64_t>(counts.size());
  TORCH_CHECK_VALUE(ranks >= 1 && S % ranks == 0, "balance_ranks: ", S, " stages over ", ranks, " ranks");
  TORCH_CHECK_VALUE(stage_extra.empty() || static_cast<int64_t>(stage_extra.size()) == S,
                    "balance_ranks: one extra per stage");
  auto load = [&](int64_t r) {
    double t = 0;
    for (int64_t s = r; s < S; s += ranks)
      t += static_cast<double>(counts[static_cast<size_t>(s)]) * layer_time +
           (stage_extra.empty() ? 0 : stage_extra[static_cast<size_t>(s)]);
    return t;
  };
  for (int64_t moves = 0; moves < S * 64; ++moves) {
    int64_t busy = 0, idle = 0;
    for (int64_t r = 1; r < ranks; ++r) {
      if (load(r) > load(busy)) busy = r;
      if (load(r) < load(idle)) idle = r;
    }
    if (!(load(idle) + layer_time < load(busy))) break;
    int64_t from = -1, to = -1;
    for (int64_t s = busy; s < S; s += ranks)
      if (counts[static_cast<size_t>(s)] > 1 && (from < 0 || counts[static_cast<size_t>(s)] >= counts[static_cast<size_t>(from)]))
        from = s;
    for (int64_t s = idle; s < S; s += ranks)
      if (to < 0 || counts[static_cast<size_t>(s)] < counts[static_cast<size_t>(to)]) to = s;
    if (from < 0) break;  // the busiest rank is down to one layer a stage
    --counts[static_cast<size_t>(from)];
    ++counts[static_cast<size_t>(to)];
  }
  return counts;
}

Split split_brute_force(const SplitProblem& p, int64_t S) {
  const auto L = static_cast<int64_t>(p.block_time.size());
  const Stages st(p, S);
  Split out;
  out.bottleneck = std::numeric_limits<double>::infinity();
  std::vector<int64_t> cur;
  std::function<void(int64_t, double)> go = [&](int64_t start, double worst) {
    const auto s = static_cast<int64_t>(cur.size());
    if (s == S - 1) {
      const double v = std::max(worst, st.time(s, start, L));
      if (start < L && v < out.bottleneck) {
        out.bottleneck = v;
        out.blocks = cur;
        out.blocks.push_back(L - start);
      }
      return;
    }
    for (int64_t end = start + 1; end <= L - (S - 1 - s); ++end) {
      cur.push_back(end - start);
      go(end, std::max(worst, st.time(s, start, end)));
      cur.pop_back();
    }
  };
  go(0, 0);
  out.feasible = out.bottleneck < std::numeric_limits<double>::infinity();
  return out;
}

}  // namespace vescale::autoplan
