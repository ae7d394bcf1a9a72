#include "collectives/collectives.h"

#include "collectives/trace.h"

#include <ATen/ATen.h>
#include <ATen/SavedTensorHooks.h>
#include <ATen/ThreadLocalPythonObjects.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <limits>
#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace vescale::collectives {

namespace {

c10::OperatorHandle functional_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// A backend work object captures the calling thread's ThreadLocalState, Python objects
// included: those torch stashes there (backward() stashes a contextvars object) and the
// saved-tensor hooks (non-reentrant activation checkpointing, `save_on_cpu`). The
// backend's own thread copies that state when it runs the collective, and may destroy
// it later; both take the GIL for those objects. Ops reached with the GIL held
// (`x[..., :k]` does not release it) then deadlock waiting for the collective, and at
// interpreter exit the destruction aborts the process. Collectives are issued and waited
// for with those objects set aside (nothing is set aside when there are none; vescale's
// collectives save no tensor for backward, so no hook could fire on them).
class WithoutPythonObjectsInThreadState {
 public:
  WithoutPythonObjectsInThreadState() : saved_(at::impl::ThreadLocalPythonObjects::get_state()) {
    at::impl::ThreadLocalPythonObjects::set_state({});
    if (!at::SavedTensorDefaultHooks::get_tls_state().stack.empty()) {
      hooks_ = at::SavedTensorDefaultHooks::get_tls_state();
      at::SavedTensorDefaultHooks::set_tls_state({});
    }
  }
  ~WithoutPythonObjectsInThreadState() {
    at::impl::ThreadLocalPythonObjects::set_state(std::move(saved_));
    if (hooks_) at::SavedTensorDefaultHooks::set_tls_state(*hooks_);
  }

 private:
  at::impl::ThreadLocalPythonObjects saved_;
  std::optional<at::impl::SavedTensorDefaultHooksTLS> hooks_;
};

enum Kind : size_t { kAllGather, kAllReduce, kReduceScatter, kAllToAll, kBroadcast, kKinds };
constexpr const char* kKindNames[kKinds] = {"all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast"};
std::atomic<uint64_t> calls[kKinds];
std::atomic<uint64_t> bytes[kKinds];

uint64_t nbytes(const at::Tensor& x) { return static_cast<uint64_t>(x.numel()) * x.element_size(); }

// Counts the call and, while an observer is on, times and records it (until it is
// waited for: the timer travels with the collective in flight).
std::shared_ptr<trace::Timed> count(Kind kind, const at::Tensor& x, const std::string& group, int64_t group_size,
                                    int32_t mesh_dim, const std::string* mesh_dim_name) {
  const uint64_t n = nbytes(x);
  calls[kind].fetch_add(1, std::memory_order_relaxed);
  bytes[kind].fetch_add(n, std::memory_order_relaxed);
  return std::make_shared<trace::Timed>(kKindNames[kind], group, group_size, mesh_dim, mesh_dim_name, n);
}

std::shared_ptr<trace::Timed> count(Kind kind, const at::Tensor& x, const Mesh& mesh, int32_t mesh_dim) {
  const auto m = static_cast<size_t>(mesh_dim);
  return count(kind, x, mesh.group_names[m], mesh.shape[m], mesh_dim,
               m < mesh.dim_names.size() ? &mesh.dim_names[m] : nullptr);
}

// A collective in flight: its output, which must not be read before wait().
struct Issued {
  at::Tensor out;
  std::shared_ptr<trace::Timed> timed;
  bool complex = false;    // `out` is the real view of a complex result
  bool nan_flags = false;  // `out` holds (values, NaN flags) pairs: with_nan_flags
};

// Max and min of floating values: the backends compare with < and so drop a NaN, or keep
// it, by the order in which the ranks' values meet, where one device's max or min of
// values that hold a NaN is NaN (a NaN in one rank's shard of a gradient went unseen by
// a global amax). The NaNs travel as flags beside the values (a trailing dim of 2,
// reduced by the same op: max of 1/0 is "any", min of -1/0 too), the values with their
// NaNs replaced by the reduction's identity.
bool needs_nan_flags(const at::Tensor& x, ReduceOp op) {
  return (op == ReduceOp::Max || op == ReduceOp::Min) && at::isFloatingType(x.scalar_type());
}

at::Tensor with_nan_flags(const at::Tensor& x, ReduceOp op) {
  const bool max = op == ReduceOp::Max;
  const auto nan = x.isnan();
  const double inf = std::numeric_limits<double>::infinity();
  auto values = at::where(nan, at::scalar_tensor(max ? -inf : inf, x.options()), x);
  auto flags = nan.to(x.scalar_type());
  return at::stack({values, max ? flags : flags.neg()}, -1);
}

at::Tensor without_nan_flags(const at::Tensor& pairs) {
  const auto values = pairs.select(-1, 0);
  const auto nan = at::scalar_tensor(std::numeric_limits<double>::quiet_NaN(), values.options());
  return at::where(pairs.select(-1, 1).ne(0), nan, values);
}

// Tensors as a backend reads them, from memory: a conjugate or negative view (z.conj(),
// z.conj().imag) resolved first, since the backend does not see the bit. Complex tensors
// travel as their real view (a trailing dim of 2): gloo has no complex type, and the
// gathers, sums and averages of (re, im) pairs are those of the complex values. True
// when the stack held a complex tensor.
bool as_sent(torch::jit::Stack& stack) {
  bool complex = false;
  for (auto& v : stack) {
    if (!v.isTensor()) continue;
    auto t = v.toTensor();
    if (t.is_conj() || t.is_neg()) t = t.resolve_conj().resolve_neg();
    if (t.is_complex()) {
      t = at::view_as_real(t.contiguous());
      complex = true;
    }
    v = std::move(t);
  }
  return complex;
}

void check_complex_reduction(const at::Tensor& x, ReduceOp op) {
  TORCH_CHECK(!x.is_complex() || op == ReduceOp::Sum || op == ReduceOp::Avg,
              "vescale: a max or min reduction of a complex tensor (complex numbers have no order; torch refuses "
              "max and min of complex tensors too)");
}

// Boxed call: the group_name argument is typed `Any`, which typed calls can't express.
// Below autograd: torch registers Python autograd kernels for these ops, and the
// collectives vescale inserts are not differentiated through anyway.
Issued issue(const c10::OperatorHandle& op, torch::jit::Stack stack, std::shared_ptr<trace::Timed> timed) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  WithoutPythonObjectsInThreadState no_python_objects;
  const bool complex = as_sent(stack);
  op.callBoxed(stack);
  return {stack.at(0).toTensor(), std::move(timed), complex};
}

at::Tensor wait(Issued issued) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  WithoutPythonObjectsInThreadState no_python_objects;
  static const auto wait_tensor = functional_op("_c10d_functional::wait_tensor");
  torch::jit::Stack stack{std::move(issued.out)};
  wait_tensor.callBoxed(stack);
  issued.timed.reset();  // records the event, ending now
  // The backend's work object may keep the result tensor alive and drop it later on
  // its own thread; hand out another TensorImpl over the same storage, so that no
  // Python object ever hangs off the one the work object holds.
  auto out = stack.at(0).toTensor().detach();
  if (issued.nan_flags) return without_nan_flags(out);
  return issued.complex ? at::view_as_complex(out) : out;
}

// One redistribution step under way: the collective it issued (none for a local step,
// whose result is `done`) and what turns the collective's output into the step's result.
struct InFlight {
  Issued issued;
  std::function<at::Tensor(const at::Tensor&)> then;  // null: the output is the result
  at::Tensor done;
};

InFlight local_result(at::Tensor x) { return {{}, nullptr, std::move(x)}; }

at::Tensor finish(InFlight f) {
  if (f.done.defined()) return std::move(f.done);
  auto out = wait(std::move(f.issued));
  return f.then ? f.then(out) : out;
}

// On gloo, through the `_out` form, which gloo runs as its plain all-gather. The other
// form takes gloo's coalesced all-gather, and in torch 2.13 two of those finishing at
// once on one group's two worker threads corrupt the heap: ProcessGroupGloo::runLoop
// stores the op's name (19 characters, so on the heap) into the group's status without
// a lock, where names of 15 characters or fewer stay inside the string. Plain torch shows
// it: two functional all-gathers in flight per step on 2 gloo ranks abort with
// "malloc(): unaligned tcache chunk detected" within seconds (docs/engine.md, "Known
// problems"). Elsewhere the other form: the `_out` form needs a backend object, which
// process groups written in Python (vescale.debug.simulate's) do not have.
bool runs_on_gloo(const std::string& group, c10::DeviceType device) {
  auto pg = c10d::resolve_process_group(group);
  const auto devices = pg->getDeviceTypes();  // (hasBackendForDeviceType is torch >= 2.13 only)
  const bool has_backend = std::any_of(devices.begin(), devices.end(),
                                       [device](const c10::Device& d) { return d.type() == device; });
  return has_backend && pg->getBackend(device)->getBackendName() == "gloo";
}

Issued issue_all_gather_dim0(const at::Tensor& x, const Mesh& mesh, int32_t mesh_dim) {
  TORCH_CHECK(x.dim() > 0, "vescale: all-gather along dim 0 of a 0-d tensor");
  const auto m = static_cast<size_t>(mesh_dim);
  const auto& group = mesh.group_names[m];
  auto timed = count(kAllGather, x, mesh, mesh_dim);
  if (runs_on_gloo(group, x.device().type())) {
    static const auto into_out = functional_op("_c10d_functional::all_gather_into_tensor_out");
    auto shape = x.sizes().vec();
    shape[0] *= mesh.shape[m];
    return issue(into_out, {x, mesh.shape[m], group, at::empty(shape, x.options())}, std::move(timed));
  }
  static const auto into_new = functional_op("_c10d_functional::all_gather_into_tensor");
  return issue(into_new, {x, mesh.shape[m], group}, std::move(timed));
}

// A reduction's issue, with NaN flags where the op needs them (needs_nan_flags).
template <typename IssueFn>
Issued issue_reduction(const at::Tensor& x, ReduceOp op, IssueFn&& issue_on) {
  check_complex_reduction(x, op);
  if (!needs_nan_flags(x, op)) return issue_on(x.contiguous());
  auto issued = issue_on(with_nan_flags(x, op));
  issued.nan_flags = true;
  return issued;
}

Issued issue_all_reduce(const at::Tensor& x, ReduceOp op, const Mesh& mesh, int32_t mesh_dim) {
  static const auto fn = functional_op("_c10d_functional::all_reduce");
  return issue_reduction(x, op, [&](const at::Tensor& sent) {
    return issue(fn, {sent, reduce_op_name(op), mesh.group_names[static_cast<size_t>(mesh_dim)]},
                 count(kAllReduce, sent, mesh, mesh_dim));
  });
}

Issued issue_all_reduce_flat(const at::Tensor& x, ReduceOp op, const Mesh& mesh) {
  static const auto fn = functional_op("_c10d_functional::all_reduce");
  std::string dims;
  for (const auto& name : mesh.dim_names) dims += (dims.empty() ? "" : "*") + name;
  return issue_reduction(x, op, [&](const at::Tensor& sent) {
    return issue(fn, {sent, reduce_op_name(op), mesh.flat_group_name},
                 count(kAllReduce, sent, mesh.flat_group_name, mesh.numel(), -1, &dims));
  });
}

Issued issue_reduce_scatter_dim0(const at::Tensor& x, ReduceOp op, const Mesh& mesh, int32_t mesh_dim) {
  static const auto fn = functional_op("_c10d_functional::reduce_scatter_tensor");
  const auto m = static_cast<size_t>(mesh_dim);
  return issue_reduction(x, op, [&](const at::Tensor& sent) {
    return issue(fn, {sent, reduce_op_name(op), mesh.shape[m], mesh.group_names[m]},
                 count(kReduceScatter, sent, mesh, mesh_dim));
  });
}

Issued issue_all_to_all_dim0(const at::Tensor& x, const Mesh& mesh, int32_t mesh_dim) {
  static const auto fn = functional_op("_c10d_functional::all_to_all_single");
  const auto m = static_cast<size_t>(mesh_dim);
  std::vector<int64_t> splits(static_cast<size_t>(mesh.shape[m]), x.size(0) / mesh.shape[m]);
  return issue(fn, {x, c10::IValue(splits), c10::IValue(splits), mesh.group_names[m]},
               count(kAllToAll, x, mesh, mesh_dim));
}

// The extent of tensor dim `dim` before mesh dim `mesh_dim` splits it: the local size
// under `placements` with that mesh dim replaced by Replicate.
int64_t parent_extent(const Mesh& mesh, c10::ArrayRef<int64_t> shape, PlacementsRef placements,
                      int32_t mesh_dim, int32_t dim) {
  Placements p(placements.begin(), placements.end());
  p[static_cast<size_t>(mesh_dim)] = Placement::replicate();
  return local_box(shape, p, mesh.shape, mesh.coordinate).sizes[static_cast<size_t>(dim)];
}

at::Tensor pad_dim0(const at::Tensor& x, int64_t rows) {
  if (x.size(0) == rows) return x;
  auto pad_shape = x.sizes().vec();
  pad_shape[0] = rows - x.size(0);
  return at::cat({x, at::zeros(pad_shape, x.options())}, 0);
}

// An interleaved split along dim 0 of `x`, seen as [groups, k, piece, ...] (the
// global order) or [k, groups, piece, ...] (the order of rank-major pieces that
// collectives exchange): swaps the first two.
at::Tensor swap_groups_and_ranks(const at::Tensor& x, int64_t first, int64_t second) {
  auto shape = x.sizes().vec();
  shape[0] = x.size(0) / (first * second);
  shape.insert(shape.begin(), {first, second});
  auto out_shape = x.sizes().vec();
  return x.reshape(shape).transpose(0, 1).reshape(out_shape);
}

InFlight gather_step(const RedistStep& s, const Mesh& mesh, c10::ArrayRef<int64_t> shape, const at::Tensor& local) {
  const auto m = static_cast<size_t>(s.mesh_dim);
  const int64_t k = mesh.shape[m];
  const int64_t dim = s.dim;
  if (s.groups > 1) {  // even pieces: rank-major after the gather, group-major wanted
    return {issue_all_gather_dim0(local.movedim(dim, 0).contiguous(), mesh, s.mesh_dim),
            [k, groups = s.groups, dim](const at::Tensor& gathered) {
              return swap_groups_and_ranks(gathered, k, groups).movedim(0, dim);
            }};
  }
  const int64_t extent = parent_extent(mesh, shape, s.before, s.mesh_dim, s.dim);
  const int64_t full = (extent + k - 1) / k;
  if (extent == 0) return local_result(local.clone());
  auto x = pad_dim0(local.movedim(dim, 0), full).contiguous();
  return {issue_all_gather_dim0(x, mesh, s.mesh_dim), [k, extent, full, dim](const at::Tensor& gathered) {
            if (extent == full * k) return gathered.movedim(0, dim);
            std::vector<at::Tensor> pieces;  // each rank's rows without its padding
            for (int64_t j = 0; j < k; ++j) {
              const int64_t n = chunk_size(extent, k, j);
              if (n > 0) pieces.push_back(gathered.narrow(0, j * full, n));
            }
            return at::cat(pieces, 0).movedim(0, dim);
          }};
}

InFlight reduce_scatter_step(const RedistStep& s, const Mesh& mesh, const at::Tensor& local) {
  const auto m = static_cast<size_t>(s.mesh_dim);
  const int64_t k = mesh.shape[m];
  const int64_t dim = s.dim;
  if (s.groups > 1) {  // rank j's pieces of every group side by side, then scatter
    auto x = swap_groups_and_ranks(local.movedim(dim, 0), s.groups, k).contiguous();
    return {issue_reduce_scatter_dim0(x, s.op, mesh, s.mesh_dim),
            [dim](const at::Tensor& out) { return out.movedim(0, dim); }};
  }
  const int64_t extent = local.size(dim);
  const int64_t full = (extent + k - 1) / k;
  const int64_t mine = chunk_size(extent, k, mesh.coordinate[m]);
  if (extent == 0) return {issue_all_reduce(local, s.op, mesh, s.mesh_dim)};
  auto x = pad_dim0(local.movedim(dim, 0), full * k).contiguous();
  return {issue_reduce_scatter_dim0(x, s.op, mesh, s.mesh_dim),
          [mine, dim](const at::Tensor& out) { return out.narrow(0, 0, mine).movedim(0, dim); }};
}

InFlight all_to_all_step(const RedistStep& s, const Mesh& mesh, const at::Tensor& local) {
  // Even split on both dims (the planner guarantees it). Send block j of `to_dim`
  // to rank j; receive rank j's block of `dim` and lay the blocks side by side.
  const int64_t k = mesh.shape[static_cast<size_t>(s.mesh_dim)];
  // In the moved layout, `dim` sits one place later when it came before `to_dim`.
  const int64_t dim_in_moved = s.dim < s.to_dim ? s.dim + 1 : s.dim;
  return {issue_all_to_all_dim0(local.movedim(s.to_dim, 0).contiguous(), mesh, s.mesh_dim),
          [k, dim_in_moved, to_dim = s.to_dim](const at::Tensor& received) {
            return at::cat(received.chunk(k, 0), dim_in_moved).movedim(0, to_dim);
          }};
}

at::Tensor chunk_step(const RedistStep& s, const Mesh& mesh, const at::Tensor& local) {
  const auto m = static_cast<size_t>(s.mesh_dim);
  const int64_t k = mesh.shape[m];
  const int64_t extent = local.size(s.dim);
  const int64_t c = mesh.coordinate[m];
  if (s.groups > 1) {  // piece c of every group
    auto x = local.movedim(s.dim, 0);
    auto shape = x.sizes().vec();
    auto out_shape = shape;
    out_shape[0] = extent / k;
    shape[0] = extent / (s.groups * k);
    shape.insert(shape.begin(), {s.groups, k});
    // (one copy: the piece is cloned dense, then viewed with its groups merged)
    return x.reshape(shape).select(1, c).clone(at::MemoryFormat::Contiguous).view(out_shape).movedim(0, s.dim);
  }
  return local.narrow(s.dim, chunk_offset(extent, k, c), chunk_size(extent, k, c)).clone();
}

at::Tensor to_partial_step(const RedistStep& s, const Mesh& mesh, const at::Tensor& local) {
  // Sum: one rank keeps the value and the rest hold zeros, which is exact (no
  // division). Avg, max and min of equal values are that value, so everyone keeps it.
  const bool keeps = s.op != ReduceOp::Sum || mesh.coordinate[static_cast<size_t>(s.mesh_dim)] == 0;
  return keeps ? local.clone() : at::zeros_like(local);
}

// How many steps from `first` on are all-reduces (one reduce op) that together cover
// every mesh dim with more than one rank, so that one all-reduce over the mesh's flat
// group does them all: reductions over disjoint rank groups compose, and the flat
// group reduces each value once. 0 when they do not, or the mesh has no flat group.
size_t flat_all_reduce_steps(const RedistPlan& plan, size_t first, const Mesh& mesh) {
  if (mesh.flat_group_name.empty() || plan.steps[first].kind != RedistStep::Kind::AllReduce) return 0;
  std::vector<bool> covered(mesh.shape.size(), false);
  size_t n = 0;
  for (size_t i = first; i < plan.steps.size(); ++i, ++n) {
    const auto& s = plan.steps[i];
    if (s.kind != RedistStep::Kind::AllReduce || s.op != plan.steps[first].op) break;
    covered[static_cast<size_t>(s.mesh_dim)] = true;
  }
  size_t spanned = 0;
  for (size_t m = 0; m < mesh.shape.size(); ++m) {
    if (mesh.shape[m] > 1 && !covered[m]) return 0;
    spanned += mesh.shape[m] > 1 ? 1 : 0;
  }
  return spanned > 1 ? n : 0;
}

// Starts step `i` of `plan` on `x`; advances `i` past the steps it covers (one
// all-reduce over the flat group can do several). Groups of one move nothing.
InFlight start_step(const RedistPlan& plan, size_t& i, const Mesh& mesh, c10::ArrayRef<int64_t> shape,
                    const at::Tensor& x) {
  using K = RedistStep::Kind;
  const auto& s = plan.steps[i];
  if (const size_t n = flat_all_reduce_steps(plan, i, mesh); n > 0) {
    i += n - 1;
    return {issue_all_reduce_flat(x, s.op, mesh)};
  }
  const bool local_step = s.kind == K::Chunk || s.kind == K::ToPartial;
  if (mesh.shape[static_cast<size_t>(s.mesh_dim)] == 1 && !local_step) return local_result(x);
  switch (s.kind) {
    case K::AllGather: return gather_step(s, mesh, shape, x);
    case K::AllToAll: return all_to_all_step(s, mesh, x);
    case K::AllReduce: return {issue_all_reduce(x, s.op, mesh, s.mesh_dim)};
    case K::ReduceScatter: return reduce_scatter_step(s, mesh, x);
    case K::Chunk: return local_result(chunk_step(s, mesh, x));
    case K::ToPartial: return local_result(to_partial_step(s, mesh, x));
  }
  TORCH_INTERNAL_ASSERT(false, "unknown redistribution step");
}

// The executors' last touch: a result that is still the input is copied (the result
// never aliases the input), and the layout follows the global strides.
at::Tensor fresh_and_laid_out(at::Tensor x, const at::Tensor& local, c10::ArrayRef<int64_t> global_stride) {
  if (x.is_same(local)) x = x.clone();
  return with_layout_of(x, global_stride);
}

}  // namespace

std::vector<CollectiveCount> collective_counts() {
  std::vector<CollectiveCount> out;
  for (size_t k = 0; k < kKinds; ++k)
    out.push_back({kKindNames[k], calls[k].load(std::memory_order_relaxed), bytes[k].load(std::memory_order_relaxed)});
  return out;
}

void reset_collective_counts() {
  for (size_t k = 0; k < kKinds; ++k) {
    calls[k] = 0;
    bytes[k] = 0;
  }
}

at::Tensor all_gather_dim0(const at::Tensor& x, const Mesh& mesh, int32_t mesh_dim) {
  return wait(issue_all_gather_dim0(x, mesh, mesh_dim));
}

at::Tensor all_reduce(const at::Tensor& x, ReduceOp op, const Mesh& mesh, int32_t mesh_dim) {
  return wait(issue_all_reduce(x, op, mesh, mesh_dim));
}

at::Tensor all_reduce_flat(const at::Tensor& x, ReduceOp op, const Mesh& mesh) {
  return wait(issue_all_reduce_flat(x, op, mesh));
}

at::Tensor reduce_scatter_dim0(const at::Tensor& x, ReduceOp op, const Mesh& mesh, int32_t mesh_dim) {
  return wait(issue_reduce_scatter_dim0(x, op, mesh, mesh_dim));
}

at::Tensor all_to_all_dim0(const at::Tensor& x, const Mesh& mesh, int32_t mesh_dim) {
  return wait(issue_all_to_all_dim0(x, mesh, mesh_dim));
}

at::Tensor broadcast(const at::Tensor& x, int64_t src, const Mesh& mesh, int32_t mesh_dim) {
  static const auto fn = functional_op("_c10d_functional::broadcast");
  return wait(issue(fn, {x.contiguous(), src, mesh.group_names[static_cast<size_t>(mesh_dim)]},
                    count(kBroadcast, x, mesh, mesh_dim)));
}

bool all_ranks(const Mesh& mesh, bool value) { return all_ranks(mesh, std::vector<bool>{value})[0]; }

std::vector<bool> all_ranks(const Mesh& mesh, const std::vector<bool>& values) {
  auto flags = at::empty({static_cast<int64_t>(values.size())}, at::TensorOptions().dtype(at::kInt));
  int32_t* in = flags.data_ptr<int32_t>();
  for (size_t k = 0; k < values.size(); ++k) in[k] = values[k] ? 1 : 0;
  flags = flags.to(mesh.device_type);
  for (size_t m = 0; m < mesh.shape.size(); ++m)
    if (mesh.shape[m] > 1) flags = all_reduce(flags, ReduceOp::Min, mesh, static_cast<int32_t>(m));
  flags = flags.cpu().contiguous();
  const int32_t* out_flags = flags.data_ptr<int32_t>();
  std::vector<bool> out(values.size());
  for (size_t k = 0; k < values.size(); ++k) out[k] = out_flags[k] == 1;
  return out;
}

at::Tensor with_layout_of(const at::Tensor& local, c10::ArrayRef<int64_t> global_stride) {
  const auto want = strides_like(local.sizes(), global_stride);
  bool same = true;
  for (int64_t d = 0; d < local.dim() && same; ++d)
    same = local.size(d) <= 1 || local.stride(d) == want[static_cast<size_t>(d)];
  if (same) return local;
  auto out = at::empty_strided(local.sizes(), want, local.options());
  out.copy_(local);
  return out;
}

bool keeps_order_of(const at::Tensor& local, c10::ArrayRef<int64_t> global_stride) {
  const auto dense = strides_like(local.sizes(), global_stride);
  std::vector<int64_t> dims;  // dims that take more than one step, innermost first
  for (int64_t d = 0; d < local.dim(); ++d) {
    if (local.size(d) <= 1) continue;
    // A dim expanded (stride 0) in the global layout too is the same broadcast in the
    // shard: it needs no place of its own in memory.
    if (local.stride(d) == 0 && global_stride[static_cast<size_t>(d)] == 0) continue;
    dims.push_back(d);
  }
  std::sort(dims.begin(), dims.end(),
            [&](int64_t a, int64_t b) { return dense[static_cast<size_t>(a)] < dense[static_cast<size_t>(b)]; });
  // Each dim's step must clear the farthest element the dims inside it reach (a step
  // slice leaves gaps: [::2] of 5 reaches offset 4, not 6).
  int64_t reach = 0;
  for (int64_t d : dims) {
    if (local.stride(d) <= reach) return false;
    reach += local.stride(d) * (local.size(d) - 1);
  }
  return true;
}

at::Tensor execute_redistribution(
    const RedistPlan& plan,
    const Mesh& mesh,
    c10::ArrayRef<int64_t> global_shape,
    c10::ArrayRef<int64_t> global_stride,
    const at::Tensor& local) {
  if (plan.empty()) return local;
  at::Tensor x = local;
  for (size_t i = 0; i < plan.steps.size(); ++i) x = finish(start_step(plan, i, mesh, global_shape, x));
  return fresh_and_laid_out(std::move(x), local, global_stride);
}

std::shared_ptr<PendingShard> start_redistribution(
    const RedistPlan& plan,
    const Mesh& mesh,
    c10::ArrayRef<int64_t> global_shape,
    c10::ArrayRef<int64_t> global_stride,
    const at::Tensor& local) {
  at::Tensor x = local;
  for (size_t i = 0; i < plan.steps.size(); ++i) {
    auto step = start_step(plan, i, mesh, global_shape, x);
    if (i + 1 == plan.steps.size() && !step.done.defined()) {
      // The last step is a collective: finished at the first use of the shard.
      std::vector<int64_t> stride(global_stride.begin(), global_stride.end());
      // (A collective's output is always fresh: no aliasing check against `local`.)
      auto in_flight = std::make_shared<InFlight>(std::move(step));
      return std::make_shared<PendingShard>([in_flight, stride = std::move(stride)] {
        return with_layout_of(finish(std::move(*in_flight)), stride);
      });
    }
    x = finish(std::move(step));
  }
  auto ready = plan.empty() ? x : fresh_and_laid_out(std::move(x), local, global_stride);
  return std::make_shared<PendingShard>([ready] { return ready; });
}

}  // namespace vescale::collectives
