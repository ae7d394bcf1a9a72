#include "autoplan/pipeline_sim.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>
#include <sstream>
#include <cmath>
#include <limits>
#include <unordered_map>

namespace vescale::autoplan {

namespace {

std::string name_of(const Action& a) {
  std::ostringstream os;
  os << a.kind << a.stage << "." << a.mb;
  return os.str();
}

// Actions keyed densely: (kind, stage, mb) -> finish time, or < 0 while not done.
class Finished {
 public:
  Finished(int32_t stages, int32_t microbatches)
      : stages_(stages), mbs_(microbatches), end_(static_cast<size_t>(4 * stages * microbatches), -1.0) {}

  bool valid(const Action& a) const { return kind_index(a.kind) >= 0 && a.stage >= 0 && a.stage < stages_ && a.mb >= 0 && a.mb < mbs_; }
  double& at(const Action& a) { return end_[index(a)]; }
  double get(char kind, int32_t stage, int32_t mb) const { return end_[index({kind, stage, mb})]; }

 private:
  static int kind_index(char k) { return k == 'F' ? 0 : k == 'B' ? 1 : k == 'I' ? 2 : k == 'W' ? 3 : -1; }
  size_t index(const Action& a) const {
    return static_cast<size_t>((kind_index(a.kind) * stages_ + a.stage) * mbs_ + a.mb);
  }
  int32_t stages_, mbs_;
  std::vector<double> end_;
};

// The seconds of an action of `kind` in a stage's costs.
double seconds(const StageCost& c, char kind) {
  return kind == 'F' ? c.forward : kind == 'B' ? c.backward : kind == 'I' ? c.input_backward : c.weight_backward;
}

// What both simulators share: the model's checks, the rank each stage runs on, and when an
// action's inputs (the activation from the stage before, the gradient from the stage
// after, sent between ranks) are all there.
class Dependencies {
 public:
  explicit Dependencies(const PipelineModel& model)
      : finished(static_cast<int32_t>(model.placement.size()), model.microbatches),
        model_(model), stages_(static_cast<int32_t>(model.placement.size())) {
    TORCH_CHECK_VALUE(stages_ > 0 && model.microbatches > 0, "pipeline ", model.name, ": needs stages and micro-batches");
    TORCH_CHECK_VALUE(model.costs.empty() || static_cast<int32_t>(model.costs.size()) == stages_, "pipeline ",
                      model.name, ": give one cost per stage (", stages_, "), got ", model.costs.size());
    for (const auto* sends : {&model.send_forward, &model.send_backward})
      TORCH_CHECK_VALUE(sends->empty() || static_cast<int32_t>(sends->size()) == stages_ - 1, "pipeline ", model.name,
                        ": give one send time per stage boundary (", stages_ - 1, "), got ", sends->size());
    for (const auto& order : model.orders)
      for (const auto& a : order)
        if (a.kind == 'I') grad_ = 'I';  // a split backward: the stage after hands on its input gradient
  }

  int32_t rank_of(int32_t stage) const { return model_.placement[static_cast<size_t>(stage)]; }

  // When a's inputs are all there, or < 0 while one is missing.
  double ready(const Action& a) const {
    double t = 0;
    auto need = [&](char kind, int32_t s, double delay) {
      const double end = finished.get(kind, s, a.mb);
      if (end < 0) return false;
      t = std::max(t, end + delay);
      return true;
    };
    if (a.kind == 'F')
      return a.stage == 0 || need('F', a.stage - 1, send(model_.send_forward, a.stage - 1, a.stage - 1, a.stage)) ? t : -1;
    if (a.kind == 'W') return need('I', a.stage, 0) ? t : -1;
    if (!need('F', a.stage, 0)) return -1;
    if (a.stage + 1 < stages_ && !need(grad_, a.stage + 1, send(model_.send_backward, a.stage, a.stage + 1, a.stage)))
      return -1;
    return t;
  }

  void check_every_action_ran() const {
    const std::vector<char> kinds = grad_ == 'I' ? std::vector<char>{'F', 'I', 'W'} : std::vector<char>{'F', 'B'};
    for (int32_t s = 0; s < stages_; ++s)
      for (int32_t mb = 0; mb < model_.microbatches; ++mb)
        for (char k : kinds)
          TORCH_CHECK(finished.get(k, s, mb) >= 0, "pipeline schedule ", model_.name, " never runs ", name_of({k, s, mb}));
  }

  Finished finished;

 private:
  double send(const std::vector<double>& times, int32_t boundary, int32_t from, int32_t to) const {
    return times.empty() || rank_of(from) == rank_of(to) ? 0.0 : times[static_cast<size_t>(boundary)];
  }

  const PipelineModel& model_;
  int32_t stages_;
  char grad_ = 'B';
};

}  // namespace

double Timeline::bubble() const {
  const double total = std::accumulate(busy.begin(), busy.end(), 0.0);
  return makespan > 0 ? 1.0 - total / (static_cast<double>(busy.size()) * makespan) : 0.0;
}

Timeline simulate_pipeline(const PipelineModel& model) {
  const auto stages = static_cast<int32_t>(model.placement.size());
  const auto ranks = model.orders.size();
  Dependencies deps(model);  // checks the model
  auto& finished = deps.finished;
  auto rank_of = [&](int32_t st) { return deps.rank_of(st); };
  auto ready = [&](const Action& a) { return deps.ready(a); };
  const StageCost unit;
  auto cost = [&](const Action& a) { return seconds(model.costs.empty() ? unit : model.costs[static_cast<size_t>(a.stage)], a.kind); };

  Timeline out;
  out.busy.assign(ranks, 0.0);
  std::vector<size_t> pos(ranks, 0);
  std::vector<double> clock(ranks, 0.0);
  size_t remaining = 0;
  for (const auto& order : model.orders) remaining += order.size();
  while (remaining > 0) {
    bool progressed = false;
    for (size_t r = 0; r < ranks; ++r) {
      const auto& order = model.orders[r];
      while (pos[r] < order.size()) {
        const Action& a = order[pos[r]];
        TORCH_CHECK_VALUE(finished.valid(a), "pipeline ", model.name, ": rank ", r, " has an action ", name_of(a),
                          " outside its ", stages, " stages and ", model.microbatches, " micro-batches");
        TORCH_CHECK_VALUE(rank_of(a.stage) == static_cast<int32_t>(r), "pipeline ", model.name, ": rank ", r,
                          " runs ", name_of(a), " of a stage placed on rank ", rank_of(a.stage));
        const double t = ready(a);
        if (t < 0) break;
        const double start = std::max(clock[r], t);
        const double end = start + cost(a);
        TORCH_CHECK_VALUE(finished.at(a) < 0, "pipeline ", model.name, ": ", name_of(a), " runs twice");
        finished.at(a) = end;
        clock[r] = end;
        out.busy[r] += end - start;
        out.actions.push_back({a, static_cast<int32_t>(r), start, end});
        ++pos[r];
        --remaining;
        progressed = true;
      }
    }
    if (!progressed) {
      std::ostringstream stuck;
      for (size_t r = 0; r < ranks; ++r)
        if (pos[r] < model.orders[r].size()) stuck << (stuck.tellp() ? ", " : "") << "rank " << r << " at " << name_of(model.orders[r][pos[r]]);
      TORCH_CHECK(false, "pipeline schedule ", model.name, " cannot finish: ranks wait on each other (", stuck.str(), ")");
    }
  }
  deps.check_every_action_ran();
  out.makespan = *std::max_element(clock.begin(), clock.end());
  return out;
}

Timeline simulate_pipeline_shared(const PipelineModel& model, double cores, const std::vector<StageCost>& waits) {
  const auto stages = static_cast<int32_t>(model.placement.size());
  const auto ranks = model.orders.size();
  Dependencies deps(model);  // checks the model
  auto& finished = deps.finished;
  auto rank_of = [&](int32_t st) { return deps.rank_of(st); };
  auto ready = [&](const Action& a) { return deps.ready(a); };
  TORCH_CHECK_VALUE(waits.empty() || static_cast<int32_t>(waits.size()) == stages, "pipeline ", model.name,
                    ": give one wait per stage (", stages, "), got ", waits.size());
  const StageCost unit, none{0, 0, 0, 0};
  auto work = [&](const Action& a) { return seconds(model.costs.empty() ? unit : model.costs[static_cast<size_t>(a.stage)], a.kind); };
  auto wait = [&](const Action& a) { return seconds(waits.empty() ? none : waits[static_cast<size_t>(a.stage)], a.kind); };
  enum Phase { kIdle, kCompute, kWait };
  struct State {
    size_t pos = 0;
    Phase phase = kIdle;
    double left = 0;     // compute seconds left (at full speed)
    double until = 0;    // end of the wait
    double start = 0;
  };
  std::vector<State> st(ranks);
  Timeline out;
  out.busy.assign(ranks, 0.0);
  size_t remaining = 0;
  for (const auto& order : model.orders) remaining += order.size();
  double now = 0;
  constexpr double eps = 1e-12;
  while (remaining > 0) {
    // start what can start now; note when waiting actions become ready
    double wake = std::numeric_limits<double>::infinity();
    for (size_t r = 0; r < ranks; ++r) {
      auto& x = st[r];
      if (x.phase != kIdle || x.pos >= model.orders[r].size()) continue;
      const Action& a = model.orders[r][x.pos];
      TORCH_CHECK_VALUE(finished.valid(a), "pipeline ", model.name, ": rank ", r, " has an action ", name_of(a),
                        " outside its ", stages, " stages and ", model.microbatches, " micro-batches");
      TORCH_CHECK_VALUE(rank_of(a.stage) == static_cast<int32_t>(r), "pipeline ", model.name, ": rank ", r, " runs ",
                        name_of(a), " of a stage placed on rank ", rank_of(a.stage));
      const double t = ready(a);
      if (t < 0) continue;
      if (t > now + eps) {
        wake = std::min(wake, t);
        continue;
      }
      x.start = now;
      x.left = work(a);
      x.phase = kCompute;
    }
    // processor sharing among the ranks that compute
    int active = 0;
    for (const auto& x : st) active += x.phase == kCompute;
    const double rate = cores > 0 && active > cores ? cores / active : 1.0;
    double next = wake;
    for (const auto& x : st) {
      if (x.phase == kCompute) next = std::min(next, now + x.left / rate);
      if (x.phase == kWait) next = std::min(next, x.until);
    }
    if (!std::isfinite(next)) {
      std::ostringstream stuck;
      for (size_t r = 0; r < ranks; ++r)
        if (st[r].pos < model.orders[r].size())
          stuck << (stuck.tellp() ? ", " : "") << "rank " << r << " at " << name_of(model.orders[r][st[r].pos]);
      TORCH_CHECK(false, "pipeline schedule ", model.name, " cannot finish: ranks wait on each other (", stuck.str(), ")");
    }
    const double dt = std::max(0.0, next - now);
    now = next;
    for (size_t r = 0; r < ranks; ++r) {
      auto& x = st[r];
      if (x.phase == kCompute) {
        x.left -= dt * rate;
        if (x.left <= eps * (1 + now)) {
          const Action& a = model.orders[r][x.pos];
          x.phase = kWait;
          x.until = now + wait(a);
        }
      }
      if (x.phase == kWait && x.until <= now + eps) {
        const Action& a = model.orders[r][x.pos];
        TORCH_CHECK_VALUE(finished.at(a) < 0, "pipeline ", model.name, ": ", name_of(a), " runs twice");
        finished.at(a) = now;
        out.busy[r] += now - x.start;
        out.actions.push_back({a, static_cast<int32_t>(r), x.start, now});
        x.phase = kIdle;
        ++x.pos;
        --remaining;
      }
    }
  }
  deps.check_every_action_ran();
  out.makespan = now;
  return out;
}

}  // namespace vescale::autoplan
