#include "dispatch/api.h"

#include "collectives/collectives.h"
#include "collectives/trace.h"
#include "dispatch/dtensor_impl.h"
#include "dispatch/reduce_once.h"
#include "dispatch/view_copies.h"

#include <ATen/ATen.h>
#include <c10/core/Contiguity.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace vescale {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Carries a spec through AutogradContext::saved_data, which holds IValues.
struct SpecHolder : torch::CustomClassHolder {
  explicit SpecHolder(SpecPtr s) : spec(std::move(s)) {}
  SpecPtr spec;
};

c10::IValue capsule(SpecPtr spec) {
  return c10::IValue::make_capsule(c10::make_intrusive<SpecHolder>(std::move(spec)));
}

SpecPtr from_capsule(const c10::IValue& v) {
  return c10::static_intrusive_pointer_cast<SpecHolder>(v.toCapsule())->spec;
}

// Gradients flowing back to a layout that held a Partial go back replicated: the
// derivative of a sum with respect to each of its terms is the whole gradient.
Placements partial_as_replicate(PlacementsRef placements) {
  Placements out(placements.begin(), placements.end());
  for (auto& p : out)
    if (p.is_partial()) p = Placement::replicate();
  return out;
}

// Under create_graph (a double backward: a gradient penalty), backward runs with grad
// mode on and what it returns must be differentiable too: then gradients move through
// the recorded API (from_local, to_local, redistribute), not around autograd, or the
// second derivative silently misses every term that passes through them.
bool records_graph(const at::Tensor& g) {
  return at::GradMode::is_enabled() && g.requires_grad();
}

// A gradient that a backward formula built with a factory (zeros(...) then a scatter)
// is a plain, whole tensor: the replicated value on `mesh`.
at::Tensor as_dtensor_gradient(const at::Tensor& g, const MeshPtr& mesh) {
  if (is_dtensor(g)) return g;
  const Placements replicated(static_cast<size_t>(mesh->ndim()), Placement::replicate());
  auto spec = make_spec(mesh, replicated, g.sizes(), g.strides(), g.scalar_type());
  return records_graph(g) ? from_local(g, std::move(spec)) : make_dtensor(g, std::move(spec));
}

// `g` in `placements`, through autograd when a double backward needs it.
at::Tensor moved_gradient(const at::Tensor& g, PlacementsRef placements) {
  return records_graph(g) ? redistribute(g, placements) : redistribute_no_grad(g, placements);
}

// The gradient of a plain tensor that met DTensors later (they take a plain tensor as
// a replicated value: `p.full_tensor().pow(2).sum()` added to a DTensor loss) arrives
// as a DTensor: the plain tensor's gradient is its whole value.
at::Tensor plain_gradient(const at::Tensor& g) {
  if (!is_dtensor(g)) return g;
  const Placements replicated(dtensor_impl(g)->spec()->placements.size(), Placement::replicate());
  auto whole = moved_gradient(g, replicated);
  return records_graph(whole) ? to_local(whole, std::nullopt) : dtensor_impl(whole)->local();
}

struct FromLocal : torch::autograd::Function<FromLocal> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& local, const c10::IValue& spec) {
    ctx->saved_data["spec"] = spec;
    return make_dtensor(local.detach(), from_capsule(spec));
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto spec = from_capsule(ctx->saved_data["spec"]);
    const auto& g = grads[0];
    if (!g.defined()) return {at::Tensor(), at::Tensor()};
    auto moved = moved_gradient(as_dtensor_gradient(g, spec->mesh), partial_as_replicate(spec->placements));
    if (records_graph(moved)) return {to_local(moved, std::nullopt), at::Tensor()};
    return {dtensor_impl(moved)->local(), at::Tensor()};
  }
};

struct ToLocal : torch::autograd::Function<ToLocal> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& dtensor, const c10::IValue& grad_spec) {
    ctx->saved_data["grad_spec"] = grad_spec;
    return dtensor_impl(dtensor)->local().detach();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto spec = from_capsule(ctx->saved_data["grad_spec"]);
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    const auto g = plain_gradient(grads[0]);
    if (records_graph(g)) return {from_local(g, spec), at::Tensor()};
    return {make_dtensor(collectives::with_layout_of(g, spec->stride), spec), at::Tensor()};
  }
};

struct Redistribute : torch::autograd::Function<Redistribute> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& dtensor, const c10::IValue& target, bool async_op) {
    ctx->saved_data["source"] = capsule(dtensor_impl(dtensor)->spec());
    return redistribute_no_grad(dtensor, from_capsule(target)->placements, async_op);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto source = from_capsule(ctx->saved_data["source"]);
    const auto& g = grads[0];
    if (!g.defined()) return {at::Tensor(), at::Tensor()};
    return {moved_gradient(as_dtensor_gradient(g, source->mesh), partial_as_replicate(source->placements)),
            at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool shard_steps_may_differ(c10::IntArrayRef shape, PlacementsRef placements, c10::ArrayRef<int64_t> mesh_shape) {
  // the mesh's first coordinate holds the largest shard of every dim and the last the smallest
  std::vector<int64_t> first(mesh_shape.size(), 0), last(mesh_shape.size());
  for (size_t m = 0; m < mesh_shape.size(); ++m) last[m] = mesh_shape[m] - 1;
  const auto largest = local_box(shape, placements, mesh_shape, first).sizes;
  const auto smallest = local_box(shape, placements, mesh_shape, last).sizes;
  for (size_t d = 0; d < largest.size(); ++d)
    if (smallest[d] <= 1 && largest[d] > 1) return true;
  return false;
}

at::Tensor from_local(const at::Tensor& local, SpecPtr spec) {
  TORCH_CHECK_TYPE(!is_dtensor(local), "from_local expects a plain local tensor, got a DTensor");
  TORCH_CHECK_VALUE(local.sizes() == c10::IntArrayRef(spec->local.sizes),
                    "from_local: this rank's local tensor has shape ", local.sizes(), ", but ",
                    spec->str(), " on ", spec->mesh->str(), " gives this rank a shard of shape ",
                    c10::IntArrayRef(spec->local.sizes),
                    "; pass the global `shape` (and `stride`) that the shards come from");
  // The DTensor wraps the user's tensor itself (writes to either show in the other, as
  // with torch's from_local) unless its dim order is not the global one: then a copy in
  // the global order, which memory-order ops (dropout's draws) need to match one device.
  // Every rank must answer alike (a write into the DTensor would reach the user's tensor
  // on some ranks only), and so must taking over a view-copy's record (its write-back is
  // collective): the ranks agree where their answers can differ.
  bool wrap = collectives::keeps_order_of(local, spec->stride);
  auto record = copy_record_of(local, *spec->mesh);
  if (record || shard_steps_may_differ(spec->shape, spec->placements, spec->mesh->shape)) {
    const auto agreed = collectives::all_ranks(*spec->mesh, {wrap, record && *record});
    wrap = agreed[0];
    if (!(wrap && agreed[1])) record.reset();
  }
  auto laid_out = wrap ? local : collectives::with_layout_of(local, spec->stride);
  if (!wrap && laid_out.is_same(local)) laid_out = local.clone();  // another rank cannot wrap: none does
  auto out = FromLocal::apply(laid_out, capsule(std::move(spec)));
  if (record) dtensor_impl(out)->copy_of = std::move(*record);
  return out;
}

at::Tensor to_local(const at::Tensor& dtensor, std::optional<Placements> grad_placements) {
  auto* impl = checked_dtensor_impl(dtensor, "to_local");
  // By default the local gradient is the gradient of the global value: replicated where
  // the tensor was Partial (each addend's gradient is the whole gradient).
  auto grad_spec = with_placements(impl->spec(), grad_placements ? *grad_placements
                                                                 : partial_as_replicate(impl->spec()->placements));
  return ToLocal::apply(dtensor, capsule(std::move(grad_spec)));
}

namespace {

// A redistributed tensor is a new tensor, laid out as clone() lays out its source: with
// the source's strides where they are dense, and torch's choice where elements share
// memory (an expanded source, whose shards arrive dense) or leave gaps (a slice).
SpecPtr as_clone(const SpecPtr& spec) {
  if (c10::_compute_non_overlapping_and_dense<int64_t>(spec->shape, spec->stride)) return spec;
  const auto meta = at::empty_strided(spec->shape, spec->stride, at::TensorOptions().dtype(spec->dtype).device(c10::kMeta));
  return make_spec(spec->mesh, spec->placements, spec->shape, at::empty_like(meta).strides(), spec->dtype);
}

}  // namespace

at::Tensor redistribute_no_grad(const at::Tensor& dtensor, PlacementsRef placements, bool async_op) {
  auto* impl = checked_dtensor_impl(dtensor, "redistribute");
  static const std::string kName = "redistribute";
  const collectives::trace::ApiContext context(kName);
  const auto& src = impl->spec();
  auto dst = with_placements(as_clone(src), placements);
  const auto plan = collectives::plan_redistribution(*src, dst->placements);
  // A Partial value with a kept reduction is served from it (data movement only), at once.
  if (async_op && !plan.empty() && !impl->kept_for_spec()) {
    // The collective reads its input while the caller goes on, and the caller may write
    // into the source meanwhile (an optimizer step, any in-place op): it reads a snapshot
    // of the shard, so the result is the source's value at this call (a shard's copy).
    // A reduction begun here is not kept: a later consumer reduces again.
    auto pending = collectives::start_redistribution(plan, *src->mesh, src->shape, src->stride,
                                                     impl->local().clone());
    return make_pending_dtensor(std::move(pending), std::move(dst), impl->device());
  }
  // Through the kept reduction of a Partial value, as the ops' inputs are: every consumer
  // of one Partial value sees the same bits (dispatch/reduce_once.h). The result is the
  // caller's: `written_or_aliased`.
  auto local = plan.empty() ? impl->local().clone()
                            : laid_out_as(*impl, plan, with_placements(src, placements), /*written_or_aliased=*/true);
  if (dst->stride != src->stride) local = collectives::with_layout_of(local, dst->stride);
  return make_dtensor(std::move(local), std::move(dst));
}

at::Tensor redistribute(const at::Tensor& dtensor, PlacementsRef placements, bool async_op) {
  auto* impl = checked_dtensor_impl(dtensor, "redistribute");
  auto dst = with_placements(impl->spec(), placements);
  if (dst == impl->spec()) return dtensor;
  return Redistribute::apply(dtensor, capsule(std::move(dst)), async_op);
}

namespace {
// Where the leaf is replicated and the gradient is a Partial sum, the gradient stays
// Partial: its reduction is bucketed with others' after the gradient is accumulated.
void keep_partial_sums(Placements& want, PlacementsRef grad) {
  for (size_t m = 0; m < want.size(); ++m)
    if (want[m].is_replicate() && grad[m].is_partial(ReduceOp::Sum)) want[m] = grad[m];
}

// The gradient in the leaf's own placements, or undefined when it already is.
at::Tensor aligned_grad(const c10::weak_intrusive_ptr<c10::TensorImpl>& weak, const at::Tensor& grad) {
  auto strong = weak.lock();
  if (!strong || !grad.defined()) return {};
  // The leaf's placements are read when the gradient arrives (`.data =` may have changed them).
  const auto* leaf_impl = static_cast<DTensorImpl*>(strong.get());
  const auto& spec = leaf_impl->spec();
  auto want = partial_as_replicate(spec->placements);
  if (leaf_impl->defer_partial_grads && is_dtensor(grad)) keep_partial_sums(want, dtensor_impl(grad)->spec()->placements);
  // Backward formulas that build their result with a factory (zeros(...).scatter_)
  // hand back a plain, whole gradient: it is the replicated value.
  if (is_dtensor(grad) && PlacementsRef(dtensor_impl(grad)->spec()->placements) == PlacementsRef(want)) return {};
  return moved_gradient(as_dtensor_gradient(grad, spec->mesh), want);
}

// Runs first among the leaf's tensor hooks, so the user's hooks see the aligned gradient
// too. It goes into the hook list directly, beside the one entry that Python's
// `register_hook` (a dict) or C++'s (a list) keeps there: registering through either
// API would replace the other's entry (torch: "using both is not defined behavior"), and
// did, silently dropping the user's Python hooks. A weak reference keeps the hook from
// holding the leaf alive.
struct AlignGradPlacements final : torch::autograd::FunctionPreHook {
  explicit AlignGradPlacements(c10::weak_intrusive_ptr<c10::TensorImpl> leaf) : leaf_(std::move(leaf)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    auto out = grads;
    if (!out.empty())
      if (auto g = aligned_grad(leaf_, out[0]); g.defined()) out[0] = std::move(g);
    return out;
  }

 private:
  c10::weak_intrusive_ptr<c10::TensorImpl> leaf_;
};

}  // namespace

void align_grad_placements(const at::Tensor& leaf) {
  checked_dtensor_impl(leaf, "align_grad_placements");
  // Only this function inserts at the front, and torch only appends after clearing the
  // list (the first Python or C++ `register_hook` on the leaf): when the front entry is
  // not ours, ours is gone and goes back in.
  auto& hooks = torch::autograd::impl::hooks(leaf);
  if (!hooks.empty() && dynamic_cast<const AlignGradPlacements*>(hooks.front().get()) != nullptr) return;
  hooks.insert(hooks.begin(), std::make_unique<AlignGradPlacements>(c10::weak_intrusive_ptr<c10::TensorImpl>(leaf.getIntrusivePtr())));
}

void defer_partial_grads(const at::Tensor& param) {
  checked_dtensor_impl(param, "defer_partial_grads")->defer_partial_grads = true;
}

void relabel(const at::Tensor& dtensor, PlacementsRef placements) {
  auto* impl = checked_dtensor_impl(dtensor, "relabel");
  auto dst = with_placements(impl->spec(), placements);
  TORCH_CHECK_VALUE(dst->local.sizes == impl->spec()->local.sizes, "relabel: ", dst->str(),
                    " has another local shape than ", impl->spec()->str(), "; only Partial <-> Replicate can be relabelled");
  impl->drop_reduced();
  impl->relayout(impl->local(), std::move(dst));
}

namespace {

// The mesh coordinate of the mesh's `rank`-th rank (row-major).
std::vector<int64_t> coordinate_of(const Mesh& mesh, int64_t rank) {
  std::vector<int64_t> coord(mesh.shape.size());
  for (size_t m = mesh.shape.size(); m-- > 0;) {
    coord[m] = rank % mesh.shape[m];
    rank /= mesh.shape[m];
  }
  return coord;
}

// `x` as the rank at `src` holds it, on every rank: broadcast along each mesh dim in
// turn, from the source's index on that dim. After dims 0..m, every rank whose
// coordinates past m equal the source's holds the source's data; after the last dim,
// every rank does.
at::Tensor broadcast_from(at::Tensor x, const Mesh& mesh, const std::vector<int64_t>& src) {
  for (size_t m = 0; m < mesh.shape.size(); ++m)
    if (mesh.shape[m] > 1) x = collectives::broadcast(x, src[m], mesh, static_cast<int32_t>(m));
  return x;
}

}  // namespace

std::vector<int64_t> strides_of_mesh_rank(c10::IntArrayRef strides, const Mesh& mesh, int64_t src_rank) {
  auto sent = at::tensor(strides.vec(), at::kLong).to(at::Device(mesh.device_type));
  auto got = broadcast_from(sent, mesh, coordinate_of(mesh, src_rank)).cpu();
  return {got.data_ptr<int64_t>(), got.data_ptr<int64_t>() + got.numel()};
}

at::Tensor distribute_tensor(const at::Tensor& full, MeshPtr mesh, PlacementsRef placements,
                             std::optional<int64_t> src_rank) {
  TORCH_CHECK_TYPE(!is_dtensor(full), "distribute_tensor expects a plain tensor, got a DTensor; "
                   "use .redistribute() to change its placements");
  TORCH_CHECK_VALUE(full.device().type() == mesh->device_type, "distribute_tensor: the tensor is on ",
                    full.device(), " but the mesh is a ", c10::DeviceTypeName(mesh->device_type, true),
                    " mesh; move the tensor to that device first");
  at::NoGradGuard no_grad;
  static const std::string kName = "distribute_tensor";
  const collectives::trace::ApiContext context(kName);
  const auto shape = full.sizes();
  at::Tensor data = full.detach();
  std::vector<int64_t> layout = full.strides().vec();
  if (src_rank) {
    TORCH_CHECK_VALUE(*src_rank >= 0 && *src_rank < mesh->numel(), "distribute_tensor: src_data_rank ",
                      *src_rank, " is outside ", mesh->str(), " (it counts the mesh's own ranks, 0..",
                      mesh->numel() - 1, ")");
    // The source's layout too: the others' tensors only receive its values (often a
    // torch.empty placeholder beside rank 0's loaded, maybe transposed, weight), and the
    // global strides, which steer later ops, must be the same on every rank.
    layout = strides_of_mesh_rank(layout, *mesh, *src_rank);
    data = broadcast_from(data, *mesh, coordinate_of(*mesh, *src_rank));
  }
  auto spec = make_spec(mesh, placements, shape, strides_like(shape, layout), full.scalar_type());
  const Placements replicated(placements.size(), Placement::replicate());
  auto full_spec = with_placements(spec, replicated);
  const auto plan = collectives::plan_redistribution(*full_spec, spec->placements);
  auto local = collectives::execute_redistribution(plan, *mesh, spec->shape, spec->stride, data);
  if (local.unsafeGetTensorImpl() == full.unsafeGetTensorImpl() || local.is_alias_of(full))
    local = local.clone();
  local = collectives::with_layout_of(local, spec->stride);
  auto out = make_dtensor(std::move(local), std::move(spec));
  if (full.requires_grad()) {
    out.set_requires_grad(true);
    align_grad_placements(out);
  }
  return out;
}

}  // namespace vescale
