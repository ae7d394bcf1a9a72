#include "sharding_rules/einsum.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <string>
#include <vector>

namespace vescale {

namespace {

struct Equation {
  std::vector<std::string> operands;
  std::string result;
};

Equation parse(std::string_view equation) {
  const auto arrow = equation.find("->");
  TORCH_CHECK(arrow != std::string_view::npos, "einsum_strategies: '", equation, "' has no '->'");
  Equation e;
  e.result = std::string(equation.substr(arrow + 2));
  std::string_view lhs = equation.substr(0, arrow);
  for (size_t start = 0;;) {
    const auto comma = lhs.find(',', start);
    e.operands.emplace_back(lhs.substr(start, comma == std::string_view::npos ? lhs.npos : comma - start));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return e;
}

bool has(const std::string& s, char c) { return s.find(c) != std::string::npos; }

Placement shard_at(const std::string& dims, char c) {
  return has(dims, c) ? Placement::shard(static_cast<int32_t>(dims.find(c))) : Placement::replicate();
}

}  // namespace

DimStrategies einsum_strategies(std::string_view equation) {
  const Equation e = parse(equation);
  const size_t n = e.operands.size();
  auto in_all = [&](char c) {
    return std::all_of(e.operands.begin(), e.operands.end(), [c](const std::string& o) { return has(o, c); });
  };
  std::string letters;  // each letter once, first appearance first
  for (const auto& o : e.operands)
    for (char c : o)
      if (!has(letters, c)) letters += c;
  for (char c : e.result) TORCH_CHECK(has(letters, c), "einsum_strategies: '", equation, "': ", c, " is in no operand");

  DimStrategies s;
  auto split = [&](char c, Placement out) {
    DimStrategy d;
    for (const auto& o : e.operands) d.inputs.push_back(shard_at(o, c));
    d.outputs.push_back(out);
    s.push_back(std::move(d));
  };
  for (char c : e.result)
    if (!in_all(c)) split(c, shard_at(e.result, c));
  for (char c : letters) {
    if (has(e.result, c)) continue;
    TORCH_CHECK(in_all(c), "einsum_strategies: '", equation, "': ", c,
                " is summed within one operand; only products whose letters are shared or kept are supported");
    split(c, Placement::partial());
  }
  for (const ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg})
    for (size_t linear_in = 0; linear_in < n; ++linear_in) {
      DimStrategy d{Placements(n, Placement::replicate()), {Placement::partial(op)}};
      d.inputs[linear_in] = Placement::partial(op);
      s.push_back(std::move(d));
    }
  for (char c : e.result)
    if (in_all(c)) split(c, shard_at(e.result, c));
  return s;
}

}  // namespace vescale
