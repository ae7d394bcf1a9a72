// Drawing only a box of a random fill on the CPU, with the values the fill gives on the
// whole tensor: the generator (MT19937) is moved to where the box's numbers start
// (sharding_rules/mt_jump.h), the fill's own kernel draws the box's rows on a small
// buffer, and the generator ends where the whole fill would have left it.
//
// This needs to know how the fill consumes the generator, per element, on a contiguous
// tensor (torch 2.13 CPU kernels, checked by the tests against whole draws):
//   uniform_                 1 output per element (double: 2)
//   normal_ (float, double;  a uniform per element (double: 2 outputs), Box-Muller on
//     >= 16 elements)        groups of 16; if n % 16, the last 16 elements are redrawn
//                            from 16 more uniforms
//   bernoulli_(p: float)     2 outputs per element (a double uniform), any dtype
//   random_(), random_(from, to)   1 output per element, 2 where the range needs 64
//                            bits (random_(): int64 and double)
// Anything else (normal_ on fewer than 16 elements, whose Box-Muller caches a sample in
// the generator; half/bfloat16 normal_; exponential_, cauchy_, ...; non-contiguous
// tensors; a CUDA generator) is not handled here: its callers draw the whole tensor.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <functional>
#include <string>

namespace vescale::rng {

struct DrawModel {
  int64_t per_element = 0;  // generator outputs per element (0: not element-local/known)
  int64_t block = 1;        // elements drawn together
  bool tail = false;        // normal_: when n % 16, the last 16 are redrawn from 16 more uniforms
  bool ok() const { return per_element > 0; }
  int64_t consumption(int64_t n) const;  // outputs a whole draw of n elements takes
};

// op: "uniform_", "normal_", "bernoulli_.float", "random_", "random_.to", "random_.from";
// range: to - from for random_.to / random_.from (-1: none, or unknown).
DrawModel model_for(const std::string& op, at::ScalarType dtype, int64_t numel, int64_t range = -1);

// Fills a contiguous buffer from the generator's current state, as the op would.
using Fill = std::function<void(at::Tensor&)>;

// Writes into `out` (contiguous, of `sizes`) the elements at `offsets` of what `fill`
// would write on a contiguous tensor of `shape`, and leaves `gen` where that whole fill
// would have left it.
void draw_box(at::CPUGeneratorImpl* gen, const DrawModel& model, at::IntArrayRef shape, at::IntArrayRef offsets,
              at::IntArrayRef sizes, const Fill& fill, at::Tensor& out);

// Moves the generator forward by n outputs (jumping or streaming, whichever is cheaper).
void advance(at::CPUGeneratorImpl* gen, uint64_t n);

// Elements drawn by draw_box's fills since the last reset (a debug counter: a local
// draw of a box draws about the box, not the tensor).
int64_t drawn_elements();
void reset_drawn_elements();
void count_drawn(int64_t n);  // for the CUDA box drawer (random_local_cuda.h)

}  // namespace vescale::rng
