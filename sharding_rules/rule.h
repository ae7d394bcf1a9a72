#pragma once
// The contract between the dispatcher and the sharding rules.
//
// On a cache miss the dispatcher describes the call as an OpCall: every tensor
// argument flattened in schema order (lists expanded, absent optionals kept as
// undefined slots), with its global shape and current placements, plus the global
// results from running the op on meta tensors. A rule answers with a ShardingChoice:
// the placements each input must have and the placements of each result. The
// dispatcher then plans the redistributions, caches the decision and runs the op on
// the local shards. Rules never communicate.
//
// Most rules describe the candidate layouts of a single mesh dim (DimStrategy) and
// let `choose_cheapest` combine them over the mesh, pricing each combination with
// the redistribution cost model. Rules are registered per operator name in one file
// per op family:
//
//   VESCALE_RULES(pointwise) {
//     rules.add("aten::add.Tensor", pointwise(Linearity::Additive));
//   }

#include "collectives/redistribute_plan.h"
#include "core/spec.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace vescale {

// What a rule sees of one tensor argument or result.
struct TensorArg {
  bool defined = false;
  bool is_dtensor = false;  // plain tensors take part as Replicate
  bool written = false;     // the op mutates it (in-place self, out=)
  Shape shape;
  Shape stride;
  int64_t storage_offset = 0;
  c10::ScalarType dtype = c10::ScalarType::Float;
  Placements placements;    // current placements; empty for results

  int64_t ndim() const { return static_cast<int64_t>(shape.size()); }
  // Whether some mesh dim splits tensor dim `d` now.
  bool sharded_along(int64_t d) const {
    for (const auto& p : placements)
      if (p.is_shard() && p.dim == d) return true;
    return false;
  }
};

struct OpCall {
  const c10::OperatorHandle& op;
  c10::ArrayRef<c10::IValue> args;  // global argument values
  const Mesh& mesh;
  std::vector<TensorArg> inputs;    // flattened tensor arguments
  std::vector<TensorArg> outputs;   // flattened tensor results (global metadata)
  std::vector<uint32_t> input_arg;  // the schema argument each flattened input comes from

  const c10::FunctionSchema& schema() const { return op.schema(); }
  // Rules read non-tensor arguments by their schema name, never by position (overloads
  // and out= variants move positions). `arg` wants the name to exist: a rule asking for
  // one its op lacks is a bug in the rule, reported as an internal error naming both.
  const c10::IValue& arg(const char* name) const;
  // The argument called `name` in the schema, or nullptr when the op has none.
  const c10::IValue* find_arg(const char* name) const;
  int64_t int_arg(const char* name) const { return arg(name).toInt(); }
  bool bool_arg(const char* name) const { return arg(name).toBool(); }
  std::vector<int64_t> int_list_arg(const char* name) const;
  // The argument as a dim list normalised to [0, ndim); an empty or absent list means
  // all dims when `empty_means_all`.
  std::vector<int64_t> dims_arg(const char* name, int64_t ndim, bool empty_means_all = true) const;
  std::string name() const;  // "aten::add.Tensor"
};

// One candidate layout of the call on a single mesh dim: a placement for every
// flattened input and every flattened result.
struct DimStrategy {
  Placements inputs;
  Placements outputs;
};
using DimStrategies = std::vector<DimStrategy>;

// Context for a rule's own local computation (see ShardingChoice::local_fn).
struct LocalContext {
  const Mesh& mesh;
  c10::ArrayRef<SpecPtr> inputs;   // the specs the inputs were redistributed to (null: undefined)
  c10::ArrayRef<SpecPtr> outputs;  // the result specs
};

// Computes the local results from the local arguments on `stack` (replacing them
// with the results, like a boxed kernel), for ops whose local computation is not the
// op itself applied to the shards.
using LocalFn = void (*)(const c10::OperatorHandle&, torch::jit::Stack*, const LocalContext&);

// Computes the op from its DTensor arguments on `stack` as a composition of other ops
// on DTensors (each dispatched through vescale in turn), for ops whose sharded form
// needs several collectives in between (log_softmax over a split dim). Replaces the
// arguments with the results, like a boxed kernel.
using DecomposeFn = void (*)(const c10::OperatorHandle&, torch::jit::Stack*);

struct ShardingChoice {
  std::vector<Placements> inputs;   // target placements per flattened input
  std::vector<Placements> outputs;  // placements per flattened result
  LocalFn local_fn = nullptr;
  // Non-tensor arguments to replace in the local call (e.g. a local shape).
  std::vector<std::pair<size_t, c10::IValue>> local_args;
  // When set, inputs/outputs are not used: the op is this composition.
  DecomposeFn decompose = nullptr;
  // The moves choose_cheapest priced for this choice, per flattened input (to the
  // target; for written inputs, back): the dispatcher runs them instead of planning
  // again. Empty, or nullopt for an input, where the rule priced none.
  std::vector<std::optional<collectives::RedistPlan>> to_target, write_back;

  static ShardingChoice composition(DecomposeFn fn) {
    ShardingChoice c;
    c.decompose = fn;
    return c;
  }
};

using RuleFn = std::function<ShardingChoice(const OpCall&)>;

// The global results' metadata (shape, stride, dtype) computed from the inputs, for the
// few ops whose meta kernel refuses calls their CPU kernel runs (_grouped_mm's meta
// kernel wants bf16; its CPU kernel takes fp32 too). Used only when the meta kernel
// raises; it raises itself (TORCH_CHECK) on calls the op cannot run.
using ShapeFn = std::function<std::vector<TensorArg>(const OpCall&)>;

// Whether a dim of `size` splits into equal, non-empty parts over all the ranks of the
// call's mesh (every mesh dim at once): some CPU kernels (pooling, MKL FFT) reject empty
// dims, and a rank that raises while the others go on leaves them waiting. (Not to be
// confused with core's all_shards_same_size, which asks it of a given layout.)
bool divides_over_all_ranks(const OpCall& call, int64_t size);

// How a rule's strategies treat an InterleavedShard input (see placement.h):
//   Gather  they do not mention it: such an input is gathered to what a strategy wants
//           (correct for every op);
//   Lift    the op treats every split dim element by element (pointwise, matmul's
//           free and contracted dims, reductions): each strategy with a Shard also
//           holds with every Shard(d) made InterleavedShard(d, g), for the g an
//           input carries, where the sizes divide evenly. Never for rules whose local
//           computation uses a shard's offset.
enum class Interleaving : uint8_t { Gather, Lift };

// Combines per-mesh-dim strategies over the whole mesh and returns the cheapest
// combination (ties go to the earlier strategy). Inputs the op writes keep their
// placements when any combination allows it. The all-replicate strategy needs no
// listing: it is added first (winning ties) unless the rule lists it somewhere itself.
ShardingChoice choose_cheapest(const OpCall& call, const DimStrategies& strategies,
                               Interleaving interleaving = Interleaving::Gather);

// What choose_cheapest weighed, for vescale.explain: every combination of the
// per-mesh-dim strategies it priced, with its cost (the redistribution cost of moving
// the inputs, in seconds; infinite when the combination cannot lay the tensors out),
// and which one it chose.
struct Candidate {
  std::vector<Placements> inputs;   // per flattened input
  std::vector<Placements> outputs;  // per flattened result
  double cost = 0;
  bool keeps_written = true;        // leaves the inputs the op writes in their placements
};
std::string to_string(const Candidate& candidate);  // "[Shard(0)], [Replicate()] -> [Shard(0)]"
std::string to_string(const DimStrategy& strategy);  // "Shard(0), Replicate() -> Shard(0)"

struct CandidateLog {
  std::vector<Candidate> candidates;
  int chosen = -1;  // index into candidates
};

// While alive, choose_cheapest calls on this thread append what they weigh to `log`.
class CandidateCapture {
 public:
  explicit CandidateCapture(CandidateLog& log);
  ~CandidateCapture();
  CandidateCapture(const CandidateCapture&) = delete;
  CandidateCapture& operator=(const CandidateCapture&) = delete;

 private:
  CandidateLog* saved_;
};

// Every input and result replicated.
ShardingChoice replicate_all(const OpCall& call);

// ---- helpers for writing rules ----------------------------------------------

// A Tensor or Tensor? argument (one flattened input slot).
bool is_tensor_argument(const c10::Argument& arg);

// The placement an input of a broadcasting op needs so that it lines up with a
// result of `out_shape` placed as `out`: a sharded result dim maps to the input's
// matching dim, or to Replicate where the input broadcasts (size 1 against more).
Placement broadcast_input_placement(const Placement& out, c10::ArrayRef<int64_t> out_shape, const TensorArg& in);

// ---- registry ----------------------------------------------------------------

class RuleTable {
 public:
  void add(const std::string& op_name, RuleFn fn);
  // Every overload of `base` ("aten::relu") and of its in-place form ("aten::relu_")
  // that this torch build has, out= variants included.
  void add_overloads(const std::string& base, const RuleFn& fn);
  const RuleFn* find(const std::string& op_name) const;
  void add_shape_fn(const std::string& op_name, ShapeFn fn);
  const ShapeFn* find_shape_fn(const std::string& op_name) const;
  std::vector<std::string> names() const;
  // Names given to add/add_overloads that match no operator in this torch build.
  // Also names given to key_on_scalar_values and add_shape_fn that match none.
  const std::vector<std::string>& missing() const { return missing_; }

  // Scalar arguments normally stay out of the decision cache key (their values never
  // change a layout); for ops whose rule reads one (a norm's order), they go in.
  void key_on_scalar_values(const std::string& base_name);
  bool keyed_on_scalar_values(const std::string& op_name) const;

 private:
  std::vector<std::string> missing_;
  std::vector<std::string> scalar_keyed_;
};

RuleTable& rules();

struct RuleRegistrar {
  explicit RuleRegistrar(void (*define)(RuleTable&)) { define(rules()); }
};

#define VESCALE_RULES(family)                                                      \
  static void vescale_define_##family##_rules(::vescale::RuleTable& rules);        \
  static const ::vescale::RuleRegistrar vescale_##family##_registrar(              \
      &vescale_define_##family##_rules);                                           \
  static void vescale_define_##family##_rules(::vescale::RuleTable& rules)

}  // namespace vescale
