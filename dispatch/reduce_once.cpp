#include "dispatch/reduce_once.h"

#include "collectives/collectives.h"

namespace vescale {

at::Tensor laid_out_as(DTensorImpl& impl, const RedistPlan& plan, const SpecPtr& target, bool keep) {
  const auto& src = *impl.spec();
  if (C10_LIKELY(!any_partial(src.placements)))
    return collectives::execute_redistribution(plan, *src.mesh, src.shape, src.stride, impl.local());
  if (const auto* kept = impl.reduced()) {
    if (kept->spec == target) return kept->local;
    const auto moves = plan_redistribution(*kept->spec, target->placements);
    return collectives::execute_redistribution(moves, *src.mesh, src.shape, src.stride, kept->local);
  }
  auto local = collectives::execute_redistribution(plan, *src.mesh, src.shape, src.stride, impl.local());
  if (keep && !any_partial(target->placements)) impl.keep_reduced(local, target);
  return local;
}

}  // namespace vescale
