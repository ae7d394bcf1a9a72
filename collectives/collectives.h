#pragma once
// Collective calls on mesh dims, through torch's _c10d_functional ops (so the same
// code runs on gloo and NCCL, and tracers and fake process groups see the traffic),
// and the executor that runs a redistribution plan on a local shard.

#include "collectives/redistribute_plan.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <mutex>
#include <string>

namespace vescale::collectives {

// Each call blocks until the result is ready (wait_tensor), so the returned tensor
// is safe to use at once. The group is this rank's process group along `mesh_dim` of
// `mesh`; each call is counted and, while vescale.debug observes, recorded
// (collectives/trace.h).
at::Tensor all_gather_dim0(const at::Tensor& x, const Mesh& mesh, int32_t mesh_dim);
at::Tensor all_reduce(const at::Tensor& x, ReduceOp op, const Mesh& mesh, int32_t mesh_dim);
// Over every rank of the mesh at once, through mesh.flat_group_name (must be set).
at::Tensor all_reduce_flat(const at::Tensor& x, ReduceOp op, const Mesh& mesh);
at::Tensor reduce_scatter_dim0(const at::Tensor& x, ReduceOp op, const Mesh& mesh, int32_t mesh_dim);
at::Tensor all_to_all_dim0(const at::Tensor& x, const Mesh& mesh, int32_t mesh_dim);
// `src` is the source's coordinate along `mesh_dim`.
at::Tensor broadcast(const at::Tensor& x, int64_t src, const Mesh& mesh, int32_t mesh_dim);

// How many collectives of each kind this process has issued, and their input bytes,
// since start-up or the last reset: for tests and tools that check what a step sends.
struct CollectiveCount {
  std::string kind;  // "all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast"
  uint64_t calls = 0;
  uint64_t bytes = 0;
};
std::vector<CollectiveCount> collective_counts();
void reset_collective_counts();

// True on every rank of the mesh when `value` is true on every rank: for decisions
// that depend on per-rank state but must be taken alike everywhere.
bool all_ranks(const Mesh& mesh, bool value);
// Element-wise all_ranks of several flags, in one collective per mesh dim.
std::vector<bool> all_ranks(const Mesh& mesh, const std::vector<bool>& values);

// Runs `plan` on this rank's shard `local` of a tensor with `global_shape` on
// `mesh`. The result is a fresh tensor: it never aliases `local`, unless the plan is
// empty. Its layout follows `global_stride`'s dim order.
at::Tensor execute_redistribution(
    const RedistPlan& plan,
    const Mesh& mesh,
    c10::ArrayRef<int64_t> global_shape,
    c10::ArrayRef<int64_t> global_stride,
    const at::Tensor& local);

// This rank's shard of a redistribution whose last collective may still be in flight
// (as torch's functional collectives, waited for at the first use of the result):
// get() waits for it and finishes the shard once; later calls return the same tensor.
// Thread-safe. Until get(), only the shard's metadata (the spec) may be relied on.
class PendingShard {
 public:
  explicit PendingShard(std::function<at::Tensor()> finish) : finish_(std::move(finish)) {}
  // A collective nobody used is still waited for: it writes into buffers that go now.
  ~PendingShard() {
    if (finish_ == nullptr) return;
    try {
      get();
    } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw; the failure shows elsewhere
    }
  }
  PendingShard(const PendingShard&) = delete;
  PendingShard& operator=(const PendingShard&) = delete;
  const at::Tensor& get() {
    std::call_once(once_, [this] {
      shard_ = finish_();
      finish_ = nullptr;  // drops the collective's buffers and its timer
    });
    return shard_;
  }

 private:
  std::once_flag once_;
  std::function<at::Tensor()> finish_;
  at::Tensor shard_;
};

// execute_redistribution, with the plan's last step, when it is a collective, issued and
// not waited for: the steps before it run now (each needs its predecessor's values), so
// every rank issues the same collectives in the same order as the blocking executor.
std::shared_ptr<PendingShard> start_redistribution(
    const RedistPlan& plan,
    const Mesh& mesh,
    c10::ArrayRef<int64_t> global_shape,
    c10::ArrayRef<int64_t> global_stride,
    const at::Tensor& local);

// Copies `local` into the dense layout whose dim order follows `global_stride`,
// unless it already has it.
at::Tensor with_layout_of(const at::Tensor& local, c10::ArrayRef<int64_t> global_stride);
// Whether `local` keeps the dim order of `global_stride` without overlapping itself,
// densely packed or not (a view into a larger buffer), dims expanded in both aside:
// such a shard needs no copy to follow the global layout.
bool keeps_order_of(const at::Tensor& local, c10::ArrayRef<int64_t> global_stride);

}  // namespace vescale::collectives
