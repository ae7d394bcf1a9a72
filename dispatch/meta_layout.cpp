#include "dispatch/meta_layout.h"

#include <ATen/TensorIterator.h>
#include <ATen/ops/empty.h>

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
  };
  return rows;
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

void match_cpu_layout(const std::string& name, const std::vector<at::Tensor>& metas, std::vector<TensorArg>& outputs) {
  const auto row = table().find(name);
  if (row == table().end() || outputs.empty() || !outputs[0].defined) return;
  auto& first = outputs[0];
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
