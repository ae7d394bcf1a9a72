// Box draws on CUDA with the whole fill's values: see random_local_cuda.h for how an
// element's Philox counter is found. The transforms are torch's own (uniform_'s lambda,
// written out below as torch 2.11 has it; the others from ATen's TransformationHelper.h),
// compiled the same way (nvcc contracts a * b + c into an FMA in both), so values match
// bit for bit; tests/python/test_cuda.py checks every fill and dtype against whole draws.

#include "sharding_rules/random_local.h"
#include "sharding_rules/random_local_cuda.h"

#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/DistributionsHelper.h>  // and TransformationHelper.h (no include guard of its own)
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/PhiloxUtils.cuh>
#include <c10/cuda/CUDAGuard.h>
#include <curand_kernel.h>

#include <limits>
#include <mutex>
#include <type_traits>

namespace vescale::rng::cuda {

namespace {

constexpr int kMaxDims = 25;
constexpr int64_t kBlock = 256;  // torch's block size for fills and dropout
constexpr int64_t kMaxGridY = 65535;  // a launch's limit on gridDim.y, which walks a box's runs

// Where the box's element e lies in the whole row-major tensor. The box is also a set of
// runs, contiguous in the whole tensor: the dims after the last dim the box cuts are
// whole, so a run spans sizes[split] x the whole dims after it.
struct Box {
  int ndim = 0;
  int64_t sizes[kMaxDims];
  int64_t offsets[kMaxDims];
  int64_t strides[kMaxDims];  // the whole tensor's
  int64_t count = 1;
  int split = 0;         // the last dim the box cuts (0 when it cuts none)
  int64_t run_len = 1;   // elements in a run
  int64_t runs = 1;

  __device__ int64_t whole_index(int64_t e) const {
    int64_t li = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      li += (offsets[d] + e % sizes[d]) * strides[d];
      e /= sizes[d];
    }
    return li;
  }

  __device__ int64_t run_start(int64_t r) const {
    int64_t li = offsets[split] * strides[split];
    for (int d = split - 1; d >= 0; --d) {
      li += (offsets[d] + r % sizes[d]) * strides[d];
      r /= sizes[d];
    }
    return li;
  }
};

Box make_box(at::IntArrayRef shape, at::IntArrayRef offsets, at::IntArrayRef sizes) {
  Box box;
  box.ndim = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int d = box.ndim - 1; d >= 0; --d) {
    box.sizes[d] = sizes[d];
    box.offsets[d] = offsets[d];
    box.strides[d] = stride;
    stride *= shape[d];
    box.count *= sizes[d];
  }
  for (int d = 0; d < box.ndim; ++d)
    if (sizes[d] != shape[d]) box.split = d;
  if (box.ndim > 0) {
    box.run_len = box.count == 0 ? 0 : sizes[box.split] * box.strides[box.split];
    box.runs = box.run_len == 0 ? 0 : box.count / box.run_len;
  }
  return box;
}

// Blocks of kBlock threads the device runs at once: torch's cap on a fill's grid.
int64_t resident_blocks() {
  const auto* props = at::cuda::getCurrentDeviceProperties();
  return int64_t{props->multiProcessorCount} * (props->maxThreadsPerMultiProcessor / kBlock);
}

// Threads in the grid torch launches over n elements (calc_execution_policy, dropout_cuda).
int64_t grid_threads(int64_t n) {
  return std::min(resident_blocks(), (n + kBlock - 1) / kBlock) * kBlock;
}

at::PhiloxCudaState take_offset(at::CUDAGeneratorImpl* gen, int64_t increment) {
  std::lock_guard<std::mutex> lock(gen->mutex_);
  return gen->philox_cuda_state(static_cast<uint64_t>(increment));
}

dim3 box_grid(int64_t count) {
  return dim3(static_cast<unsigned>(std::max<int64_t>(1, std::min(resident_blocks(), (count + kBlock - 1) / kBlock))));
}

// ---- the distribution functions torch's fills call, one Philox counter each ----------------

struct Uniform4 {
  __device__ float4 operator()(curandStatePhilox4_32_10_t* s) const { return curand_uniform4(s); }
};
struct Uniform2Double {
  __device__ double2 operator()(curandStatePhilox4_32_10_t* s) const { return curand_uniform2_double(s); }
};
struct Normal4 {
  __device__ float4 operator()(curandStatePhilox4_32_10_t* s) const { return curand_normal4(s); }
};
struct Normal2Double {
  __device__ double2 operator()(curandStatePhilox4_32_10_t* s) const { return curand_normal2_double(s); }
};

// torch's uniform_and_transform / normal_and_transform: double2 for double, float4 else.
template <typename scalar_t>
using UniformDist = std::conditional_t<std::is_same_v<scalar_t, double>, Uniform2Double, Uniform4>;
template <typename scalar_t>
using NormalDist = std::conditional_t<std::is_same_v<scalar_t, double>, Normal2Double, Normal4>;

// ---- the fills' transforms, as torch's kernels write them ----------------------------------

template <typename scalar_t, typename acc_t>
struct UniformT {  // uniform_kernel's lambda
  acc_t range;
  scalar_t from, to;
  __device__ scalar_t operator()(acc_t rand) const {
    auto value = static_cast<scalar_t>(rand * range + from);
    return value == to ? from : value;
  }
};
template <typename scalar_t, typename acc_t>
struct NormalT {
  acc_t mean, std;
  __device__ scalar_t operator()(acc_t rand) const {
    return static_cast<scalar_t>(at::transformation::normal<acc_t>(rand, mean, std));
  }
};
template <typename scalar_t, typename acc_t>
struct LogNormalT {
  acc_t mean, std;
  __device__ scalar_t operator()(acc_t rand) const {
    return static_cast<scalar_t>(
        at::transformation::log_normal<acc_t>(at::transformation::normal<acc_t>(rand, mean, std)));
  }
};
template <typename scalar_t, typename acc_t>
struct ExponentialT {
  acc_t lambda;
  __device__ scalar_t operator()(acc_t rand) const {
    return static_cast<scalar_t>(at::transformation::exponential<acc_t>(rand, lambda));
  }
};
template <typename scalar_t, typename acc_t>
struct CauchyT {
  acc_t median, sigma;
  __device__ scalar_t operator()(acc_t rand) const {
    return static_cast<scalar_t>(at::transformation::cauchy<acc_t>(rand, median, sigma));
  }
};
template <typename scalar_t, typename acc_t>
struct GeometricT {
  double p;
  __device__ scalar_t operator()(acc_t rand) const {
    return static_cast<scalar_t>(at::transformation::geometric<acc_t>(rand, p));
  }
};
template <typename scalar_t, typename acc_t>
struct BernoulliT {
  double p;
  __device__ scalar_t operator()(acc_t rand) const {
    return static_cast<scalar_t>(at::transformation::bernoulli<acc_t>(rand, p));
  }
};

// ---- the kernels ----------------------------------------------------------------------------
//
// Two ways to walk a box. Long runs (a quarter of a round of the grid or more, a round
// being S x unroll elements: a sharded sequence, the rows of a weight) go as torch's
// kernel goes: thread t of the whole grid starts Philox once, at the run's first round,
// and calls its distribution function round after round, keeping the values that fall
// in the run (one Philox call per `unroll` elements). Anything else goes element by
// element: a Philox start and call for each element of the box.

template <typename scalar_t, typename acc_t, int unroll, typename Dist, typename Transform>
__global__ void fill_runs_kernel(Box box, int64_t S, at::PhiloxCudaState philox, Dist dist, Transform transform,
                                 scalar_t* out) {
  const auto [seed, offset] = at::cuda::philox::unpack(philox);
  const int64_t r = blockIdx.y;
  const int64_t start = box.run_start(r), end = start + box.run_len;
  const int64_t window = S * unroll;  // elements a round of the grid covers
  const int64_t first = start / window, last = (end - 1) / window;
  scalar_t* run_out = out + r * box.run_len;
  for (int64_t t = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; t < S; t += int64_t{gridDim.x} * blockDim.x) {
    curandStatePhilox4_32_10_t state;
    curand_init(seed, t, offset + 4 * first, &state);
    for (int64_t k = first; k <= last; ++k) {
      auto rand = dist(&state);
#pragma unroll
      for (int ii = 0; ii < unroll; ++ii) {
        const int64_t li = (k * unroll + ii) * S + t;
        if (li >= start && li < end) run_out[li - start] = transform(static_cast<acc_t>((&rand.x)[ii]));
      }
    }
  }
}

template <typename scalar_t, typename acc_t, int unroll, typename Dist, typename Transform>
__global__ void fill_elements_kernel(Box box, int64_t S, at::PhiloxCudaState philox, Dist dist, Transform transform,
                                     scalar_t* out) {
  const auto [seed, offset] = at::cuda::philox::unpack(philox);
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < box.count; e += step) {
    const int64_t li = box.whole_index(e);
    const int64_t q = li / S;
    curandStatePhilox4_32_10_t state;
    curand_init(seed, li % S, offset + 4 * (q / unroll), &state);
    auto rand = dist(&state);
    out[e] = transform(static_cast<acc_t>((&rand.x)[q % unroll]));
  }
}

// native_dropout's kernels. With a vector width VEC >= 2 (fused_dropout_kernel_vec),
// thread t takes elements [(k x S + t) x VEC, + VEC) in round k, with VEC / 4 calls of
// curand_uniform4 a round when VEC >= 4 and one call (its .x and .y) when VEC == 2.
// With VEC == 1 (fused_dropout_kernel) elements go as in the fills, 4 to a call. An
// element is kept when its uniform is below 1 - p, and scaled by 1 / (1 - p), in the
// kernels' types.
struct DropoutGrid {
  int64_t S;
  int vec;
  __host__ __device__ int64_t window() const { return S * (vec == 1 ? 4 : vec); }
  __host__ __device__ int calls() const { return vec >= 4 ? vec / 4 : 1; }
};

template <typename scalar_t, typename acc_t>
__device__ void drop_one(float uniform, acc_t keep_p, acc_t scale, scalar_t x, scalar_t& out, bool& mask) {
  float r = uniform;
  r = r < keep_p;  // as the kernel: the uniform's slot holds the kept flag (0 or 1)
  out = x * r * scale;
  mask = static_cast<bool>(r);
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// v / d and v % d, in 32 bits where both fit (a 64-bit division costs several times more,
// and the vector walk below divides once per vector).
__device__ __forceinline__ void divmod(int64_t v, int64_t d, int64_t& q, int64_t& r) {
  if (v <= INT32_MAX && d <= INT32_MAX) {
    const auto v32 = static_cast<uint32_t>(v), d32 = static_cast<uint32_t>(d);
    q = v32 / d32;
    r = v32 % d32;
  } else {
    q = v / d;
    r = v % d;
  }
}

// VEC >= 2: one thread per vector of the whole tensor that meets the run (blockIdx.y),
// starting Philox at that vector's own thread and round of the whole kernel: vector v is
// thread v % S's in round v / S. Only the run's vectors are drawn, and those lying whole
// in the run move as one 16-byte load and two stores, as torch's kernel moves them.
template <typename scalar_t, typename acc_t, int VEC>
__global__ void dropout_vectors_kernel(Box box, int64_t S, bool aligned, at::PhiloxCudaState philox, acc_t keep_p,
                                       const scalar_t* in, scalar_t* out, bool* mask) {
  constexpr int calls = VEC >= 4 ? VEC / 4 : 1;
  const auto [seed, offset] = at::cuda::philox::unpack(philox);
  const acc_t scale = 1.0 / keep_p;
  const int64_t r = blockIdx.y;
  const int64_t start = box.run_start(r), end = start + box.run_len;
  const int64_t shift = r * box.run_len - start;  // a whole-tensor index's place in the box
  const bool whole_vectors = aligned && shift % VEC == 0;
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t v = start / VEC + int64_t{blockIdx.x} * blockDim.x + threadIdx.x; v * VEC < end; v += step) {
    int64_t round, thread;
    divmod(v, S, round, thread);
    curandStatePhilox4_32_10_t state;
    curand_init(seed, thread, offset + 4 * calls * round, &state);
    float4 rand[calls];
#pragma unroll
    for (int c = 0; c < calls; ++c) rand[c] = curand_uniform4(&state);
    const int64_t first = v * VEC, e = first + shift;
    if (whole_vectors && first >= start && first + VEC <= end) {
      const auto x = *reinterpret_cast<const Pack<scalar_t, VEC>*>(in + e);
      Pack<scalar_t, VEC> y;
      Pack<bool, VEC> kept;
#pragma unroll
      for (int j = 0; j < VEC; ++j) drop_one((&rand[j / 4].x)[j % 4], keep_p, scale, x.v[j], y.v[j], kept.v[j]);
      *reinterpret_cast<Pack<scalar_t, VEC>*>(out + e) = y;
      *reinterpret_cast<Pack<bool, VEC>*>(mask + e) = kept;
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        if (first + j >= start && first + j < end)
          drop_one((&rand[j / 4].x)[j % 4], keep_p, scale, in[e + j], out[e + j], mask[e + j]);
    }
  }
}

// VEC == 1 (fused_dropout_kernel): element li is value (li / S) % 4 of thread li % S's call
// in round li / S / 4, so a run is walked round by round, as the fills' runs are.
template <typename scalar_t, typename acc_t>
__global__ void dropout_runs_kernel(Box box, int64_t S, at::PhiloxCudaState philox, acc_t keep_p,
                                    const scalar_t* in, scalar_t* out, bool* mask) {
  const auto [seed, offset] = at::cuda::philox::unpack(philox);
  const acc_t scale = 1.0 / keep_p;
  const int64_t r = blockIdx.y;
  const int64_t start = box.run_start(r), end = start + box.run_len, base = r * box.run_len;
  const int64_t window = S * 4;
  const int64_t first = start / window, last = (end - 1) / window;
  for (int64_t t = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; t < S; t += int64_t{gridDim.x} * blockDim.x) {
    curandStatePhilox4_32_10_t state;
    curand_init(seed, t, offset + 4 * first, &state);
    for (int64_t k = first; k <= last; ++k) {
      const float4 rand = curand_uniform4(&state);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t li = (k * 4 + j) * S + t;
        if (li < start || li >= end) continue;
        const int64_t e = base + li - start;
        drop_one((&rand.x)[j], keep_p, scale, in[e], out[e], mask[e]);
      }
    }
  }
}

template <typename scalar_t, typename acc_t>
__global__ void dropout_elements_kernel(Box box, DropoutGrid grid, at::PhiloxCudaState philox, acc_t keep_p,
                                        const scalar_t* in, scalar_t* out, bool* mask) {
  const auto [seed, offset] = at::cuda::philox::unpack(philox);
  const acc_t scale = 1.0 / keep_p;
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < box.count; e += step) {
    const int64_t li = box.whole_index(e);
    int64_t thread, call;
    int value;
    if (grid.vec == 1) {
      thread = li % grid.S;
      call = li / grid.S / 4;
      value = static_cast<int>(li / grid.S % 4);
    } else {
      thread = li / grid.vec % grid.S;
      const int64_t round = li / (grid.S * grid.vec);
      const int j = static_cast<int>(li % grid.vec);
      call = round * grid.calls() + (grid.vec >= 4 ? j / 4 : 0);
      value = grid.vec >= 4 ? j % 4 : j;
    }
    curandStatePhilox4_32_10_t state;
    curand_init(seed, thread, offset + 4 * call, &state);
    float4 rand = curand_uniform4(&state);
    drop_one((&rand.x)[value], keep_p, scale, in[e], out[e], mask[e]);
  }
}

dim3 runs_grid(int64_t S, int64_t runs) {
  return dim3(static_cast<unsigned>((S + kBlock - 1) / kBlock), static_cast<unsigned>(runs));
}

// Runs of at least a quarter of a round go round by round: a run meets at most
// run / round + 2 rounds, each S Philox calls (x calls a round), where element by element
// costs two Philox evaluations (the start and the call) per element; a quarter of a
// round is where the two meet at worst.
bool walk_by_runs(const Box& box, int64_t window) {
  return box.run_len * 4 >= window && box.runs <= kMaxGridY;
}

template <typename scalar_t, typename acc_t, typename Dist, typename Transform>
void launch_fill(const Box& box, int64_t n, at::CUDAGeneratorImpl* gen, Transform transform, at::Tensor& out) {
  constexpr int unroll = sizeof(std::invoke_result_t<Dist, curandStatePhilox4_32_10_t*>) / sizeof(acc_t);
  const int64_t S = grid_threads(n);
  const auto philox = take_offset(gen, (n - 1) / (S * unroll) * 4 + 4);
  if (box.count == 0) return;
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (walk_by_runs(box, S * unroll))
    fill_runs_kernel<scalar_t, acc_t, unroll><<<runs_grid(S, box.runs), kBlock, 0, stream>>>(
        box, S, philox, Dist{}, transform, out.data_ptr<scalar_t>());
  else
    fill_elements_kernel<scalar_t, acc_t, unroll><<<box_grid(box.count), kBlock, 0, stream>>>(
        box, S, philox, Dist{}, transform, out.data_ptr<scalar_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t>
void fill_box(const Fill& fill, const Box& box, int64_t n, at::CUDAGeneratorImpl* gen, at::Tensor& out) {
  using acc_t = at::acc_type<scalar_t, true>;
  using discrete_t = typename at::DiscreteDistributionType<scalar_t>::type;
  const std::string& op = fill.op;
  if (op == "uniform_") {
    using opmath_t = at::opmath_type<scalar_t>;
    const auto from = static_cast<scalar_t>(fill.a);
    const auto to = static_cast<scalar_t>(fill.b);
    const auto range = static_cast<opmath_t>(to - from);
    launch_fill<scalar_t, opmath_t, UniformDist<scalar_t>>(box, n, gen, UniformT<scalar_t, opmath_t>{range, from, to}, out);
  } else if (op == "normal_") {
    launch_fill<scalar_t, acc_t, NormalDist<scalar_t>>(
        box, n, gen, NormalT<scalar_t, acc_t>{static_cast<acc_t>(fill.a), static_cast<acc_t>(fill.b)}, out);
  } else if (op == "log_normal_") {
    launch_fill<scalar_t, acc_t, NormalDist<scalar_t>>(
        box, n, gen, LogNormalT<scalar_t, acc_t>{static_cast<acc_t>(fill.a), static_cast<acc_t>(fill.b)}, out);
  } else if (op == "exponential_") {
    launch_fill<scalar_t, acc_t, UniformDist<scalar_t>>(box, n, gen, ExponentialT<scalar_t, acc_t>{static_cast<acc_t>(fill.a)},
                                                        out);
  } else if (op == "cauchy_") {
    launch_fill<scalar_t, acc_t, UniformDist<scalar_t>>(
        box, n, gen, CauchyT<scalar_t, acc_t>{static_cast<acc_t>(fill.a), static_cast<acc_t>(fill.b)}, out);
  } else if (op == "geometric_") {
    launch_fill<scalar_t, discrete_t, UniformDist<scalar_t>>(box, n, gen, GeometricT<scalar_t, discrete_t>{fill.a}, out);
  } else if (op == "bernoulli_.float") {
    launch_fill<scalar_t, discrete_t, UniformDist<scalar_t>>(box, n, gen, BernoulliT<scalar_t, discrete_t>{fill.a}, out);
  } else {
    TORCH_INTERNAL_ASSERT(false, "vescale: no CUDA box draw for ", op);
  }
}

bool floating(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// torch fills a tensor with 32-bit indexing in one launch (TensorIteratorBase::can_use_32bit_indexing).
bool one_launch(int64_t n, at::ScalarType dtype) {
  const int64_t limit = std::numeric_limits<int32_t>::max();
  return n <= limit && (n - 1) * static_cast<int64_t>(c10::elementSize(dtype)) + 1 <= limit;
}

bool box_fits(at::IntArrayRef shape, at::IntArrayRef offsets, at::IntArrayRef sizes) {
  if (shape.size() > static_cast<size_t>(kMaxDims) || offsets.size() != shape.size() || sizes.size() != shape.size())
    return false;
  for (size_t d = 0; d < shape.size(); ++d)
    if (offsets[d] < 0 || sizes[d] < 0 || offsets[d] + sizes[d] > shape[d]) return false;
  return true;
}

int64_t numel_of(at::IntArrayRef shape) {
  int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

}  // namespace

bool handles(const std::string& op, at::ScalarType dtype) {
  if (op == "bernoulli_.float") return floating(dtype) || dtype == at::kBool;
  return floating(dtype) && (op == "uniform_" || op == "normal_" || op == "log_normal_" || op == "exponential_" ||
                             op == "cauchy_" || op == "geometric_");
}

bool draw_box(const Fill& fill, const std::optional<at::Generator>& generator, at::IntArrayRef shape,
              at::IntArrayRef offsets, at::IntArrayRef sizes, at::Tensor& out) {
  const auto dtype = out.scalar_type();
  const int64_t n = numel_of(shape);
  if (!out.is_cuda() || !out.is_contiguous() || !handles(fill.op, dtype) || !box_fits(shape, offsets, sizes) ||
      !one_launch(n, dtype) || out.sizes() != sizes)
    return false;
  if (n == 0) return true;  // an empty fill takes nothing from the generator
  c10::cuda::CUDAGuard guard(out.device());
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(generator, at::cuda::detail::getDefaultCUDAGenerator());
  const Box box = make_box(shape, offsets, sizes);
  AT_DISPATCH_FLOATING_TYPES_AND3(at::kHalf, at::kBFloat16, at::kBool, dtype, "vescale_fill_box",
                                  [&] { fill_box<scalar_t>(fill, box, n, gen, out); });
  count_drawn(box.count);
  return true;
}

bool dropout_box(const at::Tensor& input, double p, at::IntArrayRef shape, at::IntArrayRef offsets,
                 at::IntArrayRef sizes, at::Tensor& output, at::Tensor& mask) {
  const int64_t n = numel_of(shape);
  if (!input.is_cuda() || !input.is_contiguous() || !floating(input.scalar_type()) || !box_fits(shape, offsets, sizes) ||
      input.sizes() != sizes || n == 0)
    return false;
  c10::cuda::CUDAGuard guard(input.device());
  output = at::empty_like(input);
  mask = at::empty_like(input, input.options().dtype(at::kBool));
  if (p == 1) {  // native_dropout_cuda's shortcut: zeros, nothing drawn
    output.zero_();
    mask.zero_();
    return true;
  }
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(std::nullopt, at::cuda::detail::getDefaultCUDAGenerator());
  const int64_t S = grid_threads(n);
  const auto philox = take_offset(gen, (n - 1) / (S * 4) * 4 + 4);
  const Box box = make_box(shape, offsets, sizes);
  if (box.count == 0) return true;
  const double keep = 1. - p;
  const auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "vescale_dropout_box", [&] {
    using acc_t = at::acc_type<scalar_t, true>;
    // get_vector_size for a fresh (aligned) contiguous tensor of n elements: 16 bytes,
    // halved until it divides n
    int vec = 16 / static_cast<int>(sizeof(scalar_t));
    while (vec > 1 && n % vec) vec /= 2;
    const DropoutGrid grid{S, vec};
    const auto* in = input.data_ptr<scalar_t>();
    auto* out = output.data_ptr<scalar_t>();
    auto* kept = mask.data_ptr<bool>();
    const auto keep_p = static_cast<acc_t>(keep);
    if (vec >= 2 && box.runs <= kMaxGridY) {
      // 16-byte moves need the input aligned as a fresh tensor is (output and mask are fresh)
      const bool aligned = reinterpret_cast<uintptr_t>(in) % (vec * sizeof(scalar_t)) == 0;
      const dim3 blocks(static_cast<unsigned>(std::min(resident_blocks(), (box.run_len / vec + 2 + kBlock - 1) / kBlock)),
                        static_cast<unsigned>(box.runs));
      const auto launch = [&](auto kernel) {
        kernel<<<blocks, kBlock, 0, stream>>>(box, S, aligned, philox, keep_p, in, out, kept);
      };
      switch (vec) {
        case 8: launch(dropout_vectors_kernel<scalar_t, acc_t, 8>); break;
        case 4: launch(dropout_vectors_kernel<scalar_t, acc_t, 4>); break;
        default: launch(dropout_vectors_kernel<scalar_t, acc_t, 2>); break;
      }
    } else if (vec == 1 && walk_by_runs(box, grid.window())) {
      dropout_runs_kernel<scalar_t, acc_t><<<runs_grid(S, box.runs), kBlock, 0, stream>>>(box, S, philox, keep_p, in, out, kept);
    } else {
      dropout_elements_kernel<scalar_t, acc_t><<<box_grid(box.count), kBlock, 0, stream>>>(box, grid, philox, keep_p, in, out, kept);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  count_drawn(box.count);
  return true;
}

}  // namespace vescale::rng::cuda
