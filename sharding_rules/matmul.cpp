// The matmul family. Per mesh dim, from the einsum equations of einsum.h; for
// C[m,n] = A[m,k] @ B[k,n] ("mk,kn->mn"):
//
//   A         B         C
//   R         R         R          (the framework's, always first)
//   S(m)      R         S(m)       rows split
//   R         S(n)      S(n)       columns split
//   S(k)      S(k)      Partial    contraction split
//   Partial   R         Partial    linear in A
//   R         Partial   Partial    linear in B
//
// bmm ("bmk,bkn->bmn") adds a batch dim split on all three; mv ("mk,k->m") and dot
// ("k,k->") are the same with fewer dims. linear, matmul and einsum decompose into these
// above autograd.
//
// _grouped_mm(a, b, offs) runs one matmul per group, the groups cut by the global
// positions in `offs` along one dim, which therefore stays whole (and offs replicated):
//
//   a          b           result        offs cut
//   (M, K)     (K, N)      (G, M, N)     K          a S(0) -> S(1); b S(1) -> S(2)
//   (M, K)     (G, K, N)   (M, N)        M          b S(2) -> S(1); K split -> Partial
//   (G, M, K)  (K, N)      (M, N)        N          a S(1) -> S(0); K split -> Partial
//   (G, M, K)  (G, K, N)   (G, M, N)     -          as bmm
//
// The CPU and CUDA kernels want row strides that are multiples of 16 bytes, so a matrix
// dim is split only where every rank's part keeps that alignment (and is not empty).

#include "sharding_rules/einsum.h"
#include "sharding_rules/rule.h"

namespace vescale {

namespace {

const Placement R = Placement::replicate();
Placement S(int32_t d) { return Placement::shard(d); }

// addmm / baddbmm / addmv: the added term follows the product's placement (a Partial
// product takes a Partial bias, which one rank holds and the others hold as zeros).
DimStrategies with_bias(const OpCall& call, DimStrategies product) {
  const auto& bias = call.inputs[0];
  const auto& out_shape = call.outputs[0].shape;
  for (auto& s : product) s.inputs.insert(s.inputs.begin(), broadcast_input_placement(s.outputs[0], out_shape, bias));
  return product;
}

// A rule choosing among an equation's strategies; with a bias first when `bias`.
RuleFn product_rule(std::string_view equation, bool bias, Interleaving interleaving) {
  return [strategies = einsum_strategies(equation), bias, interleaving](const OpCall& call) {
    return choose_cheapest(call, bias ? with_bias(call, strategies) : strategies, interleaving);
  };
}

// Whether splitting a dim of `size` over every rank keeps each part a multiple of 16
// bytes of `dtype` (and no part empty or uneven).
bool divides_into_aligned_rows(const OpCall& call, int64_t size, c10::ScalarType dtype) {
  int64_t ranks = 1;
  for (auto n : call.mesh.shape) ranks *= n;
  const int64_t align = std::max<int64_t>(1, 16 / static_cast<int64_t>(c10::elementSize(dtype)));
  return size > 0 && size % (ranks * align) == 0;
}

ShardingChoice grouped_mm_rule(const OpCall& call) {
  const auto& a = call.inputs[0];
  const auto& b = call.inputs[1];
  if (call.inputs.size() > 3 && call.inputs[3].defined) return replicate_all(call);  // a bias: kept simple
  const size_t n_in = call.inputs.size();
  DimStrategies s;
  auto add = [&](Placement pa, Placement pb, Placement out) {
    Placements in(n_in, R);
    in[0] = pa;
    in[1] = pb;
    s.push_back({in, {out}});
  };
  auto ok = [&](const TensorArg& t, int64_t d) { return divides_into_aligned_rows(call, t.shape[static_cast<size_t>(d)], t.dtype); };
  const Placement P = Placement::partial();
  // (Every split dim is checked: an operand may be a transposed view, autograd's a.T
  // among them, whose row stride is the size of its first matrix dim.)
  if (a.ndim() == 2 && b.ndim() == 2) {  // groups along K
    if (ok(a, 0)) add(S(0), R, S(1));
    if (ok(b, 1)) add(R, S(1), S(2));
  } else if (a.ndim() == 2 && b.ndim() == 3) {  // groups along a's rows
    if (ok(b, 2)) add(R, S(2), S(1));
    if (ok(a, 1)) add(S(1), S(1), P);
  } else if (a.ndim() == 3 && b.ndim() == 2) {  // groups along b's columns
    if (ok(a, 1)) add(S(1), R, S(0));
    if (ok(a, 2)) add(S(2), S(0), P);
  } else if (a.ndim() == 3 && b.ndim() == 3) {  // a batch of groups
    add(S(0), S(0), S(0));
    if (ok(a, 1)) add(S(1), R, S(1));
    if (ok(b, 2)) add(R, S(2), S(2));
    if (ok(a, 2)) add(S(2), S(1), P);
  } else {
    return replicate_all(call);
  }
  for (const ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
    const Placement p = Placement::partial(op);
    add(p, R, p);
    add(R, p, p);
  }
  return choose_cheapest(call, s, Interleaving::Lift);  // a packed gate|up weight
}

// _grouped_mm's result metadata (its meta kernel accepts bf16 only).
std::vector<TensorArg> grouped_mm_shapes(const OpCall& call) {
  const auto& a = call.inputs[0];
  const auto& b = call.inputs[1];
  const auto& offs = call.inputs[2];
  TensorArg out;
  out.defined = true;
  const bool grouped = a.ndim() == 2 || b.ndim() == 2;
  TORCH_CHECK(grouped == offs.defined, "_grouped_mm: offs must be given exactly when mat_a or mat_b is 2-d");
  TORCH_CHECK(!offs.defined || offs.ndim() == 1, "_grouped_mm: offs must be 1-d");
  if (a.ndim() == 2 && b.ndim() == 2) out.shape = {offs.shape[0], a.shape[0], b.shape[1]};
  else if (a.ndim() == 2 && b.ndim() == 3) out.shape = {a.shape[0], b.shape[2]};
  else if (a.ndim() == 3 && b.ndim() == 2) out.shape = {a.shape[1], b.shape[1]};
  else if (a.ndim() == 3 && b.ndim() == 3) out.shape = {a.shape[0], a.shape[1], b.shape[2]};
  else TORCH_CHECK(false, "_grouped_mm: mat_a and mat_b must be 2-d or 3-d, got ", a.ndim(), "-d and ", b.ndim(), "-d");
  out.stride.resize(out.shape.size());
  int64_t step = 1;
  for (size_t d = out.shape.size(); d-- > 0;) {
    out.stride[d] = step;
    step *= std::max<int64_t>(out.shape[d], 1);
  }
  const auto* out_dtype = call.find_arg("out_dtype");
  out.dtype = out_dtype && !out_dtype->isNone() ? out_dtype->toScalarType() : a.dtype;
  return {out};
}

}  // namespace

VESCALE_RULES(matmul) {
  rules.add("aten::_grouped_mm", grouped_mm_rule);
  rules.add_shape_fn("aten::_grouped_mm", grouped_mm_shapes);
  // Matrix dims may be InterleavedShard (a packed gate|up weight): the product treats
  // every row and column alike.
  rules.add("aten::mm", product_rule("mk,kn->mn", false, Interleaving::Lift));
  rules.add("aten::addmm", product_rule("mk,kn->mn", true, Interleaving::Lift));
  rules.add("aten::bmm", product_rule("bmk,bkn->bmn", false, Interleaving::Lift));
  rules.add("aten::baddbmm", product_rule("bmk,bkn->bmn", true, Interleaving::Lift));
  rules.add("aten::mv", product_rule("mk,k->m", false, Interleaving::Gather));
  rules.add("aten::addmv", product_rule("mk,k->m", true, Interleaving::Gather));
  for (const char* op : {"aten::dot", "aten::vdot"}) rules.add(op, product_rule("k,k->", false, Interleaving::Gather));
}

}  // namespace vescale
