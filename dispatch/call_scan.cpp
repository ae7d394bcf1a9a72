#include "dispatch/call_scan.h"

#include "dispatch/dtensor_impl.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <functional>

namespace vescale {

namespace {

// Word tags keep differently shaped keys from colliding.
enum : uint64_t {
  kUndefined = 1,
  kDTensor,
  kPlain,
  kNone,
  kInt,
  kBool,
  kDouble,
  kList,
  kString,
  kDevice,
  kTypeOnly,
  kOther,
};

uint64_t bits_of(double d) {
  uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
}

[[noreturn]] void mesh_mismatch(const OpInfo& info, const Mesh& a, const Mesh& b) {
  TORCH_CHECK_VALUE(false, info.name, ": DTensor arguments live on different device meshes, ",
                    a.str(), " and ", b.str(),
                    "; redistribute them onto one mesh (or use to_local/from_local) before "
                    "combining them");
}

}  // namespace

void CallScan::add_tensor(const OpInfo& info, const at::Tensor& t, uint32_t arg, int32_t elem) {
  tensors.push_back(t);
  slots.push_back({arg, elem});
  if (!t.defined()) {
    key.push_back(kUndefined);
    return;
  }
  if (is_dtensor(t)) {
    const auto& spec = dtensor_impl(t)->spec();
    key.push_back(kDTensor);
    key.push_back(reinterpret_cast<uint64_t>(spec.get()));
    const Mesh* m = spec->mesh.get();
    if (mesh == nullptr) mesh = m;
    else if (mesh != m) mesh_mismatch(info, *mesh, *m);
    return;
  }
  const auto* impl = t.unsafeGetTensorImpl();
  key.push_back(kPlain);
  key.push_back(static_cast<uint64_t>(t.scalar_type()) |
                static_cast<uint64_t>(t.device().type()) << 8 |
                static_cast<uint64_t>(impl->is_wrapped_number()) << 16 |
                static_cast<uint64_t>(t.dim()) << 24);
  for (auto s : t.sizes()) key.push_back(static_cast<uint64_t>(s));
  for (auto s : t.strides()) key.push_back(static_cast<uint64_t>(s));
}

void CallScan::add_value(const c10::IValue& v) {
  if (v.isInt()) {
    key.push_back(kInt);
    key.push_back(static_cast<uint64_t>(v.toInt()));
  } else if (v.isBool()) {
    key.push_back(kBool);
    key.push_back(v.toBool());
  } else if (v.isNone()) {
    key.push_back(kNone);
  } else if (v.isDouble()) {
    key.push_back(kDouble);
    key.push_back(bits_of(v.toDouble()));
  } else if (v.isList()) {
    const auto list = v.toListRef();
    key.push_back(kList);
    key.push_back(list.size());
    for (const auto& e : list) add_value(e);
  } else if (v.isString()) {
    key.push_back(kString);
    key.push_back(std::hash<std::string_view>{}(v.toStringView()));
  } else if (v.isDevice()) {
    const auto d = v.toDevice();
    key.push_back(kDevice);
    key.push_back(static_cast<uint64_t>(d.type()) << 8 | static_cast<uint8_t>(d.index()));
  } else if (v.isSymInt()) {
    key.push_back(kInt);
    key.push_back(static_cast<uint64_t>(v.toSymInt().expect_int()));
  } else {
    key.push_back(kOther);  // e.g. a Generator: never changes a sharding decision
  }
}

void CallScan::run(const c10::OperatorHandle& op, const OpInfo& info,
                   c10::ArrayRef<c10::IValue> args) {
  key.push_back(reinterpret_cast<uint64_t>(&op.schema()));
  for (uint32_t i = 0; i < args.size(); ++i) {
    const auto& v = args[i];
    switch (info.args[i]) {
      case ArgKind::Tensor:
        add_tensor(info, v.isTensor() ? v.toTensor() : at::Tensor(), i, -1);
        break;
      case ArgKind::TensorList:
      case ArgKind::OptionalTensorList: {
        const auto list = v.toListRef();
        key.push_back(kList);
        key.push_back(list.size());
        for (size_t j = 0; j < list.size(); ++j)
          add_tensor(info, list[j].isTensor() ? list[j].toTensor() : at::Tensor(), i,
                     static_cast<int32_t>(j));
        break;
      }
      case ArgKind::TypeOnly:
        key.push_back(kTypeOnly);
        if (v.isList()) {
          key.push_back(kList);
          key.push_back(v.toListRef().size());
        } else {
          key.push_back(v.isNone() ? 0 : v.isDouble() ? 1 : v.isInt() ? 2 : v.isBool() ? 3 : 4);
        }
        break;
      case ArgKind::Value:
        add_value(v);
        break;
    }
  }
  TORCH_CHECK(mesh != nullptr, info.name, ": reached the DTensor handler without a DTensor argument");
}

void replace_tensors(torch::jit::Stack& stack, size_t base, const OpInfo& info,
                     c10::ArrayRef<TensorSlot> slots, c10::ArrayRef<at::Tensor> tensors) {
  size_t k = 0;
  while (k < slots.size()) {
    const uint32_t arg = slots[k].arg;
    auto& v = stack[base + arg];
    if (slots[k].elem < 0) {
      if (tensors[k].defined()) v = tensors[k];
      ++k;
      continue;
    }
    if (info.args[arg] == ArgKind::TensorList) {
      c10::List<at::Tensor> list;
      for (; k < slots.size() && slots[k].arg == arg; ++k) list.push_back(tensors[k]);
      v = std::move(list);
    } else {
      c10::List<std::optional<at::Tensor>> list;
      for (; k < slots.size() && slots[k].arg == arg; ++k)
        list.push_back(tensors[k].defined() ? std::optional<at::Tensor>(tensors[k]) : std::nullopt);
      v = std::move(list);
    }
  }
}

}  // namespace vescale
