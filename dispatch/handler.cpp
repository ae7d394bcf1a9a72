#include "dispatch/handler.h"

#include "collectives/collectives.h"
#include "dispatch/api.h"
#include "dispatch/call_scan.h"
#include "dispatch/dtensor_impl.h"
#include "dispatch/observe.h"
#include "dispatch/propagation.h"
#include "dispatch/reduce_once.h"
#include "dispatch/view_copies.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <memory>
#include <mutex>

namespace vescale {

namespace {

// The local shard of a result must be exactly the block its spec assigns to this
// rank; a mismatch means a rule is wrong, and a wrong spec would give wrong answers
// later, so it stops here. The dtype is the kernel's: a few meta kernels disagree with
// the CPU ones (layer norm's statistics in bf16), and the data is what it is.
SpecPtr checked_spec(const OpInfo& info, const SpecPtr& spec, const at::Tensor& local) {
  TORCH_CHECK(local.sizes() == c10::IntArrayRef(spec->local.sizes), "vescale internal error in the sharding rule of ",
              info.name, ": the local result has shape ", local.sizes(), " but ", spec->str(),
              " assigns this rank shape ", c10::IntArrayRef(spec->local.sizes),
              ". Please report it with the op's arguments.");
  if (C10_LIKELY(local.scalar_type() == spec->dtype)) return spec;
  return make_spec(spec->mesh, spec->placements, spec->shape, spec->stride, local.scalar_type(), spec->storage_offset);
}

// No other tensor shares this shard's storage (saved-for-backward shallow copies share
// the shard object itself, which is fine: they only read).
bool exclusively_owned(const at::Tensor& local) {
  return local.has_storage() && local.storage().use_count() == 1;
}

// A view's shard counts writes with its base's, as a torch view does: the local view op
// ran below autograd's view tracking, which gave it a counter of its own, and then a
// write through the view's to_local() left what the base derived from its old values
// (a kept reduction) looking current.
void share_version_counter(const at::Tensor& view_local, const at::Tensor& base_local) {
  if (view_local.is_inference() || base_local.is_inference() || !view_local.is_alias_of(base_local)) return;
  view_local.unsafeGetTensorImpl()->set_version_counter(base_local.unsafeGetTensorImpl()->version_counter());
}

// A view that is the whole base under another name (detach, alias, view_as of its own
// shape): the same spec (global shape, strides and offset: the same elements) over the
// same shard. Decided from global facts only, as every rank must decide alike: whether
// the view shares the base's kept reduction steers later collectives. The shards' own
// strides may differ between ranks where a shard has a dim of one element (a view op
// may give such a dim any stride), and comparing them once let some ranks share and
// others not: a hang in the next reduction (fuzzer seed 84000575).
bool is_alias(const DTensorImpl& view, const DTensorImpl& base) {
  return view.spec() == base.spec() && view.local().is_alias_of(base.local());
}

size_t tensor_count(const c10::IValue& v, ReturnKind kind) {
  if (kind == ReturnKind::Tensor) return 1;
  if (kind == ReturnKind::TensorList) return v.toListRef().size();
  return 0;
}

}  // namespace

namespace {

// A composition's DTensor results laid out with the strides the op itself gives them
// (see Decision::result_strides); a copy only where the composed ops left another layout.
void adopt_result_strides(torch::jit::Stack& stack, const OpInfo& info, const std::vector<Shape>& strides) {
  size_t j = 0;
  map_results(stack, stack.size() - info.num_returns, info, [&](const at::Tensor& t, int) -> at::Tensor {
    const size_t k = j++;
    if (!t.defined() || !is_dtensor(t) || k >= strides.size() || strides[k].empty()) return t;
    const auto& spec = dtensor_impl(t)->spec();
    if (spec->stride == strides[k] || spec->shape.size() != strides[k].size()) return t;
    return make_dtensor(collectives::with_layout_of(dtensor_impl(t)->local(), strides[k]),
                        make_spec(spec->mesh, spec->placements, spec->shape, strides[k], spec->dtype));
  });
}

void run_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const OpInfo& info = op_info(op);
  const size_t base = stack->size() - info.num_args;
  const c10::ArrayRef<c10::IValue> args(stack->data() + base, info.num_args);

  CallScan scan;
  scan.run(op, info, args);
  const Decision& d = lookup_decision(op, info, args, scan);
  if (d.decompose) {
    d.decompose(op, stack);
    adopt_result_strides(*stack, info, d.result_strides);
    return;
  }
  if (d.fallback_counter) d.fallback_counter->fetch_add(1, std::memory_order_relaxed);

  // Arguments the op writes and hands back: the caller gets its own tensors back.
  c10::SmallVector<std::pair<size_t, c10::IValue>, 2> written;
  if (info.writes_any)
    for (size_t a = 0; a < info.num_args; ++a)
      if (info.arg_written[a]) written.emplace_back(a, args[a]);

  // Unwrap, moving each input to the layout the local op needs.
  const size_t n = scan.tensors.size();
  c10::SmallVector<at::Tensor, 6> locals(n);
  bool view_of_copy = false;
  int view_input = -1;  // for view ops: the flattened input the results alias
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& t = scan.tensors[i];
    if (!t.defined()) continue;
    DTensorImpl* impl = is_dtensor(t) ? dtensor_impl(t) : nullptr;
    if (impl == nullptr) {
      locals[i] = t;
    } else {
      // A DTensor leaf that will receive a gradient gets it in its own placements;
      // the hook goes on when the leaf takes part in an op (again if it was cleared).
      if (t.requires_grad() && t.is_leaf()) align_grad_placements(t);
      locals[i] = impl->local();
    }
    if (impl != nullptr && static_cast<int>(scan.slots[i].arg) == info.view_of) view_input = static_cast<int>(i);
    const auto& plan = d.to_target[i];
    if (plan.empty()) continue;
    const auto& src = *d.sources[i];
    const bool owned = impl != nullptr && exclusively_owned(impl->local());
    const bool written_or_aliased = info.arg_written[scan.slots[i].arg] || view_input == static_cast<int>(i);
    locals[i] = impl != nullptr ? laid_out_as(*impl, plan, d.targets[i], written_or_aliased)
                                : collectives::execute_redistribution(plan, *src.mesh, src.shape, src.stride, locals[i]);
    if (view_input == static_cast<int>(i)) {
      // A view must alias its base. A result of an op is re-laid out in place (same
      // values, new placements) unless another tensor shares its storage; a tensor the
      // user laid out, or a leaf that requires grad (a parameter), keeps its placements.
      // Otherwise the view is of a copy, kept in step with its base (view_copies.h).
      // Sharing is a per-rank fact (Python frees cycles whenever its collector runs) but
      // the choice steers later decisions, so ranks agree first.
      const bool keeps = t.is_leaf() && (t.requires_grad() || impl->keeps_placements);
      if (!keeps && collectives::all_ranks(*src.mesh, owned)) {
        moved_shard(impl->local(), locals[i]);
        impl->relayout(locals[i], d.targets[i]);
      } else {
        view_of_copy = true;
      }
    }
  }
  replace_tensors(*stack, base, info, scan.slots, locals);
  for (const auto& [index, value] : d.local_args) (*stack)[base + index] = value;

  if (d.local_fn) {
    d.local_fn(op, stack, LocalContext{*d.mesh, d.targets, d.outputs});
  } else {
    op.callBoxed(stack);
  }

  // Written inputs that had to move were updated in a temporary: copy the result
  // back into the caller's tensor, in the caller's layout.
  for (size_t i = 0; i < n; ++i) {
    if (d.write_back[i].empty()) continue;
    const auto& tgt = *d.targets[i];
    auto back = collectives::execute_redistribution(d.write_back[i], *tgt.mesh, tgt.shape, tgt.stride, locals[i]);
    const at::Tensor& t = scan.tensors[i];
    (is_dtensor(t) ? dtensor_impl(t)->local() : t).copy_(back);
  }

  // A written DTensor's shard changed below autograd, where nothing counts versions;
  // count it, so that what was derived from the old values (a kept reduction) is known
  // to be stale, and keep views taken from copies in step (dispatch/view_copies.h).
  if (info.writes_any)
    for (size_t i = 0; i < n; ++i)
      if (info.arg_written[scan.slots[i].arg] && is_dtensor(scan.tensors[i])) {
        const auto& local = dtensor_impl(scan.tensors[i])->local();
        if (!local.is_inference()) local.unsafeGetTensorImpl()->bump_version();
        forget_reductions(local);
        after_write(scan.tensors[i]);
      }

  // Wrap the local results.
  size_t j = 0;  // flattened result index
  auto wrap = [&](const at::Tensor& local) -> at::Tensor {
    const size_t slot = j++;
    if (!local.defined()) return local;
    SpecPtr spec;
    if (d.fallback_counter) {
      const Placements r(static_cast<size_t>(d.mesh->ndim()), Placement::replicate());
      spec = make_spec(d.mesh, r, local.sizes(), local.strides(), local.scalar_type());
    } else {
      spec = checked_spec(info, d.outputs[slot], local);
    }
    if (view_input >= 0) share_version_counter(local, locals[view_input]);  // the base's shard, or its copy
    at::Tensor out = view_input >= 0 ? make_dtensor_view(local, std::move(spec), scan.tensors[view_input])
                                     : make_dtensor(local, std::move(spec));
    dtensor_impl(out)->keeps_placements = false;
    if (C10_UNLIKELY(view_of_copy)) {
      record_view_of_copy(out, scan.tensors[view_input], locals[view_input], d.targets[view_input]);
    } else if (view_input >= 0) {  // a view of a view of a copy is one too
      const auto* base = dtensor_impl(scan.tensors[view_input]);
      auto* view = dtensor_impl(out);
      view->copy_of = base->copy_of;
      if (is_alias(*view, *base)) base->share_reduced_with(*view);  // detach, alias, view_as
    }
    return out;
  };
  for (size_t r = 0; r < info.num_returns; ++r) {
    auto& v = (*stack)[base + r];
    if (const int alias = info.return_alias_of[r]; alias >= 0) {
      j += tensor_count(v, info.returns[r]);
      for (const auto& [index, value] : written)
        if (index == static_cast<size_t>(alias)) v = value;
      continue;
    }
    switch (info.returns[r]) {
      case ReturnKind::Tensor:
        v = wrap(v.isTensor() ? v.toTensor() : at::Tensor());
        break;
      case ReturnKind::TensorList: {
        c10::List<at::Tensor> out;
        for (const auto& e : v.toTensorList()) out.push_back(wrap(e));
        v = std::move(out);
        break;
      }
      case ReturnKind::Other:
        break;
    }
  }
}

}  // namespace

void dtensor_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  // Autocast decided above autograd, on the DTensors, what dtype this op runs in; the
  // local ops must run exactly that, not be cast again by the local tensors' autocast key.
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  // The only cost of vescale.debug's observers while they are off: one relaxed load.
  if (C10_UNLIKELY(collectives::trace::flags() != 0)) {
    observed_kernel(op, stack, &run_kernel);
    return;
  }
  run_kernel(op, stack);
}

// Every op on a DTensor must reach dtensor_kernel. A backend fallback loses to a
// CompositeExplicitAutograd kernel (which would run its composite body on the
// wrapper), so those ops get an explicit registration for our key. Ops with only a
// CompositeImplicitAutograd kernel are left alone: they decompose above autograd.
void claim_composite_explicit_ops() {
  static std::once_flag once;
  std::call_once(once, [] {
    static std::vector<std::unique_ptr<torch::Library>> libraries;
    std::unordered_map<std::string, torch::Library*> by_namespace;
    auto& dispatcher = c10::Dispatcher::singleton();
    for (const auto& name : dispatcher.getAllOpNames()) {
      auto handle = dispatcher.findOp(name);
      if (!handle || handle->hasKernelForDispatchKey(kDTensorKey)) continue;
      const bool explicit_kernel =
          handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
          handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional);
      if (!explicit_kernel || handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd))
        continue;
      const auto sep = name.name.find("::");
      const std::string ns = name.name.substr(0, sep);
      auto& lib = by_namespace[ns];
      if (lib == nullptr) {
        libraries.push_back(std::make_unique<torch::Library>(
            torch::Library::IMPL, ns, kDTensorKey, __FILE__, __LINE__));
        lib = libraries.back().get();
      }
      std::string op_name = name.name.substr(sep + 2);
      if (!name.overload_name.empty()) op_name += "." + name.overload_name;
      lib->impl(op_name.c_str(), torch::CppFunction::makeFromBoxedFunction<&dtensor_kernel>());
    }
  });
}

}  // namespace vescale

TORCH_LIBRARY_IMPL(_, PrivateUse2, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&vescale::dtensor_kernel>());
}

namespace {

// CompositeImplicitAutograd ops whose body, for a CPU tensor without grad that is not
// "subclass-like" (at::isTensorSubclassLike: Python, functorch, meta... not our key),
// reads the data pointer directly: they take the path torch takes for subclasses. Both
// our keys get them (inference mode skips the autograd one).
at::Tensor max_pool1d(const at::Tensor& self, c10::IntArrayRef kernel_size, c10::IntArrayRef stride,
                      c10::IntArrayRef padding, c10::IntArrayRef dilation, bool ceil_mode) {
  auto out = std::get<0>(at::max_pool1d_with_indices(self, kernel_size, stride, padding, dilation, ceil_mode));
  // Torch's body takes the same route when autograd needs the indices or the tensor is
  // not on CPU; otherwise its own kernel returns a contiguous result. The layout must be
  // torch's: ops that draw in memory order (dropout, randn_like) follow it.
  const bool torch_routes_so = (self.requires_grad() && at::GradMode::is_enabled()) ||
                               self._fw_grad(0).defined() || !self.device().is_cpu();
  return torch_routes_so ? out : out.contiguous();
}

// A fact about this rank's memory, not about the global value: answered by the shard
// (through the rules it would be a replicate fallback, gathering the tensor to ask).
bool is_pinned(const at::Tensor& self, std::optional<at::Device> device) {
  return vescale::dtensor_impl(self)->local().is_pinned(device);
}

}  // namespace

// Non-differentiable CompositeImplicitAutograd ops whose decomposition builds its result
// with a factory (a plain tensor, filled in place from the DTensor): taken whole, so
// the result is a DTensor. With a kernel for our backend key, our autograd key no
// longer decomposes them; it passes through, which is right only because they have
// no gradient.
TORCH_LIBRARY_IMPL(aten, PrivateUse2, m) {
  m.impl("one_hot", torch::CppFunction::makeFromBoxedFunction<&vescale::dtensor_kernel>());
  m.impl("max_pool1d", TORCH_FN(max_pool1d));
  m.impl("is_pinned", TORCH_FN(is_pinned));
}
TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse2, m) {
  m.impl("one_hot", torch::CppFunction::makeFallthrough());
  m.impl("max_pool1d", TORCH_FN(max_pool1d));
}
