#pragma once
// Alpha-beta cost model for collectives, shared by the redistribution planner, the
// sharding-rule selection and the auto-planner (autoplan/comm_time.h places these on a
// machine's NVLink and InfiniBand links).
//
// A ring collective over k ranks costs (k-1) latency terms plus the bytes each rank
// sends times the per-byte time. The numbers are rough defaults per device type;
// only their ratios matter for choosing between shardings.

#include <c10/core/DeviceType.h>

#include <cstdint>

namespace vescale::collectives {

struct LinkCost {
  double alpha_s;           // latency per message, seconds
  double beta_s_per_byte;   // transfer time per byte, seconds
  double copy_s_per_byte;   // local memory copy time per byte, seconds
};

const LinkCost& link_cost(c10::DeviceType device);

// Costs in seconds; `bytes` is the size of the full (unsharded along the collective's
// mesh dim) buffer involved, `k` the number of ranks in the group.
double all_gather_cost(const LinkCost& c, double bytes, int64_t k);
double all_reduce_cost(const LinkCost& c, double bytes, int64_t k);
double reduce_scatter_cost(const LinkCost& c, double bytes, int64_t k);
double all_to_all_cost(const LinkCost& c, double bytes, int64_t k);
double local_copy_cost(const LinkCost& c, double bytes);
// One message of `bytes` from one rank to another (a pipeline send).
double p2p_cost(const LinkCost& c, double bytes);

}  // namespace vescale::collectives
