#include "sharding_rules/rule.h"

#include "collectives/redistribute_plan.h"

#include <c10/util/Exception.h>
#include <c10/util/flat_hash_map.h>

#include <algorithm>
#include <limits>

namespace vescale {

const c10::IValue& OpCall::arg(const char* arg_name) const {
  const auto* v = find_arg(arg_name);
  TORCH_INTERNAL_ASSERT(v != nullptr, name(), " has no argument called '", arg_name, "' (a sharding rule asked for it)");
  return *v;
}

std::vector<int64_t> OpCall::int_list_arg(const char* name) const {
  std::vector<int64_t> out;
  const auto& v = arg(name);
  if (v.isNone()) return out;
  for (const auto& x : v.toListRef()) out.push_back(x.toInt());
  return out;
}

std::vector<int64_t> OpCall::dims_arg(const char* name, int64_t ndim, bool empty_means_all) const {
  std::vector<int64_t> dims;
  const auto& v = arg(name);
  if (v.isInt()) {
    dims.push_back(v.toInt());
  } else {
    dims = int_list_arg(name);
  }
  if (dims.empty() && empty_means_all) {
    for (int64_t d = 0; d < ndim; ++d) dims.push_back(d);
  }
  for (auto& d : dims) {
    if (d < 0) d += std::max<int64_t>(ndim, 1);
  }
  return dims;
}

std::string OpCall::name() const { return c10::toString(op.operator_name()); }

const c10::IValue* OpCall::find_arg(const char* name) const {
  const auto index = schema().argumentIndexWithName(name);
  return index ? &args[static_cast<size_t>(*index)] : nullptr;
}

namespace {

// The moves of one input, planned once per target placements (the same targets recur
// across the strategy combinations) and kept: the chosen ones go to the dispatcher.
class InputMoves {
 public:
  InputMoves(const Mesh& mesh, const TensorArg& arg) : mesh_(mesh), arg_(arg) {}

  // Seconds to move the input to `target`; `back`: from `target` back to where it is
  // (a written input laid out elsewhere is written into a temporary, then moved back).
  double cost(const Placements& target, bool back = false) {
    const auto* plan = find(target, back);
    return plan ? plan->cost : 0.0;
  }
  // The plan, moved out (nullopt when the input stays as it is).
  std::optional<collectives::RedistPlan> take(const Placements& target, bool back = false) {
    auto* plan = find(target, back);
    return plan ? std::optional<collectives::RedistPlan>(std::move(*plan)) : std::nullopt;
  }

 private:
  collectives::RedistPlan* find(const Placements& target, bool back) {
    if (target == arg_.placements) return nullptr;
    for (auto& m : memo_)  // a few distinct targets per input
      if (m.back == back && m.target == target) return &m.plan;
    const PlacementsRef from = back ? PlacementsRef(target) : PlacementsRef(arg_.placements);
    const PlacementsRef to = back ? PlacementsRef(arg_.placements) : PlacementsRef(target);
    memo_.push_back({target, back, collectives::plan_redistribution(mesh_, from, to, arg_.shape, arg_.dtype)});
    return &memo_.back().plan;
  }

  struct Memo {
    Placements target;
    bool back;
    collectives::RedistPlan plan;
  };
  const Mesh& mesh_;
  const TensorArg& arg_;
  std::vector<Memo> memo_;
};

}  // namespace

bool divides_over_all_ranks(const OpCall& call, int64_t size) {
  int64_t ranks = 1;
  for (auto n : call.mesh.shape) ranks *= n;
  return size > 0 && size % ranks == 0;
}

namespace {

// The groups counts of the InterleavedShard placements among the call's inputs.
std::vector<int32_t> interleaved_groups(const OpCall& call) {
  std::vector<int32_t> groups;
  for (const auto& in : call.inputs)
    for (const auto& p : in.placements)
      if (p.is_interleaved() && std::find(groups.begin(), groups.end(), p.groups) == groups.end())
        groups.push_back(p.groups);
  return groups;
}

// `strategies` followed by their interleaved copies, one per groups count: every
// Shard(d) becomes InterleavedShard(d, g). Whether the sizes divide is checked per
// combination (it depends on the mesh dim's size).
DimStrategies lift_interleaved(const DimStrategies& strategies, const std::vector<int32_t>& groups) {
  DimStrategies out = strategies;
  auto lift = [](Placements ps, int32_t g) {
    bool any = false;
    for (auto& p : ps)
      if (p.is_shard()) {
        p = Placement::interleaved(p.dim, g);
        any = true;
      }
    return std::make_pair(ps, any);
  };
  for (const int32_t g : groups)
    for (const auto& s : strategies) {
      auto [in, lifted_in] = lift(s.inputs, g);
      auto [outs, lifted_out] = lift(s.outputs, g);
      if (lifted_in || lifted_out) out.push_back({std::move(in), std::move(outs)});
    }
  return out;
}

bool lays_out(const TensorArg& t, PlacementsRef placements, const Mesh& mesh) {
  return !t.defined || interleaved_problem(t.shape, placements, mesh.shape).empty();
}

void log_candidate(const OpCall& call, const DimStrategies& strategies, const std::vector<size_t>& combo,
                   double cost, bool keeps_written);

}  // namespace

namespace {
thread_local CandidateLog* t_candidates = nullptr;
}  // namespace

namespace {
void log_candidate(const OpCall& call, const DimStrategies& strategies, const std::vector<size_t>& combo,
                   double cost, bool keeps_written) {
  Candidate c;
  c.cost = cost;
  c.keeps_written = keeps_written;
  const size_t mesh_ndim = combo.size();
  for (size_t i = 0; i < call.inputs.size(); ++i) {
    Placements p;
    if (call.inputs[i].defined)
      for (size_t m = 0; m < mesh_ndim; ++m) p.push_back(strategies[combo[m]].inputs[i]);
    c.inputs.push_back(std::move(p));
  }
  for (size_t j = 0; j < call.outputs.size(); ++j) {
    Placements p;
    for (size_t m = 0; m < mesh_ndim; ++m) p.push_back(strategies[combo[m]].outputs[j]);
    c.outputs.push_back(std::move(p));
  }
  t_candidates->candidates.push_back(std::move(c));
}
}  // namespace

CandidateCapture::CandidateCapture(CandidateLog& log) : saved_(t_candidates) { t_candidates = &log; }
CandidateCapture::~CandidateCapture() { t_candidates = saved_; }

std::string to_string(const Candidate& c) {
  std::string s;
  for (size_t i = 0; i < c.inputs.size(); ++i) s += (i ? ", " : "") + (c.inputs[i].empty() ? "-" : to_string(c.inputs[i]));
  s += " -> ";
  for (size_t j = 0; j < c.outputs.size(); ++j) s += (j ? ", " : "") + to_string(c.outputs[j]);
  return s;
}

std::string to_string(const DimStrategy& strategy) {
  std::string s;
  for (size_t i = 0; i < strategy.inputs.size(); ++i) s += (i ? ", " : "") + strategy.inputs[i].str();
  s += " -> ";
  for (size_t j = 0; j < strategy.outputs.size(); ++j) s += (j ? ", " : "") + strategy.outputs[j].str();
  return s;
}

namespace {
bool replicates_all(const DimStrategy& s) {
  auto r = [](const Placement& p) { return p.is_replicate(); };
  return std::all_of(s.inputs.begin(), s.inputs.end(), r) && std::all_of(s.outputs.begin(), s.outputs.end(), r);
}

// Every op can run on whole tensors: the all-replicate layout is always a candidate,
// first (it wins ties), unless the rule placed it itself.
DimStrategies with_replicate_all(const OpCall& call, const DimStrategies& offered) {
  DimStrategies out;
  out.reserve(offered.size() + 1);
  out.push_back({Placements(call.inputs.size(), Placement::replicate()), Placements(call.outputs.size(), Placement::replicate())});
  out.insert(out.end(), offered.begin(), offered.end());
  return out;
}
}  // namespace

ShardingChoice choose_cheapest(const OpCall& call, const DimStrategies& rule_strategies, Interleaving interleaving) {
  const bool rule_replicates = std::any_of(rule_strategies.begin(), rule_strategies.end(), replicates_all);
  const DimStrategies completed = rule_replicates ? DimStrategies{} : with_replicate_all(call, rule_strategies);
  const DimStrategies& offered = rule_replicates ? rule_strategies : completed;
  const auto groups = interleaving == Interleaving::Lift ? interleaved_groups(call) : std::vector<int32_t>{};
  const DimStrategies lifted = groups.empty() ? DimStrategies{} : lift_interleaved(offered, groups);
  const DimStrategies& strategies = groups.empty() ? offered : lifted;
  const bool check_interleaved = std::any_of(strategies.begin(), strategies.end(), [](const DimStrategy& s) {
    auto interleaved = [](const Placement& p) { return p.is_interleaved(); };
    return std::any_of(s.inputs.begin(), s.inputs.end(), interleaved) ||
        std::any_of(s.outputs.begin(), s.outputs.end(), interleaved);
  });
  const size_t n_in = call.inputs.size();
  const size_t n_out = call.outputs.size();
  for (const auto& s : strategies) {
    TORCH_INTERNAL_ASSERT(s.inputs.size() == n_in && s.outputs.size() == n_out, call.name(),
                          ": strategy has ", s.inputs.size(), " inputs and ", s.outputs.size(),
                          " outputs, the call has ", n_in, " and ", n_out);
  }
  const auto mesh_ndim = static_cast<size_t>(call.mesh.ndim());
  std::vector<InputMoves> moves;
  moves.reserve(n_in);
  for (const auto& in : call.inputs) moves.emplace_back(call.mesh, in);

  std::vector<size_t> combo(mesh_ndim, 0), best_strict, best_any;
  size_t combinations = 1;
  for (size_t m = 0; m < mesh_ndim; ++m) combinations *= strategies.size();
  double best_strict_cost = std::numeric_limits<double>::infinity();
  double best_any_cost = std::numeric_limits<double>::infinity();
  Placements target(mesh_ndim);
  // Whether the combination lays every input and result out (interleaved splits need
  // even sizes and no nesting); plain strategies always do.
  auto fits = [&]() {
    if (!check_interleaved) return true;
    for (size_t i = 0; i < n_in; ++i) {
      for (size_t m = 0; m < mesh_ndim; ++m) target[m] = strategies[combo[m]].inputs[i];
      if (!lays_out(call.inputs[i], target, call.mesh)) return false;
    }
    for (size_t j = 0; j < n_out; ++j) {
      for (size_t m = 0; m < mesh_ndim; ++m) target[m] = strategies[combo[m]].outputs[j];
      if (!lays_out(call.outputs[j], target, call.mesh)) return false;
    }
    return true;
  };
  while (true) {
    double cost = 0;
    bool keeps_written = true;
    const bool ok = fits();
    for (size_t i = 0; i < n_in && ok; ++i) {
      const auto& in = call.inputs[i];
      if (!in.defined) continue;
      for (size_t m = 0; m < mesh_ndim; ++m) target[m] = strategies[combo[m]].inputs[i];
      if (in.written && target != in.placements) {
        keeps_written = false;
        cost += moves[i].cost(target, /*back=*/true);  // writing into a temporary costs the way back too
      }
      cost += moves[i].cost(target);
    }
    if (!ok) cost = std::numeric_limits<double>::infinity();
    if (C10_UNLIKELY(t_candidates != nullptr)) log_candidate(call, strategies, combo, cost, keeps_written);
    if (keeps_written && cost < best_strict_cost) {
      best_strict_cost = cost;
      best_strict = combo;
    }
    if (cost < best_any_cost) {
      best_any_cost = cost;
      best_any = combo;
    }
    size_t m = 0;  // odometer over mesh dims
    while (m < mesh_ndim && ++combo[m] == strategies.size()) combo[m++] = 0;
    if (m == mesh_ndim) break;
  }
  const auto& best = best_strict.empty() ? best_any : best_strict;
  if (C10_UNLIKELY(t_candidates != nullptr)) {
    // The chosen combination is the one logged at its odometer position in this call.
    size_t index = 0, scale = 1;
    for (size_t m = 0; m < mesh_ndim; ++m, scale *= strategies.size()) index += best[m] * scale;
    t_candidates->chosen = static_cast<int>(t_candidates->candidates.size() - combinations + index);
  }

  ShardingChoice choice;
  choice.inputs.assign(n_in, Placements(mesh_ndim));
  choice.outputs.assign(n_out, Placements(mesh_ndim));
  for (size_t m = 0; m < mesh_ndim; ++m) {
    const auto& s = strategies[best[m]];
    for (size_t i = 0; i < n_in; ++i) choice.inputs[i][m] = s.inputs[i];
    for (size_t j = 0; j < n_out; ++j) choice.outputs[j][m] = s.outputs[j];
  }
  choice.to_target.resize(n_in);
  choice.write_back.resize(n_in);
  for (size_t i = 0; i < n_in; ++i) {
    if (!call.inputs[i].defined) continue;
    choice.to_target[i] = moves[i].take(choice.inputs[i]);
    if (call.inputs[i].written) choice.write_back[i] = moves[i].take(choice.inputs[i], /*back=*/true);
  }
  return choice;
}

ShardingChoice replicate_all(const OpCall& call) {
  const Placements r(static_cast<size_t>(call.mesh.ndim()), Placement::replicate());
  ShardingChoice choice;
  choice.inputs.assign(call.inputs.size(), r);
  choice.outputs.assign(call.outputs.size(), r);
  return choice;
}

bool is_tensor_argument(const c10::Argument& arg) {
  const auto& t = arg.type();
  if (t->kind() == c10::TypeKind::TensorType) return true;
  auto opt = t->cast<c10::OptionalType>();
  return opt && opt->getElementType()->kind() == c10::TypeKind::TensorType;
}

Placement broadcast_input_placement(const Placement& out, c10::ArrayRef<int64_t> out_shape, const TensorArg& in) {
  if (!out.is_shard()) return out;
  const int64_t d = out.dim - (static_cast<int64_t>(out_shape.size()) - in.ndim());
  if (d < 0) return Placement::replicate();
  if (in.shape[static_cast<size_t>(d)] == 1 && out_shape[static_cast<size_t>(out.dim)] != 1)
    return Placement::replicate();
  return Placement::shard(static_cast<int32_t>(d));
}

// ---- registry ----------------------------------------------------------------

namespace {
ska::flat_hash_map<std::string, RuleFn>& table() {
  static ska::flat_hash_map<std::string, RuleFn> t;
  return t;
}
}  // namespace

namespace {
// Whether "ns::name.overload" (or "ns::name" for the default overload) is an operator.
bool op_exists(const std::string& op_name) {
  const auto dot = op_name.find('.', op_name.find("::"));
  const c10::OperatorName name(op_name.substr(0, dot), dot == std::string::npos ? "" : op_name.substr(dot + 1));
  return c10::Dispatcher::singleton().findOp(name).has_value();
}

// Whether some overload of "ns::name" is an operator.
bool base_exists(const std::string& base) {
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames())
    if (name.name == base) return true;
  return false;
}
}  // namespace

void RuleTable::key_on_scalar_values(const std::string& base_name) {
  if (!base_exists(base_name)) missing_.push_back(base_name);
  scalar_keyed_.push_back(base_name);
}

void RuleTable::add(const std::string& op_name, RuleFn fn) {
  if (!op_exists(op_name)) {
    missing_.push_back(op_name);  // a typo, or an op this torch build lacks
    return;
  }
  const bool inserted = table().emplace(op_name, std::move(fn)).second;
  TORCH_INTERNAL_ASSERT(inserted, "two sharding rules registered for ", op_name);
}

void RuleTable::add_overloads(const std::string& base, const RuleFn& fn) {
  const std::string inplace = base + "_";
  bool any = false;
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name != base && name.name != inplace) continue;
    add(name.overload_name.empty() ? name.name : name.name + "." + name.overload_name, fn);
    any = true;
  }
  if (!any) missing_.push_back(base);
}

bool RuleTable::keyed_on_scalar_values(const std::string& op_name) const {
  const auto base = op_name.substr(0, op_name.find('.', op_name.find("::")));
  return std::find(scalar_keyed_.begin(), scalar_keyed_.end(), base) != scalar_keyed_.end();
}

namespace {
ska::flat_hash_map<std::string, ShapeFn>& shape_fns() {
  static ska::flat_hash_map<std::string, ShapeFn> t;
  return t;
}
}  // namespace

void RuleTable::add_shape_fn(const std::string& op_name, ShapeFn fn) {
  if (!op_exists(op_name)) {
    missing_.push_back(op_name);
    return;
  }
  const bool inserted = shape_fns().emplace(op_name, std::move(fn)).second;
  TORCH_INTERNAL_ASSERT(inserted, "two shape functions registered for ", op_name);
}

const ShapeFn* RuleTable::find_shape_fn(const std::string& op_name) const {
  auto it = shape_fns().find(op_name);
  return it == shape_fns().end() ? nullptr : &it->second;
}

const RuleFn* RuleTable::find(const std::string& op_name) const {
  auto it = table().find(op_name);
  return it == table().end() ? nullptr : &it->second;
}

std::vector<std::string> RuleTable::names() const {
  std::vector<std::string> out;
  for (const auto& [name, fn] : table()) out.push_back(name);
  return out;
}

RuleTable& rules() {
  static RuleTable t;
  return t;
}

}  // namespace vescale
