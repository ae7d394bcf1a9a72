// Drawing only a box of a random fill on a CUDA device, with the values torch's CUDA
// kernels give on the whole tensor. Built only against a CUDA torch (VESCALE_CUDA).
//
// torch's CUDA fills are counter-based. A whole fill of n elements runs a grid of S
// threads (S = 256 x min(SMs x blocks per SM, ceil(n / 256))). Thread t starts Philox at
// (seed, subsequence t, the generator's offset) and calls its distribution function
// (curand_uniform4, curand_normal4, ...) once per round, each call taking 4 of the
// offset; a call gives `unroll` values (4 floats, or 2 doubles). Element li comes from
// thread li % S, round (li / S) / unroll, value (li / S) % unroll
// (distribution_elementwise_grid_stride_kernel, torch 2.11). So each element of a box is
// drawn alone: Philox at (seed, li % S, offset + 4 x round), the call, the value, and the
// fill's own transform (ATen's TransformationHelper.h). The generator moves as the whole
// fill would move it. native_dropout's kernel takes its elements in vectors of VEC
// (dropout_box).
//
// Handled: uniform_, normal_, log_normal_, exponential_, cauchy_ (floating dtypes),
// bernoulli_(p: float) (floating dtypes and bool), geometric_ (floating dtypes), on a
// dense row-major whole tensor that torch fills with 32-bit indexing (under 2^31
// bytes); native_dropout in training. Anything else (random_, bernoulli_(p: Tensor),
// larger tensors, which torch splits and draws piece by piece) is left to the
// caller, which draws the whole tensor.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

namespace vescale::rng::cuda {

// A fill by its op name ("normal_", "uniform_", "bernoulli_.float", ...) and its scalar
// parameters in schema order (b unused by one-parameter fills).
struct Fill {
  std::string op;
  double a = 0, b = 0;
};

bool handles(const std::string& op, at::ScalarType dtype);

// Writes into `out` (a contiguous CUDA tensor of `sizes`) the elements at `offsets` of
// what `fill` would write on a contiguous tensor of `shape`, and moves `generator` (the
// device's default when empty) as that whole fill would. False, with nothing drawn: not
// handled. The caller has checked the fill's arguments (torch's checks run on an empty
// tensor, which draws nothing).
bool draw_box(const Fill& fill, const std::optional<at::Generator>& generator, at::IntArrayRef shape,
              at::IntArrayRef offsets, at::IntArrayRef sizes, at::Tensor& out);

// native_dropout(whole, p, train=True) on a contiguous tensor of `shape`, for the box at
// `offsets`: `input` holds the box's values; returns (output, mask) of the box's sizes,
// and moves the default generator as the whole op would. False: not handled.
bool dropout_box(const at::Tensor& input, double p, at::IntArrayRef shape, at::IntArrayRef offsets,
                 at::IntArrayRef sizes, at::Tensor& output, at::Tensor& mask);

}  // namespace vescale::rng::cuda
