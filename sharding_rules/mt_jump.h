// Moving torch's CPU generator (MT19937, at::mt19937) forward without producing the
// numbers in between: by streaming (regenerating the 624-word state block by block, no
// tempering: well under a nanosecond per output) or by jumping (polynomial arithmetic
// over GF(2): t^m mod the characteristic polynomial of MT19937, by square-and-multiply,
// applied to the state by Horner's rule; O(log m) polynomial squarings plus one
// application, whatever m). advance() picks the cheaper one.
#pragma once

#include <ATen/core/MT19937RNGEngine.h>

#include <cstdint>

namespace vescale::mt {

// The state after n more calls of at::mt19937::operator(), streaming.
void stream(at::mt19937_data_pod& s, uint64_t n);
// The same state, by jumping (the polynomial for the skip is computed each call).
void jump(at::mt19937_data_pod& s, uint64_t n);
// Whichever is cheaper: streams short skips, jumps long ones.
void advance(at::mt19937_data_pod& s, uint64_t n);
// The skip (in outputs) from which advance() jumps; measured: see bench/rng_jump.py.
uint64_t jump_threshold();

}  // namespace vescale::mt
