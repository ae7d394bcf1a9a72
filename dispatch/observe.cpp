#include "dispatch/observe.h"

#include "dispatch/dtensor_impl.h"
#include "dispatch/propagation.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <algorithm>
#include <deque>
#include <map>
#include <mutex>
#include <sstream>

namespace vescale {

namespace trace = collectives::trace;


namespace {

std::string shape_str(c10::ArrayRef<int64_t> shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

// Seconds as microseconds to the nanosecond, "50.025 us" (as Python's f"{us:.3f} us").
std::string micros(double seconds) {
  if (std::isinf(seconds)) return "cannot lay the tensors out";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3f us", seconds * 1e6);
  return buf;
}

// Explanations list every candidate up to this many, else the cheapest few.
constexpr size_t kMaxCandidatesShown = 16;
constexpr size_t kCheapestShown = 8;

std::string arg_name(const c10::OperatorHandle& op, const TensorSlot& slot) {
  std::string name = op.schema().arguments()[slot.arg].name();
  if (slot.elem >= 0) name += "[" + std::to_string(slot.elem) + "]";
  return name;
}

// Shape, dtype and placements of a defined tensor (a plain one's placements left empty).
void describe_tensor(ExplainedTensor& x, const at::Tensor& t) {
  x.defined = true;
  x.is_dtensor = is_dtensor(t);
  if (x.is_dtensor) {
    const auto& spec = *dtensor_impl(t)->spec();
    x.shape = spec.shape;
    x.dtype = spec.dtype;
    x.placements = spec.placements;
  } else {
    x.shape.assign(t.sizes().begin(), t.sizes().end());
    x.dtype = t.scalar_type();
  }
}

std::string describe(const ExplainedTensor& t) {
  if (!t.defined) return "(none)";
  return to_string(t.placements) + " " + shape_str(t.shape) + " " + c10::toString(t.dtype) +
      (t.is_dtensor ? "" : " (plain tensor, taken as replicated)");
}

// ---- capture ---------------------------------------------------------------------------

struct Capture {
  size_t capacity;
  std::deque<std::shared_ptr<const OpExplanation>> items;
};

std::mutex g_capture_mu;
std::map<int64_t, Capture> g_captures;
int64_t g_next_capture = 1;

void keep(const std::shared_ptr<const OpExplanation>& e) {
  std::lock_guard<std::mutex> lock(g_capture_mu);
  for (auto& [id, c] : g_captures) {
    c.items.push_back(e);
    while (c.items.size() > c.capacity) c.items.pop_front();
  }
}

thread_local int t_depth = 0;

struct DepthGuard {
  DepthGuard() { ++t_depth; }
  ~DepthGuard() { --t_depth; }
};

std::shared_ptr<OpExplanation> explain_before(const c10::OperatorHandle& op, const OpInfo& info,
                                              c10::ArrayRef<c10::IValue> args) {
  CallScan scan;
  scan.run(op, info, args);
  auto e = std::make_shared<OpExplanation>();
  e->op = info.name;
  e->depth = t_depth;
  e->scope = trace::scope();
  auto traced = trace_decision(op, info, args, scan);
  const Decision& d = *traced.decision;
  e->cache_hit = traced.cached;
  e->mesh = d.mesh ? d.mesh->str() : "";
  e->candidates = std::move(traced.candidates);
  if (d.decompose) {
    e->how = OpExplanation::How::Decomposed;
  } else if (d.fallback_counter) {
    e->how = OpExplanation::How::Fallback;
    e->fallback_reason = traced.fallback_reason;
  }
  for (size_t i = 0; i < scan.tensors.size(); ++i) {
    ExplainedTensor x;
    x.name = arg_name(op, scan.slots[i]);
    const auto& t = scan.tensors[i];
    if (t.defined()) {
      describe_tensor(x, t);
      // a plain tensor among DTensors is replicated over the op's mesh
      if (!x.is_dtensor && d.mesh) x.placements.assign(static_cast<size_t>(d.mesh->ndim()), Placement::replicate());
      x.target = x.placements;
      if (!d.decompose && i < d.targets.size() && d.targets[i]) {
        x.target = d.targets[i]->placements;
        if (!d.to_target[i].empty()) {
          x.moves = d.to_target[i].str();
          x.cost = d.to_target[i].cost;
        }
      }
    }
    e->inputs.push_back(std::move(x));
  }
  return e;
}

void describe_results(OpExplanation& e, const OpInfo& info, const torch::jit::Stack& stack, size_t base) {
  size_t j = 0;
  auto add = [&](const at::Tensor& t) {
    ExplainedTensor x;
    x.name = "result " + std::to_string(j++);
    if (t.defined()) describe_tensor(x, t);
    e.outputs.push_back(std::move(x));
  };
  for (size_t r = 0; r < info.num_returns; ++r) {
    const auto& v = stack[base + r];
    switch (info.returns[r]) {
      case ReturnKind::Tensor: add(v.isTensor() ? v.toTensor() : at::Tensor()); break;
      case ReturnKind::TensorList:
        for (const auto& t : v.toTensorList()) add(t);
        break;
      case ReturnKind::Other: break;
    }
  }
}

// ---- anomalies -------------------------------------------------------------------------

std::mutex g_anomaly_mu;
int g_anomaly_users = 0;
int g_anomaly_raisers = 0;
std::optional<Anomaly> g_anomaly;
std::atomic<bool> g_has_anomaly{false};  // once one is found, later ops are not checked

bool all_finite(const at::Tensor& t) {
  if (!t.defined() || t.is_meta() || t.numel() == 0) return true;
  if (!(at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()))) return true;
  at::NoGradGuard no_grad;
  return at::isfinite(t).all().item<bool>();
}

const at::Tensor& local_of(const at::Tensor& t) { return is_dtensor(t) ? dtensor_impl(t)->local() : t; }

int64_t global_rank(const Mesh& mesh) {
  int64_t flat = 0;
  for (size_t m = 0; m < mesh.shape.size(); ++m) flat = flat * mesh.shape[m] + mesh.coordinate[m];
  return flat < static_cast<int64_t>(mesh.ranks.size()) ? mesh.ranks[static_cast<size_t>(flat)] : -1;
}

void check_results(const OpInfo& info, const torch::jit::Stack& stack, size_t base,
                   const std::vector<c10::IValue>& inputs) {
  if (g_has_anomaly.load(std::memory_order_relaxed)) return;
  std::vector<at::Tensor> results;
  for (size_t r = 0; r < info.num_returns; ++r) {
    const auto& v = stack[base + r];
    if (info.returns[r] == ReturnKind::Tensor) results.push_back(v.isTensor() ? v.toTensor() : at::Tensor());
    if (info.returns[r] == ReturnKind::TensorList)
      for (const auto& t : v.toTensorList()) results.push_back(t);
  }
  const at::Tensor* bad = nullptr;
  size_t bad_index = 0;
  for (size_t k = 0; k < results.size() && bad == nullptr; ++k)
    if (results[k].defined() && is_dtensor(results[k]) && !all_finite(local_of(results[k]))) {
      bad = &results[k];
      bad_index = k;
    }
  if (bad == nullptr) return;

  Anomaly a;
  a.op = info.name;
  a.scope = trace::scope();
  const auto& spec = *dtensor_impl(*bad)->spec();
  a.rank = global_rank(*spec.mesh);
  a.result = "result " + std::to_string(bad_index) + " " + spec.str();
  for (size_t i = 0; i < inputs.size() && a.inputs_finite; ++i) {
    if (info.arg_written[i]) continue;  // overwritten by now
    const auto& v = inputs[i];
    if (v.isTensor()) a.inputs_finite = all_finite(local_of(v.toTensor()));
    else if (v.isTensorList())
      for (const auto& t : v.toTensorList())
        if (a.inputs_finite) a.inputs_finite = all_finite(local_of(t));
  }
  std::ostringstream os;
  os << "vescale.debug.detect_anomaly: " << a.op << " produced a non-finite value (NaN or Inf) in its " << a.result
     << " on rank " << a.rank;
  if (a.scope != 0) os << ", in " << scope_name(a.scope);
  os << (a.inputs_finite ? "; its inputs were finite, so this op is where it starts"
                         : "; its inputs already held NaN/Inf (they came from outside vescale's ops, "
                           "e.g. a plain tensor computation or the data)");
  a.message = os.str();
  bool raise = false;
  {
    std::lock_guard<std::mutex> lock(g_anomaly_mu);
    if (!g_anomaly) g_anomaly = a;
    g_has_anomaly = true;
    raise = g_anomaly_raisers > 0;
  }
  TORCH_CHECK(!raise, a.message);
}

// ---- scopes ------------------------------------------------------------------------------

std::mutex g_scope_mu;
std::vector<std::string>& scope_names() {
  static std::vector<std::string> names{""};
  return names;
}
std::map<std::pair<std::string, bool>, int32_t>& scope_ids() {
  static std::map<std::pair<std::string, bool>, int32_t> ids;
  return ids;
}

}  // namespace

std::string OpExplanation::str() const {
  std::ostringstream os;
  const std::string pad(static_cast<size_t>(2 * depth), ' ');
  os << pad << op << " on " << mesh << ": ";
  switch (how) {
    case How::Rule: os << (cache_hit ? "cache hit" : "decided now (cache miss)"); break;
    case How::Fallback: os << "replicate fallback (" << fallback_reason << ")"; break;
    case How::Decomposed: os << "decomposed into the ops that follow"; break;
  }
  os << "\n";
  for (const auto& x : inputs) {
    os << pad << "  input " << x.name << ": " << describe(x);
    if (x.defined && how != How::Decomposed) {
      if (x.moves.empty()) os << ", used as it is";
      else os << " -> " << to_string(x.target) << " by " << x.moves << ", cost " << micros(x.cost);
    }
    os << "\n";
  }
  const auto& all = candidates.candidates;
  if (!all.empty()) {
    // All of them while they fit on a screen (in the rule's order), else the cheapest.
    std::vector<size_t> shown(all.size());
    for (size_t k = 0; k < all.size(); ++k) shown[k] = k;
    if (all.size() > kMaxCandidatesShown) {
      std::stable_sort(shown.begin(), shown.end(), [&](size_t a, size_t b) { return all[a].cost < all[b].cost; });
      shown.resize(kCheapestShown);
      if (candidates.chosen >= 0 &&
          std::find(shown.begin(), shown.end(), static_cast<size_t>(candidates.chosen)) == shown.end())
        shown.push_back(static_cast<size_t>(candidates.chosen));
      os << pad << "  candidates, the " << shown.size() << " cheapest of " << all.size()
         << " (inputs -> results: cost of moving the inputs; * chosen):\n";
    } else {
      os << pad << "  candidates (inputs -> results: cost of moving the inputs; * chosen):\n";
    }
    for (const size_t k : shown) {
      const auto& c = all[k];
      os << pad << (static_cast<int>(k) == candidates.chosen ? "  * " : "    ") << to_string(c) << ": "
         << micros(c.cost) << (c.keeps_written ? "" : " (moves an input the op writes)") << "\n";
    }
  } else if (how == How::Rule) {
    os << pad << "  candidates: none listed (the rule chose directly)\n";
  }
  if (collectives.empty()) {
    os << pad << "  collectives: none\n";
  } else {
    for (const auto& c : collectives) {
      os << pad << "  collective: " << c.kind << " on mesh dim " << c.mesh_dim;
      if (!c.mesh_dim_name.empty()) os << " (" << c.mesh_dim_name << ")";
      os << ", " << c.group_size << " ranks, " << c.bytes << " bytes\n";
    }
  }
  for (const auto& x : outputs) os << pad << "  " << x.name << ": " << describe(x) << "\n";
  std::string s = os.str();
  if (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

void observed_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack, KernelFn run) {
  const OpInfo& info = op_info(op);
  const uint32_t flags = trace::flags();
  const trace::OpContext context(info.name);
  const size_t base = stack->size() - info.num_args;
  const c10::ArrayRef<c10::IValue> args(stack->data() + base, info.num_args);

  std::shared_ptr<OpExplanation> explanation;
  if (flags & trace::kExplain) {
    explanation = explain_before(op, info, args);
    keep(explanation);  // before running: a decomposition's parts follow their op
  }
  std::vector<c10::IValue> inputs;
  if (flags & trace::kAnomaly) inputs.assign(args.begin(), args.end());
  {
    std::optional<trace::Listener> listener;
    if (explanation) listener.emplace();
    const DepthGuard depth;
    run(op, stack);
    if (explanation) explanation->collectives = std::move(listener->events);
  }
  if (explanation) describe_results(*explanation, info, *stack, base);
  if (flags & trace::kAnomaly) check_results(info, *stack, base, inputs);
}

int64_t begin_explain_capture(size_t capacity) {
  TORCH_CHECK_VALUE(capacity > 0, "vescale.explain: keep at least one decision, got ", capacity);
  int64_t id;
  {
    std::lock_guard<std::mutex> lock(g_capture_mu);
    id = g_next_capture++;
    g_captures[id] = Capture{capacity, {}};
  }
  trace::enable(trace::kExplain);
  return id;
}

std::vector<std::shared_ptr<const OpExplanation>> end_explain_capture(int64_t handle) {
  std::vector<std::shared_ptr<const OpExplanation>> out;
  {
    std::lock_guard<std::mutex> lock(g_capture_mu);
    auto it = g_captures.find(handle);
    if (it == g_captures.end()) return out;
    out.assign(it->second.items.begin(), it->second.items.end());
    g_captures.erase(it);
  }
  trace::disable(trace::kExplain);
  return out;
}

void begin_anomaly_detection(bool raise) {
  {
    std::lock_guard<std::mutex> lock(g_anomaly_mu);
    ++g_anomaly_users;
    if (raise) ++g_anomaly_raisers;
  }
  trace::enable(trace::kAnomaly);
}

void end_anomaly_detection(bool raise) {
  {
    std::lock_guard<std::mutex> lock(g_anomaly_mu);
    if (g_anomaly_users == 0) return;
    --g_anomaly_users;
    if (raise && g_anomaly_raisers > 0) --g_anomaly_raisers;
  }
  trace::disable(trace::kAnomaly);
}

std::optional<Anomaly> first_anomaly() {
  std::lock_guard<std::mutex> lock(g_anomaly_mu);
  return g_anomaly;
}

void reset_anomaly() {
  std::lock_guard<std::mutex> lock(g_anomaly_mu);
  g_anomaly.reset();
  g_has_anomaly = false;
}

int32_t scope_id(const std::string& module, bool backward) {
  std::lock_guard<std::mutex> lock(g_scope_mu);
  auto [it, inserted] = scope_ids().try_emplace({module, backward}, 0);
  if (inserted) {
    it->second = static_cast<int32_t>(scope_names().size());
    scope_names().push_back(module + (backward ? " (backward)" : " (forward)"));
  }
  return it->second;
}

std::string scope_name(int32_t scope) {
  std::lock_guard<std::mutex> lock(g_scope_mu);
  const auto& names = scope_names();
  return scope >= 0 && static_cast<size_t>(scope) < names.size() ? names[static_cast<size_t>(scope)] : "";
}

}  // namespace vescale
