#include "dispatch/op_info.h"

#include "sharding_rules/rule.h"

#include <c10/util/flat_hash_map.h>

#include <memory>
#include <mutex>

namespace vescale {

namespace {

bool is_tensor_type(const c10::TypePtr& t) { return t->kind() == c10::TypeKind::TensorType; }

ArgKind kind_of(const c10::Argument& arg) {
  const auto& t = arg.type();
  if (is_tensor_type(t)) return ArgKind::Tensor;
  if (auto opt = t->cast<c10::OptionalType>()) {
    if (is_tensor_type(opt->getElementType())) return ArgKind::Tensor;
    const auto k = opt->getElementType()->kind();
    if (k == c10::TypeKind::NumberType || k == c10::TypeKind::FloatType) return ArgKind::TypeOnly;
  }
  if (auto list = t->cast<c10::ListType>()) {
    const auto& e = list->getElementType();
    if (is_tensor_type(e)) return ArgKind::TensorList;
    if (e->kind() == c10::TypeKind::NumberType) return ArgKind::TypeOnly;  // Scalar[]
    if (auto opt = e->cast<c10::OptionalType>(); opt && is_tensor_type(opt->getElementType()))
      return ArgKind::OptionalTensorList;
  }
  if (t->kind() == c10::TypeKind::NumberType || t->kind() == c10::TypeKind::FloatType)
    return ArgKind::TypeOnly;
  return ArgKind::Value;
}

std::unique_ptr<OpInfo> build(const c10::OperatorHandle& op) {
  const auto& schema = op.schema();
  auto info = std::make_unique<OpInfo>();
  info->name = c10::toString(op.operator_name());
  info->num_args = schema.arguments().size();
  info->num_returns = schema.returns().size();
  const bool scalars_matter = rules().keyed_on_scalar_values(info->name);
  for (const auto& a : schema.arguments()) {
    const auto kind = kind_of(a);
    info->args.push_back(kind == ArgKind::TypeOnly && scalars_matter ? ArgKind::Value : kind);
    const bool written = a.alias_info() && a.alias_info()->isWrite();
    info->arg_written.push_back(written);
    info->writes_any |= written;
  }
  for (const auto& r : schema.returns()) {
    const auto k = kind_of(r);
    info->returns.push_back(k == ArgKind::Tensor ? ReturnKind::Tensor
                                : k == ArgKind::TensorList ? ReturnKind::TensorList
                                                           : ReturnKind::Other);
    int alias_of = -1;
    // A list of views (unbind, split: `Tensor(a)[]`) carries its alias set on the element type.
    const c10::AliasInfo* view_alias = r.alias_info();
    if (view_alias && view_alias->beforeSets().empty() && !view_alias->containedTypes().empty())
      view_alias = &view_alias->containedTypes()[0];
    if (view_alias && !view_alias->isWrite() && !view_alias->beforeSets().empty()) {
      for (size_t i = 0; i < schema.arguments().size(); ++i) {
        const auto& a = schema.arguments()[i];
        if (a.alias_info() && a.alias_info()->beforeSets() == view_alias->beforeSets()) info->view_of = static_cast<int>(i);
      }
    }
    if (r.alias_info() && r.alias_info()->isWrite()) {
      for (size_t i = 0; i < schema.arguments().size(); ++i) {
        const auto& a = schema.arguments()[i];
        if (a.alias_info() && a.alias_info()->isWrite() &&
            a.alias_info()->beforeSets() == r.alias_info()->beforeSets()) {
          alias_of = static_cast<int>(i);
          break;
        }
      }
    }
    info->return_alias_of.push_back(alias_of);
  }
  return info;
}

}  // namespace

const OpInfo& op_info(const c10::OperatorHandle& op) {
  // Keyed by the schema's address, which is stable for a registered operator.
  thread_local ska::flat_hash_map<const void*, const OpInfo*> local;
  const void* key = &op.schema();
  if (auto it = local.find(key); it != local.end()) return *it->second;

  static std::mutex mu;
  static ska::flat_hash_map<const void*, std::unique_ptr<OpInfo>> shared;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = shared[key];
  if (!slot) slot = build(op);
  local.emplace(key, slot.get());
  return *slot;
}

}  // namespace vescale
