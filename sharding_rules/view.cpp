// View and shape ops. A shard survives a shape change when every rank's block is
// still a block of the new shape (under torch.chunk sizes); otherwise that mesh dim
// is gathered first. Partial passes through every op here (they only move values).
//
//   view / _unsafe_view / _reshape_alias   dims are grouped into runs whose sizes
//        multiply to the same number ([B, S, H*D] -> [B, S, H, D]: B, S, and
//        H*D <-> (H, D)). Within a run only the first non-unit input dim may stay
//        split, and it maps to the first non-unit output dim of the run if the flat
//        ranges of every rank agree.
//   t / transpose / permute / unsqueeze / squeeze   shards follow their dims
//   expand                                          broadcast dims must be whole
//   select / slice / split / unbind (+ backward)    the indexed dim must be whole
//   cat / stack                                     all inputs alike, cat dim whole
//   view_as_real / view_as_complex                  shards follow their dims; the pair
//                                                   dim of view_as_complex whole
//   detach / alias                                  the same shards, any Partial too
//   unfold (+ backward)                             the unfolded dim whole
//
// InterleavedShard(d, g) follows its dim through the ops above like Shard(d) (in a
// view, when d is its run's leading dim and both sizes divide into g x k pieces).
// Two ops turn one into the other, which is what fused projections need:
//   split / split_with_sizes of dim d into its g blocks    each block Shard(d)
//   cat of g equal Shard(d) inputs along d                InterleavedShard(d, g)

#include "sharding_rules/rule.h"

#include <ATen/ATen.h>

#include <numeric>

namespace vescale {

namespace {

// ---- shared helpers ------------------------------------------------------------

Placements input_placements(const OpCall& call, size_t i = 0) { return call.inputs[i].placements; }

// A choice for single-input ops: input target and result placements.
ShardingChoice single(const OpCall& call, Placements in, std::vector<Placements> outs) {
  ShardingChoice c;
  c.inputs.push_back(std::move(in));
  for (size_t i = 1; i < call.inputs.size(); ++i) c.inputs.push_back(call.inputs[i].placements);
  c.outputs = std::move(outs);
  return c;
}

// Maps each input shard through `dim_map` (input dim -> result dim, or -1 when the
// dim must be whole first). Returns the input target and the result placements.
std::pair<Placements, Placements> map_dims(const OpCall& call, const std::function<int64_t(int64_t)>& dim_map) {
  Placements in = input_placements(call);
  Placements out = in;
  for (size_t m = 0; m < in.size(); ++m) {
    if (!in[m].splits()) continue;
    const int64_t to = dim_map(in[m].dim);
    if (to < 0) in[m] = out[m] = Placement::replicate();
    else out[m].dim = static_cast<int32_t>(to);
  }
  return {in, out};
}

ShardingChoice map_dims_rule(const OpCall& call, const std::function<int64_t(int64_t)>& dim_map) {
  auto [in, out] = map_dims(call, dim_map);
  return single(call, in, std::vector<Placements>(call.outputs.size(), out));
}

std::vector<int64_t> local_sizes(const OpCall& call, const Placements& out) {
  const auto box = local_box(call.outputs[0].shape, out, call.mesh.shape, call.mesh.coordinate);
  return {box.sizes.begin(), box.sizes.end()};
}

// ---- view / reshape --------------------------------------------------------------

struct Run {
  std::vector<int64_t> in, out;  // dims of the input and of the result
};

// Splits two shapes of equal numel into runs of dims with equal products.
std::vector<Run> view_runs(c10::ArrayRef<int64_t> a, c10::ArrayRef<int64_t> b) {
  const auto na = static_cast<int64_t>(a.size()), nb = static_cast<int64_t>(b.size());
  const int64_t numel = std::accumulate(a.begin(), a.end(), int64_t{1}, std::multiplies<>());
  std::vector<Run> runs;
  if (numel == 0) {  // nothing to split: one run holding everything
    Run r;
    for (int64_t i = 0; i < na; ++i) r.in.push_back(i);
    for (int64_t j = 0; j < nb; ++j) r.out.push_back(j);
    return {r};
  }
  int64_t i = 0, j = 0;
  while (i < na || j < nb) {
    Run r;
    int64_t pa = 1, pb = 1;
    if (i < na) { r.in.push_back(i); pa = a[i++]; }
    if (j < nb) { r.out.push_back(j); pb = b[j++]; }
    while (pa != pb) {
      if (pa < pb) { r.in.push_back(i); pa *= a[i++]; }
      else { r.out.push_back(j); pb *= b[j++]; }
    }
    runs.push_back(std::move(r));
  }
  return runs;
}

int64_t first_non_unit(const std::vector<int64_t>& dims, c10::ArrayRef<int64_t> shape) {
  for (auto d : dims)
    if (shape[d] > 1) return d;
  return -1;
}

int64_t product_after(const std::vector<int64_t>& dims, int64_t first, c10::ArrayRef<int64_t> shape) {
  int64_t p = 1;
  bool after = false;
  for (auto d : dims) {
    if (after) p *= shape[d];
    after |= d == first;
  }
  return p;
}

// Do the nested chunks of `in_size` (rows of `in_inner` elements) and of `out_size`
// (rows of `out_inner`) give every rank the same flat range?
bool same_flat_ranges(const Mesh& mesh, const std::vector<size_t>& mesh_dims, int64_t in_size, int64_t in_inner,
                      int64_t out_size, int64_t out_inner) {
  std::vector<int64_t> coord(mesh_dims.size(), 0);
  while (true) {
    int64_t a = 0, la = in_size, b = 0, lb = out_size;
    for (size_t q = 0; q < mesh_dims.size(); ++q) {
      const int64_t k = mesh.shape[mesh_dims[q]];
      a += chunk_offset(la, k, coord[q]);
      la = chunk_size(la, k, coord[q]);
      b += chunk_offset(lb, k, coord[q]);
      lb = chunk_size(lb, k, coord[q]);
    }
    if (la * in_inner != lb * out_inner) return false;
    if (la > 0 && a * in_inner != b * out_inner) return false;
    size_t q = 0;
    while (q < coord.size() && ++coord[q] == mesh.shape[mesh_dims[q]]) coord[q++] = 0;
    if (q == coord.size()) return true;
  }
}

std::pair<Placements, Placements> view_placements(const OpCall& call) {
  const auto& in_shape = call.inputs[0].shape;
  const auto& out_shape = call.outputs[0].shape;
  Placements in = input_placements(call);
  Placements out = in;
  for (const auto& run : view_runs(in_shape, out_shape)) {
    const int64_t first_in = first_non_unit(run.in, in_shape);
    const int64_t first_out = first_non_unit(run.out, out_shape);
    std::vector<size_t> keep;  // mesh dims splitting the run's leading dim
    for (size_t m = 0; m < in.size(); ++m) {
      if (!in[m].splits() || std::find(run.in.begin(), run.in.end(), in[m].dim) == run.in.end()) continue;
      if (in[m].dim == first_in && first_out >= 0) keep.push_back(m);
      else in[m] = out[m] = Placement::replicate();
    }
    if (keep.empty()) continue;
    if (in[keep[0]].is_interleaved()) {  // never nested: keep holds it alone
      // As Shard on a virtual mesh dim g x k large: whole pieces on both sides.
      const int64_t pieces = in[keep[0]].groups * call.mesh.shape[keep[0]];
      if (in_shape[first_in] % pieces == 0 && out_shape[first_out] % pieces == 0)
        out[keep[0]].dim = static_cast<int32_t>(first_out);
      else
        in[keep[0]] = out[keep[0]] = Placement::replicate();
      continue;
    }
    const bool ok = same_flat_ranges(call.mesh, keep, in_shape[first_in], product_after(run.in, first_in, in_shape),
                                     out_shape[first_out], product_after(run.out, first_out, out_shape));
    for (auto m : keep) {
      if (ok) out[m] = Placement::shard(static_cast<int32_t>(first_out));
      else in[m] = out[m] = Placement::replicate();
    }
  }
  return {in, out};
}

// view(self, size) / _unsafe_view(self, size): the local call takes the local size.
ShardingChoice view_rule(const OpCall& call) {
  auto [in, out] = view_placements(call);
  auto c = single(call, in, {out});
  c.local_args.emplace_back(1, c10::IValue(local_sizes(call, out)));
  return c;
}

// _reshape_alias(self, size, stride) carries global strides; the shard is viewed
// with `view` instead, which checks that its own layout allows it.
void reshape_alias_locally(const c10::OperatorHandle& op, torch::jit::Stack* stack, const LocalContext& ctx) {
  auto self = (*stack)[stack->size() - 3].toTensor();
  const auto& sizes = ctx.outputs[0]->local.sizes;
  torch::jit::drop(*stack, 3);
  torch::jit::push(*stack, self.view(c10::IntArrayRef(sizes)));
}

ShardingChoice reshape_alias_rule(const OpCall& call) {
  auto [in, out] = view_placements(call);
  auto c = single(call, in, {out});
  c.local_fn = reshape_alias_locally;
  return c;
}

// ---- dim permutations and unit dims ----------------------------------------------

ShardingChoice transpose_rule(const OpCall& call) {
  const int64_t ndim = call.inputs[0].ndim();
  int64_t d0 = 0, d1 = ndim > 1 ? 1 : 0;  // t()
  if (call.args.size() >= 3) {
    d0 = at::maybe_wrap_dim(call.int_arg("dim0"), ndim);
    d1 = at::maybe_wrap_dim(call.int_arg("dim1"), ndim);
  }
  return map_dims_rule(call, [&](int64_t d) { return d == d0 ? d1 : d == d1 ? d0 : d; });
}

ShardingChoice permute_rule(const OpCall& call) {
  const int64_t ndim = call.inputs[0].ndim();
  const auto dims = call.dims_arg("dims", ndim, false);
  return map_dims_rule(call, [&](int64_t d) -> int64_t {
    return std::find(dims.begin(), dims.end(), d) - dims.begin();
  });
}

ShardingChoice unsqueeze_rule(const OpCall& call) {
  const int64_t at = at::maybe_wrap_dim(call.int_arg("dim"), call.inputs[0].ndim() + 1);
  return map_dims_rule(call, [&](int64_t d) { return d >= at ? d + 1 : d; });
}

// squeeze / squeeze.dim / squeeze.dims: drops the dims of global size 1 (a split unit
// dim is gathered). Locally the dropped dims are named: a shard may have size 1 along a
// dim that is longer globally, which a bare squeeze() would drop too.
std::vector<int64_t> squeezed_dims(const Shape& shape, c10::ArrayRef<c10::IValue> args) {
  const auto ndim = static_cast<int64_t>(shape.size());
  std::vector<int64_t> candidates, dims;
  if (args.size() == 1) {
    for (int64_t d = 0; d < ndim; ++d) candidates.push_back(d);
  } else if (args[1].isInt()) {
    candidates.push_back(at::maybe_wrap_dim(args[1].toInt(), ndim));
  } else {
    for (const auto& v : args[1].toListRef()) candidates.push_back(at::maybe_wrap_dim(v.toInt(), ndim));
  }
  for (auto d : candidates)
    if (ndim > 0 && shape[static_cast<size_t>(d)] == 1) dims.push_back(d);
  return dims;
}

void squeeze_named_dims(const c10::OperatorHandle& op, torch::jit::Stack* stack, const LocalContext& ctx) {
  const size_t n = op.schema().arguments().size();
  auto args = torch::jit::last(*stack, n);
  const auto dims = squeezed_dims(ctx.inputs[0]->shape, args);
  auto out = at::squeeze(args[0].toTensor(), dims);
  torch::jit::drop(*stack, n);
  torch::jit::push(*stack, std::move(out));
}

ShardingChoice squeeze_rule(const OpCall& call) {
  const int64_t ndim = call.inputs[0].ndim();
  std::vector<bool> dropped(static_cast<size_t>(ndim), false);
  for (auto d : squeezed_dims(call.inputs[0].shape, call.args)) dropped[static_cast<size_t>(d)] = true;
  auto c = map_dims_rule(call, [&](int64_t d) -> int64_t {
    if (dropped[d]) return -1;
    return d - std::count(dropped.begin(), dropped.begin() + d, true);
  });
  c.local_fn = squeeze_named_dims;
  return c;
}

// diagonal(self, offset, dim1, dim2): a view without dim1 and dim2, the diagonal appended
// last; dim1 and dim2 are whole, every other dim keeps its split (and Partial stays).
std::vector<int64_t> kept_dims(int64_t ndim, int64_t d1, int64_t d2) {
  std::vector<int64_t> kept;
  for (int64_t d = 0; d < ndim; ++d)
    if (d != d1 && d != d2) kept.push_back(d);
  return kept;
}

ShardingChoice diagonal_rule(const OpCall& call) {
  const int64_t n = call.inputs[0].ndim();
  const auto kept = kept_dims(n, at::maybe_wrap_dim(call.int_arg("dim1"), n), at::maybe_wrap_dim(call.int_arg("dim2"), n));
  return map_dims_rule(call, [&](int64_t d) -> int64_t {
    const auto it = std::find(kept.begin(), kept.end(), d);
    return it == kept.end() ? -1 : it - kept.begin();
  });
}

// diagonal_backward(grad, input_sizes, offset, dim1, dim2): the inverse; the local call
// gets this rank's share of input_sizes.
ShardingChoice diagonal_backward_rule(const OpCall& call) {
  const int64_t n = call.outputs[0].ndim();
  const auto kept = kept_dims(n, at::maybe_wrap_dim(call.int_arg("dim1"), n), at::maybe_wrap_dim(call.int_arg("dim2"), n));
  auto [in, out] = map_dims(call, [&](int64_t g) -> int64_t {
    return g < static_cast<int64_t>(kept.size()) ? kept[static_cast<size_t>(g)] : -1;
  });
  auto c = single(call, in, {out});
  c.local_args.emplace_back(1, c10::IValue(local_sizes(call, out)));
  return c;
}

// expand(self, size): new leading dims and broadcast unit dims are whole.
ShardingChoice expand_rule(const OpCall& call) {
  const auto& in_shape = call.inputs[0].shape;
  const auto& out_shape = call.outputs[0].shape;
  const int64_t lead = call.outputs[0].ndim() - call.inputs[0].ndim();
  auto [in, out] = map_dims(call, [&](int64_t d) -> int64_t {
    return in_shape[d] == out_shape[d + lead] ? d + lead : -1;
  });
  auto c = single(call, in, {out});
  c.local_args.emplace_back(1, c10::IValue(local_sizes(call, out)));
  return c;
}

// ---- indexing along one dim --------------------------------------------------------

// select.int(self, dim, index): the dim goes away.
ShardingChoice select_rule(const OpCall& call) {
  const int64_t dim = at::maybe_wrap_dim(call.int_arg("dim"), call.inputs[0].ndim());
  return map_dims_rule(call, [&](int64_t d) { return d == dim ? -1 : d > dim ? d - 1 : d; });
}

// slice / split / split_with_sizes (self, _, dim): the dim must be whole.
ShardingChoice whole_dim_rule(const OpCall& call) {
  const int64_t dim = at::maybe_wrap_dim(call.int_arg("dim"), call.inputs[0].ndim());
  return map_dims_rule(call, [&](int64_t d) { return d == dim ? -1 : d; });
}

// split.Tensor(self, split_size, dim) / split_with_sizes(self, split_sizes, dim): an
// InterleavedShard(dim, g) cut into its g blocks stays where it is, and each block is
// Shard(dim); the local call cuts the shard into g equal parts.
ShardingChoice split_rule(const OpCall& call, bool with_sizes) {
  const int64_t dim = at::maybe_wrap_dim(call.int_arg("dim"), call.inputs[0].ndim());
  auto c = whole_dim_rule(call);
  const auto& placements = call.inputs[0].placements;
  const int64_t n = call.inputs[0].shape[static_cast<size_t>(dim)];
  for (size_t m = 0; m < placements.size(); ++m) {
    const auto& p = placements[m];
    if (!p.is_interleaved() || p.dim != dim || static_cast<int64_t>(call.outputs.size()) != p.groups) continue;
    const int64_t block = n / p.groups;
    bool blocks = true;
    for (const auto& out : call.outputs) blocks &= out.shape[static_cast<size_t>(dim)] == block;
    if (!blocks) continue;
    c.inputs[0][m] = p;
    for (auto& out : c.outputs) out[m] = Placement::shard(static_cast<int32_t>(dim));
    const int64_t local_block = block / call.mesh.shape[m];
    if (with_sizes) c.local_args.emplace_back(1, c10::IValue(std::vector<int64_t>(p.groups, local_block)));
    else c.local_args.emplace_back(1, c10::IValue(local_block));
  }
  return c;
}

// unbind.int(self, dim)
ShardingChoice unbind_rule(const OpCall& call) { return select_rule(call); }

// select_backward(grad, input_sizes, dim, index) / slice_backward(grad, input_sizes,
// dim, start, end, step): the gradient is scattered into zeros of the input's size,
// whole along `dim`; the local call gets the local size.
ShardingChoice index_backward_rule(const OpCall& call, bool dim_removed) {
  const int64_t dim = at::maybe_wrap_dim(call.int_arg("dim"), call.outputs[0].ndim());
  auto [in, out] = map_dims(call, [&](int64_t d) -> int64_t {
    const int64_t to = dim_removed && d >= dim ? d + 1 : d;
    return to == dim ? -1 : to;
  });
  auto c = single(call, in, {out});
  c.local_args.emplace_back(1, c10::IValue(local_sizes(call, out)));
  return c;
}

// as_strided(self, size, stride, storage_offset?) addresses storage directly (autograd
// uses it to re-create views). It runs on the replicated tensor, whose shard must then
// be laid out exactly as the global tensor claims; it is for tensors autograd made
// fresh. Anything else is refused with an explanation rather than computed wrongly.
void as_strided_locally(const c10::OperatorHandle& op, torch::jit::Stack* stack, const LocalContext& ctx) {
  const auto& spec = *ctx.inputs[0];
  const auto self = (*stack)[stack->size() - op.schema().arguments().size()].toTensor();
  // (An empty tensor has no elements to address: its strides mean nothing.)
  bool same = self.numel() == 0 || self.storage_offset() == spec.storage_offset;
  for (int64_t d = 0; d < self.dim() && same && self.numel() > 0; ++d)
    same = self.size(d) <= 1 || self.stride(d) == spec.stride[static_cast<size_t>(d)];
  TORCH_CHECK(same, "as_strided on a DTensor needs its replicated shard laid out like the global tensor ",
              spec.str(), " (strides ", c10::IntArrayRef(spec.stride), ", offset ", spec.storage_offset,
              "), but the shard has strides ", self.strides(), " and offset ", self.storage_offset(),
              ". Use view/reshape/slicing ops instead of as_strided on distributed tensors.");
  op.callBoxed(stack);
}

ShardingChoice as_strided_rule(const OpCall& call) {
  auto c = replicate_all(call);
  c.local_fn = as_strided_locally;
  return c;
}

// ---- complex numbers as pairs ----------------------------------------------------

// detach / alias / view_as_real: every dim keeps its shard. A Partial of any kind passes
// too: the result shares the shards (a reduction here made `x.detach()` of a Partial max
// a new tensor, which writes through it did not reach).
ShardingChoice same_dims_rule(const OpCall& call) {
  return map_dims_rule(call, [](int64_t d) { return d; });
}

// A Partial max or min of the first input is reduced first, for ops through which only
// sums pass.
ShardingChoice sums_only(ShardingChoice c) {
  for (size_t m = 0; m < c.inputs[0].size(); ++m) {
    const auto& p = c.inputs[0][m];
    if (p.is_partial() && p.op != ReduceOp::Sum && p.op != ReduceOp::Avg)
      for (auto& out : c.outputs) c.inputs[0][m] = out[m] = Placement::replicate();
  }
  return c;
}

// view_as_complex(self): a real [.., 2] becomes a complex [..]; the pairs must be whole,
// and a Partial max or min is reduced first (complex numbers have no order).
ShardingChoice view_as_complex_rule(const OpCall& call) {
  const int64_t pairs = call.inputs[0].ndim() - 1;
  return sums_only(map_dims_rule(call, [pairs](int64_t d) { return d == pairs ? -1 : d; }));
}

// ---- sliding windows -------------------------------------------------------------

// unfold(self, dimension, size, step): the windows along `dimension` (which must be
// whole) become a new last dim; every other dim keeps its shard.
ShardingChoice unfold_rule(const OpCall& call) {
  const int64_t dim = at::maybe_wrap_dim(call.int_arg("dimension"), std::max<int64_t>(call.inputs[0].ndim(), 1));
  return map_dims_rule(call, [dim](int64_t d) { return d == dim ? -1 : d; });
}

// unfold_backward(grad_in, input_sizes, dim, size, step): the windows' gradients summed
// back into the input's shape (so only Partial sums pass); `dim` and the window dim
// whole; the local call gets the local size.
ShardingChoice unfold_backward_rule(const OpCall& call) {
  const int64_t ndim = call.outputs[0].ndim();
  const int64_t dim = at::maybe_wrap_dim(call.int_arg("dim"), std::max<int64_t>(ndim, 1));
  auto [in, out] = map_dims(call, [&](int64_t d) -> int64_t { return d == dim || d >= ndim ? -1 : d; });
  auto c = sums_only(single(call, in, {out}));
  c.local_args.emplace_back(1, c10::IValue(local_sizes(call, c.outputs[0])));
  return c;
}

// ---- joining -------------------------------------------------------------------------

// cat(tensors, dim) / stack(tensors, dim): every input alike; the joined dim whole.
// cat skips 1-d empty inputs, as torch does (a legacy rule: torch.cat([torch.tensor([]),
// x], dim) is x whatever x's rank; Hugging Face's KV cache starts that way): they take
// no part in the choice, keep their placements (their shards are empty too) and the dim
// wraps by the first input that is not skipped.
bool skipped_by_cat(const TensorArg& t) {
  return t.ndim() == 1 && t.shape[0] == 0;
}

// Whether cat's inputs are at least two blocks of one size along `dim`, none skipped.
bool joins_equal_blocks(const OpCall& call, int64_t dim) {
  if (call.inputs.size() < 2 || call.inputs.size() > 63) return false;
  for (const auto& in : call.inputs)
    if (!in.defined || in.shape[static_cast<size_t>(dim)] != call.inputs[0].shape[static_cast<size_t>(dim)])
      return false;
  return true;
}

ShardingChoice join_rule(const OpCall& call, bool stacking) {
  const size_t n = call.inputs.size();
  OpCall joined = call;
  const TensorArg* first = nullptr;
  for (auto& in : joined.inputs) {
    if (!stacking && skipped_by_cat(in)) in.defined = false;  // choose_cheapest ignores it
    else if (first == nullptr) first = &in;
  }
  if (first == nullptr && !stacking) {  // all skipped: the result is an empty 1-d tensor
    auto c = replicate_all(call);
    for (size_t i = 0; i < n; ++i) c.inputs[i] = call.inputs[i].placements;
    return c;
  }
  const int64_t in_ndim = first == nullptr ? 0 : first->ndim();
  const int64_t dim = at::maybe_wrap_dim(call.int_arg("dim"), stacking ? in_ndim + 1 : std::max<int64_t>(in_ndim, 1));
  DimStrategies s;
  auto all = [&](Placement in, Placement out) { s.push_back({Placements(n, in), {out}}); };
  for (int32_t d = 0; d < in_ndim; ++d) {
    if (!stacking && d == dim) continue;
    all(Placement::shard(d), Placement::shard(stacking && d >= dim ? d + 1 : d));
  }
  if (!stacking && joins_equal_blocks(joined, dim))  // sizes are checked per mesh dim
    all(Placement::shard(static_cast<int32_t>(dim)), Placement::interleaved(static_cast<int32_t>(dim), static_cast<int32_t>(n)));
  for (const ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) all(Placement::partial(op), Placement::partial(op));
  auto c = choose_cheapest(joined, s);
  for (size_t i = 0; i < n; ++i)
    if (!joined.inputs[i].defined) c.inputs[i] = call.inputs[i].placements;
  return c;
}

}  // namespace

VESCALE_RULES(view) {
  rules.add("aten::view", view_rule);
  rules.add("aten::_unsafe_view", view_rule);
  rules.add("aten::_reshape_alias", reshape_alias_rule);
  rules.add("aten::t", transpose_rule);
  rules.add("aten::diagonal", diagonal_rule);
  rules.add("aten::diagonal_backward", diagonal_backward_rule);
  rules.add("aten::transpose.int", transpose_rule);
  rules.add("aten::permute", permute_rule);
  rules.add("aten::unsqueeze", unsqueeze_rule);
  for (const char* op : {"aten::squeeze", "aten::squeeze.dim", "aten::squeeze.dims"}) rules.add(op, squeeze_rule);
  rules.add("aten::expand", expand_rule);
  rules.add("aten::select.int", select_rule);
  rules.add("aten::slice.Tensor", whole_dim_rule);
  rules.add("aten::split.Tensor", [](const OpCall& c) { return split_rule(c, false); });
  rules.add("aten::split_with_sizes", [](const OpCall& c) { return split_rule(c, true); });
  rules.add("aten::unbind.int", unbind_rule);
  rules.add("aten::select_backward", [](const OpCall& c) { return index_backward_rule(c, true); });
  rules.add("aten::slice_backward", [](const OpCall& c) { return index_backward_rule(c, false); });
  rules.add("aten::as_strided", as_strided_rule);
  rules.add("aten::view_as_real", same_dims_rule);  // a complex [..] becomes a real [.., 2]
  rules.add("aten::detach", same_dims_rule);
  rules.add("aten::alias", same_dims_rule);
  rules.add("aten::view_as_complex", view_as_complex_rule);
  rules.add("aten::unfold", unfold_rule);
  rules.add("aten::unfold_backward", unfold_backward_rule);
  rules.add("aten::cat", [](const OpCall& c) { return join_rule(c, false); });
  rules.add("aten::stack", [](const OpCall& c) { return join_rule(c, true); });
}

}  // namespace vescale
