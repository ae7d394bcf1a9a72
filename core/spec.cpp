#include "core/spec.h"

#include <ATen/ExpandUtils.h>
#include <c10/util/Exception.h>
#include <c10/util/hash.h>

#include <algorithm>
#include <mutex>
#include <numeric>
#include <sstream>
#include <unordered_map>

namespace vescale {

int64_t TensorSpec::numel() const {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

std::string TensorSpec::str() const {
  std::ostringstream os;
  os << "Spec(" << to_string(placements) << ", shape=[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "], " << c10::toString(dtype) << ")";
  return os.str();
}

Shape dense_strides(c10::ArrayRef<int64_t> shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= std::max<int64_t>(shape[i], 1);
  }
  return strides;
}

Shape strides_like(c10::ArrayRef<int64_t> shape, c10::ArrayRef<int64_t> like_strides) {
  if (like_strides.size() != shape.size()) return dense_strides(shape);
  // Torch's own rule (TensorIterator's, and empty_like's for tensors that are not dense):
  // a dim of stride 0 (expanded) has no place in the order and keeps its contiguous
  // one. Sorting it innermost instead gave an expanded key's shards a last-dim stride
  // of 2, which the CPU flash-attention kernel reads as if it were 1.
  const auto strides = at::infer_dense_strides(shape, like_strides);
  return Shape(strides.begin(), strides.end());
}

int32_t normalize_shard_dim(int64_t dim, int64_t ndim, const std::string& what) {
  const int64_t d = dim < 0 ? dim + ndim : dim;
  TORCH_CHECK_INDEX(d >= 0 && d < ndim, what, ": Shard(", dim, ") is out of range for a tensor with ",
                    ndim, " dimension", ndim == 1 ? "" : "s", "; use a dim in [", -ndim, ", ",
                    ndim - 1, "]");
  return static_cast<int32_t>(d);
}

namespace {

size_t hash_spec(const TensorSpec& s) {
  auto h = c10::get_hash(s.mesh.get(), static_cast<int>(s.dtype), s.storage_offset);
  for (const auto& p : s.placements) h = c10::hash_combine(h, p.code());
  for (auto v : s.shape) h = c10::hash_combine(h, static_cast<size_t>(v));
  for (auto v : s.stride) h = c10::hash_combine(h, static_cast<size_t>(v));
  return h;
}

bool same_spec(const TensorSpec& x, const TensorSpec& y) {
  return x.hash == y.hash && x.mesh == y.mesh && x.dtype == y.dtype && x.placements == y.placements &&
      x.shape == y.shape && x.stride == y.stride && x.storage_offset == y.storage_offset;
}

// The interning table holds its specs weakly: a spec lives as long as a tensor, a
// cached decision or a caller holds it, and equal live specs are one object. Entries
// whose spec died are dropped when met during a lookup, and all at once whenever the
// table has grown to twice its live size since the last sweep (so its size stays
// within twice the number of live specs, plus kMinSweep).
constexpr size_t kMinSweep = 4096;

struct InternTable {
  std::mutex mu;
  std::unordered_multimap<size_t, std::weak_ptr<const TensorSpec>> entries;
  size_t sweep_at = kMinSweep;

  // Drops the entries whose spec died; the caller holds `mu`.
  void sweep() {
    std::erase_if(entries, [](const auto& e) { return e.second.expired(); });
    sweep_at = std::max(kMinSweep, 2 * entries.size());
  }
};

InternTable& intern_table() {
  static auto* table = new InternTable();  // never destroyed: specs may die during exit
  return *table;
}

}  // namespace

SpecTableSize spec_table_size() {
  auto& t = intern_table();
  std::lock_guard<std::mutex> lock(t.mu);
  SpecTableSize out;
  out.entries = t.entries.size();
  t.sweep();
  out.live = t.entries.size();
  out.min_sweep = kMinSweep;
  return out;
}

SpecPtr make_spec(
    MeshPtr mesh,
    PlacementsRef placements,
    c10::ArrayRef<int64_t> shape,
    c10::ArrayRef<int64_t> stride,
    c10::ScalarType dtype,
    int64_t storage_offset) {
  TORCH_CHECK_VALUE(mesh, "a DTensor spec needs a mesh");
  TORCH_CHECK_VALUE(static_cast<int64_t>(placements.size()) == mesh->ndim(), "got ",
                    placements.size(), " placements ", to_string(placements), " for a ",
                    mesh->ndim(), "-d mesh; give one placement per mesh dimension");
  TORCH_CHECK_VALUE(stride.size() == shape.size(), "stride and shape differ in length");
  TensorSpec spec;
  spec.mesh = std::move(mesh);
  spec.placements.assign(placements.begin(), placements.end());
  const auto ndim = static_cast<int64_t>(shape.size());
  for (auto& p : spec.placements)
    if (p.splits()) p.dim = normalize_shard_dim(p.dim, ndim, "placement");
  replicate_groups_of_one(spec.placements, spec.mesh->shape);
  spec.shape.assign(shape.begin(), shape.end());
  spec.stride.assign(stride.begin(), stride.end());
  spec.dtype = dtype;
  spec.storage_offset = storage_offset;
  spec.hash = hash_spec(spec);

  auto& table = intern_table();
  std::lock_guard<std::mutex> lock(table.mu);
  auto [first, last] = table.entries.equal_range(spec.hash);
  for (auto it = first; it != last;) {
    if (auto live = it->second.lock()) {
      if (same_spec(*live, spec)) return live;
      ++it;
    } else {
      it = table.entries.erase(it);
    }
  }
  // Checked once per distinct spec: an interned one was laid out before.
  const auto problem = interleaved_problem(spec.shape, spec.placements, spec.mesh->shape);
  TORCH_CHECK_VALUE(problem.empty(), problem);
  spec.local = local_box(spec.shape, spec.placements, spec.mesh->shape, spec.mesh->coordinate);
  if (table.entries.size() >= table.sweep_at) table.sweep();
  const size_t hash = spec.hash;
  SpecPtr ptr = std::make_shared<const TensorSpec>(std::move(spec));
  table.entries.emplace(hash, ptr);
  return ptr;
}

SpecPtr with_placements(const SpecPtr& spec, PlacementsRef placements) {
  if (PlacementsRef(spec->placements) == placements) return spec;
  return make_spec(spec->mesh, placements, spec->shape, spec->stride, spec->dtype, spec->storage_offset);
}

}  // namespace vescale
