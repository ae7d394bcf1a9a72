#pragma once
// Sharding propagation: from a scanned call to a cached Decision.
//
// On a miss it describes the call to the op's rule (global shapes of the results come
// from running the op on meta tensors), turns the rule's choice into specs and
// redistribution plans, and caches the result per thread. Ops without a rule, or
// without a meta kernel, get the replicate fallback.

#include "dispatch/call_scan.h"
#include "dispatch/decision.h"

namespace vescale {

const Decision& lookup_decision(
    const c10::OperatorHandle& op,
    const OpInfo& info,
    c10::ArrayRef<c10::IValue> args,
    const CallScan& scan);

// Forgets every cached decision (on all threads, lazily).
void clear_decision_cache();
// Number of decisions computed so far (cache misses), across threads.
int64_t decision_cache_misses();

}  // namespace vescale
