#include "autoplan/eager_memory.h"

#include <algorithm>
#include <cmath>

namespace vescale::autoplan::eager {

std::vector<double> in_flight(const Schedule& s, int64_t stages) {
  std::vector<double> peak(static_cast<size_t>(stages), 1.0);
  if (s.orders.empty()) return peak;
  bool split = false;
  for (const auto& o : s.orders)
    for (const auto& a : o) split |= a.kind == 'I';
  for (const auto& order : s.orders) {
    std::vector<double> held(static_cast<size_t>(stages), 0.0);
    for (const auto& a : order) {
      auto& h = held[static_cast<size_t>(a.stage)];
      if (a.kind == 'F') {
        h += 1;
        peak[static_cast<size_t>(a.stage)] = std::max(peak[static_cast<size_t>(a.stage)], h);
      } else if (a.kind == 'B' || (split && a.kind == 'W')) {
        h -= 1;
      }
    }
  }
  return peak;
}

// The most bytes one rank's order keeps for backward at once, and the most once the
// rank's gradients are there (after its first B, W, or the first stage's I): a stage's
// saved tensors from a micro-batch's F to its backward (to W where the backward is split,
// except on the first stage, which runs its whole backward in I), and from I to W what
// the split keeps for W (`held`). Stages sharing a rank (virtual stages) count together.
Kept peak_kept(const std::vector<Action>& order, const std::vector<double>& saved, const std::vector<double>& held) {
  std::vector<double> halves(saved.size(), 0.0);
  double now = 0;
  bool grads = false;
  Kept k;
  for (const auto& a : order) {
    const auto s = static_cast<size_t>(a.stage);
    const bool whole_in_i = a.kind == 'I' && a.stage == 0;
    if (a.kind == 'F') {
      now += saved[s];
    } else if (a.kind == 'B' || whole_in_i || (a.kind == 'W' && halves[s] > 0)) {
      now -= saved[s];
      if (a.kind == 'W') {
        halves[s] -= 1;
        now -= held[s];
      }
    } else if (a.kind == 'I') {
      halves[s] += 1;
      now += held[s];
    }
    grads |= a.kind == 'B' || a.kind == 'W' || whole_in_i;
    k.peak = std::max(k.peak, now);
    if (grads) k.with_grads = std::max(k.with_grads, now);
  }
  return k;
}

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
