// Embedding lookup and the negative log-likelihood loss, including their vocabulary-
// parallel forms (the weight's rows / the logits' classes split across ranks).
//
//   embedding(weight[V, E], indices)
//     indices split            -> result rows split alike
//     weight S(1)              -> result's last dim split
//     weight S(0) (vocab)      -> Partial(sum): each rank looks up the rows it owns and
//                                 zeroes the others
//   embedding_dense_backward(grad, indices, V, ...)
//     token rows split alike   -> Partial weight grad
//     grad's last dim split    -> S(1)
//     vocab split (weight S(0)) -> each rank accumulates its own rows only
//   nll_loss_forward(logits[N, C], target, weight?, reduction, ignore_index)
//     rows split               -> sum / none: target split alike; mean: targets
//                                 replicated so every rank knows the global weight
//     classes split            -> Partial(sum): each rank picks the target logits it owns
//   nll_loss_backward          -> the same splits; a rank writes only its own classes
//
// Only 2-d logits split; a 1-d (single sample) loss is replicated.

#include "sharding_rules/rule.h"

#include <ATen/ATen.h>

namespace vescale {

namespace {

const Placement R = Placement::replicate();
const Placement P = Placement::partial();
Placement S(int64_t d) { return Placement::shard(static_cast<int32_t>(d)); }

bool shards(PlacementsRef placements, int32_t dim) {
  return std::any_of(placements.begin(), placements.end(), [&](const Placement& p) { return p.is_shard(dim); });
}

// The span [offset, offset + size) of tensor dim `dim` this rank holds under `spec`.
std::pair<int64_t, int64_t> span(const TensorSpec& spec, size_t dim) {
  return {spec.local.offsets[dim], spec.local.sizes[dim]};
}

// Indices shifted into a block [offset, offset + size): which fall inside, and where
// (outside ones point at 0).
std::pair<at::Tensor, at::Tensor> into_block(const at::Tensor& indices, int64_t offset, int64_t size) {
  auto local = indices - offset;
  auto inside = local.ge(0).logical_and(local.lt(size));
  return {local.masked_fill(inside.logical_not(), 0), inside};
}

// Indices a single device refuses (outside [0, size), except those `counted` leaves out)
// raise here too: a split lookup would quietly read zeros for them. The rules below hand
// every rank of the split the same indices, so every rank raises alike. On CUDA the check
// is a device-side assertion, as the single-device kernels' are: no wait for the device.
void check_in_range(const at::Tensor& indices, int64_t size, const std::string& what,
                    const at::Tensor& counted = {}) {
  if (indices.is_meta() || indices.numel() == 0) return;  // what-if planning runs on meta: no values
  auto bad = indices.lt(0).logical_or(indices.ge(size));
  if (counted.defined()) bad = bad.logical_and(counted);
  if (indices.is_cuda()) {
    at::_assert_async(bad.any().logical_not(), what + " out of range (vescale: a split lookup)");
    return;
  }
  if (!bad.any().item<bool>()) return;
  TORCH_CHECK_INDEX(false, what, " ", indices.masked_select(bad)[0].item<int64_t>(), " is out of range [0, ", size,
                    ") (as on one device; vescale checks it before the split lookup, which would read zeros)");
}

// ---- embedding ------------------------------------------------------------------------

// embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse) with the vocab
// split: rows this rank does not own come out zero. Zeroed by selection, never by a
// product: an index this rank does not own reads its local row 0, and a NaN or inf
// there (a diverged row no batch looks up) times 0 would be NaN where one device reads
// only the rows it is asked for. The same holds for every masked read below.
void embedding_vocab_locally(const c10::OperatorHandle& op, torch::jit::Stack* stack, const LocalContext& ctx) {
  auto args = torch::jit::last(*stack, 5);
  const at::Tensor weight = args[0].toTensor();
  const at::Tensor indices = args[1].toTensor();
  const auto [offset, rows] = span(*ctx.inputs[0], 0);
  check_in_range(indices, ctx.inputs[0]->shape[0], "embedding: index");
  at::Tensor out;
  if (rows == 0) {
    auto shape = indices.sizes().vec();
    shape.push_back(weight.size(1));
    out = at::zeros(shape, weight.options());
  } else {
    auto [local, inside] = into_block(indices, offset, rows);
    out = at::embedding(weight, local).masked_fill(inside.logical_not().unsqueeze(-1), 0);
  }
  torch::jit::drop(*stack, 5);
  torch::jit::push(*stack, std::move(out));
}

ShardingChoice embedding_rule(const OpCall& call) {
  const int64_t idx_ndim = call.inputs[1].ndim();
  DimStrategies s = {{{S(1), R}, {S(idx_ndim)}}, {{S(0), R}, {P}}};
  for (int64_t d = 0; d < idx_ndim; ++d) s.push_back({{R, S(d)}, {S(d)}});
  auto choice = choose_cheapest(call, s);
  if (shards(choice.inputs[0], 0)) choice.local_fn = embedding_vocab_locally;
  return choice;
}

// embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)
// with the vocab split: the rank accumulates the gradient rows it owns.
void embedding_backward_vocab_locally(const c10::OperatorHandle& op, torch::jit::Stack* stack,
                                      const LocalContext& ctx) {
  auto args = torch::jit::last(*stack, 5);
  const at::Tensor grad = args[0].toTensor();
  const at::Tensor indices = args[1].toTensor();
  const int64_t padding_idx = args[3].toInt();
  const auto [offset, rows] = span(*ctx.outputs[0], 0);
  auto [local, inside] = into_block(indices, offset, rows);
  const auto kept = grad.masked_fill(inside.logical_not().unsqueeze(-1), 0);
  const int64_t local_padding = padding_idx >= offset && padding_idx < offset + rows ? padding_idx - offset : -1;
  auto out = at::embedding_dense_backward(kept, local, rows, local_padding, false);
  torch::jit::drop(*stack, 5);
  torch::jit::push(*stack, std::move(out));
}

ShardingChoice embedding_backward_rule(const OpCall& call) {
  const int64_t idx_ndim = call.inputs[1].ndim();
  const bool scale_by_freq = call.bool_arg("scale_grad_by_freq");  // frequencies must be counted globally
  DimStrategies s = {{{S(idx_ndim), R}, {S(1)}}, {{P, R}, {P}}};
  if (!scale_by_freq) {
    s.push_back({{R, R}, {S(0)}});
    for (int64_t d = 0; d < idx_ndim; ++d) s.push_back({{S(d), S(d)}, {P}});
  }
  auto choice = choose_cheapest(call, s);
  if (shards(choice.outputs[0], 0)) choice.local_fn = embedding_backward_vocab_locally;
  return choice;
}

// ---- negative log-likelihood -------------------------------------------------------------

enum Reduction : int64_t { kNone = 0, kMean = 1, kSum = 2 };

// What a rank needs to compute its share of the loss over its block of the logits.
struct LossBlock {
  at::Tensor target;        // this rank's rows
  at::Tensor valid;         // target != ignore_index
  at::Tensor class_index;   // target shifted into this rank's classes (0 where not owned)
  at::Tensor owned;         // valid and the target class is this rank's
  at::Tensor weight;        // per-row class weight (0 where ignored)
  at::Tensor total_weight;  // sum of the weights over every row, from the whole target
};

LossBlock loss_block(const TensorSpec& logits, const TensorSpec& target_spec, const at::Tensor& target,
                     const std::optional<at::Tensor>& class_weight, int64_t ignore_index, at::ScalarType dtype) {
  auto row_weight = [&](const at::Tensor& t, const at::Tensor& valid) {
    if (class_weight && class_weight->defined())
      return class_weight->index_select(0, t.masked_fill(valid.logical_not(), 0)).mul(valid);
    return valid.to(dtype);
  };
  LossBlock b;
  const auto [row_offset, rows] = span(logits, 0);
  const auto [class_offset, classes] = span(logits, 1);
  const bool whole_target = target_spec.is_replicated() && target.size(0) == logits.shape[0];
  b.target = whole_target ? target.narrow(0, row_offset, rows) : target;
  b.valid = b.target.ne(ignore_index);
  auto [local, inside] = into_block(b.target, class_offset, classes);
  b.class_index = local;
  b.owned = inside.logical_and(b.valid);
  b.weight = row_weight(b.target, b.valid);
  const auto all_valid = target.ne(ignore_index);
  b.total_weight = row_weight(target, all_valid).sum().to(dtype);
  return b;
}

// nll_loss_forward over a block of rows and classes: the logit of each row's target
// if this rank owns that class, weighted; summed or averaged over the global weight.
void nll_locally(const c10::OperatorHandle& op, torch::jit::Stack* stack, const LocalContext& ctx) {
  auto args = torch::jit::last(*stack, 5);
  const at::Tensor self = args[0].toTensor();
  const at::Tensor target = args[1].toTensor();
  const auto weight = args[2].toOptional<at::Tensor>();
  const int64_t reduction = args[3].toInt();
  const int64_t ignore_index = args[4].toInt();
  check_in_range(target, ctx.inputs[0]->shape[1], "nll_loss: target", target.ne(ignore_index));
  const auto b = loss_block(*ctx.inputs[0], *ctx.inputs[1], target, weight, ignore_index, self.scalar_type());
  at::Tensor picked = self.size(1) == 0 ? at::zeros({self.size(0)}, self.options())
                                         : self.gather(1, b.class_index.unsqueeze(1)).squeeze(1);
  // (A class a row does not pick can be -inf: a masked or padded vocabulary entry.)
  const auto loss = picked.masked_fill(b.owned.logical_not(), 0).mul(b.weight).neg();
  at::Tensor out;
  at::Tensor total = b.total_weight;
  if (reduction == kNone) out = loss;
  else if (reduction == kSum) out = loss.sum();
  else out = loss.sum().div(total);
  if (reduction != kMean) total = b.weight.sum().to(self.scalar_type());
  torch::jit::drop(*stack, 5);
  torch::jit::push(*stack, std::move(out), std::move(total));
}

// nll_loss_forward(self, target, weight?, reduction, ignore_index) -> (output, total_weight)
ShardingChoice nll_loss_rule(const OpCall& call) {
  const bool batched = call.inputs[0].ndim() == 2;
  const auto reduction = call.int_arg("reduction");
  DimStrategies s;
  if (batched) {
    // Rows split. Mean needs the global weight, so the targets are whole.
    if (reduction == kNone) s.push_back({{S(0), S(0), R}, {S(0), P}});
    if (reduction == kSum) s.push_back({{S(0), S(0), R}, {P, P}});
    if (reduction == kMean) s.push_back({{S(0), R, R}, {P, R}});
    // Classes split: each rank picks the logits it owns.
    s.push_back({{S(1), R, R}, {P, R}});
  }
  auto choice = choose_cheapest(call, s);
  const bool classes = shards(choice.inputs[0], 1);
  const bool mean_rows = reduction == kMean && shards(choice.inputs[0], 0);
  if (classes || mean_rows) choice.local_fn = nll_locally;
  return choice;
}

// nll_loss_backward over a block: minus the (scaled) gradient at each owned target.
void nll_backward_locally(const c10::OperatorHandle& op, torch::jit::Stack* stack, const LocalContext& ctx) {
  auto args = torch::jit::last(*stack, 7);
  const at::Tensor grad = args[0].toTensor();
  const at::Tensor self = args[1].toTensor();
  const at::Tensor target = args[2].toTensor();
  const auto weight = args[3].toOptional<at::Tensor>();
  const int64_t reduction = args[4].toInt();
  const int64_t ignore_index = args[5].toInt();
  const at::Tensor total_weight = args[6].toTensor();
  const auto b = loss_block(*ctx.inputs[1], *ctx.inputs[2], target, weight, ignore_index, self.scalar_type());
  auto scale = b.weight.neg();
  scale = reduction == kNone ? scale.mul(grad) : scale.mul(grad.reshape({}));
  if (reduction == kMean) scale = scale.div(total_weight);
  // Rows whose target this rank does not own, or that are ignored, get exactly 0, as on one
  // device: a product would turn a batch of only ignored targets (0 / 0) into NaN.
  scale = scale.masked_fill(b.owned.logical_not(), 0);
  auto out = at::zeros_like(self);
  if (self.size(1) > 0) out.scatter_(1, b.class_index.unsqueeze(1), scale.unsqueeze(1).to(self.scalar_type()));
  torch::jit::drop(*stack, 7);
  torch::jit::push(*stack, std::move(out));
}

// nll_loss_backward(grad_output, self, target, weight?, reduction, ignore_index, total_weight)
ShardingChoice nll_loss_backward_rule(const OpCall& call) {
  const bool batched = call.inputs[1].ndim() == 2;
  const auto reduction = call.int_arg("reduction");
  DimStrategies s;
  if (batched) {
    const Placement grad = reduction == kNone ? S(0) : R;
    s.push_back({{grad, S(0), S(0), R, R}, {S(0)}});
    s.push_back({{R, S(1), R, R, R}, {S(1)}});
  }
  auto choice = choose_cheapest(call, s);
  // total_weight only matters for mean; elsewhere it may stay wherever it is.
  if (reduction != kMean) choice.inputs[4] = call.inputs[4].placements;
  if (shards(choice.inputs[1], 1)) choice.local_fn = nll_backward_locally;
  return choice;
}

}  // namespace

VESCALE_RULES(embedding_loss) {
  rules.add("aten::embedding", embedding_rule);
  rules.add("aten::embedding_dense_backward", embedding_backward_rule);
  rules.add("aten::nll_loss_forward", nll_loss_rule);
  rules.add("aten::nll_loss_backward", nll_loss_backward_rule);
}

}  // namespace vescale
