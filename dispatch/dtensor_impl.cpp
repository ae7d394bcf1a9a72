#include "dispatch/dtensor_impl.h"

#include "collectives/collectives.h"

#include <c10/core/InferenceMode.h>
#include <c10/core/TensorOptions.h>
#include <c10/util/Exception.h>

#include <atomic>

namespace vescale {

namespace {

// The autocast key of the local device's backend too (AutocastCPU, AutocastCUDA, ...): a
// TensorImpl gets it from its backend bit, which PrivateUse2 is not. Without it autocast
// skipped DTensor ops, autograd recorded them in fp32, the local ops ran in bf16 under
// the same autocast, and backward met mixed dtypes.
c10::DispatchKeySet dtensor_key_set(c10::Device device) {
  const auto backend = c10::toBackendComponent(c10::computeDispatchKey(std::nullopt, std::nullopt, device));
  return c10::DispatchKeySet({kDTensorKey, kDTensorAutogradKey, c10::DispatchKey::ADInplaceOrView}) |
         c10::getAutocastRelatedKeySetFromBackend(backend);
}

std::atomic<int64_t> g_live{0};

}  // namespace

DTensorImpl::DTensorImpl(at::Tensor local, SpecPtr spec)
    : c10::TensorImpl(dtensor_key_set(local.device()), local.dtype(), local.device()),
      local_(std::move(local)),
      spec_(std::move(spec)) {
  set_storage_access_should_throw();
  set_sizes_and_strides(spec_->shape, spec_->stride, spec_->storage_offset);
  // A conjugate or negative view (z.conj(), z.conj().imag) keeps the bit on its shard, as
  // torch keeps it on a view; the DTensor shows it too, so that torch's own checks (view_as_real
  // refuses a conjugate view) and resolution (the Conjugate and Negative fallbacks) see it.
  _set_conj(local_.is_conj());
  _set_neg(local_.is_neg());
  g_live.fetch_add(1, std::memory_order_relaxed);
}

DTensorImpl::DTensorImpl(std::shared_ptr<collectives::PendingShard> pending, SpecPtr spec, c10::Device device)
    : c10::TensorImpl(dtensor_key_set(device), c10::scalarTypeToTypeMeta(spec->dtype), device),
      pending_(std::move(pending)),
      spec_(std::move(spec)) {
  set_storage_access_should_throw();
  set_sizes_and_strides(spec_->shape, spec_->stride, spec_->storage_offset);
  g_live.fetch_add(1, std::memory_order_relaxed);
}

void DTensorImpl::take_pending() const {
  local_ = pending_->get();
  pending_.reset();
}

DTensorImpl::~DTensorImpl() {
  if (!released_) g_live.fetch_sub(1, std::memory_order_relaxed);
}

void DTensorImpl::release_resources() {
  c10::TensorImpl::release_resources();
  local_ = at::Tensor();
  pending_.reset();  // (waits, if no one did: the collective writes into its buffers)
  kept_.reset();
  copy_of.reset();
  released_ = true;
  g_live.fetch_sub(1, std::memory_order_relaxed);
}

int64_t DTensorImpl::live() { return g_live.load(std::memory_order_relaxed); }

const char* DTensorImpl::tensorimpl_type_name() const {
  // Shown by torch in "Cannot access storage of <name>".
  return "vescale DTensorImpl (a distributed tensor owns no storage; call .to_local() for "
         "this rank's shard, and save models and optimizers with vescale.save(path, state), which "
         "every rank calls and which reshards on load)";
}

template <typename Version>
c10::intrusive_ptr<c10::TensorImpl> DTensorImpl::detached_copy(Version&& version,
                                                               bool allow_change) const {
  auto impl = pending_ != nullptr ? c10::make_intrusive<DTensorImpl>(pending_, spec_, device())
                                  : c10::make_intrusive<DTensorImpl>(local_, spec_);
  impl->keeps_placements = keeps_placements;
  impl->copy_of = copy_of;
  share_reduced_with(*impl);
  copy_tensor_metadata(this, impl.get(), std::forward<Version>(version), allow_change);
  return impl;
}

c10::intrusive_ptr<c10::TensorImpl> DTensorImpl::shallow_copy_and_detach(
    const c10::VariableVersion& version_counter, bool allow_tensor_metadata_change) const {
  return detached_copy(version_counter, allow_tensor_metadata_change);
}

c10::intrusive_ptr<c10::TensorImpl> DTensorImpl::shallow_copy_and_detach(
    c10::VariableVersion&& version_counter, bool allow_tensor_metadata_change) const {
  return detached_copy(std::move(version_counter), allow_tensor_metadata_change);
}

void DTensorImpl::shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) {
  // Reached by `a.data = b`: torch has already checked that b has our key set.
  auto* other = dynamic_cast<DTensorImpl*>(impl.get());
  TORCH_CHECK(other, "cannot assign a plain tensor's data to a DTensor; distribute it first");
  copy_tensor_metadata(other, this, version_counter(), allow_tensor_metadata_change());
  local_ = other->local();
  pending_.reset();
  spec_ = other->spec_;
  kept_.reset();  // of the old data (the spec may be the same interned object)
}

void DTensorImpl::relayout(at::Tensor local, SpecPtr spec) {
  TORCH_INTERNAL_ASSERT(spec->shape == spec_->shape && spec->stride == spec_->stride);
  pending_.reset();
  local_ = std::move(local);
  spec_ = std::move(spec);
  kept_.reset();  // (aliases keep theirs)
}

void DTensorImpl::adopt(const DTensorImpl& other) {
  local_ = other.local();
  pending_.reset();
  spec_ = other.spec_;
  copy_of = other.copy_of;
  kept_.reset();
  set_sizes_and_strides(spec_->shape, spec_->stride, spec_->storage_offset);
}

namespace {
// Inference tensors have no version counter; nothing is kept for them.
uint32_t version_of(const c10::TensorImpl& impl) { return impl.version_counter().current_version(); }
}  // namespace

const DTensorImpl::Reduced* DTensorImpl::reduced() const {
  // keep_reduced keeps nothing for inference tensors, which have no version counter.
  if (!kept_for_spec() || !kept_->reduced.local.defined()) return nullptr;
  if (version_of(*this) != kept_->version || version_of(*local().unsafeGetTensorImpl()) != kept_->local_version ||
      version_of(*kept_->reduced.local.unsafeGetTensorImpl()) != kept_->reduced_version)
    return nullptr;
  return &kept_->reduced;
}

void DTensorImpl::drop_reduced() {
  if (kept_) kept_->drop();
}

std::shared_ptr<DTensorImpl::Kept> DTensorImpl::keep_reduced(at::Tensor local, SpecPtr spec) {
  if (is_inference() || this->local().is_inference() || local.is_inference()) return nullptr;
  if (!kept_) kept_ = std::make_shared<Kept>();
  kept_->reduced_version = version_of(*local.unsafeGetTensorImpl());
  kept_->reduced = Reduced{std::move(local), std::move(spec)};
  kept_->from = spec_;
  kept_->version = version_of(*this);
  kept_->local_version = version_of(*this->local().unsafeGetTensorImpl());
  return kept_;
}

void DTensorImpl::share_reduced_with(DTensorImpl& alias) const {
  if (!kept_) kept_ = std::make_shared<Kept>();
  alias.kept_ = kept_;
}

DTensorImpl* checked_dtensor_impl(const at::TensorBase& t, const char* what) {
  TORCH_CHECK_TYPE(is_dtensor(t), what, " expects a vescale DTensor, got a plain tensor; use "
                   "vescale.distribute_tensor or DTensor.from_local to make one");
  return dtensor_impl(t);
}

at::Tensor make_dtensor(at::Tensor local, SpecPtr spec) {
  TORCH_INTERNAL_ASSERT(!is_dtensor(local), "a DTensor's shard must be a plain tensor, got a DTensor for ", spec->str());
  return at::Tensor(c10::make_intrusive<DTensorImpl>(std::move(local), std::move(spec)));
}

at::Tensor make_dtensor_view(at::Tensor local, SpecPtr spec, const at::Tensor& base) {
  if (C10_LIKELY(!c10::InferenceMode::is_enabled()) || base.is_inference()) return make_dtensor(std::move(local), std::move(spec));
  // TensorImpl's constructor makes an inference tensor whenever inference mode is on:
  // construct with it off, as torch constructs views of normal tensors.
  c10::InferenceMode off(/*enabled=*/false);
  return make_dtensor(std::move(local), std::move(spec));
}

at::Tensor make_pending_dtensor(std::shared_ptr<collectives::PendingShard> pending, SpecPtr spec, c10::Device device) {
  return at::Tensor(c10::make_intrusive<DTensorImpl>(std::move(pending), std::move(spec), device));
}

}  // namespace vescale
