#include "autoplan/eager_memory.h"

#include <algorithm>
#include <cmath>

namespace vescale::autoplan::eager {

std::vector<double> buckets_of(double bytes, double cap) {
  if (bytes <= 0) return {};
  const double nb = std::max(1.0, std::ceil(bytes / cap));
  return std::vector<double>(static_cast<size_t>(nb), bytes / nb);
}

Memory rank_memory(const Problem& p, const Config& c, const RankHoldings& h) {
  const double dpd = static_cast<double>(c.dp);
  const double rb = h.param_bytes;
  const double largest_block = h.blocks.empty() ? 0.0 : *std::max_element(h.blocks.begin(), h.blocks.end());
  const double largest_unit_grads = std::max(largest_block, h.root_bytes) * p.grad_bytes_per_param_byte;
  Memory mem;
  // ZeRO-3 holds, besides the slices, the root unit whole (its module runs around all
  // the others, so it is gathered for the whole forward and backward; a pipeline stage
  // never releases it), and while forward and backward run two blocks: the one running
  // and the next, which backward prefetches (vescale/parallel/zero3.py), and the
  // backend's own copy of a block while it gathers
  mem.params = c.zero == 3 ? rb / dpd + h.root_bytes : rb;
  const double gathered_blocks = c.zero == 3 ? (2 + p.gather_copies) * largest_block : 0.0;
  mem.optimizer = (c.zero >= 1 ? (p.state_bytes_per_element + p.master_bytes_per_element) / dpd
                               : p.state_bytes_per_element) * (rb / 4.0);
  const double grads = rb * p.grad_bytes_per_param_byte;
  // ZeRO-2/3 without a pipeline copy each gradient into its unit's bucket as backward
  // produces it and keep a slice: whole gradients of at most two units (one reducing, one
  // filling) and the slices. A pipeline's schedule runs under no_sync
  // (vescale/parallel/pipeline/engine.py): gradients accumulate whole over the
  // micro-batches, as without ZeRO, and are reduce-scattered unit by unit at the end.
  const bool scatter_in_backward = c.dp > 1 && c.zero >= 2 && c.pp == 1;
  const double live_grads = scatter_in_backward ? std::min(grads, 2 * largest_unit_grads) + grads / dpd : grads;
  // DDP's all-reduce buckets (ZeRO-0/1) are kept from step to step, as torch's DDP keeps
  // them: from the second step on they are there at every moment
  const double buckets = c.dp > 1 && c.zero <= 1 ? h.bucketed : 0.0;
  // Forward and backward have two fullest moments. Early: the saved tensors at their
  // fullest (ZeRO-2/3 without a pipeline: with the whole gradients of the head, whose
  // backward runs first, of a tensor tied to the embedding, which the head's backward
  // starts, and of two blocks, one filling and one in its bucket). Late: the most of the
  // saved tensors that meet the gradients (eager.cpp walks a pipeline's schedule; without
  // one, what the last block's backward still has), with the gradients whole, or under
  // ZeRO-2/3 the slices, the tied tensor's and two blocks' whole.
  const double tied = p.tied_param_bytes / static_cast<double>(c.tp);
  const double g = p.grad_bytes_per_param_byte;
  const double early_grads = scatter_in_backward ? std::min(grads, (h.head_bytes + tied + 2 * largest_block) * g) : 0.0;
  const double late_grads = scatter_in_backward ? std::min(grads, (tied + 2 * largest_block) * g + grads / dpd) : grads;
  const double early = h.saved + early_grads + h.transient;
  // the loss rank's temporaries meet the gradients where its forwards follow backwards
  const double late = h.saved_with_grads + late_grads + (c.pp > 1 ? h.transient : 0.0);
  const bool late_peak = late > early;
  const double during = std::max(early, late) + h.rematerialized + buckets + gathered_blocks;
  // the gradients and their buckets (DDP's all-reduce); ZeRO-2/3's are in live_grads, or
  // after a pipeline: the whole gradients, the unit being copied into its bucket and the
  // one before, whose input the collective holds until it is waited for
  double reduce = grads + buckets;
  if (c.dp > 1 && c.zero >= 2) reduce = scatter_in_backward ? live_grads : grads + 2 * largest_unit_grads;
  const double kept = c.zero >= 2 ? grads / dpd : grads;
  const double stepping = kept + p.optimizer_temp_per_element * h.optimizer_elements + buckets;  // the optimizer step
  // ZeRO-1/2 then gather the updated slices into the parameters one bucket at a time
  // (vescale/parallel/optimizer.py): the gradients kept and one bucket's parameters whole
  // (ZeRO-1: into DDP's kept bucket, no new buffer; ZeRO-2: a unit's, fresh), and the
  // backend's copy of it
  double gathering = 0;
  if (c.dp > 1 && (c.zero == 1 || c.zero == 2)) {
    std::vector<double> units = h.blocks;
    units.push_back(h.root_bytes);
    double largest = 0;
    for (const double u : c.zero == 2 ? units : std::vector<double>{rb})
      for (const double b : buckets_of(u, p.bucket_bytes)) largest = std::max(largest, b);
    gathering = kept + largest * ((c.zero == 2 ? 1 : 0) + p.gather_copies) + buckets;
  }
  const double top = std::max({during, reduce, stepping, gathering});
  if (top == during) {
    mem.params += gathered_blocks;
    mem.activations = (late_peak ? late - late_grads : early - early_grads) + h.rematerialized;
    mem.grads = (late_peak ? late_grads : early_grads) + buckets;
  } else {
    mem.activations = 0;
    mem.grads = top;  // gradients, their bucket, the step's temporaries or a gathered bucket with them
  }
  return mem;
}

}  // namespace vescale::autoplan::eager
