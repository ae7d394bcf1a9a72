#pragma once
// Per-operator facts derived once from the schema: how each argument takes part in
// the cache key and in unwrapping, which arguments the op writes, and which results
// hand back a written argument.

#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <vector>

namespace vescale {

enum class ArgKind : uint8_t {
  Tensor,              // Tensor or Tensor?
  TensorList,          // Tensor[]
  OptionalTensorList,  // Tensor?[]
  TypeOnly,            // Scalar, float, Scalar[]: only the type (and list length) reaches
                       // the key; values never change a sharding decision, and optimizer
                       // scalars change every step
  Value,               // everything else: the value is part of the key
};

enum class ReturnKind : uint8_t { Tensor, TensorList, Other };

struct OpInfo {
  std::string name;                  // "aten::add.Tensor"
  size_t num_args = 0;
  size_t num_returns = 0;
  std::vector<ArgKind> args;
  std::vector<bool> arg_written;     // schema alias annotation with a write (in-place, out=)
  std::vector<ReturnKind> returns;
  std::vector<int> return_alias_of;  // per result: index of the written argument it returns, or -1
  bool writes_any = false;
  int view_of = -1;                  // view ops (results alias an argument without writing): that argument
};

// Cached per operator; thread-safe.
const OpInfo& op_info(const c10::OperatorHandle& op);

}  // namespace vescale
