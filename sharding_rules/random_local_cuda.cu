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

// Where the box's element e lies in the whole row-major tensor.
struct Box {
  int ndim = 0;
  int64_t sizes[kMaxDims];
  int64_t offsets[kMaxDims];
  int64_t strides[kMaxDims];  // the whole tensor's
  int64_t count = 1;

  __device__ int64_t whole_index(int64_t e) const {
    int64_t li = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      li += (offsets[d] + e % sizes[d]) * strides[d];
      e /= sizes[d];
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
  return box;
}

// Threads in the grid torch launches over n elements (calc_execution_policy, dropout_cuda).
int64_t grid_threads(int64_t n) {
  const auto* props = at::cuda::getCurrentDeviceProperties();
  const int64_t cap = int64_t{props->multiProcessorCount} * (props->maxThreadsPerMultiProcessor / kBlock);
  return std::min(cap, (n + kBlock - 1) / kBlock) * kBlock;
}

at::PhiloxCudaState take_offset(at::CUDAGeneratorImpl* gen, int64_t increment) {
  std::lock_guard<std::mutex> lock(gen->mutex_);
  return gen->philox_cuda_state(static_cast<uint64_t>(increment));
}

dim3 box_grid(int64_t count) {
  const auto* props = at::cuda::getCurrentDeviceProperties();
  const int64_t cap = int64_t{props->multiProcessorCount} * (props->maxThreadsPerMultiProcessor / kBlock);
  return dim3(static_cast<unsigned>(std::max<int64_t>(1, std::min(cap, (count + kBlock - 1) / kBlock))));
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

template <typename scalar_t, typename acc_t, int unroll, typename Dist, typename Transform>
__global__ void fill_box_kernel(Box box, int64_t S, at::PhiloxCudaState philox, Dist dist, Transform transform,
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

// fused_dropout_kernel_vec (VEC >= 2: thread (li / VEC) % S, round li / (S x VEC), VEC / 4
// calls a round when VEC >= 4, one call a round using .x and .y when VEC == 2) and
// fused_dropout_kernel (VEC == 1: as the fills, unroll 4). An element is kept when its
// uniform is below 1 - p, and scaled by 1 / (1 - p), in the kernels' types.
template <typename scalar_t, typename acc_t>
__global__ void dropout_box_kernel(Box box, int64_t S, int vec, at::PhiloxCudaState philox, acc_t keep_p,
                                   const scalar_t* in, scalar_t* out, bool* mask) {
  const auto [seed, offset] = at::cuda::philox::unpack(philox);
  const acc_t scale = 1.0 / keep_p;
  const int64_t step = int64_t{gridDim.x} * blockDim.x;
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < box.count; e += step) {
    const int64_t li = box.whole_index(e);
    int64_t thread, call;
    int value;
    if (vec == 1) {
      thread = li % S;
      call = li / S / 4;
      value = static_cast<int>(li / S % 4);
    } else {
      thread = li / vec % S;
      const int64_t round = li / (S * vec);
      const int j = static_cast<int>(li % vec);
      call = vec >= 4 ? round * (vec / 4) + j / 4 : round;
      value = vec >= 4 ? j % 4 : j;
    }
    curandStatePhilox4_32_10_t state;
    curand_init(seed, thread, offset + 4 * call, &state);
    float4 rand = curand_uniform4(&state);
    float& r = (&rand.x)[value];
    r = r < keep_p;
    out[e] = in[e] * r * scale;
    mask[e] = static_cast<bool>(r);
  }
}

template <typename scalar_t, typename acc_t, typename Dist, typename Transform>
void launch_fill(const Box& box, int64_t n, at::CUDAGeneratorImpl* gen, Transform transform, at::Tensor& out) {
  constexpr int unroll = sizeof(std::invoke_result_t<Dist, curandStatePhilox4_32_10_t*>) / sizeof(acc_t);
  const int64_t S = grid_threads(n);
  const auto philox = take_offset(gen, (n - 1) / (S * unroll) * 4 + 4);
  if (box.count == 0) return;
  fill_box_kernel<scalar_t, acc_t, unroll><<<box_grid(box.count), kBlock, 0, at::cuda::getCurrentCUDAStream()>>>(
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "vescale_dropout_box", [&] {
    using acc_t = at::acc_type<scalar_t, true>;
    // get_vector_size for a fresh (aligned) contiguous tensor of n elements: 16 bytes,
    // halved until it divides n
    int vec = 16 / static_cast<int>(sizeof(scalar_t));
    while (vec > 1 && n % vec) vec /= 2;
    dropout_box_kernel<scalar_t, acc_t><<<box_grid(box.count), kBlock, 0, at::cuda::getCurrentCUDAStream()>>>(
        box, S, vec, philox, static_cast<acc_t>(keep), input.data_ptr<scalar_t>(), output.data_ptr<scalar_t>(),
        mask.data_ptr<bool>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  count_drawn(box.count);
  return true;
}

}  // namespace vescale::rng::cuda
