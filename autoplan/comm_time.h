#pragma once
// Collective and point-to-point times on a machine of GPU nodes: collectives/cost_model.h's
// alpha-beta ring formulas, put on NVLink inside a node and InfiniBand between nodes.
//
// A group spanning nodes runs hierarchically, as NCCL does with one NIC per GPU: the
// members of a node reduce-scatter (or gather) among themselves over NVLink, and each
// of them then runs the inter-node ring on its own slice of the buffer over its own NIC
// (all_reduce = intra reduce-scatter + inter all-reduce of bytes/local + intra all-gather).
// Groups running at the same time on other GPUs use other NICs, so they do not slow
// each other down; two collectives of one GPU at once are not modelled.

#include "autoplan/hardware.h"

#include <cstdint>

namespace vescale::autoplan {

// Ranks r0, r0 + stride, ..., in the global rank order, where consecutive ranks fill a
// node (gpus_per_node of them) before the next.
struct Group {
  int64_t size = 1;
  int64_t stride = 1;
};

enum class Collective { all_reduce, all_gather, reduce_scatter };

// Members of the group on one node (>= 1).
int64_t members_per_node(const Hardware& hw, Group g);

// Seconds for a collective whose full (unsharded) buffer is `bytes`.
double collective_time(const Hardware& hw, Collective kind, double bytes, Group g);

// Seconds for one message between two ranks.
double p2p_time(const Hardware& hw, double bytes, bool same_node);

}  // namespace vescale::autoplan
