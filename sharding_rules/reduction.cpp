// Reductions and scans. Per mesh dim:
//
//   input          result
//   R              R
//   S(kept dim)    S(that dim, renumbered)
//   S(reduced)     Partial(op)          when the op has a partial form (below); else the
//                                       reduced dim must be whole
//   Partial(op)    Partial(op)          when the reduction is linear in op / idempotent
//
//   op                               split reduced dim -> result   partial inputs
//   sum, nansum                      Partial(sum)                  sum, avg
//   mean                             Partial(sum) of sum / N       sum, avg
//   amax, max()                      Partial(max)                  max
//   amin, min()                      Partial(min)                  min
//   linalg_vector_norm ord 1 / 0     Partial(sum)                  -
//   linalg_vector_norm ord +-inf     Partial(max / min)            -
//   linalg_vector_norm other ord     composed: sum(|x|^p) then ^(1/p)
//   max.dim, min.dim, argmax, argmin, var, std, logsumexp, any, all, prod,
//   median, mode, kthvalue, aminmax, count_nonzero    reduced dims whole
//   cumsum, cumprod, logcumsumexp, cummax, cummin     scanned dim whole
//   histc(bins, min, max) with min < max              any split -> Partial(sum) (the
//                                                     counts add up); min == max takes
//                                                     the data's range: input whole
//
// mean over a split dim: every rank computes sum(block) / N with N the global count,
// exact when blocks differ in size or are empty.

#include "sharding_rules/rule.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>

#include <cmath>
#include <limits>
#include <optional>

namespace vescale {

namespace {

struct Reduce {
  std::vector<int64_t> dims;  // reduced (or scanned) dims, normalised
  bool keepdim = false;
};

// Reduced dims and keepdim read off the schema: a missing, None or empty `dim` means
// every dim; scans keep every dim and name the scanned one.
Reduce reduce_args(const OpCall& call, bool scan) {
  const int64_t ndim = call.inputs[0].ndim();
  Reduce r;
  if (const auto* dim = call.find_arg("dim")) {
    if (dim->isInt()) r.dims.push_back(at::maybe_wrap_dim(dim->toInt(), ndim));
    else if (dim->isList())
      for (const auto& v : dim->toListRef()) r.dims.push_back(at::maybe_wrap_dim(v.toInt(), ndim));
  }
  if (r.dims.empty())
    for (int64_t d = 0; d < ndim; ++d) r.dims.push_back(d);
  if (const auto* keepdim = call.find_arg("keepdim")) r.keepdim = keepdim->toBool();
  if (scan) r.keepdim = true;
  return r;
}

struct Family {
  std::optional<ReduceOp> split;  // the partial form of a split reduced dim, if any
  std::vector<ReduceOp> passes;   // partial inputs that pass through
  bool scan = false;
};

DimStrategies reduction_strategies(const OpCall& call, const Family& f) {
  const auto r = reduce_args(call, f.scan);
  const size_t n_out = call.outputs.size();
  const int64_t ndim = call.inputs[0].ndim();
  auto reduced = [&](int64_t d) { return std::find(r.dims.begin(), r.dims.end(), d) != r.dims.end(); };
  auto all = [&](Placement in, Placement out) { return DimStrategy{{in}, Placements(n_out, out)}; };
  DimStrategies s;
  int32_t kept = 0;  // result dim of the next kept input dim
  for (int32_t d = 0; d < ndim; ++d) {
    if (!reduced(d)) {
      s.push_back(all(Placement::shard(d), Placement::shard(kept++)));
      continue;
    }
    if (f.split) s.push_back(all(Placement::shard(d), Placement::partial(*f.split)));
    if (r.keepdim) ++kept;
  }
  for (const ReduceOp op : f.passes) s.push_back(all(Placement::partial(op), Placement::partial(op)));
  return s;
}

// The kernels refuse to take the max or min of nothing, but a split dim may leave a
// rank an empty block: its share of a Partial(max / min) is then the identity, which
// the reduction across ranks ignores.
void extreme_of_block(const c10::OperatorHandle& op, torch::jit::Stack* stack, const LocalContext& ctx) {
  const size_t n_args = op.schema().arguments().size();
  const auto self = (*stack)[stack->size() - n_args].toTensor();
  const auto& out = ctx.outputs.empty() ? nullptr : ctx.outputs[0];
  if (self.numel() > 0 || !out) {
    op.callBoxed(stack);
    return;
  }
  const bool is_max = std::any_of(out->placements.begin(), out->placements.end(),
                                  [](const Placement& p) { return p.is_partial(ReduceOp::Max); });
  c10::Scalar identity;
  if (at::isFloatingType(out->dtype)) {
    identity = is_max ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::infinity();
  } else if (out->dtype == at::kBool) {
    identity = !is_max;
  } else {  // the dtype's own extreme: int64's would not fit an int32 block, on the empty ranks only
    AT_DISPATCH_V2(out->dtype, "vescale_extreme_identity", AT_WRAP([&] {
      identity = is_max ? std::numeric_limits<scalar_t>::lowest() : std::numeric_limits<scalar_t>::max();
    }), AT_EXPAND(AT_INTEGRAL_TYPES_V2));
  }
  auto result = at::full(c10::IntArrayRef(out->local.sizes), identity, self.options().dtype(out->dtype));
  torch::jit::drop(*stack, n_args);
  torch::jit::push(*stack, std::move(result));
}

RuleFn reduction(Family f) {
  return [f](const OpCall& call) {
    auto choice = choose_cheapest(call, reduction_strategies(call, f), Interleaving::Lift);
    if (f.split == ReduceOp::Max || f.split == ReduceOp::Min) choice.local_fn = extreme_of_block;
    return choice;
  };
}

// ---- mean -----------------------------------------------------------------------------

// mean's local computation: sum of this rank's block over the global count.
void mean_as_partial_sum(const c10::OperatorHandle& op, torch::jit::Stack* stack, const LocalContext& ctx) {
  const auto& in = *ctx.inputs[0];
  const size_t n_args = op.schema().arguments().size();
  auto args = torch::jit::last(*stack, n_args);
  const at::Tensor self = args[0].toTensor();
  std::vector<int64_t> dims;
  bool keepdim = false;
  std::optional<at::ScalarType> dtype;
  if (n_args > 2) {
    if (!args[1].isNone())
      for (const auto& v : args[1].toListRef()) dims.push_back(at::maybe_wrap_dim(v.toInt(), in.ndim()));
    keepdim = args[2].toBool();
    dtype = args[3].toOptional<at::ScalarType>();
  } else {
    dtype = args[1].toOptional<at::ScalarType>();
  }
  if (dims.empty())
    for (int64_t d = 0; d < in.ndim(); ++d) dims.push_back(d);
  int64_t count = 1;  // a 0-d tensor reduced over "dim 0" is its own mean
  if (in.ndim() > 0)
    for (auto d : dims) count *= in.shape[static_cast<size_t>(d)];
  auto result = at::sum(self, dims, keepdim, dtype).div_(count);
  torch::jit::drop(*stack, n_args);
  torch::jit::push(*stack, std::move(result));
}

ShardingChoice mean_rule(const OpCall& call) {
  auto choice = choose_cheapest(call, reduction_strategies(call, {ReduceOp::Sum, {ReduceOp::Sum, ReduceOp::Avg}}),
                               Interleaving::Lift);
  choice.local_fn = mean_as_partial_sum;
  return choice;
}

// ---- vector norms -----------------------------------------------------------------------

// The norm's order: the `ord` (linalg_vector_norm, _foreach_norm) or `p` argument.
double norm_order(const OpCall& call) {
  for (const char* name : {"ord", "p"})
    if (const auto* v = call.find_arg(name); v && !v->isNone()) return v->toScalar().toDouble();
  return 2.0;
}

// sum(|x|^p)^(1/p) with the sum over split dims done as a Partial.
void vector_norm_composed(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n_args = op.schema().arguments().size();
  auto args = torch::jit::last(*stack, n_args);
  at::Tensor x = args[0].toTensor();
  const double p = args[1].toScalar().toDouble();
  std::vector<int64_t> dims;
  if (!args[2].isNone())
    for (const auto& v : args[2].toListRef()) dims.push_back(v.toInt());
  const bool keepdim = args[3].toBool();
  if (const auto dtype = args[4].toOptional<at::ScalarType>()) x = x.to(*dtype);
  auto result = x.abs().pow(p).sum(dims, keepdim).pow(1.0 / p);
  torch::jit::drop(*stack, n_args);
  torch::jit::push(*stack, std::move(result));
}

ShardingChoice vector_norm_rule(const OpCall& call) {
  const double p = norm_order(call);
  Family f;
  if (p == 1.0 || p == 0.0) f.split = ReduceOp::Sum;
  else if (std::isinf(p)) f.split = p > 0 ? ReduceOp::Max : ReduceOp::Min;
  const bool composable = !f.split && call.schema().name() == "aten::linalg_vector_norm";
  if (composable) {
    // A reduced dim that is split already: summing powers as a Partial beats gathering.
    const auto r = reduce_args(call, false);
    for (const auto& pl : call.inputs[0].placements)
      if (pl.splits() && std::find(r.dims.begin(), r.dims.end(), pl.dim) != r.dims.end())
        return ShardingChoice::composition(vector_norm_composed);
  }
  return reduction(f)(call);
}

// _foreach_norm(tensors, ord, dtype): one vector norm per tensor.
void foreach_norm_composed(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 3);
  const auto tensors = args[0].toTensorVector();
  const auto ord = args[1].toScalar();
  const auto dtype = args[2].toOptional<at::ScalarType>();
  c10::List<at::Tensor> out;
  for (const auto& t : tensors) out.push_back(at::linalg_vector_norm(t, ord, std::nullopt, false, dtype));
  torch::jit::drop(*stack, 3);
  torch::jit::push(*stack, std::move(out));
}

ShardingChoice histc_rule(const OpCall& call) {
  const auto& x = call.inputs[0];
  DimStrategies s;
  const double lo = call.arg("min").toScalar().toDouble();
  const double hi = call.arg("max").toScalar().toDouble();
  if (lo < hi)
    for (int32_t d = 0; d < x.ndim(); ++d) s.push_back({{Placement::shard(d)}, {Placement::partial()}});
  return choose_cheapest(call, s);
}

}  // namespace

VESCALE_RULES(reduction) {
  rules.add("aten::histc", histc_rule);
  rules.key_on_scalar_values("aten::histc");
  const Family sum{ReduceOp::Sum, {ReduceOp::Sum, ReduceOp::Avg}};
  const Family max{ReduceOp::Max, {ReduceOp::Max}};
  const Family min{ReduceOp::Min, {ReduceOp::Min}};
  const Family whole{};
  const Family scan{std::nullopt, {}, true};

  for (const char* op : {"aten::sum", "aten::sum.dim_IntList", "aten::nansum"}) rules.add(op, reduction(sum));
  for (const char* op : {"aten::mean", "aten::mean.dim"}) rules.add(op, mean_rule);
  for (const char* op : {"aten::amax", "aten::max"}) rules.add(op, reduction(max));
  for (const char* op : {"aten::amin", "aten::min"}) rules.add(op, reduction(min));
  for (const char* op : {"aten::max.dim", "aten::min.dim", "aten::argmax", "aten::argmin", "aten::var.correction",
                         "aten::std.correction", "aten::var_mean.correction", "aten::std_mean.correction",
                         "aten::logsumexp", "aten::any", "aten::any.dim", "aten::any.dims", "aten::all",
                         "aten::all.dim", "aten::all.dims", "aten::prod", "aten::prod.dim_int", "aten::median.dim",
                         "aten::mode", "aten::kthvalue", "aten::aminmax", "aten::count_nonzero.dim_IntList",
                         "aten::nanmean"})
    rules.add(op, reduction(whole));
  for (const char* op : {"aten::cumsum", "aten::cumprod", "aten::logcumsumexp", "aten::cummax", "aten::cummin"})
    rules.add(op, reduction(scan));
  for (const char* op : {"aten::linalg_vector_norm", "aten::norm.ScalarOpt_dim", "aten::norm.Scalar"})
    rules.add(op, vector_norm_rule);
  for (const char* op : {"aten::linalg_vector_norm", "aten::norm"}) rules.key_on_scalar_values(op);
  rules.add("aten::_foreach_norm.Scalar", [](const OpCall&) { return ShardingChoice::composition(foreach_norm_composed); });
}

}  // namespace vescale
