#pragma once
// Per-mesh-dim strategies of a product written as an einsum equation ("mk,kn->mn"), as
// torch's gen_einsum_strategies derives them: one letter per tensor dim, every letter
// shared by all operands or appearing in the result. For each mesh dim:
//
//   a letter in one operand and the result   split it there, the others replicated
//   a letter in every operand, not the result split it in every operand: Partial(sum)
//   a letter in every operand and the result  split it everywhere (a batch dim)
//   any operand Partial, the others replicated  the result Partial (the product is
//                                               linear in each operand)
//
// Order (ties go to the earlier strategy): the result's own letters in result order,
// then the contracted ones, then the Partial ones (sum, then avg), then batch letters.
// The all-replicate strategy is the framework's (choose_cheapest adds it first).

#include "sharding_rules/rule.h"

#include <string_view>

namespace vescale {

DimStrategies einsum_strategies(std::string_view equation);

}  // namespace vescale
