// Indexing, sorting and reordering ops. The indexed (or sorted, flipped, ...) dims
// must be whole; every other dim may be split, alike on the tensors that share it.
//
//   op                                    whole dims          split alike
//   gather(self, dim, index)              dim                 self, index, result
//   scatter / scatter_add / scatter_reduce dim                self, index, src, result
//   index_select(self, dim, index)        dim                 self, result; or index
//                                                             split -> result split on dim
//   index_add / index_copy / index_fill   dim                 self, source, result
//   index.Tensor (x[idx]), index_put      indexed dims        the other dims (index_put:
//                                                             self and values alike)
//   topk, sort                            dim                 self, values, indices
//   flip(dims), roll(dims)                dims                self, result
//   tril, triu                            last two            self, result
//   repeat(repeats)                       repeated dims       self, result
// Index tensors are replicated unless said otherwise.

#include "sharding_rules/rule.h"

#include <ATen/ATen.h>

namespace vescale {

namespace {

const Placement R = Placement::replicate();
Placement S(int64_t d) { return Placement::shard(static_cast<int32_t>(d)); }

std::vector<int64_t> dims_of(const OpCall& call, const char* name, int64_t ndim) {
  std::vector<int64_t> out;
  if (const auto* v = call.find_arg(name)) {
    if (v->isInt()) out.push_back(at::maybe_wrap_dim(v->toInt(), ndim));
    else if (v->isList())
      for (const auto& d : v->toListRef()) out.push_back(at::maybe_wrap_dim(d.toInt(), ndim));
  }
  return out;
}

bool contains(const std::vector<int64_t>& v, int64_t x) { return std::find(v.begin(), v.end(), x) != v.end(); }

// Every result and the inputs in `alike` (and any written `out=` tensor) split
// together on any result dim outside `whole` where they all have the result's size;
// the other inputs replicated.
DimStrategies split_alike(const OpCall& call, const std::vector<int64_t>& whole, std::vector<size_t> alike) {
  const size_t n_in = call.inputs.size();
  const size_t n_out = call.outputs.size();
  const auto& out = call.outputs[0];
  alike.erase(std::remove_if(alike.begin(), alike.end(), [&](size_t i) { return i >= n_in; }), alike.end());
  for (size_t i = 0; i < n_in; ++i)
    if (call.inputs[i].written && !std::count(alike.begin(), alike.end(), i)) alike.push_back(i);
  DimStrategies s = {{Placements(n_in, R), Placements(n_out, R)}};
  for (int64_t d = 0; d < out.ndim(); ++d) {
    if (contains(whole, d)) continue;
    bool fits = true;
    for (size_t i : alike) {
      const auto& in = call.inputs[i];
      fits &= !in.defined || (in.ndim() == out.ndim() && in.shape[static_cast<size_t>(d)] == out.shape[static_cast<size_t>(d)]);
    }
    if (!fits) continue;
    Placements in(n_in, R);
    for (size_t i : alike) in[i] = S(d);
    s.push_back({in, Placements(n_out, S(d))});
  }
  return s;
}

// Ops over `dim` (gather, scatter*, topk, sort, index_* ...): the inputs in `alike`
// split with the result elsewhere.
RuleFn over_dim(std::vector<size_t> alike, const char* dim_arg = "dim") {
  return [alike, dim_arg](const OpCall& call) {
    const auto whole = dims_of(call, dim_arg, call.inputs[0].ndim());
    return choose_cheapest(call, split_alike(call, whole, alike));
  };
}

ShardingChoice index_select_rule(const OpCall& call) {
  const auto whole = dims_of(call, "dim", call.inputs[0].ndim());
  auto s = split_alike(call, whole, {0});
  if (call.inputs[1].ndim() == 1 && call.outputs[0].ndim() > whole[0])
    s.push_back({{R, S(0)}, {S(whole[0])}});  // each rank picks its share of the indices
  return choose_cheapest(call, s);
}

ShardingChoice tril_rule(const OpCall& call) {
  const int64_t n = call.inputs[0].ndim();
  return choose_cheapest(call, split_alike(call, {n - 2, n - 1}, {0}));
}

// constant_pad_nd(self, pad, value): padded (or cropped) dims whole, the others split
// alike (pad holds (before, after) pairs from the last dim backwards).
ShardingChoice constant_pad_rule(const OpCall& call) {
  const int64_t n = call.inputs[0].ndim();
  const auto pad = call.int_list_arg(1);
  std::vector<int64_t> whole;
  for (size_t i = 0; i + 1 < pad.size(); i += 2)
    if (pad[i] != 0 || pad[i + 1] != 0) whole.push_back(n - 1 - static_cast<int64_t>(i / 2));
  return choose_cheapest(call, split_alike(call, whole, {0}));
}

ShardingChoice roll_rule(const OpCall& call) {
  const int64_t n = call.inputs[0].ndim();
  auto whole = dims_of(call, "dims", n);
  if (whole.empty())  // a roll of the flattened tensor moves across every dim
    for (int64_t d = 0; d < n; ++d) whole.push_back(d);
  return choose_cheapest(call, split_alike(call, whole, {0}));
}

// repeat(self, repeats): leading new dims and repeated dims whole; a dim repeated once
// keeps its split (shifted past the new leading dims).
ShardingChoice repeat_rule(const OpCall& call) {
  const auto repeats = call.int_list_arg(1);
  const int64_t lead = static_cast<int64_t>(repeats.size()) - call.inputs[0].ndim();
  DimStrategies s = {{{R}, {R}}};
  for (int64_t d = 0; d < call.inputs[0].ndim(); ++d)
    if (repeats[static_cast<size_t>(d + lead)] == 1) s.push_back({{S(d)}, {S(d + lead)}});
  return choose_cheapest(call, s);
}

// x[i0, i1, ...] with None for untouched dims: when the indexed dims are adjacent, the
// indexed view keeps the untouched dims in place and puts the index dims where the
// indexed block was. Yields (dim of x, dim of the indexed view) for the untouched dims.
std::vector<std::pair<int64_t, int64_t>> untouched_dims(const OpCall& call, int64_t view_ndim) {
  const auto indices = call.arg(1).toListRef();
  std::vector<int64_t> indexed;
  for (size_t i = 0; i < indices.size(); ++i)
    if (!indices[i].isNone()) indexed.push_back(static_cast<int64_t>(i));
  std::vector<std::pair<int64_t, int64_t>> out;
  const bool adjacent = !indexed.empty() && indexed.back() - indexed.front() + 1 == static_cast<int64_t>(indexed.size());
  if (!adjacent) return out;
  const int64_t ndim = call.inputs[0].ndim();
  const int64_t shift = view_ndim - ndim;  // index dims minus indexed dims
  for (int64_t d = 0; d < ndim; ++d)
    if (!contains(indexed, d)) out.emplace_back(d, d < indexed.front() ? d : d + shift);
  return out;
}

// index.Tensor(self, indices): untouched dims may stay split; indices replicated.
ShardingChoice index_rule(const OpCall& call) {
  const size_t n_in = call.inputs.size();
  DimStrategies s = {{Placements(n_in, R), {R}}};
  for (const auto& [d, v] : untouched_dims(call, call.outputs[0].ndim())) {
    Placements in(n_in, R);
    in[0] = S(d);
    s.push_back({in, {S(v)}});
  }
  return choose_cheapest(call, s);
}

// index_put(self, indices, values, accumulate) and its in-place forms: self and values
// (shaped like the indexed view) split alike on the untouched dims.
ShardingChoice index_put_rule(const OpCall& call) {
  const size_t n_in = call.inputs.size();
  const size_t values = n_in - 1;  // self, the defined indices, values
  DimStrategies s = {{Placements(n_in, R), Placements(call.outputs.size(), R)}};
  for (const auto& [d, v] : untouched_dims(call, call.inputs[values].ndim())) {
    Placements in(n_in, R);
    in[0] = S(d);
    in[values] = S(v);
    s.push_back({in, Placements(call.outputs.size(), S(d))});
  }
  return choose_cheapest(call, s);
}

}  // namespace

VESCALE_RULES(indexing) {
  rules.add("aten::gather", over_dim({0, 1}));
  for (const char* base : {"aten::scatter", "aten::scatter_add", "aten::scatter_reduce"})
    rules.add_overloads(base, over_dim({0, 1, 2}));
  rules.add("aten::index_select", index_select_rule);
  rules.add("aten::constant_pad_nd", constant_pad_rule);
  for (const char* base : {"aten::index_add", "aten::index_copy"}) rules.add_overloads(base, over_dim({0, 2}));
  rules.add_overloads("aten::index_fill", over_dim({0}));
  rules.add("aten::index.Tensor", index_rule);
  for (const char* op : {"aten::index_put", "aten::index_put_", "aten::_index_put_impl_"})
    rules.add(op, index_put_rule);
  for (const char* op : {"aten::topk", "aten::sort", "aten::sort.stable"}) rules.add(op, over_dim({0}));
  rules.add("aten::flip", over_dim({0}, "dims"));
  rules.add("aten::roll", roll_rule);
  for (const char* base : {"aten::tril", "aten::triu"}) rules.add_overloads(base, tril_rule);
  rules.add("aten::repeat", repeat_rule);
}

}  // namespace vescale
