// Random ops give every rank the values one device would draw. Ranks must seed alike
// (as with torch.manual_seed on every rank); every rank moves its generator as the op on
// the whole tensor would, so the generators stay in step.
//
// On the CPU, fills whose consumption of the generator is element-local and known
// (uniform_, normal_ on >= 16 elements, bernoulli_(p), random_, and native_dropout's
// mask; see sharding_rules/random_local.h) draw only this rank's block: the Mersenne
// Twister jumps (or streams, for short gaps) to where the block's rows start. On CUDA
// (a CUDA build), uniform_, normal_, log_normal_, exponential_, cauchy_, geometric_,
// bernoulli_(p) and native_dropout draw only this rank's block: Philox is counter-based,
// each element is drawn where the whole fill would draw it
// (sharding_rules/random_local_cuda.h). Every other case (InterleavedShard,
// non-contiguous global layouts, the *_like draws, draws that read data) draws the whole
// tensor and keeps the block.
//
//   in-place fills (normal_, uniform_, bernoulli_, ...)   self keeps its layout (a
//        Partial one is filled as Replicate and written back); tensor parameters
//        (bernoulli_'s p) are replicated
//   *_like draws (rand_like, randn_like, randint_like, bernoulli.p, out-of-place fills)
//        the result takes the input's layout; the input's values are never read, so
//        nothing moves
//   draws that read data (bernoulli(p), multinomial, normal(mean, std), poisson, ...)
//        inputs replicated; a result of the first input's shape takes its layout
//   native_dropout  linear in its input: input and result keep any layout; the mask
//        takes the input's layout (a Partial one read as Replicate)

#include "collectives/collectives.h"
#include "sharding_rules/random_local.h"
#include "sharding_rules/rule.h"
#ifdef VESCALE_CUDA
#include "sharding_rules/random_local_cuda.h"
#endif

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/DistributionsHelper.h>

namespace vescale {

namespace {

Placements no_partial(PlacementsRef p) {
  Placements out(p.begin(), p.end());
  for (auto& x : out)
    if (x.is_partial()) x = Placement::replicate();
  return out;
}

Placements replicated(const OpCall& call) {
  return Placements(static_cast<size_t>(call.mesh.ndim()), Placement::replicate());
}

// This rank's block of a whole tensor, laid out densely.
at::Tensor block_of(const at::Tensor& whole, const TensorSpec& spec) {
  const bool interleaved = std::any_of(spec.placements.begin(), spec.placements.end(),
                                       [](const Placement& p) { return p.is_interleaved(); });
  if (interleaved) {  // pieces, not a block: cut the way distributing a tensor does (no communication)
    const Placements whole_layout(spec.placements.size(), Placement::replicate());
    const auto plan = collectives::plan_redistribution(*spec.mesh, whole_layout, spec.placements, spec.shape, spec.dtype);
    return collectives::execute_redistribution(plan, *spec.mesh, spec.shape, spec.stride, whole).contiguous();
  }
  at::Tensor b = whole;
  for (size_t d = 0; d < spec.local.sizes.size(); ++d)
    b = b.narrow(static_cast<int64_t>(d), spec.local.offsets[d], spec.local.sizes[d]);
  return b.contiguous();
}

at::Tensor whole_stand_in(const TensorSpec& spec, const c10::Device& device) {
  return at::empty_strided(spec.shape, spec.stride, at::TensorOptions().dtype(spec.dtype).device(device));
}

// Runs the op with every input that is not replicated replaced by an uninitialised
// tensor of its global shape (its values are never read), then keeps this rank's
// block of each result, or of the written self for in-place fills.
void draw_whole_keep_block(const c10::OperatorHandle& op, torch::jit::Stack* stack, const LocalContext& ctx) {
  const auto& schema = op.schema();
  const size_t n_args = schema.arguments().size();
  const size_t base = stack->size() - n_args;
  at::Tensor written;  // in-place: the local shard to fill
  size_t slot = 0;     // flattened tensor slot (these ops take no tensor lists)
  for (size_t a = 0; a < n_args; ++a) {
    auto& v = (*stack)[base + a];
    if (!is_tensor_argument(schema.arguments()[a])) continue;
    const auto& spec_ptr = ctx.inputs[slot++];
    if (!spec_ptr) continue;
    const auto& spec = *spec_ptr;
    const bool is_written = schema.arguments()[a].alias_info() && schema.arguments()[a].alias_info()->isWrite();
    if (is_written) written = v.toTensor();
    if (!spec.is_replicated() || is_written) v = whole_stand_in(spec, v.toTensor().device());
  }
  op.callBoxed(stack);
  const size_t n_ret = schema.returns().size();
  for (size_t r = 0; r < n_ret; ++r) {
    auto& v = (*stack)[stack->size() - n_ret + r];
    if (!v.isTensor()) continue;
    if (written.defined()) {
      written.copy_(block_of(v.toTensor(), *ctx.inputs[0]));
      v = written;
    } else {
      v = block_of(v.toTensor(), *ctx.outputs[r]);
    }
  }
}

bool is_interleaved(const TensorSpec& spec) {
  return std::any_of(spec.placements.begin(), spec.placements.end(),
                     [](const Placement& p) { return p.is_interleaved(); });
}

// Whether this rank's block of `spec` is a box of a dense row-major whole tensor (not
// interleaved pieces): what the box drawers take.
bool block_layout(const TensorSpec& spec) {
  return !is_interleaved(spec) && spec.stride == dense_strides(spec.shape);
}

bool block_drawable(const TensorSpec& spec, const at::Tensor& local) {
  return local.device().is_cpu() && block_layout(spec);
}

// The CPU generator an op's optional generator argument names (null: not a CPU one).
at::CPUGeneratorImpl* cpu_generator(const c10::IValue& g) {
  if (g.isNone()) return at::check_generator<at::CPUGeneratorImpl>(at::detail::getDefaultCPUGenerator());
  const auto gen = g.toGenerator();
  if (gen.device().type() != c10::DeviceType::CPU) return nullptr;
  return at::check_generator<at::CPUGeneratorImpl>(gen);
}

// Runs torch's own argument checks of a fill before a box draw moves the generator (a
// refused fill must leave every rank's generator where it was): the fill on an empty
// tensor checks its arguments and draws nothing.
void check_fill_arguments(const c10::OperatorHandle& op, const torch::jit::Stack& stack, size_t base) {
  torch::jit::Stack check(stack.begin() + static_cast<std::ptrdiff_t>(base), stack.end());
  check[0] = at::empty({0}, check[0].toTensor().options());
  op.callBoxed(&check);
}

// Writes this rank's block of the stack's in-place fill into self through `draw`, which
// fills a contiguous tensor of the block's sizes (self, or a buffer then copied into
// self) and returns false, having drawn nothing, where it cannot.
template <typename Draw>
bool fill_block(torch::jit::Stack* stack, size_t n_args, const TensorSpec& spec, Draw&& draw) {
  const at::Tensor self = (*stack)[stack->size() - n_args].toTensor();
  at::Tensor out = self.is_contiguous() ? self
                                        : at::empty(spec.local.sizes, self.options().memory_format(at::MemoryFormat::Contiguous));
  if (!draw(out)) return false;
  if (!out.is_same(self)) self.copy_(out);
  torch::jit::drop(*stack, n_args);
  torch::jit::push(*stack, self);
  return true;
}

#ifdef VESCALE_CUDA
// CUDA fills: the block alone where rng::cuda handles the fill and the layout.
bool fill_cuda_block(const c10::OperatorHandle& op, torch::jit::Stack* stack, const TensorSpec& spec,
                     const std::string& name) {
  const auto& schema = op.schema();
  const size_t n_args = schema.arguments().size();
  const size_t base = stack->size() - n_args;
  const auto g_index = schema.argumentIndexWithName("generator");
  if (!g_index || !rng::cuda::handles(name, spec.dtype) || !block_layout(spec)) return false;
  std::optional<at::Generator> gen;
  if (!(*stack)[base + *g_index].isNone()) gen = (*stack)[base + *g_index].toGenerator();
  if (gen && gen->device().type() != c10::DeviceType::CUDA) return false;
  check_fill_arguments(op, *stack, base);
  // every handled fill takes one or two floats after self
  const auto& second = (*stack)[base + 2];
  const rng::cuda::Fill fill{name, (*stack)[base + 1].toDouble(), second.isDouble() ? second.toDouble() : 0.};
  return fill_block(stack, n_args, spec, [&](at::Tensor& out) {
    return rng::cuda::draw_box(fill, gen, spec.shape, spec.local.offsets, spec.local.sizes, out);
  });
}
#endif

// In-place fills: this rank's block alone where the fill's use of the generator is
// known, else the whole tensor.
void fill_local_or_whole(const c10::OperatorHandle& op, torch::jit::Stack* stack, const LocalContext& ctx) {
  const auto& schema = op.schema();
  const size_t n_args = schema.arguments().size();
  const size_t base = stack->size() - n_args;
  const at::Tensor self = (*stack)[base].toTensor();
  const auto& spec = *ctx.inputs[0];
  std::string name = schema.name().substr(6);  // past "aten::"
  if (!schema.overload_name().empty()) name += "." + schema.overload_name();
#ifdef VESCALE_CUDA
  if (self.is_cuda()) {
    if (!fill_cuda_block(op, stack, spec, name)) draw_whole_keep_block(op, stack, ctx);
    return;
  }
#endif
  int64_t range = -1;
  if (name == "random_.to") range = (*stack)[base + 1].toInt();
  if (name == "random_.from" && !(*stack)[base + 2].isNone())
    range = (*stack)[base + 2].toInt() - (*stack)[base + 1].toInt();
  const auto model = rng::model_for(name, spec.dtype, spec.numel(), range);
  at::CPUGeneratorImpl* gen = nullptr;
  const auto g_index = schema.argumentIndexWithName("generator");
  if (model.ok() && g_index && block_drawable(spec, self)) gen = cpu_generator((*stack)[base + *g_index]);
  if (!gen) return draw_whole_keep_block(op, stack, ctx);
  check_fill_arguments(op, *stack, base);
  const torch::jit::Stack args(stack->begin() + static_cast<std::ptrdiff_t>(base), stack->end());
  fill_block(stack, n_args, spec, [&](at::Tensor& out) {
    rng::draw_box(gen, model, spec.shape, spec.local.offsets, spec.local.sizes,
                  [&](at::Tensor& buf) {
                    torch::jit::Stack s = args;
                    s[0] = buf;
                    op.callBoxed(&s);
                  },
                  out);
    return true;
  });
}

ShardingChoice with_draw(ShardingChoice c) {
  c.local_fn = draw_whole_keep_block;
  return c;
}

// In-place fills: self keeps its layout (Partial read as Replicate and written back),
// tensor parameters replicated.
ShardingChoice fill_rule(const OpCall& call) {
  ShardingChoice c;
  c.inputs.push_back(no_partial(call.inputs[0].placements));
  for (size_t i = 1; i < call.inputs.size(); ++i) c.inputs.push_back(replicated(call));
  c.outputs.assign(call.outputs.size(), c.inputs[0]);
  c.local_fn = fill_local_or_whole;
  return c;
}

// Draws shaped like the input: the input stays where it is.
ShardingChoice like_rule(const OpCall& call) {
  ShardingChoice c;
  for (const auto& in : call.inputs) c.inputs.push_back(in.placements);
  c.outputs.assign(call.outputs.size(), no_partial(call.inputs[0].placements));
  return with_draw(std::move(c));
}

// Draws that read their inputs' values: inputs replicated.
ShardingChoice data_rule(const OpCall& call) {
  ShardingChoice c;
  c.inputs.assign(call.inputs.size(), replicated(call));
  for (const auto& out : call.outputs)
    c.outputs.push_back(out.shape == call.inputs[0].shape ? no_partial(call.inputs[0].placements) : replicated(call));
  return with_draw(std::move(c));
}

// input * mask * scale, scale = 1 / (1 - p), computed as native_dropout's kernel does:
// on the CPU input.mul(mask).mul_(scale), where the scale is a Scalar (bfloat16 and
// half round it to their own precision first); on CUDA in the accumulation type (float
// below double), from 1 - p rounded to it, and rounded to the dtype once at the end.
at::Tensor dropped(const at::Tensor& input, const at::Tensor& mask, double p) {
  const double keep = 1. - p;
  if (!input.is_cuda()) return input.mul(mask).mul_(keep == 0 ? 0. : 1. / keep);
  if (keep == 0) return at::zeros_like(input);  // native_dropout_cuda's shortcut
  const double scale = input.scalar_type() == at::kDouble ? 1. / keep
                                                           : static_cast<float>(1.0 / static_cast<float>(keep));
  at::Tensor factor = at::scalar_tensor(scale, at::TensorOptions().dtype(at::kDouble));
  factor.unsafeGetTensorImpl()->set_wrapped_number(true);  // computed in the accumulation type
  return input.mul(mask).mul_(factor);
}

// native_dropout(input, p, train) -> (output, mask): the output is linear in the input,
// so input and output keep any layout, and this rank's output is its input block
// scaled by its block of the mask, as the op computes it (input * mask * scale).
// In training, the mask's block alone is drawn where the layout allows: on the CPU
// native_dropout's own mask, bernoulli_(1 - p) on a bool tensor, through the
// Mersenne Twister's jump; on CUDA the fused kernel's, through Philox. Otherwise the op
// runs on a whole tensor of ones in the input's global layout (fresh, as a whole input
// would be: CUDA's kernel picks its vector width from the input's alignment and
// layout) and this rank keeps its block of the mask.
void dropout_locally(const c10::OperatorHandle& op, torch::jit::Stack* stack, const LocalContext& ctx) {
  const size_t base = stack->size() - 3;
  const at::Tensor input = (*stack)[base].toTensor();
  const auto& in_spec = *ctx.inputs[0];
  const auto& mask_spec = *ctx.outputs[1];
  const double p = (*stack)[base + 1].toDouble();
  const auto& train = (*stack)[base + 2];
  const bool training = train.isNone() || train.toBool();
  // on the CPU a p outside [0, 1] goes to the whole op, which refuses it before anything
  // is drawn (CUDA's kernel takes any p, and so does its block draw)
  const bool valid = p >= 0 && p <= 1;
  if (training && valid && in_spec.numel() > 0 && block_drawable(mask_spec, input) &&
      rng::model_for("bernoulli_.float", at::kBool, mask_spec.numel()).ok()) {
    at::Tensor mask = at::empty(mask_spec.local.sizes, input.options().dtype(at::kBool));
    rng::draw_box(cpu_generator(c10::IValue()), rng::model_for("bernoulli_.float", at::kBool, mask_spec.numel()),
                  mask_spec.shape, mask_spec.local.offsets, mask_spec.local.sizes,
                  [p](at::Tensor& buf) { buf.bernoulli_(1. - p); }, mask);
    at::Tensor output = dropped(input, mask, p);
    torch::jit::drop(*stack, 3);
    torch::jit::push(*stack, output, mask);
    return;
  }
#ifdef VESCALE_CUDA
  at::Tensor output, mask;
  if (training && input.is_cuda() && block_layout(mask_spec) &&
      rng::cuda::dropout_box(input.contiguous(), p, mask_spec.shape, mask_spec.local.offsets, mask_spec.local.sizes,
                             output, mask)) {
    torch::jit::drop(*stack, 3);
    torch::jit::push(*stack, output, mask);
    return;
  }
#endif
  (*stack)[base] = whole_stand_in(in_spec, input.device()).fill_(1);
  op.callBoxed(stack);
  const auto whole_mask = block_of((*stack)[stack->size() - 1].toTensor(), *ctx.outputs[1]);
  torch::jit::drop(*stack, 2);
  // out of training, the op hands its input back (and a mask of ones)
  torch::jit::push(*stack, training ? dropped(input, whole_mask, p) : input.clone(), whole_mask);
}

ShardingChoice dropout_rule(const OpCall& call) {
  ShardingChoice c;
  const auto& in = call.inputs[0].placements;
  c.inputs.push_back(in);
  c.outputs = {in, no_partial(in)};
  c.local_fn = dropout_locally;
  return c;
}

// An in-place fill's result is self. Used when the fill's meta kernel refuses its
// arguments (normal_ with std < 0): the fill still reaches its local function, where
// torch's own check raises on every rank, instead of the replicate fallback gathering
// self first (and reporting the fill as an op without a meta kernel).
std::vector<TensorArg> fill_result(const OpCall& call) {
  TensorArg out = call.inputs[0];
  out.is_dtensor = false;
  out.written = false;
  out.placements.clear();
  return {out};
}

}  // namespace

VESCALE_RULES(random) {
  for (const char* base : {"aten::normal_", "aten::uniform_", "aten::exponential_", "aten::cauchy_",
                           "aten::log_normal_", "aten::geometric_", "aten::random_", "aten::bernoulli_"})
    rules.add_overloads(base, fill_rule);
  for (const char* op : {"aten::normal_", "aten::uniform_", "aten::exponential_", "aten::cauchy_", "aten::log_normal_",
                         "aten::geometric_", "aten::random_", "aten::random_.from", "aten::random_.to",
                         "aten::bernoulli_.float", "aten::bernoulli_.Tensor"})
    rules.add_shape_fn(op, fill_result);
  for (const char* op : {"aten::rand_like", "aten::rand_like.generator", "aten::randn_like",
                         "aten::randn_like.generator", "aten::randint_like", "aten::randint_like.low_dtype",
                         "aten::randint_like.generator", "aten::randint_like.low_generator_dtype",
                         "aten::bernoulli.p", "aten::normal_functional", "aten::uniform", "aten::exponential",
                         "aten::cauchy", "aten::log_normal", "aten::geometric", "aten::random", "aten::random.from",
                         "aten::random.to"})
    rules.add(op, like_rule);
  for (const char* op : {"aten::bernoulli", "aten::multinomial", "aten::normal.Tensor_Tensor",
                         "aten::normal.Tensor_float", "aten::normal.float_Tensor", "aten::poisson",
                         "aten::_standard_gamma", "aten::binomial", "aten::randint_like.Tensor",
                         "aten::randint_like.Tensor_generator"})
    rules.add(op, data_rule);
  rules.add("aten::native_dropout", dropout_rule);
}

}  // namespace vescale
