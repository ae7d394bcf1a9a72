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
  // While the saved tensors are all there (backward's start) the whole gradients are the
  // head's, whose backward runs first (with a tensor tied to the embedding: its
  // gradient too, which the head's backward starts) and two blocks' (one filling, one in
  // its bucket); the slices come as the saved tensors go.
  const double tied = p.tied_param_bytes / static_cast<double>(c.tp);
  const double during_grads =
      scatter_in_backward
          ? std::min(grads, (h.head_bytes + tied + 2 * largest_block) * p.grad_bytes_per_param_byte)
          : live_grads;
  // DDP's all-reduce buckets (ZeRO-0/1) are kept from step to step, as torch's DDP keeps
  // them: from the second step on they are there at every moment
  const double buckets = c.dp > 1 && c.zero <= 1 ? h.bucketed : 0.0;
  // forward and backward: the gradients fill up in this rank's first backward while its
  // micro-batch's saved tensors go, and are whole from then on. Where a forward follows a
  // backward (1F1B's steady state) whole gradients meet every micro-batch in flight;
  // else (GPipe, or one micro-batch) the fullest moments are the first backward's start
  // (no gradients) and the second's (whole gradients, one micro-batch fewer). ZeRO-2/3
  // without a pipeline: their gradients during backward (during_grads) meet all the saved
  // tensors.
  const bool whole_with_all = scatter_in_backward || h.forward_after_backward;
  const double saved_with_grads = whole_with_all ? h.saved : h.saved - h.saved_one;
  const bool grads_peak = saved_with_grads + during_grads > h.saved;
  const double peak_saved = grads_peak ? saved_with_grads : h.saved;
  const double peak_grads = grads_peak ? during_grads : 0.0;
  const double during = peak_saved + peak_grads + h.rematerialized + h.transient + buckets + gathered_blocks;
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
    mem.activations = peak_saved + h.rematerialized + h.transient;
    mem.grads = peak_grads + buckets;
  } else {
    mem.activations = 0;
    mem.grads = top;  // gradients, their bucket, the step's temporaries or a gathered bucket with them
  }
  return mem;
}

}  // namespace vescale::autoplan::eager
