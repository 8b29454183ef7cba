// One token of each recurrence, for one (batch, head) row: the arithmetic shared by the one-token
// operators (decode.cpp `step`, gated.cpp `gated_step`, delta.cpp `delta_step`) and the whole-model
// decoding step (model_step.cpp). The new state may be written over the old one (dst == src, as the
// model step does) or into another buffer (the operators, which leave their input state alone): each
// entry is read before it is written, at the same index, so both are safe. Internal linkage.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__SSE2__)
#include <xmmintrin.h>
#endif

#include "common.h"

namespace {

// linattn.ops.delta.reference.L2_EPS: q̂ = q / √(‖q‖² + ε)
constexpr double kL2Eps = 1e-6;

// 1 / √(ss + ε) for ss = ‖x‖² of the n values x. When ss overflowed (|x| ≳ 1.8e19 in float) the norm is
// taken over x / m, m = max|x|, instead: √(‖x‖² + ε) = m √(‖x/m‖² + ε/m²), so a huge but finite row
// still normalizes (before, 1/√inf = 0 made k̂ = 0). Rows holding Inf or NaN keep their old result.
template <typename Acc>
inline Acc inverse_norm(const Acc* x, int64_t n, Acc ss) {
  if (ss <= std::numeric_limits<Acc>::max()) return Acc(1) / std::sqrt(ss + Acc(kL2Eps));
  Acc m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::abs(x[i]));
  if (!(m <= std::numeric_limits<Acc>::max())) return Acc(1) / std::sqrt(ss + Acc(kL2Eps));
  Acc s = 0;
  for (int64_t i = 0; i < n; ++i) s += (x[i] / m) * (x[i] / m);
  return Acc(1) / (m * std::sqrt(s + Acc(kL2Eps) / (m * m)));
}

// Flushes denormal results and operands to zero on the calling thread while alive (x86 MXCSR FTZ and
// DAZ; restored after). With strong decay, products of two small gate factors (e^{b_i − b_j} of far
// apart tokens) fall below the smallest normal float, and arithmetic on denormals costs ~100 cycles
// an operation: a Gated DeltaNet backward with g = logsigmoid(N(0, 1)) took 422 ms against 292 ms
// with g = −0.01 (B·H = 8, N = 16384, 2 threads). Their values are below 1e-38 of the O(1) terms
// they add to.
class FlushDenormals {
 public:
#if defined(__SSE2__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

// kv' = diag(a) kv + k̃ vᵀ (F×E; a_f = a[f] with vector, a[0] for every f, or 1 when a is null),
// out = q̃ᵀ kv'; the inner loops vectorize over E.
template <typename T>
LINATTN_CLONES void decay_update_row(const T* src, T* dst, const T* __restrict__ qr, const T* __restrict__ kr,
                                     const T* __restrict__ vr, const T* __restrict__ a, bool vector,
                                     T* __restrict__ out, int64_t F, int64_t E) {
  for (int64_t e = 0; e < E; ++e) out[e] = T(0);
  for (int64_t f = 0; f < F; ++f) {
    const T kf = kr[f], qf = qr[f];
    const T* s = src + f * E;
    T* d = dst + f * E;
    if (a == nullptr) {
#pragma omp simd
      for (int64_t e = 0; e < E; ++e) {
        const T x = s[e] + kf * vr[e];
        d[e] = x;
        out[e] += qf * x;
      }
    } else {
      const T af = a[vector ? f : 0];
#pragma omp simd
      for (int64_t e = 0; e < E; ++e) {
        const T x = af * s[e] + kf * vr[e];
        d[e] = x;
        out[e] += qf * x;
      }
    }
  }
}

// The delta family for one token: S_α = Diag(α) S, u = S_αᵀ k̂, w = β (v − u), S' = S_α + k̂ wᵀ,
// o = scale · S'ᵀ q̂, with q̂ and k̂ the first and second D values of qk; α one decay per key channel
// (alpha[d], Channels: KDA) or one for the row (alpha[0]: then u = α Sᵀk̂, w = β (v − α Sᵀk̂)). By strips of W columns (256 bytes): a column of S' needs only its own u, so each strip is
// read for u, then again (from L1) for S' and o; the sums stay in registers across the D rows, two
// partial sums (even and odd rows) so that the FMA chains overlap: S is read from memory once and S'
// written once, and nothing else goes to memory per row of S (summing u and o across rows in memory
// made the step store-bound: 1.55–1.8× the time to copy the state, issue 33; two passes over the
// whole of S, one per sum: GDN's step 41 µs out of place, 33 in place, at 16×128×128 on one core).
template <typename T, typename Acc, bool Channels>
LINATTN_CLONES void delta_row(const Acc* S, Acc* S2, const Acc* __restrict__ qk, const T* __restrict__ v, Acc beta,
                              const Acc* __restrict__ alpha, Acc scale, T* __restrict__ o, int64_t D, int64_t E) {
  // strips of four 512-bit registers (256 bytes of a row at a time: one pinned EPYC core, 16×128×128,
  // fp32: out-of-place step 40.7 -> 37-39 µs, in place 31 -> 30; two registers read 128-byte pieces)
  constexpr int64_t W = 256 / sizeof(Acc);
  const Acc* __restrict__ q = qk;
  const Acc* __restrict__ k = qk + D;
  const Acc a = Channels ? Acc(1) : alpha[0];
  for (int64_t e0 = 0; e0 < E; e0 += W) {  // w = β (v − a Sᵀ(α ⊙ k̂)), a strip at a time
    const int64_t n = std::min(W, E - e0);
    Acc acc[W], acc2[W];
    for (int64_t x = 0; x < W; ++x) acc[x] = acc2[x] = Acc(0);
    int64_t d = 0;
    if (n == W) {
      for (; d + 1 < D; d += 2) {
        const Acc k1 = Channels ? k[d] * alpha[d] : k[d], k2 = Channels ? k[d + 1] * alpha[d + 1] : k[d + 1];
        const Acc* __restrict__ s1 = S + d * E + e0;
        const Acc* __restrict__ s2 = s1 + E;
#pragma omp simd
        for (int64_t x = 0; x < W; ++x) {
          acc[x] += k1 * s1[x];
          acc2[x] += k2 * s2[x];
        }
      }
    }
    for (; d < D; ++d) {
      const Acc k1 = Channels ? k[d] * alpha[d] : k[d];
      const Acc* __restrict__ s1 = S + d * E + e0;
      for (int64_t x = 0; x < n; ++x) acc[x] += k1 * s1[x];
    }
    // S' = Diag(α) S + k̂ wᵀ and o = S'ᵀ q̂ on the same strip (its columns need only their own w), while
    // the strip (D × 256 bytes) is still in L1
    Acc w[W];
    for (int64_t x = 0; x < W; ++x) {
      w[x] = x < n ? beta * (static_cast<Acc>(v[e0 + x]) - a * (acc[x] + acc2[x])) : Acc(0);
      acc[x] = acc2[x] = Acc(0);
    }
    d = 0;
    if (n == W) {
      for (; d + 1 < D; d += 2) {
        const Acc a1 = Channels ? alpha[d] : a, a2 = Channels ? alpha[d + 1] : a;
        const Acc k1 = k[d], k2 = k[d + 1], q1 = q[d], q2 = q[d + 1];
        const Acc* s1 = S + d * E + e0;
        Acc* t1 = S2 + d * E + e0;
#pragma omp simd  // each entry is read before it is written, at its own index (S2 may be S)
        for (int64_t x = 0; x < W; ++x) {
          const Acc y1 = a1 * s1[x] + k1 * w[x], y2 = a2 * s1[E + x] + k2 * w[x];
          t1[x] = y1;
          t1[E + x] = y2;
          acc[x] += q1 * y1;
          acc2[x] += q2 * y2;
        }
      }
    }
    for (; d < D; ++d) {
      const Acc a1 = Channels ? alpha[d] : a, k1 = k[d], q1 = q[d];
      const Acc* s1 = S + d * E + e0;
      Acc* t1 = S2 + d * E + e0;
#pragma omp simd
      for (int64_t x = 0; x < n; ++x) {
        const Acc y1 = a1 * s1[x] + k1 * w[x];
        t1[x] = y1;
        acc[x] += q1 * y1;
      }
    }
    for (int64_t x = 0; x < n; ++x) o[e0 + x] = static_cast<T>(scale * (acc[x] + acc2[x]));
  }
}

// The delta rule with one decay α for the row (1 without a gate): delta_row above.
template <typename T, typename Acc>
LINATTN_CLONES void delta_update_row(const Acc* S, Acc* S2, const Acc* __restrict__ qk, const T* __restrict__ v,
                                     Acc beta, Acc alpha, Acc scale, T* __restrict__ o, int64_t D, int64_t E) {
  delta_row<T, Acc, false>(S, S2, qk, v, beta, &alpha, scale, o, D, E);
}

}  // namespace
