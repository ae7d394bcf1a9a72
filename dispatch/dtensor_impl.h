#pragma once
// DTensorImpl: the TensorImpl behind every vescale DTensor.
//
// It reports the global shape and strides, the local shard's dtype and device, and
// owns no storage: its data is `local_`, this rank's shard. Its dispatch key set is
// {kDTensorKey, its autograd key, ADInplaceOrView} and the local device's autocast key,
// so autocast, autograd and view tracking run above it and every aten op then reaches
// vescale's handler.

#include "core/spec.h"

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>

namespace vescale {

namespace collectives {
class PendingShard;  // collectives/collectives.h
}

// The c10 private-use backend key vescale claims. PrivateUse1 is what out-of-tree
// accelerators register as; PrivateUse2 is free in practice, and it ranks above the
// CPU and CUDA backend bits, so an op mixing a DTensor with plain tensors reaches us.
constexpr c10::DispatchKey kDTensorKey = c10::DispatchKey::PrivateUse2;
constexpr c10::DispatchKey kDTensorAutogradKey = c10::DispatchKey::AutogradPrivateUse2;

class DTensorImpl final : public c10::TensorImpl {
 public:
  DTensorImpl(at::Tensor local, SpecPtr spec);
  // A DTensor whose shard a collective is still computing (DTensor.redistribute(...,
  // async_op=True)): the first use of the shard waits for it.
  DTensorImpl(std::shared_ptr<collectives::PendingShard> pending, SpecPtr spec, c10::Device device);
  ~DTensorImpl() override;
  // DTensors whose shard is still held (a debug counter: a training step must leave none behind).
  static int64_t live();

  // Waits for a pending shard first. Like any tensor's, a DTensor's first use is not
  // to race with another thread's.
  const at::Tensor& local() const {
    if (C10_UNLIKELY(pending_ != nullptr)) take_pending();
    return local_;
  }
  bool pending() const { return pending_ != nullptr; }
  const SpecPtr& spec() const { return spec_; }

  // Lays the same global values out differently: the local shard and spec change,
  // the global metadata (and every Python reference) stays. Only valid while no other
  // tensor aliases the local storage.
  void relayout(at::Tensor local, SpecPtr spec);

  // Takes over another DTensor's shard and spec, global sizes and strides included:
  // how in-place view ops (transpose_, squeeze_, ...) and set_ restride a DTensor.
  void adopt(const DTensorImpl& other);

  // The first reduction of a Partial value, kept so that every later consumer starts
  // from the same bits (see dispatch/reduce_once.h). Null when none is kept or the
  // tensor changed since.
  struct Reduced {
    at::Tensor local;
    SpecPtr spec;
  };
  const Reduced* reduced() const;
  // Whether a reduction was kept for the current spec, valid or not since: the same on
  // every rank (keeping is), unlike validity (a write can reach the shard's storage through
  // an alias that only some ranks have, e.g. from_local's layout copy).
  bool kept_for_spec() const { return kept_ != nullptr && kept_->from == spec_; }
  // What a tensor keeps, shared by its aliases (share_reduced_with). Valid while the
  // spec is `from` and neither the wrapper (views share its version counter), the shard
  // (views and shallow copies share its counter) nor the kept tensor changed.
  struct Kept {
    Reduced reduced;
    SpecPtr from;
    uint32_t version = 0;          // of the wrapper
    uint32_t local_version = 0;    // of the shard
    uint32_t reduced_version = 0;  // of reduced.local, which redistribute() may have handed out
    void drop() { reduced = Reduced{}; }  // `from` stays, as on every other rank
  };
  // Keeps `local` (this tensor's value laid out as `spec`); returns the state it went
  // into, for the registry that drops it when the shard's storage is written.
  std::shared_ptr<Kept> keep_reduced(at::Tensor local, SpecPtr spec);
  void drop_reduced();
  // Makes `alias` (a detached copy, or a view with this tensor's spec and shard) share
  // what this tensor keeps: a reduction kept through either serves both, so that
  // `x.detach()` and `x` see one value.
  void share_reduced_with(DTensorImpl& alias) const;

  // Set on a parameter whose Partial(sum) gradients over its replicated mesh dims are
  // reduced later, in buckets (vescale/parallel/tp_grads.py): the hook leaves them Partial.
  bool defer_partial_grads = false;
  // On a view that had to be taken from a copy of its base (the base needed another
  // layout and could not change in place): the base and the copy, so that a write
  // into the view (whose shard is part of the copy's) is pushed back into the base.
  // Views of such a view share the record.
  struct CopyOf {
    at::Tensor base;        // the DTensor the view was asked of, as it was then
    at::Tensor copy_local;  // the copy's shard: the base laid out as copy_spec
    SpecPtr copy_spec;
  };
  std::shared_ptr<const CopyOf> copy_of;
  // Cleared on op results: they may be re-laid out in place when a view needs it.
  // Tensors the user laid out (distribute_tensor, from_local, redistribute) keep theirs.
  bool keeps_placements = true;


  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      const c10::VariableVersion& version_counter,
      bool allow_tensor_metadata_change) const override;
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      c10::VariableVersion&& version_counter,
      bool allow_tensor_metadata_change) const override;
  void shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) override;
  // The last strong reference went while weak ones remain (the registries of kept
  // reductions and view copies hold DTensors weakly): the shard and everything kept with
  // it go now, not when the last weak reference does. Without this, a registry entry
  // kept its own key's storage alive through the dead wrapper, and every reduced
  // Partial input leaked its shard.
  void release_resources() override;

 protected:
  const char* tensorimpl_type_name() const override;

 private:
  template <typename Version>
  c10::intrusive_ptr<c10::TensorImpl> detached_copy(Version&& version, bool allow_change) const;
  void take_pending() const;

  // Until the first use of a pending shard, `local_` is undefined and `pending_` holds
  // the collective in flight (shared with shallow copies, which wait for it once).
  mutable at::Tensor local_;
  mutable std::shared_ptr<collectives::PendingShard> pending_;
  SpecPtr spec_;
  mutable std::shared_ptr<Kept> kept_;  // shared by aliases (share_reduced_with)
  bool released_ = false;
};

inline bool is_dtensor(const at::TensorBase& t) {
  return t.defined() && t.unsafeGetTensorImpl()->key_set().has(kDTensorKey);
}

// The impl of a tensor known to be a DTensor.
inline DTensorImpl* dtensor_impl(const at::TensorBase& t) {
  return static_cast<DTensorImpl*>(t.unsafeGetTensorImpl());
}

// Throws a clear error when `t` is not a DTensor; `what` names the caller.
DTensorImpl* checked_dtensor_impl(const at::TensorBase& t, const char* what);

// Wraps a local shard (which must not carry autograd history) with a spec.
at::Tensor make_dtensor(at::Tensor local, SpecPtr spec);
// A DTensor that is a view of `base`: as torch's views, a normal tensor when its base is
// one, even in inference mode (which otherwise makes every new tensor an inference
// tensor, and autograd's view tracking then fails on it).
at::Tensor make_dtensor_view(at::Tensor local, SpecPtr spec, const at::Tensor& base);
// Wraps a shard still in flight; `device` is where it will be.
at::Tensor make_pending_dtensor(std::shared_ptr<collectives::PendingShard> pending, SpecPtr spec, c10::Device device);

}  // namespace vescale
