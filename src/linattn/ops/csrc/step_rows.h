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
// (alpha[d], Channels: KDA) or one for the row (alpha[0]: then u = α Sᵀk̂, w = β (v − α Sᵀk̂)); u: 2·E of
// scratch.
template <typename T, typename Acc, bool Channels>
LINATTN_CLONES void delta_row(const Acc* S, Acc* S2, const Acc* __restrict__ qk, const T* __restrict__ v, Acc beta,
                              const Acc* __restrict__ alpha, Acc scale, T* __restrict__ o, Acc* __restrict__ u,
                              int64_t D, int64_t E) {
  const Acc* __restrict__ q = qk;
  const Acc* __restrict__ k = qk + D;
  for (int64_t e = 0; e < E; ++e) u[e] = Acc(0);
  for (int64_t d = 0; d < D; ++d) {
    const Acc kd = Channels ? k[d] * alpha[d] : k[d];
#pragma omp simd
    for (int64_t e = 0; e < E; ++e) u[e] += kd * S[d * E + e];
  }
  const Acc a = Channels ? Acc(1) : alpha[0];
#pragma omp simd
  for (int64_t e = 0; e < E; ++e) u[e] = beta * (static_cast<Acc>(v[e]) - a * u[e]);  // w
  Acc* __restrict__ out = u + E;
  for (int64_t e = 0; e < E; ++e) out[e] = Acc(0);
  for (int64_t d = 0; d < D; ++d) {
    const Acc kd = k[d], qd = q[d], ad = Channels ? alpha[d] : a;
#pragma omp simd
    for (int64_t e = 0; e < E; ++e) {
      const Acc x = ad * S[d * E + e] + kd * u[e];
      S2[d * E + e] = x;
      out[e] += qd * x;
    }
  }
  for (int64_t e = 0; e < E; ++e) o[e] = static_cast<T>(scale * out[e]);
}

// The delta rule with one decay α for the row (1 without a gate): delta_row above.
template <typename T, typename Acc>
LINATTN_CLONES void delta_update_row(const Acc* S, Acc* S2, const Acc* __restrict__ qk, const T* __restrict__ v,
                                     Acc beta, Acc alpha, Acc scale, T* __restrict__ o, Acc* __restrict__ u, int64_t D,
                                     int64_t E) {
  delta_row<T, Acc, false>(S, S2, qk, v, beta, &alpha, scale, o, u, D, E);
}

}  // namespace
