#pragma once
// The boxed kernel every aten op on a DTensor reaches:
//   unwrap -> propagate (cached) -> redistribute -> local op -> wrap.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace vescale {

void dtensor_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack);

// Registers dtensor_kernel for every operator whose CompositeExplicitAutograd kernel
// would otherwise win over our backend fallback. Idempotent.
void claim_composite_explicit_ops();

}  // namespace vescale
