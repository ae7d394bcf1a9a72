#include "dispatch/propagation.h"

#include "dispatch/dtensor_impl.h"
#include "dispatch/fallback_stats.h"
#include "dispatch/meta_layout.h"

#include <ATen/ATen.h>
#include <c10/util/flat_hash_map.h>
#include <c10/util/hash.h>

#include <atomic>

namespace vescale {

namespace {

// ---- describing the call -------------------------------------------------------

TensorArg describe(const at::Tensor& t, int64_t mesh_ndim) {
  TensorArg a;
  if (!t.defined()) return a;
  a.defined = true;
  if (is_dtensor(t)) {
    const auto& spec = *dtensor_impl(t)->spec();
    a.is_dtensor = true;
    a.shape = spec.shape;
    a.stride = spec.stride;
    a.storage_offset = spec.storage_offset;
    a.dtype = spec.dtype;
    a.placements = spec.placements;
  } else {
    a.shape.assign(t.sizes().begin(), t.sizes().end());
    a.stride.assign(t.strides().begin(), t.strides().end());
    a.storage_offset = t.storage_offset();
    a.dtype = t.scalar_type();
    a.placements.assign(static_cast<size_t>(mesh_ndim), Placement::replicate());
  }
  return a;
}

// The spec a flattened input has now: a DTensor's own, or Replicate for a plain tensor.
SpecPtr source_spec(const at::Tensor& t, const TensorArg& a, const MeshPtr& mesh) {
  if (!t.defined()) return nullptr;
  if (a.is_dtensor) return dtensor_impl(t)->spec();
  return make_spec(mesh, a.placements, a.shape, a.stride, a.dtype, a.storage_offset);
}

// ---- global result metadata from the meta kernels ---------------------------------

at::Tensor meta_like(const at::Tensor& t, const TensorArg& a) {
  if (!a.defined) return at::Tensor();
  // Python scalars (wrapped numbers) mix with meta tensors as scalars do, and keep type
  // promotion right. Other plain 0-dim tensors become meta like the rest: ops such as
  // stack refuse a CPU tensor among meta ones (autograd's zeros for unused unbind outputs).
  if (!a.is_dtensor && t.dim() == 0 && t.is_cpu() && t.unsafeGetTensorImpl()->is_wrapped_number()) return t;
  auto options = at::TensorOptions().dtype(a.dtype).device(c10::kMeta);
  if (a.storage_offset == 0) return at::empty_strided(a.shape, a.stride, options);
  // A view: give it room before it in its storage, so views of it compute offsets right.
  // (An empty view addresses no element: its offset is all the room it needs.)
  int64_t span = a.storage_offset + 1;
  for (size_t d = 0; d < a.shape.size(); ++d) span += (a.shape[d] - 1) * a.stride[d];
  if (std::find(a.shape.begin(), a.shape.end(), 0) != a.shape.end()) span = a.storage_offset;
  return at::empty({span}, options).as_strided(a.shape, a.stride, a.storage_offset);
}

// Runs the op on meta tensors with the global metadata. Returns false (with the
// reason) when the op has no meta kernel, when its meta kernel refuses the call
// (arguments the op itself would refuse too, or a meta kernel stricter than the CPU
// kernel), or when its result shape depends on data.
bool run_meta(const c10::OperatorHandle& op, const OpInfo& info, c10::ArrayRef<c10::IValue> args,
              const CallScan& scan, const std::vector<TensorArg>& inputs,
              std::vector<TensorArg>& outputs, std::string& why) {
  torch::jit::Stack stack(args.begin(), args.end());
  for (auto& v : stack)
    if (v.isDevice()) v = c10::Device(c10::kMeta);
  std::vector<at::Tensor> metas;
  for (size_t i = 0; i < inputs.size(); ++i) metas.push_back(meta_like(scan.tensors[i], inputs[i]));
  replace_tensors(stack, 0, info, scan.slots, metas);
  try {
    op.callBoxed(stack);
  } catch (const c10::NotImplementedError& e) {
    why = std::string("no meta kernel: ") + e.what_without_backtrace();
    return false;
  } catch (const c10::Error& e) {
    why = std::string("its meta kernel refused the call: ") + e.what_without_backtrace();
    return false;
  } catch (const std::exception& e) {
    // A meta kernel written in Python raises a Python exception (nonzero's, reached by
    // x[mask] with a bool mask: its result's shape depends on the data).
    const std::string what = e.what();  // its first line (a Python traceback follows)
    why = "its meta kernel raised: " + what.substr(0, what.find('\n'));
    return false;
  }
  map_results(stack, 0, info, [&](const at::Tensor& t, int) {
    TensorArg a;
    if (t.defined()) {
      a.defined = true;
      a.shape.assign(t.sizes().begin(), t.sizes().end());
      a.stride.assign(t.strides().begin(), t.strides().end());
      a.storage_offset = t.storage_offset();
      a.dtype = t.scalar_type();
    }
    outputs.push_back(std::move(a));
    return t;
  });
  match_cpu_layout(info.name, args, scan.tensors.empty() ? c10::kCPU : scan.tensors[0].device().type(), metas, outputs);
  return true;
}

// ---- turning a rule's choice into a decision ------------------------------------

std::unique_ptr<Decision> from_choice(const OpCall& call, const CallScan& scan,
                                      const MeshPtr& mesh, ShardingChoice choice) {
  if (choice.decompose) {
    auto d = std::make_unique<Decision>();
    d->mesh = mesh;
    d->decompose = choice.decompose;
    for (size_t i = 0; i < call.inputs.size(); ++i) d->sources.push_back(source_spec(scan.tensors[i], call.inputs[i], mesh));
    for (const auto& out : call.outputs) d->result_strides.push_back(out.defined ? out.stride : Shape{});
    return d;
  }
  const size_t n_in = call.inputs.size();
  const size_t n_out = call.outputs.size();
  TORCH_INTERNAL_ASSERT(choice.inputs.size() == n_in && choice.outputs.size() == n_out,
                        call.name(), ": rule returned ", choice.inputs.size(), " inputs and ",
                        choice.outputs.size(), " outputs for a call with ", n_in, " and ", n_out);
  auto d = std::make_unique<Decision>();
  d->mesh = mesh;
  d->sources.resize(n_in);
  d->targets.resize(n_in);
  d->to_target.resize(n_in);
  d->write_back.resize(n_in);
  for (size_t i = 0; i < n_in; ++i) {
    const auto& in = call.inputs[i];
    if (!in.defined) continue;
    d->sources[i] = source_spec(scan.tensors[i], in, mesh);
    d->targets[i] = with_placements(d->sources[i], choice.inputs[i]);
    if (d->targets[i] == d->sources[i]) continue;
    // The plan the rule priced when it has one (the same inputs: shape, dtype, mesh).
    auto priced_or_planned = [&](auto& priced, const SpecPtr& from, const SpecPtr& to) {
      return i < priced.size() && priced[i] ? std::move(*priced[i])
                                            : collectives::plan_redistribution(*from, to->placements);
    };
    d->to_target[i] = priced_or_planned(choice.to_target, d->sources[i], d->targets[i]);
    if (in.written) d->write_back[i] = priced_or_planned(choice.write_back, d->targets[i], d->sources[i]);
  }
  for (size_t j = 0; j < n_out; ++j) {
    const auto& out = call.outputs[j];
    d->outputs.push_back(out.defined ? make_spec(mesh, choice.outputs[j], out.shape, out.stride, out.dtype,
                                                 out.storage_offset)
                                     : nullptr);
  }
  d->local_args = std::move(choice.local_args);
  d->local_fn = choice.local_fn;
  return d;
}

// Set while trace_decision runs decide(): the reason of a fallback.
thread_local std::string* t_fallback_reason = nullptr;

std::unique_ptr<Decision> fallback(const OpCall& call, const CallScan& scan, const MeshPtr& mesh,
                                   const std::string& op_name, const std::string& why) {
  if (C10_UNLIKELY(t_fallback_reason != nullptr)) *t_fallback_reason = why;
  const Placements r(static_cast<size_t>(mesh->ndim()), Placement::replicate());
  ShardingChoice choice;
  choice.inputs.assign(call.inputs.size(), r);
  auto d = from_choice(call, scan, mesh, std::move(choice));
  d->fallback_counter = fallback_counter(op_name, why);
  return d;
}

std::unique_ptr<Decision> decide(const c10::OperatorHandle& op, const OpInfo& info,
                                 c10::ArrayRef<c10::IValue> args, const CallScan& scan) {
  MeshPtr mesh;
  for (const auto& t : scan.tensors)
    if (is_dtensor(t)) {
      mesh = dtensor_impl(t)->spec()->mesh;
      break;
    }
  OpCall call{op, args, *mesh, {}, {}};
  for (size_t i = 0; i < scan.tensors.size(); ++i) {
    call.inputs.push_back(describe(scan.tensors[i], mesh->ndim()));
    call.inputs.back().written = info.arg_written[scan.slots[i].arg];
    call.input_arg.push_back(scan.slots[i].arg);
  }
  const RuleFn* rule = rules().find(info.name);
  if (rule == nullptr) return fallback(call, scan, mesh, info.name, "no rule");
  // Results' global metadata; ops that return no tensor (item, equal) need none.
  const bool returns_tensors = std::any_of(info.returns.begin(), info.returns.end(),
                                           [](ReturnKind k) { return k != ReturnKind::Other; });
  std::string why;
  if (returns_tensors && !run_meta(op, info, args, scan, call.inputs, call.outputs, why)) {
    const ShapeFn* shapes = rules().find_shape_fn(info.name);
    if (shapes == nullptr) return fallback(call, scan, mesh, info.name, why);
    call.outputs = (*shapes)(call);  // a meta kernel stricter than the CPU kernel
  }
  return from_choice(call, scan, mesh, (*rule)(call));
}

// ---- the cache -------------------------------------------------------------------

// Each thread caches its decisions in a map that is cleared when it reaches the limit
// (a hit then stays free of book-keeping; a run whose shapes change every step
// recomputes its decisions once per `limit` new ones instead of growing without end).
// A Decision reference handed out stays valid until this thread's next lookup: the
// handler makes none while it uses one (a decomposition's nested calls come after
// its last use of its own).
constexpr size_t kDefaultDecisionLimit = 16384;
std::atomic<size_t> g_limit{kDefaultDecisionLimit};
std::atomic<uint64_t> g_generation{0};
std::atomic<int64_t> g_misses{0};
std::atomic<int64_t> g_entries{0};    // cached decisions, all threads
std::atomic<int64_t> g_evictions{0};  // caches cleared because they were full

using Key = std::vector<uint64_t>;

struct ThreadCache {
  uint64_t generation = 0;
  // c10's ska::flat_hash_map finds by its own key type only; looking up through this
  // copy of the scanned key, whose capacity is reused, keeps a hit free of allocation.
  Key probe;
  ska::flat_hash_map<Key, std::unique_ptr<Decision>, c10::hash<Key>> map;

  void clear() {
    g_entries.fetch_sub(static_cast<int64_t>(map.size()), std::memory_order_relaxed);
    map.clear();
  }
  ~ThreadCache() { clear(); }
};

ThreadCache& thread_cache() {
  thread_local ThreadCache cache;
  return cache;
}

}  // namespace

const Decision& lookup_decision(const c10::OperatorHandle& op, const OpInfo& info,
                                c10::ArrayRef<c10::IValue> args, const CallScan& scan) {
  auto& cache = thread_cache();
  const auto generation = g_generation.load(std::memory_order_relaxed);
  if (C10_UNLIKELY(cache.generation != generation)) {
    cache.clear();
    cache.generation = generation;
  }
  cache.probe.assign(scan.key.begin(), scan.key.end());
  if (auto it = cache.map.find(cache.probe); C10_LIKELY(it != cache.map.end())) return *it->second;
  g_misses.fetch_add(1, std::memory_order_relaxed);
  auto decision = decide(op, info, args, scan);
  if (C10_UNLIKELY(cache.map.size() >= g_limit.load(std::memory_order_relaxed))) {
    cache.clear();
    g_evictions.fetch_add(1, std::memory_order_relaxed);
  }
  auto& slot = cache.map[Key(scan.key.begin(), scan.key.end())];
  slot = std::move(decision);
  g_entries.fetch_add(1, std::memory_order_relaxed);
  return *slot;
}

bool decision_cached(const CallScan& scan) {
  auto& cache = thread_cache();
  if (cache.generation != g_generation.load(std::memory_order_relaxed)) return false;
  const Key key(scan.key.begin(), scan.key.end());
  return cache.map.find(key) != cache.map.end();
}

DecisionTrace trace_decision(const c10::OperatorHandle& op, const OpInfo& info, c10::ArrayRef<c10::IValue> args,
                             const CallScan& scan) {
  DecisionTrace out;
  out.cached = decision_cached(scan);
  std::string reason;
  t_fallback_reason = &reason;
  CandidateCapture capture(out.candidates);
  try {
    out.decision = decide(op, info, args, scan);
  } catch (...) {
    t_fallback_reason = nullptr;
    throw;
  }
  t_fallback_reason = nullptr;
  out.fallback_reason = std::move(reason);
  return out;
}

std::string to_string(const Decision& d) {
  if (d.decompose) return "Decision(decomposed into other DTensor ops)";
  std::string s = d.fallback_counter ? "Decision(replicate fallback; inputs " : "Decision(inputs ";
  for (size_t i = 0; i < d.sources.size(); ++i) {
    s += i ? "; " : "";
    if (!d.sources[i]) {
      s += "-";
      continue;
    }
    s += to_string(d.sources[i]->placements);
    if (!d.to_target[i].empty()) s += " -> " + to_string(d.targets[i]->placements) + " by " + d.to_target[i].str();
  }
  s += "; results ";
  if (d.fallback_counter) {
    s += "replicated";
  } else {
    for (size_t j = 0; j < d.outputs.size(); ++j)
      s += (j ? ", " : "") + (d.outputs[j] ? to_string(d.outputs[j]->placements) : std::string("-"));
  }
  if (d.local_fn) s += "; a local computation of its own";
  return s + ")";
}

void clear_decision_cache() { g_generation.fetch_add(1); }

int64_t decision_cache_misses() { return g_misses.load(); }

DecisionCacheSize decision_cache_size() {
  return {g_entries.load(std::memory_order_relaxed), g_limit.load(std::memory_order_relaxed),
          g_evictions.load(std::memory_order_relaxed)};
}

void set_decision_cache_limit(size_t limit) {
  TORCH_CHECK_VALUE(limit > 0, "the decision cache limit must be positive, got ", limit);
  g_limit.store(limit, std::memory_order_relaxed);
}

size_t default_decision_cache_limit() { return kDefaultDecisionLimit; }

}  // namespace vescale
