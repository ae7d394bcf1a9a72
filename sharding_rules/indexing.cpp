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
  const auto pad = call.int_list_arg("pad");
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
  const auto repeats = call.int_list_arg("repeats");
  const int64_t lead = static_cast<int64_t>(repeats.size()) - call.inputs[0].ndim();
  DimStrategies s;
  for (int64_t d = 0; d < call.inputs[0].ndim(); ++d)
    if (repeats[static_cast<size_t>(d + lead)] == 1) s.push_back({{S(d)}, {S(d + lead)}});
  return choose_cheapest(call, s);
}

// x[i0, i1, ...] (index.Tensor, index_put) with None for untouched dims. An integer
// index takes one dim of x; a bool (or uint8) mask takes as many dims as it has and
// stands for the one dim of its nonzero positions. The index tensors broadcast together
// into the index dims of the indexed view; when the indexed dims are adjacent, the view
// keeps the untouched dims in place and puts the index dims where the indexed block
// was, otherwise the index dims come first and the untouched dims follow in order.
struct IndexedView {
  bool ok = false;  // false: a layout these rules do not map (only Replicate is offered)
  int64_t ndim = 0;  // of the indexed view
  std::vector<std::pair<int64_t, int64_t>> untouched;  // (dim of x, dim of the view)
  std::vector<int64_t> view_shape;  // -1 on the index dims (a mask's length depends on data)
  // Set when the only index is one bool mask: the dims of x it covers, [mask_first,
  // mask_first + mask_ndim), and the view dim of its nonzero positions.
  int64_t mask_first = -1, mask_ndim = 0, mask_view_dim = -1;
};

bool is_mask(const TensorArg& t) { return t.dtype == c10::ScalarType::Bool || t.dtype == c10::ScalarType::Byte; }

IndexedView indexed_view(const OpCall& call) {
  IndexedView v;
  const auto& self = call.inputs[0];
  const int64_t ndim = self.ndim();
  const size_t n_indices = call.arg("indices").toListRef().size();
  int64_t d = 0, index_ndim = 0, first = -1, last = -1, n_defined = 0;
  bool adjacent = true;
  std::vector<bool> indexed(static_cast<size_t>(ndim), false);
  for (size_t j = 0; j < n_indices; ++j) {
    const auto& idx = call.inputs[1 + j];  // None entries are undefined slots
    if (!idx.defined) {
      ++d;
      continue;
    }
    const int64_t takes = is_mask(idx) ? idx.ndim() : 1;
    if (takes == 0) return v;  // x[True]: a new unit dim; not mapped
    if (d + takes > ndim) return v;  // torch rejects it; let the local op say so
    if (first < 0) first = d;
    else if (last != d - 1) adjacent = false;
    for (int64_t k = d; k < d + takes; ++k) indexed[static_cast<size_t>(k)] = true;
    index_ndim = std::max(index_ndim, is_mask(idx) ? int64_t{1} : idx.ndim());
    if (is_mask(idx)) {
      v.mask_first = d;
      v.mask_ndim = takes;
    }
    last = d + takes - 1;
    d += takes;
    ++n_defined;
  }
  if (n_defined == 0) return v;
  if (n_defined != 1 || v.mask_first < 0) v.mask_first = -1, v.mask_ndim = 0;
  v.ndim = ndim - std::count(indexed.begin(), indexed.end(), true) + index_ndim;
  v.view_shape.assign(static_cast<size_t>(v.ndim), -1);
  int64_t next = adjacent ? 0 : index_ndim;  // the view dim of the next untouched dim
  for (int64_t k = 0; k < ndim; ++k) {
    if (indexed[static_cast<size_t>(k)]) {
      if (adjacent && k == first) {
        if (v.mask_first >= 0) v.mask_view_dim = next;
        next += index_ndim;
      }
      continue;
    }
    v.untouched.emplace_back(k, next);
    v.view_shape[static_cast<size_t>(next)] = self.shape[static_cast<size_t>(k)];
    ++next;
  }
  v.ok = true;
  return v;
}

// index.Tensor(self, indices): untouched dims may stay split; indices replicated.
ShardingChoice index_rule(const OpCall& call) {
  const size_t n_in = call.inputs.size();
  DimStrategies s;
  const auto view = indexed_view(call);
  if (view.ok && view.ndim == call.outputs[0].ndim()) {
    for (const auto& [d, v] : view.untouched) {
      Placements in(n_in, R);
      in[0] = S(d);
      s.push_back({in, {S(v)}});
    }
  }
  return choose_cheapest(call, s);
}

// index_put(self, indices, values, accumulate) and its in-place forms. The values
// broadcast to the indexed view (they may be 0-d, have fewer dims, or unit dims):
//  - self split on an untouched dim, the values split on the matching view dim where
//    they have its full size (replicated where they broadcast), indices replicated;
//  - with a single bool mask as the index and values that broadcast along its nonzero
//    positions (x[x > 0] = 0, x[mask] = row): self and the mask split alike on a masked
//    dim, the values replicated; each rank writes its own selected elements.
ShardingChoice index_put_rule(const OpCall& call) {
  const size_t n_in = call.inputs.size();
  const size_t n_out = call.outputs.size();
  const size_t values = n_in - 1;  // self, one slot per index (None: undefined), values
  const auto& vals = call.inputs[values];
  DimStrategies s = {{Placements(n_in, R), Placements(n_out, R)}};
  const auto view = indexed_view(call);
  if (!view.ok || vals.ndim() > view.ndim) return choose_cheapest(call, s);
  for (const auto& [d, v] : view.untouched) {
    Placements in(n_in, R);
    in[0] = S(d);
    in[values] = broadcast_input_placement(S(v), view.view_shape, vals);
    s.push_back({in, Placements(n_out, S(d))});
  }
  if (view.mask_first >= 0) {
    const int64_t at = view.mask_view_dim - (view.ndim - vals.ndim());  // the values' dim there
    const bool broadcast = at < 0 || vals.shape[static_cast<size_t>(at)] == 1;
    size_t mask = 1;
    while (!call.inputs[mask].defined) ++mask;
    // (A mask of another shape is an error, which every rank must raise alike: whole.)
    const auto& mask_shape = call.inputs[mask].shape;
    const auto& self_shape = call.inputs[0].shape;
    bool fits = true;
    for (int64_t k = 0; k < view.mask_ndim; ++k)
      fits &= mask_shape[static_cast<size_t>(k)] == self_shape[static_cast<size_t>(view.mask_first + k)];
    if (broadcast && fits)
      for (int64_t k = 0; k < view.mask_ndim; ++k) {
        Placements in(n_in, R);
        in[0] = S(view.mask_first + k);
        in[mask] = S(k);
        s.push_back({in, Placements(n_out, S(view.mask_first + k))});
      }
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
