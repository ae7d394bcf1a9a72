#pragma once
// Pointwise strategies, shared with the families that build on them (addmm's bias,
// foreach ops).

#include "sharding_rules/rule.h"

#include <vector>

namespace vescale {

// Where a pointwise op lets Partial inputs through.
struct Linearity {
  // true: the op is additive jointly in `args` (all of them if empty); false: linear
  // in each of `args` alone (none: nonlinear).
  bool additive = false;
  std::vector<int> args;
};

DimStrategies pointwise_strategies(const OpCall& call, const Linearity& lin);
RuleFn pointwise(Linearity lin);

}  // namespace vescale
