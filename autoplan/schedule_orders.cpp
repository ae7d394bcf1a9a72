#include "autoplan/schedule_orders.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace vescale::autoplan {

Orders one_f_one_b(int32_t p, int32_t m, int32_t v) {
  TORCH_CHECK_VALUE(p >= 1 && m >= 1 && v >= 1, "1F1B needs ranks, micro-batches and virtual stages >= 1");
  TORCH_CHECK_VALUE(v == 1 || m % p == 0, "interleaved 1F1B runs micro-batches in rounds of the pipeline size: ",
                    m, " micro-batches is not a multiple of ", p);
  Orders o;
  o.ranks = p;
  o.virtual_stages = v;
  o.microbatches = m;
  o.orders.resize(static_cast<size_t>(p));
  for (int32_t s = 0; s < p * v; ++s) o.placement.push_back(s % p);
  for (int32_t r = 0; r < p; ++r) {
    auto& order = o.orders[static_cast<size_t>(r)];
    order.reserve(static_cast<size_t>(2 * m * v));
    if (v == 1) {  // schedules.py _one_f_one_b
      const int32_t warmup = std::min(p - r - 1, m);
      for (int32_t i = 0; i < warmup; ++i) order.push_back({'F', r, i});
      for (int32_t i = 0; i < m - warmup; ++i) {
        order.push_back({'F', r, warmup + i});
        order.push_back({'B', r, i});
      }
      for (int32_t i = m - warmup; i < m; ++i) order.push_back({'B', r, i});
      continue;
    }
    // schedules.py _interleaved: forward k runs chunk (k / p) % v of round k / (p v).
    const int32_t total = m * v;
    auto forward = [&](int32_t k) -> Action {
      return {'F', ((k / p) % v) * p + r, (k / (p * v)) * p + k % p};
    };
    auto backward = [&](int32_t k) -> Action {
      return {'B', (v - 1 - (k / p) % v) * p + r, (k / (p * v)) * p + k % p};
    };
    const int32_t warmup = std::min((p - r - 1) * 2 + (v - 1) * p, total);
    for (int32_t k = 0; k < warmup; ++k) order.push_back(forward(k));
    for (int32_t i = 0; i < total - warmup; ++i) {
      order.push_back(forward(warmup + i));
      order.push_back(backward(i));
    }
    for (int32_t k = total - warmup; k < total; ++k) order.push_back(backward(k));
  }
  return o;
}

Orders zb_h1(int32_t p, int32_t m) {
  TORCH_CHECK_VALUE(p >= 1 && m >= 1, "ZB-H1 needs ranks and micro-batches >= 1");
  Orders o;
  o.ranks = p;
  o.microbatches = m;
  o.orders.resize(static_cast<size_t>(p));
  for (int32_t s = 0; s < p; ++s) o.placement.push_back(s);
  for (int32_t r = 0; r < p; ++r) {
    auto& order = o.orders[static_cast<size_t>(r)];
    order.reserve(static_cast<size_t>(3 * m));
    const int32_t warmup = std::min(p - r - 1, m);
    for (int32_t i = 0; i < warmup; ++i) order.push_back({'F', r, i});
    int32_t next_w = 0;
    for (int32_t k = 0; k < m; ++k) {  // one I per step; after the last forward, only I's and W's
      if (warmup + k < m) order.push_back({'F', r, warmup + k});
      order.push_back({'I', r, k});
      if (k >= r) order.push_back({'W', r, next_w++});
    }
    for (int32_t i = next_w; i < m; ++i) order.push_back({'W', r, i});
  }
  return o;
}

std::vector<double> peak_held(const Orders& o, const std::vector<double>& saved,
                              const std::vector<double>& weight_held) {
  TORCH_CHECK_VALUE(static_cast<int32_t>(saved.size()) == o.stages(), "peak_held: give one size per stage (",
                    o.stages(), "), got ", saved.size());
  std::vector<double> out;
  out.reserve(o.orders.size());
  for (const auto& order : o.orders) {
    double held = 0, peak = 0;
    for (const auto& a : order) {
      const double bytes = saved[static_cast<size_t>(a.stage)];
      const double kept = weight_held.empty() ? 0 : weight_held[static_cast<size_t>(a.stage)];
      if (a.kind == 'F') {
        held += bytes;
      } else if (a.kind == 'B') {
        held -= bytes;
      } else if (a.kind == 'I') {
        held += kept - bytes;
      } else {
        held -= kept;
      }
      peak = std::max(peak, held);
    }
    out.push_back(peak);
  }
  return out;
}

}  // namespace vescale::autoplan
