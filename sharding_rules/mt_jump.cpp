// MT19937 jump-ahead. The words x_k of the Mersenne Twister obey
//   x_{k+624} = x_{k+397} ^ twist(x_k, x_{k+1}),
// a linear recurrence over GF(2) whose state (the upper bit of x_k and x_{k+1..k+623})
// has 19937 bits; every bit sequence of it (for k >= 1: x_0's lower bits are never used)
// obeys the characteristic polynomial phi (degree 19937), found here once per process by
// Berlekamp-Massey on one bit of the output. Then the window of 624 words m steps on is
// sum_j g_j W_{k+j} with g = t^m mod phi: Horner's rule over windows (one recurrence step
// and at most one 624-word XOR per coefficient).
#include "sharding_rules/mt_jump.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <mutex>
#include <vector>

namespace vescale::mt {

namespace {

constexpr int N = 624;
constexpr int M = 397;
constexpr int D = 19937;                 // degree of phi
constexpr int W = (D + 63) / 64 + 1;     // words of a polynomial of degree <= D (313)
constexpr uint32_t MATRIX_A = 0x9908b0dfU;
constexpr uint32_t UMASK = 0x80000000U;
constexpr uint32_t LMASK = 0x7fffffffU;

inline uint32_t twist(uint32_t u, uint32_t v) {
  return (((u & UMASK) | (v & LMASK)) >> 1) ^ ((0U - (v & 1U)) & MATRIX_A);  // branch-free: vectorises
}

// at::mt19937's next_state, on the words alone. Written as indexed loops so that the
// compiler vectorises them (the reads ahead are anti-dependences, the reads 227 behind
// are far enough); the AVX2 clone streams about 1.7x faster than the baseline one.
__attribute__((target_clones("avx2", "default"))) void regenerate(uint32_t* s) {
  for (int i = 0; i < N - M; ++i) s[i] = s[i + M] ^ twist(s[i], s[i + 1]);
  for (int i = N - M; i < N - 1; ++i) s[i] = s[i + M - N] ^ twist(s[i], s[i + 1]);
  s[N - 1] = s[M - 1] ^ twist(s[N - 1], s[0]);
}

using Poly = std::vector<uint64_t>;  // bit i = coefficient of t^i

inline bool bit(const Poly& p, int64_t i) { return (p[static_cast<size_t>(i >> 6)] >> (i & 63)) & 1U; }

// phi, by Berlekamp-Massey on the lowest bit of 2*D raw words.
Poly characteristic_polynomial() {
  at::mt19937 engine(5489);
  auto pod = engine.data();
  const int64_t n_bits = 2 * D;
  std::vector<uint8_t> s(static_cast<size_t>(n_bits));
  for (int64_t i = 0; i < n_bits; ++i) {
    if (i % N == 0) regenerate(pod.state_.data());
    s[static_cast<size_t>(i)] = pod.state_[static_cast<size_t>(i % N)] & 1U;
  }
  // r: the sequence reversed and packed, so that sum_i c_i s_{n-i} is a dot product of C
  // with a window of r starting at bit n_bits-1-n
  const int64_t rw = n_bits / 64 + 2;
  Poly r(static_cast<size_t>(rw), 0);
  for (int64_t j = 0; j < n_bits; ++j)
    if (s[static_cast<size_t>(n_bits - 1 - j)]) r[static_cast<size_t>(j >> 6)] |= uint64_t{1} << (j & 63);
  const int64_t cw = D / 64 + 4;
  Poly c(static_cast<size_t>(cw), 0), b(static_cast<size_t>(cw), 0), t;
  c[0] = b[0] = 1;
  int64_t L = 0, m = 1;
  for (int64_t n = 0; n < n_bits; ++n) {
    const int64_t off = n_bits - 1 - n;
    const int64_t w0 = off >> 6, sh = off & 63;
    uint64_t acc = 0;
    for (int64_t k = 0; k <= (L >> 6); ++k) {
      const uint64_t lo = r[static_cast<size_t>(w0 + k)];
      const uint64_t hi = (w0 + k + 1 < rw) ? r[static_cast<size_t>(w0 + k + 1)] : 0;
      const uint64_t win = sh ? ((lo >> sh) | (hi << (64 - sh))) : lo;
      acc ^= c[static_cast<size_t>(k)] & win;
    }
    if (!(__builtin_popcountll(acc) & 1)) {
      ++m;
      continue;
    }
    const bool grow = 2 * L <= n;
    if (grow) t = c;
    // c ^= b << m
    const int64_t ws = m >> 6, bs = m & 63;
    for (int64_t k = cw - 1; k >= ws; --k) {
      uint64_t v = b[static_cast<size_t>(k - ws)] << bs;
      if (bs && k - ws - 1 >= 0) v |= b[static_cast<size_t>(k - ws - 1)] >> (64 - bs);
      c[static_cast<size_t>(k)] ^= v;
    }
    if (grow) {
      L = n + 1 - L;
      b = std::move(t);
      m = 1;
    } else {
      ++m;
    }
  }
  TORCH_CHECK(L == D, "vescale: MT19937's characteristic polynomial came out of degree ", L, ", not ", D);
  Poly phi(W, 0);
  for (int64_t j = 0; j <= D; ++j)
    if (bit(c, D - j)) phi[static_cast<size_t>(j >> 6)] |= uint64_t{1} << (j & 63);
  return phi;
}

struct Tables {
  Poly phi;
  std::vector<Poly> shifted;  // phi << s, s = 0..63, W + 1 words each
};

const Tables& tables() {
  static const Tables tab = [] {
    Tables x;
    x.phi = characteristic_polynomial();
    x.shifted.assign(64, Poly(W + 1, 0));
    for (int s = 0; s < 64; ++s)
      for (int k = 0; k < W; ++k) {
        x.shifted[s][k] ^= x.phi[k] << s;
        if (s) x.shifted[s][k + 1] ^= x.phi[k] >> (64 - s);
      }
    return x;
  }();
  return tab;
}

// p (2W words) reduced mod phi in place; the remainder is in p[0..W).
void reduce(Poly& p, const Tables& tab) {
  for (int64_t w = static_cast<int64_t>(p.size()) - 1; w >= D / 64; --w) {
    while (true) {
      uint64_t word = p[static_cast<size_t>(w)];
      if (w == D / 64) word &= ~((uint64_t{1} << (D & 63)) - 1);  // only bits >= D
      if (!word) break;
      const int64_t i = w * 64 + 63 - __builtin_clzll(word);
      const int64_t sh = i - D;
      const uint64_t* src = tab.shifted[static_cast<size_t>(sh & 63)].data();
      uint64_t* dst = p.data() + (sh >> 6);
      for (int k = 0; k < W + 1; ++k) dst[k] ^= src[k];
    }
  }
}

inline uint64_t spread32(uint32_t x) {  // bits of x at the even positions
  uint64_t v = x;
  v = (v | (v << 16)) & 0x0000FFFF0000FFFFULL;
  v = (v | (v << 8)) & 0x00FF00FF00FF00FFULL;
  v = (v | (v << 4)) & 0x0F0F0F0F0F0F0F0FULL;
  v = (v | (v << 2)) & 0x3333333333333333ULL;
  v = (v | (v << 1)) & 0x5555555555555555ULL;
  return v;
}

// t^m mod phi, by square-and-multiply from the top bit of m.
Poly power_of_t(uint64_t m, const Tables& tab) {
  Poly g(2 * W + 2, 0);
  g[0] = 1;
  Poly sq(2 * W + 2, 0);
  for (int b = 63 - __builtin_clzll(m); b >= 0; --b) {
    std::fill(sq.begin(), sq.end(), 0);
    for (int k = 0; k < W; ++k) {
      sq[2 * k] = spread32(static_cast<uint32_t>(g[k]));
      sq[2 * k + 1] = spread32(static_cast<uint32_t>(g[k] >> 32));
    }
    reduce(sq, tab);
    std::swap(g, sq);
    if ((m >> b) & 1U) {  // times t
      for (int k = W; k > 0; --k) g[k] = (g[k] << 1) | (g[k - 1] >> 63);
      g[0] <<= 1;
      reduce(g, tab);
    }
  }
  g.resize(W);
  return g;
}

// The window of words `steps` recurrence steps after `window` (whose first word has an
// index >= 1 in the sequence).
void jump_window(uint32_t* window, uint64_t steps) {
  const auto& tab = tables();
  const Poly g = power_of_t(steps, tab);
  int64_t top = -1;
  for (int64_t i = D - 1; i >= 0; --i)
    if (bit(g, i)) {
      top = i;
      break;
    }
  TORCH_CHECK(top >= 0, "vescale: MT19937 jump polynomial is zero");
  std::vector<uint32_t> buf(static_cast<size_t>(N + top + 1), 0);
  uint32_t* acc = buf.data();
  std::copy(window, window + N, acc);
  for (int64_t j = top - 1; j >= 0; --j) {
    acc[N] = acc[M] ^ twist(acc[0], acc[1]);
    ++acc;
    if (bit(g, j))
      for (int k = 0; k < N; ++k) acc[k] ^= window[k];
  }
  std::copy(acc, acc + N, window);
}

// Takes the outputs left in the current block; returns how many of n remain, with the
// state at the end of its block (the next output regenerates), or 0 if n fit.
uint64_t take_current_block(at::mt19937_data_pod& s, uint64_t n) {
  const uint64_t rem = static_cast<uint64_t>(s.left_ - 1);
  if (n <= rem) {
    s.left_ -= static_cast<int>(n);
    s.next_ += static_cast<uint32_t>(n);
    return 0;
  }
  return n - rem;
}

// n >= 1 outputs from the end of a block: `blocks` regenerations, then `used` outputs.
void finish(at::mt19937_data_pod& s, uint64_t n, bool jumping) {
  const uint64_t blocks = (n - 1) / N + 1;
  const uint64_t used = n - (blocks - 1) * N;  // 1..624
  regenerate(s.state_.data());                 // now the window starts at an index >= 1
  if (blocks > 1) {
    if (jumping) {
      jump_window(s.state_.data(), (blocks - 1) * N);
    } else {
      for (uint64_t b = 1; b < blocks; ++b) regenerate(s.state_.data());
    }
  }
  s.next_ = static_cast<uint32_t>(used);
  s.left_ = static_cast<int>(N + 1 - used);
}

}  // namespace

void stream(at::mt19937_data_pod& s, uint64_t n) {
  n = take_current_block(s, n);
  if (n) finish(s, n, false);
}

void jump(at::mt19937_data_pod& s, uint64_t n) {
  n = take_current_block(s, n);
  if (n) finish(s, n, true);
}

uint64_t jump_threshold() {
  // bench/rng_jump.py (AVX2 machine, quiet): a jump costs 4-11 ms from 2^24 outputs on;
  // streaming 0.09 ns per output (the vectorised regenerate): 1.5 ms for 2^24, 6 ms for 2^26
  return uint64_t{1} << 26;
}

void advance(at::mt19937_data_pod& s, uint64_t n) {
  if (n >= jump_threshold()) {
    jump(s, n);
  } else {
    stream(s, n);
  }
}

}  // namespace vescale::mt
