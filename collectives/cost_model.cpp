#include "collectives/cost_model.h"

namespace vescale::collectives {

const LinkCost& link_cost(c10::DeviceType device) {
  // gloo over loopback TCP vs NCCL over NVLink: latency and bandwidth differ by
  // about two orders of magnitude.
  static const LinkCost cpu{50e-6, 1.0 / 2e9, 1.0 / 10e9};
  static const LinkCost cuda{10e-6, 1.0 / 150e9, 1.0 / 1000e9};
  return device == c10::DeviceType::CUDA ? cuda : cpu;
}

double all_gather_cost(const LinkCost& c, double bytes, int64_t k) {
  if (k <= 1) return 0;
  return c.alpha_s * (k - 1) + c.beta_s_per_byte * bytes * (k - 1) / k;
}

double all_reduce_cost(const LinkCost& c, double bytes, int64_t k) {
  if (k <= 1) return 0;
  return 2 * c.alpha_s * (k - 1) + 2 * c.beta_s_per_byte * bytes * (k - 1) / k;
}

double reduce_scatter_cost(const LinkCost& c, double bytes, int64_t k) {
  if (k <= 1) return 0;
  return c.alpha_s * (k - 1) + c.beta_s_per_byte * bytes * (k - 1) / k;
}

double all_to_all_cost(const LinkCost& c, double bytes, int64_t k) {
  if (k <= 1) return 0;
  // Each rank keeps 1/k of its shard and sends the rest.
  return c.alpha_s * (k - 1) + c.beta_s_per_byte * (bytes / k) * (k - 1) / k;
}

double local_copy_cost(const LinkCost& c, double bytes) { return c.copy_s_per_byte * bytes; }

double p2p_cost(const LinkCost& c, double bytes) { return c.alpha_s + c.beta_s_per_byte * bytes; }

}  // namespace vescale::collectives
