#pragma once
// Sharding propagation: from a scanned call to a cached Decision.
//
// On a miss it describes the call to the op's rule (global shapes of the results come
// from running the op on meta tensors), turns the rule's choice into specs and
// redistribution plans, and caches the result per thread. Ops without a rule, or
// without a meta kernel, get the replicate fallback.

#include "dispatch/call_scan.h"
#include "dispatch/decision.h"

#include <memory>
#include <string>

namespace vescale {

const Decision& lookup_decision(
    const c10::OperatorHandle& op,
    const OpInfo& info,
    c10::ArrayRef<c10::IValue> args,
    const CallScan& scan);

// "Decision(inputs [Shard(0)]; [Shard(1)] -> [Replicate()] by all_gather(dim=1, mesh_dim=0); results [Shard(0)])"
std::string to_string(const Decision& decision);

// A Decision reference stays valid until the calling thread's next lookup_decision.

// Whether this thread's cache holds a decision for the scanned call (no side effect).
bool decision_cached(const CallScan& scan);

// A decision computed afresh for vescale.explain (the cache is neither read nor
// written), with what the rule weighed and why a fallback fell back.
struct DecisionTrace {
  std::unique_ptr<Decision> decision;
  bool cached = false;          // the cache held a decision for this call
  std::string fallback_reason;  // set for the replicate fallback
  CandidateLog candidates;      // empty when the rule chose without choose_cheapest
};
DecisionTrace trace_decision(const c10::OperatorHandle& op, const OpInfo& info, c10::ArrayRef<c10::IValue> args,
                             const CallScan& scan);

// Forgets every cached decision (on all threads, lazily).
void clear_decision_cache();
// Number of decisions computed so far (cache misses), across threads.
int64_t decision_cache_misses();

// The caches are per thread, each cleared when it reaches `limit` entries.
struct DecisionCacheSize {
  int64_t entries;    // cached decisions, all threads together
  size_t limit;       // per thread
  int64_t evictions;  // times a full cache was cleared
};
DecisionCacheSize decision_cache_size();
void set_decision_cache_limit(size_t limit);
size_t default_decision_cache_limit();

}  // namespace vescale
