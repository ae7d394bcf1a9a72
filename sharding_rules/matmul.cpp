// The matmul family. Per mesh dim, for C[m,n] = A[m,k] @ B[k,n]:
//
//   A         B         C
//   R         R         R
//   S(m)      R         S(m)       rows split
//   R         S(n)      S(n)       columns split
//   S(k)      S(k)      Partial    contraction split
//   Partial   R         Partial    linear in A
//   R         Partial   Partial    linear in B
//
// bmm adds a batch dim that may be split on all three; mv and dot are the same with
// fewer dims. linear, matmul and einsum decompose into these above autograd.

#include "sharding_rules/rule.h"

namespace vescale {

namespace {

const Placement R = Placement::replicate();
Placement S(int32_t d) { return Placement::shard(d); }

// Strategies of A @ B where the matrix dims sit after `batch` leading batch dims.
DimStrategies matmul_strategies(int32_t batch) {
  const int32_t m = batch, k_a = batch + 1, k_b = batch, n = batch + 1;
  DimStrategies s = {
      {{R, R}, {R}},
      {{S(m), R}, {S(m)}},
      {{R, S(n)}, {S(n)}},
      {{S(k_a), S(k_b)}, {Placement::partial()}},
  };
  for (const ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
    const Placement p = Placement::partial(op);
    s.push_back({{p, R}, {p}});
    s.push_back({{R, p}, {p}});
  }
  if (batch == 1) s.push_back({{S(0), S(0)}, {S(0)}});
  return s;
}

// addmm / baddbmm: the added term follows the product's placement (a Partial product
// takes a Partial bias, which one rank holds and the others hold as zeros).
DimStrategies with_bias(const OpCall& call, DimStrategies product) {
  const auto& bias = call.inputs[0];
  const auto& out_shape = call.outputs[0].shape;
  for (auto& s : product) s.inputs.insert(s.inputs.begin(), broadcast_input_placement(s.outputs[0], out_shape, bias));
  return product;
}

// Matrix-vector and vector-vector products: the matrix's rows split the result; a
// split contraction makes it Partial.
DimStrategies mv_strategies() {
  DimStrategies s = {{{R, R}, {R}}, {{S(0), R}, {S(0)}}, {{S(1), S(0)}, {Placement::partial()}}};
  for (const ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
    s.push_back({{Placement::partial(op), R}, {Placement::partial(op)}});
    s.push_back({{R, Placement::partial(op)}, {Placement::partial(op)}});
  }
  return s;
}

DimStrategies dot_strategies() {
  DimStrategies s = {{{R, R}, {R}}, {{S(0), S(0)}, {Placement::partial()}}};
  for (const ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
    s.push_back({{Placement::partial(op), R}, {Placement::partial(op)}});
    s.push_back({{R, Placement::partial(op)}, {Placement::partial(op)}});
  }
  return s;
}

ShardingChoice mm_rule(const OpCall& call) { return choose_cheapest(call, matmul_strategies(0)); }
ShardingChoice bmm_rule(const OpCall& call) { return choose_cheapest(call, matmul_strategies(1)); }
ShardingChoice addmm_rule(const OpCall& call) {
  return choose_cheapest(call, with_bias(call, matmul_strategies(0)));
}
ShardingChoice baddbmm_rule(const OpCall& call) {
  return choose_cheapest(call, with_bias(call, matmul_strategies(1)));
}

}  // namespace

VESCALE_RULES(matmul) {
  rules.add("aten::mm", mm_rule);
  rules.add("aten::bmm", bmm_rule);
  rules.add("aten::addmm", addmm_rule);
  rules.add("aten::baddbmm", baddbmm_rule);
  rules.add("aten::mv", [](const OpCall& c) { return choose_cheapest(c, mv_strategies()); });
  rules.add("aten::addmv", [](const OpCall& c) { return choose_cheapest(c, with_bias(c, mv_strategies())); });
  for (const char* op : {"aten::dot", "aten::vdot"})
    rules.add(op, [](const OpCall& c) { return choose_cheapest(c, dot_strategies()); });
}

}  // namespace vescale
