#include "autoplan/comm_time.h"

#include <algorithm>

namespace vescale::autoplan {

int64_t members_per_node(const Hardware& hw, Group g) {
  if (g.size <= 1) return 1;
  const int64_t per_node = std::max<int64_t>(1, hw.gpus_per_node / std::max<int64_t>(1, g.stride));
  return std::min(g.size, per_node);
}

double collective_time(const Hardware& hw, Collective kind, double bytes, Group g) {
  if (g.size <= 1 || bytes <= 0) return 0;
  const int64_t local = members_per_node(hw, g);
  const int64_t nodes = (g.size + local - 1) / local;
  const collectives::LinkCost nv = hw.nvlink(), ib = hw.ib();
  if (nodes == 1) {
    switch (kind) {
      case Collective::all_reduce: return collectives::all_reduce_cost(nv, bytes, local);
      case Collective::all_gather: return collectives::all_gather_cost(nv, bytes, local);
      case Collective::reduce_scatter: return collectives::reduce_scatter_cost(nv, bytes, local);
    }
  }
  const double slice = bytes / static_cast<double>(local);  // each member's share across nodes
  switch (kind) {
    case Collective::all_reduce:
      return collectives::reduce_scatter_cost(nv, bytes, local) + collectives::all_reduce_cost(ib, slice, nodes) +
             collectives::all_gather_cost(nv, bytes, local);
    case Collective::all_gather:
      return collectives::all_gather_cost(ib, slice, nodes) + collectives::all_gather_cost(nv, bytes, local);
    case Collective::reduce_scatter:
      return collectives::reduce_scatter_cost(nv, bytes, local) + collectives::reduce_scatter_cost(ib, slice, nodes);
  }
  return 0;
}

double p2p_time(const Hardware& hw, double bytes, bool same_node) {
  return collectives::p2p_cost(same_node ? hw.nvlink() : hw.ib(), bytes);
}

}  // namespace vescale::autoplan
