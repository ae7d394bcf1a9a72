#include "dispatch/spec.h"

#include <c10/util/Exception.h>
#include <c10/util/hash.h>

#include <algorithm>
#include <mutex>
#include <numeric>
#include <sstream>
#include <unordered_set>

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
  const size_t n = shape.size();
  if (like_strides.size() != n) return dense_strides(shape);
  c10::SmallVector<size_t, 6> order(n);
  std::iota(order.begin(), order.end(), 0);
  // Innermost first: smallest stride; ties keep the later dim inner.
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (like_strides[a] != like_strides[b]) return like_strides[a] < like_strides[b];
    return a > b;
  });
  Shape strides(n);
  int64_t s = 1;
  for (size_t i : order) {
    strides[i] = s;
    s *= std::max<int64_t>(shape[i], 1);
  }
  return strides;
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

struct SpecHash {
  using is_transparent = void;
  size_t operator()(const SpecPtr& s) const { return s->hash; }
  size_t operator()(const TensorSpec* s) const { return s->hash; }
};

struct SpecEq {
  using is_transparent = void;
  static const TensorSpec& get(const SpecPtr& s) { return *s; }
  static const TensorSpec& get(const TensorSpec* s) { return *s; }
  template <class A, class B>
  bool operator()(const A& a, const B& b) const {
    const TensorSpec& x = get(a);
    const TensorSpec& y = get(b);
    return x.hash == y.hash && x.mesh == y.mesh && x.dtype == y.dtype &&
        x.placements == y.placements && x.shape == y.shape && x.stride == y.stride &&
        x.storage_offset == y.storage_offset;
  }
};

}  // namespace

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
  spec.shape.assign(shape.begin(), shape.end());
  spec.stride.assign(stride.begin(), stride.end());
  spec.dtype = dtype;
  spec.storage_offset = storage_offset;
  spec.hash = hash_spec(spec);

  static std::mutex mu;
  // std::unordered_set for the lookup by TensorSpec* (heterogeneous, C++20).
  static std::unordered_set<SpecPtr, SpecHash, SpecEq> interned;
  std::lock_guard<std::mutex> lock(mu);
  auto it = interned.find(&spec);
  if (it != interned.end()) return *it;
  // Checked once per distinct spec: an interned one was laid out before.
  const auto problem = interleaved_problem(spec.shape, spec.placements, spec.mesh->shape);
  TORCH_CHECK_VALUE(problem.empty(), problem);
  spec.local = local_box(spec.shape, spec.placements, spec.mesh->shape, spec.mesh->coordinate);
  auto ptr = std::make_shared<const TensorSpec>(std::move(spec));
  interned.insert(ptr);
  return ptr;
}

SpecPtr with_placements(const SpecPtr& spec, PlacementsRef placements) {
  if (PlacementsRef(spec->placements) == placements) return spec;
  return make_spec(spec->mesh, placements, spec->shape, spec->stride, spec->dtype, spec->storage_offset);
}

}  // namespace vescale
