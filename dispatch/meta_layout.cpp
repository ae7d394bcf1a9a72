#include "dispatch/meta_layout.h"

#include <ATen/Context.h>
#include <ATen/TensorIterator.h>
#include <ATen/WrapDimUtils.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <numeric>

#include <unordered_map>

namespace vescale {

namespace {

enum class CpuLayout {
  Elementwise,   // TensorIterator's over the tensor inputs (the meta kernel may go contiguous)
  Contiguous,    // the first result contiguous (the meta kernel keeps the input's layout)
  InputsFormat,  // the first result in the memory format the first input suggests
                 // (channels-last stays so, any other layout becomes contiguous)
  LossBackward,  // (grad, self, target...): contiguous when the result has self's shape;
                 // the meta kernel is right when self broadcasts against the target
  Fft,           // (self, dim, ...): MKL's layout on CPU (below); torch's meta kernels take
                 // cuFFT's path on meta tensors, which is right on CUDA only
  Conv1d,        // (input, weight, ...): on CPU a 3-d input is made contiguous and run as
                 // (N, C, 1, L), which suggests channels-last when it has one channel; the
                 // meta kernel looks at the 3-d input and says contiguous
};

// Found by comparing meta and CPU strides for transposed and broadcast inputs
// (tests/python/test_meta_layout.py runs each row against plain torch).
const std::unordered_map<std::string, CpuLayout>& table() {
  static const std::unordered_map<std::string, CpuLayout> rows = {
      {"aten::copysign.Tensor", CpuLayout::Elementwise},
      {"aten::floor_divide", CpuLayout::Elementwise},
      {"aten::div.Tensor_mode", CpuLayout::Elementwise},
      {"aten::heaviside", CpuLayout::Elementwise},
      {"aten::logaddexp", CpuLayout::Elementwise},
      {"aten::logaddexp2", CpuLayout::Elementwise},
      {"aten::logical_and", CpuLayout::Elementwise},
      {"aten::logical_or", CpuLayout::Elementwise},
      {"aten::logical_xor", CpuLayout::Elementwise},
      {"aten::xlogy.Tensor", CpuLayout::Elementwise},
      {"aten::special_xlog1py", CpuLayout::Elementwise},
      {"aten::native_dropout_backward", CpuLayout::Elementwise},
      {"aten::hardtanh_backward", CpuLayout::Elementwise},
      {"aten::softplus_backward", CpuLayout::Elementwise},
      {"aten::elu_backward", CpuLayout::Elementwise},
      {"aten::hardswish_backward", CpuLayout::Elementwise},
      {"aten::hardsigmoid_backward", CpuLayout::Elementwise},
      {"aten::logit_backward", CpuLayout::Elementwise},
      {"aten::log_sigmoid_forward", CpuLayout::Contiguous},
      {"aten::_log_softmax_backward_data", CpuLayout::Contiguous},
      {"aten::isin.Tensor_Tensor", CpuLayout::Contiguous},
      {"aten::isin.Tensor_Scalar", CpuLayout::Contiguous},
      {"aten::normal.Tensor_Tensor", CpuLayout::Contiguous},
      {"aten::normal.float_Tensor", CpuLayout::Contiguous},
      {"aten::poisson", CpuLayout::Contiguous},
      {"aten::mse_loss_backward", CpuLayout::LossBackward},
      {"aten::smooth_l1_loss_backward", CpuLayout::LossBackward},
      {"aten::huber_loss_backward", CpuLayout::LossBackward},
      {"aten::native_batch_norm", CpuLayout::InputsFormat},
      {"aten::_native_batch_norm_legit", CpuLayout::InputsFormat},
      {"aten::_native_batch_norm_legit.no_stats", CpuLayout::InputsFormat},
      {"aten::_native_batch_norm_legit_no_training", CpuLayout::InputsFormat},
      {"aten::_batch_norm_with_update", CpuLayout::InputsFormat},
      {"aten::_batch_norm_no_update", CpuLayout::InputsFormat},
      {"aten::native_batch_norm_backward", CpuLayout::InputsFormat},
      {"aten::_fft_r2c", CpuLayout::Fft},
      {"aten::_fft_c2c", CpuLayout::Fft},
      {"aten::_fft_c2r", CpuLayout::Fft},
      {"aten::roll", CpuLayout::InputsFormat},  // (chain fuzzer seed 49001738: after an FFT)
      {"aten::convolution", CpuLayout::Conv1d},  // (seed 49003445: one channel after a movedim)
  };
  return rows;
}

// ---- FFTs on CPU: _sort_dims and _exec_fft of aten/src/ATen/native/mkl/SpectralOps.cpp ----
// Mirrored step by step (std::partition and std::sort included, so that dims with equal
// strides fall the same way): batch dims first, in the input's stride order, then the
// transformed dims in the order they are transformed, the whole contiguous in that order.

using Dims = std::vector<int64_t>;

Dims sort_dims(c10::IntArrayRef strides, Dims dims, bool exclude_last) {
  std::sort(dims.begin(), dims.end() - (exclude_last ? 1 : 0),
            [&](int64_t a, int64_t b) { return strides[a] > strides[b]; });
  return dims;
}

Shape mkl_fft_strides(c10::IntArrayRef in_strides, c10::IntArrayRef out_sizes, const Dims& dims) {
  const auto ndim = static_cast<int64_t>(out_sizes.size());
  const auto batch_dims = ndim - static_cast<int64_t>(dims.size());
  Dims permute(static_cast<size_t>(ndim));
  std::iota(permute.begin(), permute.end(), int64_t{0});
  std::vector<bool> transformed(static_cast<size_t>(ndim));
  for (const auto d : dims) transformed[static_cast<size_t>(d)] = true;
  const auto batch_end = std::partition(permute.begin(), permute.end(),
                                        [&](int64_t d) { return !transformed[static_cast<size_t>(d)]; });
  std::sort(permute.begin(), batch_end, [&](int64_t a, int64_t b) { return in_strides[a] > in_strides[b]; });
  std::copy(dims.begin(), dims.end(), batch_end);
  // The result is made contiguous as [batch, transformed dims...], then viewed back.
  Shape inner(dims.size());  // contiguous strides of the transformed dims
  int64_t block = 1;
  for (size_t i = dims.size(); i-- > 0;) {
    inner[i] = block;
    block *= out_sizes[dims[i]];
  }
  Shape out(static_cast<size_t>(ndim));
  int64_t batch_numel = 1;
  for (int64_t i = batch_dims - 1; i >= 0; --i) {
    out[static_cast<size_t>(permute[static_cast<size_t>(i)])] = batch_numel * block;
    batch_numel *= out_sizes[permute[static_cast<size_t>(i)]];
  }
  for (int64_t i = batch_dims; i < ndim; ++i)
    out[static_cast<size_t>(permute[static_cast<size_t>(i)])] = inner[static_cast<size_t>(i - batch_dims)];
  return out;
}

// The CPU kernel's strides for the FFT `name` of `self` over `dims` into `out_sizes`.
Shape cpu_fft_strides(const std::string& name, const at::Tensor& self, Dims dims, c10::IntArrayRef out_sizes) {
  if (!at::hasMKL()) {  // pocketfft: a contiguous result
    Shape strides(out_sizes.size());
    int64_t step = 1;
    for (size_t d = out_sizes.size(); d-- > 0;) {
      strides[d] = step;
      step *= std::max<int64_t>(out_sizes[d], 1);
    }
    return strides;
  }
  if (name == "aten::_fft_r2c") return mkl_fft_strides(self.strides(), out_sizes, sort_dims(self.strides(), dims, true));
  if (name == "aten::_fft_c2c") return mkl_fft_strides(self.strides(), out_sizes, sort_dims(self.strides(), dims, false));
  // c2r: the c2c transforms of all but the last dim first, then the c2r of the last
  Shape strides(self.strides().begin(), self.strides().end());
  if (dims.size() > 1) {
    strides = mkl_fft_strides(strides, self.sizes(), sort_dims(strides, Dims(dims.begin(), dims.end() - 1), false));
    dims = {dims.back()};
  }
  return mkl_fft_strides(strides, out_sizes, dims);
}

Shape elementwise_strides(const std::vector<at::Tensor>& metas) {
  at::TensorIteratorConfig config;
  config.set_check_mem_overlap(false).promote_inputs_to_common_dtype(true).allow_cpu_scalars(true);
  config.add_owned_output(at::Tensor());
  for (const auto& t : metas)
    if (t.defined()) config.add_owned_const_input(t);
  const auto iter = config.build();
  const auto strides = iter.output(0).strides();
  return Shape(strides.begin(), strides.end());
}

}  // namespace

void match_cpu_layout(const std::string& name, c10::ArrayRef<c10::IValue> args, c10::DeviceType device,
                      const std::vector<at::Tensor>& metas, std::vector<TensorArg>& outputs) {
  const auto row = table().find(name);
  if (row == table().end() || outputs.empty() || !outputs[0].defined) return;
  auto& first = outputs[0];
  if (row->second == CpuLayout::Fft) {
    if (device != c10::kCPU || metas.empty() || args.size() < 2 || !args[1].isIntList()) return;
    Dims dims;
    for (const auto d : args[1].toIntVector()) dims.push_back(at::maybe_wrap_dim(d, metas[0].dim()));
    if (!dims.empty()) first.stride = cpu_fft_strides(name, metas[0], std::move(dims), first.shape);
    return;
  }
  if (row->second == CpuLayout::Conv1d) {
    if (device != c10::kCPU || metas.size() < 2 || !metas[0].defined() || !metas[1].defined() ||
        metas[0].dim() != 3 || first.shape.size() != 3)
      return;
    const auto input = metas[0].is_contiguous() ? metas[0] : metas[0].contiguous();
    constexpr auto cl = at::MemoryFormat::ChannelsLast;
    if (input.unsqueeze(2).suggest_memory_format() != cl && metas[1].unsqueeze(2).suggest_memory_format() != cl) return;
    const auto laid_out = at::empty({first.shape[0], first.shape[1], 1, first.shape[2]},
                                    at::TensorOptions().dtype(first.dtype).device(c10::kMeta).memory_format(cl));
    const auto s = laid_out.strides();
    first.stride = {s[0], s[1], s[3]};
    return;
  }
  if (row->second == CpuLayout::LossBackward &&
      (metas.size() < 2 || !metas[1].defined() || metas[1].sizes() != c10::IntArrayRef(first.shape)))
    return;
  if (row->second != CpuLayout::Elementwise) {
    const auto format = row->second == CpuLayout::InputsFormat && !metas.empty() && metas[0].defined()
                            ? metas[0].suggest_memory_format()
                            : at::MemoryFormat::Contiguous;
    const auto laid_out = at::empty(first.shape, at::TensorOptions().dtype(first.dtype).device(c10::kMeta).memory_format(format));
    first.stride.assign(laid_out.strides().begin(), laid_out.strides().end());
    return;
  }
  const auto strides = elementwise_strides(metas);
  for (auto& out : outputs)
    if (out.defined && out.shape.size() == strides.size()) out.stride = strides;
}

}  // namespace vescale
