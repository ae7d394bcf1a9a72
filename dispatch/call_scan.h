#pragma once
// One pass over a call's arguments on the per-op path: it builds the cache key and
// collects the tensor arguments (flattened in schema order) and their mesh.
//
// The key is a short list of 64-bit words: the operator, then per argument either a
// DTensor's interned spec pointer, a plain tensor's metadata, or a non-tensor value
// (Scalar and float arguments contribute only their type, see ArgKind::TypeOnly).

#include "core/mesh.h"
#include "dispatch/op_info.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <c10/util/SmallVector.h>

namespace vescale {

struct TensorSlot {
  uint32_t arg;   // schema argument index
  int32_t elem;   // position in a list argument, -1 for a single tensor
};

struct CallScan {
  c10::SmallVector<uint64_t, 32> key;
  c10::SmallVector<at::Tensor, 6> tensors;  // flattened; undefined for absent optionals
  c10::SmallVector<TensorSlot, 6> slots;
  const Mesh* mesh = nullptr;

  // Throws when DTensors from different meshes meet.
  void run(const c10::OperatorHandle& op, const OpInfo& info, c10::ArrayRef<c10::IValue> args);

 private:
  void add_tensor(const OpInfo& info, const at::Tensor& t, uint32_t arg, int32_t elem);
  void add_value(const c10::IValue& v);
};

// Writes `tensors` (one per slot, as collected by CallScan) into the arguments that
// start at stack[base], rebuilding list arguments.
void replace_tensors(torch::jit::Stack& stack, size_t base, const OpInfo& info,
                     c10::ArrayRef<TensorSlot> slots, c10::ArrayRef<at::Tensor> tensors);

// Calls `fn(tensor)` for every tensor result of an op whose results start at
// stack[base], in flattened order (undefined tensors for absent results), and
// stores what it returns back in place.
template <class Fn>
void map_results(torch::jit::Stack& stack, size_t base, const OpInfo& info, Fn&& fn) {
  for (size_t r = 0; r < info.num_returns; ++r) {
    auto& v = stack[base + r];
    switch (info.returns[r]) {
      case ReturnKind::Tensor:
        v = fn(v.isTensor() ? v.toTensor() : at::Tensor(), static_cast<int>(r));
        break;
      case ReturnKind::TensorList: {
        c10::List<at::Tensor> out;
        for (const auto& e : v.toTensorList()) out.push_back(fn(e, static_cast<int>(r)));
        v = std::move(out);
        break;
      }
      case ReturnKind::Other:
        break;
    }
  }
}

}  // namespace vescale
