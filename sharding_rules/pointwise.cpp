// Pointwise ops: the result follows any shard of the broadcast shape; Partial passes
// through an op only where the op is linear in the partial argument(s).
//
//   additive      f(x1 + x2, y1 + y2) = f(x1, y1) + f(x2, y2) in the listed args
//                 jointly (add, sub, copy, casts): all of them Partial together,
//                 plain/replicated ones turned into Partial (one rank keeps the
//                 value, the rest zeros);
//   linear in k   f is linear in arg k alone (mul, div numerator, activation
//                 backward in the gradient): arg k Partial, the others Replicate;
//   nonlinear     Partial inputs are reduced first.
//
// isin(elements, test_elements) is pointwise in `elements`; the test set stays whole.

#include "sharding_rules/pointwise.h"

namespace vescale {

namespace {

// Candidate placement of every input for a result placed as `out`.
Placements follow_result(const OpCall& call, const Placement& out) {
  Placements in;
  const auto& out_shape = call.outputs[0].shape;
  for (const auto& a : call.inputs) {
    if (!a.defined) in.push_back(Placement::replicate());
    else if (a.written) in.push_back(out);  // written args hold the result itself
    else in.push_back(broadcast_input_placement(out, out_shape, a));
  }
  return in;
}

bool contains(const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); }

}  // namespace

DimStrategies pointwise_strategies(const OpCall& call, const Linearity& lin) {
  TORCH_INTERNAL_ASSERT(!call.outputs.empty(), call.name(), ": pointwise rule needs a result");
  const auto& out = call.outputs[0];
  const size_t n_out = call.outputs.size();
  DimStrategies s;
  auto add = [&](Placements in, Placement o) { s.push_back({std::move(in), Placements(n_out, o)}); };

  add(follow_result(call, Placement::replicate()), Placement::replicate());
  for (int32_t d = 0; d < out.ndim(); ++d) add(follow_result(call, Placement::shard(d)), Placement::shard(d));

  const int n_in = static_cast<int>(call.inputs.size());
  for (const ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
    const Placement p = Placement::partial(op);
    // Jointly linear args all Partial; the rest (which the op must not scale)
    // Replicate. A written arg outside the set can't hold a Partial result.
    if (lin.additive) {
      Placements in;
      bool ok = true;
      for (int i = 0; i < n_in; ++i) {
        const bool in_set = lin.args.empty() || contains(lin.args, i);
        ok &= in_set || !call.inputs[i].written;
        in.push_back(in_set ? p : Placement::replicate());
      }
      if (ok) add(std::move(in), p);
      continue;
    }
    for (int k : lin.args) {
      if (k >= n_in || !call.inputs[k].defined) continue;
      Placements in;
      bool ok = true;
      for (int i = 0; i < n_in; ++i) {
        ok &= i == k || !call.inputs[i].written;
        in.push_back(i == k ? p : Placement::replicate());
      }
      if (ok) add(std::move(in), p);
    }
  }
  return s;
}

namespace {

ShardingChoice isin_rule(const OpCall& call) {
  const Placement R = Placement::replicate();
  DimStrategies s;
  for (int32_t d = 0; d < call.outputs[0].ndim(); ++d) s.push_back({{Placement::shard(d), R}, {Placement::shard(d)}});
  return choose_cheapest(call, s);
}

}  // namespace

RuleFn pointwise(Linearity lin) {
  return [lin](const OpCall& call) { return choose_cheapest(call, pointwise_strategies(call, lin), Interleaving::Lift); };
}

VESCALE_RULES(pointwise) {
  const Linearity additive{true, {}};
  const Linearity nonlinear{false, {}};
  const Linearity linear_in_first{false, {0}};
  const Linearity linear_in_either{false, {0, 1}};

  for (const char* op : {"aten::add.Tensor", "aten::add_.Tensor", "aten::add.out",
                         "aten::sub.Tensor", "aten::sub_.Tensor", "aten::sub.out",
                         "aten::neg", "aten::neg_", "aten::neg.out",
                         "aten::clone", "aten::zero_", "aten::positive",
                         "aten::conj_physical", "aten::conj_physical_", "aten::_conj_physical", "aten::_conj",
                         "aten::_neg_view", "aten::resolve_conj", "aten::resolve_neg"})
    rules.add(op, pointwise(additive));
  // complex(real, imag) is additive in the pair; polar(abs, angle) is not.
  rules.add("aten::complex", pointwise(additive));
  // A cast is additive only into a floating or complex dtype: rounding to integers is not
  // (the parts of a Partial would each be truncated), so those casts reduce first.
  for (const char* op : {"aten::_to_copy", "aten::copy_"})
    rules.add(op, [additive, nonlinear](const OpCall& call) {
      const auto to = call.outputs.empty() ? call.inputs[0].dtype : call.outputs[0].dtype;
      const bool exact = at::isFloatingType(to) || at::isComplexType(to);
      return choose_cheapest(call, pointwise_strategies(call, exact ? additive : nonlinear), Interleaving::Lift);
    });
  // Interpolation is linear jointly in its two end points; the weight stays replicated.
  for (const char* op : {"aten::lerp.Scalar", "aten::lerp_.Scalar", "aten::lerp.Tensor", "aten::lerp_.Tensor"})
    rules.add(op, pointwise(Linearity{true, {0, 1}}));
  rules.add("aten::where.self", pointwise(Linearity{true, {1, 2}}));
  rules.add("aten::isin.Tensor_Tensor", isin_rule);
  rules.add("aten::isin.Tensor_Scalar", pointwise(nonlinear));

  for (const char* op : {"aten::mul.Tensor", "aten::mul_.Tensor", "aten::mul.out"})
    rules.add(op, pointwise(linear_in_either));
  for (const char* op : {"aten::mul.Scalar", "aten::mul_.Scalar", "aten::div.Tensor", "aten::div_.Tensor",
                         "aten::div.out", "aten::div.Scalar", "aten::div_.Scalar"})
    rules.add(op, pointwise(linear_in_first));
  // Activation backward: linear in the incoming gradient.
  for (const char* base : {"aten::threshold_backward", "aten::gelu_backward", "aten::tanh_backward",
                           "aten::sigmoid_backward", "aten::silu_backward", "aten::elu_backward",
                           "aten::hardtanh_backward", "aten::hardswish_backward", "aten::hardsigmoid_backward",
                           "aten::leaky_relu_backward", "aten::softplus_backward", "aten::mish_backward",
                           "aten::log_sigmoid_backward", "aten::softshrink_backward", "aten::hardshrink_backward",
                           "aten::logit_backward", "aten::native_dropout_backward"})
    rules.add_overloads(base, pointwise(linear_in_first));

  // Nonlinear: every overload and in-place/out variant of these.
  for (const char* base : {
           "aten::abs", "aten::angle", "aten::polar", "aten::acos", "aten::acosh", "aten::asin", "aten::asinh", "aten::atan", "aten::atan2",
           "aten::atanh", "aten::ceil", "aten::clamp", "aten::clamp_min", "aten::clamp_max", "aten::cos",
           "aten::cosh", "aten::deg2rad", "aten::digamma", "aten::erf", "aten::erfc", "aten::erfinv", "aten::exp",
           "aten::exp2", "aten::expm1", "aten::floor", "aten::frac", "aten::hypot", "aten::i0", "aten::lgamma",
           "aten::log", "aten::log10", "aten::log1p", "aten::log2", "aten::logaddexp", "aten::logaddexp2",
           "aten::logit", "aten::logical_not", "aten::logical_and", "aten::logical_or", "aten::logical_xor",
           "aten::mvlgamma", "aten::nan_to_num", "aten::nextafter", "aten::polygamma", "aten::pow", "aten::rad2deg",
           "aten::reciprocal", "aten::remainder", "aten::fmod", "aten::round", "aten::rsqrt", "aten::sigmoid",
           "aten::sign", "aten::sgn", "aten::signbit", "aten::sin", "aten::sinc", "aten::sinh", "aten::sqrt",
           "aten::square", "aten::tan", "aten::tanh", "aten::trunc", "aten::xlogy", "aten::relu", "aten::relu6",
           "aten::gelu", "aten::silu", "aten::mish", "aten::hardtanh", "aten::hardswish", "aten::hardsigmoid",
           "aten::elu", "aten::selu", "aten::celu", "aten::leaky_relu", "aten::softplus", "aten::softshrink",
           "aten::hardshrink", "aten::threshold", "aten::log_sigmoid_forward", "aten::isnan", "aten::isinf",
           "aten::isfinite", "aten::isposinf", "aten::isneginf", "aten::bitwise_and", "aten::bitwise_or",
           "aten::bitwise_xor", "aten::bitwise_not", "aten::eq", "aten::ne", "aten::lt", "aten::le", "aten::gt",
           "aten::ge", "aten::maximum", "aten::minimum", "aten::fmax", "aten::fmin", "aten::copysign",
           "aten::float_power", "aten::heaviside", "aten::addcmul", "aten::addcdiv", "aten::fill",
           "aten::masked_fill", "aten::rsub", "aten::gcd", "aten::lcm", "aten::floor_divide",
           "aten::special_entr", "aten::special_erfcx", "aten::special_i0e", "aten::special_i1",
           "aten::special_i1e", "aten::special_ndtri", "aten::special_log_ndtr", "aten::special_xlog1py",
           "aten::special_zeta", "aten::special_airy_ai", "aten::special_bessel_j0", "aten::special_bessel_j1",
           "aten::special_bessel_y0", "aten::special_bessel_y1", "aten::special_modified_bessel_i0",
           "aten::special_modified_bessel_i1", "aten::special_modified_bessel_k0", "aten::special_modified_bessel_k1",
           "aten::special_scaled_modified_bessel_k0", "aten::special_scaled_modified_bessel_k1",
           "aten::special_spherical_bessel_j0", "aten::special_chebyshev_polynomial_t",
           "aten::special_chebyshev_polynomial_u", "aten::special_chebyshev_polynomial_v",
           "aten::special_chebyshev_polynomial_w", "aten::special_shifted_chebyshev_polynomial_t",
           "aten::special_shifted_chebyshev_polynomial_u", "aten::special_shifted_chebyshev_polynomial_v",
           "aten::special_shifted_chebyshev_polynomial_w", "aten::special_hermite_polynomial_h",
           "aten::special_hermite_polynomial_he", "aten::special_laguerre_polynomial_l",
           "aten::special_legendre_polynomial_p", "aten::igamma", "aten::igammac", "aten::ldexp"})
    rules.add_overloads(base, pointwise(nonlinear));
  // Division with rounding is not linear in the dividend.
  for (const char* op : {"aten::div.Tensor_mode", "aten::div_.Tensor_mode", "aten::div.out_mode",
                         "aten::div.Scalar_mode", "aten::div_.Scalar_mode"})
    rules.add(op, pointwise(nonlinear));
  for (const char* op : {"aten::add.Scalar", "aten::add_.Scalar", "aten::sub.Scalar", "aten::sub_.Scalar"})
    rules.add(op, pointwise(nonlinear));
}

}  // namespace vescale
