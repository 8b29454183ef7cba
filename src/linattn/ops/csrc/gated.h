// What the fused CPU operators of gated causal linear attention share (design §12; gated.cpp: the
// forward and the step, gated_backward.cpp: the backward; linattn/ops/gated/fused.py wires them).
//
// Per (batch, head) row, features Q, K (φ = elu + 1 or the identity), values V, log-decays g ≤ 0 of
// one scalar per token or one per feature, state S (F×E) and, with normalize, z (F). One row per task,
// chunk by chunk, products by torch's BLAS gemm (blas.h), with the pieces of the ungated kernels
// (chunked.h).
//
// Scalar gates, a chunk of c rows, β = the cumulative sum of g inside it (double), λ = β_c:
//   A = M ⊙ (Q Kᵀ) ⊙ e^{β_i − β_j}   (exponents ≤ 0: the mask is applied before the exponential)
//   U = e^{β} ⊙ (Q S) + A V,   den = A 1 + e^{β} ⊙ (Q z) + ε,   O = U / den (or U)
//   S ← e^{λ} S + (e^{λ − β} ⊙ K)ᵀ V,   z ← e^{λ} z + (e^{λ − β} ⊙ K)ᵀ 1
// Vector gates: the chunk is cut into pieces whose log-decay over rows 2…len stays within
// kSpanLimit for every feature (almost always one piece per chunk; a row alone is always a piece).
// With γ the cumulative sum of g over rows 2…len of a piece (γ_1 = 0), λ = g_1 + γ_len, w = e^{γ_len − γ}:
//   Ŝ = e^{λ} ⊙ S (rows),  Q̌ = Q / w (≤ e^{kSpanLimit}),  K̂ = K ⊙ w (≤ 1),  A = M ⊙ Q̌ K̂ᵀ
//   U = Q̌ Ŝ + A V,   den = A 1 + Q̌ ẑ + ε,   S ← Ŝ + K̂ᵀ V,   z ← ẑ + K̂ᵀ 1
// Each entry of A is a sum of the true terms q_f k_f e^{β_if − β_jf}; nothing overflows and nothing
// cancels. Same four gemms per chunk as the ungated forward; the gates add O(c² + c·F) exponentials.
//
// The backward walks each row back block by block, chunk by chunk in reverse; the gates' gradient
// comes from the identity of §12 applied to each chunk (piece) with its entering state held fixed:
//   ∂L/∂g_s = Σ_{t≥s in it} (q_t ⊙ ∂q_t − k_t ⊙ ∂k_t) + Σ_e S_out ⊙ R_out (+ z_out ⊙ r_out), in double.
#pragma once

#include "chunked.h"

namespace {

// Largest log-decay of a vector-gated piece over its rows 2…len, any feature: Q̌ ≤ e^40 ≈ 2.4e17·|q|
constexpr double kSpanLimit = 40.0;
// Scalar gates are clamped at this floor before β is summed (GATE_FLOOR of linattn/ops/gated/chunked.py):
// a g of −1e16 in the double sum would swallow the small gates summed after it; e^{−100} ≈ 3.7e-44 is
// below every rounding. The gradient of a gate below the floor is 0 (gate_grads), for vector gates too
// (their pieces never sum a huge g with another: a row beyond kSpanLimit starts a piece).
constexpr double kGatedFloor = -100.0;

// β_i = Σ_{s≤i} max(g_s, kGatedFloor) (double), eb_i = e^{β_i}, w_i = e^{β_{c−1} − β_i}, for one chunk of
// scalar gates
template <typename Acc>
LINATTN_CLONES void scalar_decays(const Acc* __restrict__ g, int c, double* __restrict__ beta, Acc* __restrict__ eb,
                                  Acc* __restrict__ w) {
  double acc = 0;
  for (int i = 0; i < c; ++i) {
    acc += std::max(static_cast<double>(g[i]), kGatedFloor);
    beta[i] = acc;
  }
  const double last = beta[c - 1];
  for (int i = 0; i < c; ++i) {
    eb[i] = exp_nonpositive(static_cast<Acc>(beta[i]));
    w[i] = exp_nonpositive(static_cast<Acc>(last - beta[i]));
  }
}

// A_ij ← A_ij · D_ij with D_ij = e^{β_i − β_j} on and below the diagonal, 0 above (D kept for the backward).
// The differences are taken in double, then the exponentials in a loop of Acc alone (it vectorizes).
template <typename Acc>
LINATTN_CLONES void decay_scores(Acc* __restrict__ A, Acc* __restrict__ D, int c, const double* __restrict__ beta) {
  for (int i = 0; i < c; ++i) {
    Acc* __restrict__ Ai = A + int64_t(i) * c;
    Acc* __restrict__ Di = D + int64_t(i) * c;
    const double bi = beta[i];
    for (int j = 0; j <= i; ++j) Di[j] = static_cast<Acc>(bi - beta[j]);
#pragma omp simd
    for (int j = 0; j <= i; ++j) {
      Di[j] = exp_nonpositive(Di[j]);
      Ai[j] *= Di[j];
    }
    for (int j = i + 1; j < c; ++j) Ai[j] = Di[j] = Acc(0);
  }
}

// den_i = Σ_j A_ij + a_i (Q_i · z) + ε (a = nullptr: a_i = 1); A already masked
template <typename Acc>
LINATTN_CLONES void gated_denominators(const Acc* __restrict__ A, int c, const Acc* __restrict__ Q,
                                       const Acc* __restrict__ z, const Acc* __restrict__ a, int64_t F, Acc eps,
                                       Acc* __restrict__ den) {
  for (int i = 0; i < c; ++i) {
    const Acc* __restrict__ Ai = A + int64_t(i) * c;
    const Acc* __restrict__ Qi = Q + i * F;
    Acc d = 0, qz = 0;
#pragma omp simd reduction(+ : d)
    for (int j = 0; j <= i; ++j) d += Ai[j];
#pragma omp simd reduction(+ : qz)
    for (int64_t x = 0; x < F; ++x) qz += Qi[x] * z[x];
    den[i] = d + (a == nullptr ? qz : a[i] * qz) + eps;
  }
}

// X_i ← a_i X_i for the c rows of X (c×n)
template <typename Acc>
LINATTN_CLONES void scale_rows(Acc* __restrict__ X, const Acc* __restrict__ a, int c, int64_t n) {
  for (int i = 0; i < c; ++i)
    for (int64_t x = 0; x < n; ++x) X[i * n + x] *= a[i];
}

// X_{f,·} ← a_f X_{f,·} for the F rows of X (F×n): a state decayed per feature (n = 1: a vector)
template <typename Acc>
LINATTN_CLONES void decay_rows(Acc* __restrict__ X, const Acc* __restrict__ a, int64_t F, int64_t n) {
  for (int64_t f = 0; f < F; ++f)
    for (int64_t x = 0; x < n; ++x) X[f * n + x] *= a[f];
}

// out_{f,·} = a_f X_{f,·} (decay_rows into another buffer)
template <typename Acc>
LINATTN_CLONES void decayed_rows(const Acc* __restrict__ X, const Acc* __restrict__ a, int64_t F, int64_t n,
                                 Acc* __restrict__ out) {
  for (int64_t f = 0; f < F; ++f)
    for (int64_t x = 0; x < n; ++x) out[f * n + x] = a[f] * X[f * n + x];
}

template <typename Acc>
LINATTN_CLONES void scale_all(Acc* __restrict__ X, int64_t n, Acc a) {
  for (int64_t i = 0; i < n; ++i) X[i] *= a;
}

// out_i = a_i X_i (c rows of F)
template <typename Acc>
LINATTN_CLONES void weighted_rows(const Acc* __restrict__ X, const Acc* __restrict__ a, int c, int64_t F,
                                  Acc* __restrict__ out) {
  for (int i = 0; i < c; ++i)
    for (int64_t x = 0; x < F; ++x) out[i * F + x] = a[i] * X[i * F + x];
}

// P_ij ← (P_ij + g_i) D_ij (g = nullptr: P_ij D_ij); D is 0 above the diagonal, so this also masks
template <typename Acc>
LINATTN_CLONES void add_rows_and_decay(Acc* __restrict__ P, const Acc* __restrict__ g, const Acc* __restrict__ D,
                                       int c) {
  for (int i = 0; i < c; ++i) {
    const Acc gi = g == nullptr ? Acc(0) : g[i];
    for (int j = 0; j < c; ++j) P[int64_t(i) * c + j] = (P[int64_t(i) * c + j] + gi) * D[int64_t(i) * c + j];
  }
}

// The rows of a vector-gated piece starting at g (rows of F): the largest len ≤ maxlen whose log-decay
// over rows 2…len, Σ_{s=1}^{len−1} g_s, stays ≥ −kSpanLimit in every feature. Summed in Acc (span, F
// long): only where the piece is cut depends on it, and the forward and the backward cut alike. Each
// row falls row by row (g ≤ 0), so each new row is the only one to check. valid &= every gate read
// (rows 0…len, the row that ends the piece too) is a finite g ≤ 0, as gates_valid.
template <typename Acc>
LINATTN_CLONES int piece_length(const Acc* __restrict__ g, int maxlen, int64_t F, Acc* __restrict__ span,
                                bool& valid) {
  const Acc limit = static_cast<Acc>(-kSpanLimit);
  int bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t f = 0; f < F; ++f) {
    span[f] = Acc(0);
    bad |= invalid_gate(g[f]);
  }
  int len = 1;
  for (; len < maxlen; ++len) {
    const Acc* __restrict__ gr = g + len * F;
    int beyond = 0;
#pragma omp simd reduction(| : beyond, bad)
    for (int64_t f = 0; f < F; ++f) {
      span[f] += gr[f];
      beyond |= span[f] < limit;
      bad |= invalid_gate(gr[f]);
    }
    if (beyond) break;
  }
  valid = valid && bad == 0;
  return len;
}

// A piece's decays from its gates g (len rows of F): w_if = e^{Σ_{s>i} g_sf} ∈ [e^{−kSpanLimit}, 1]
// and dec_f = e^{Σ_s g_sf} (the whole piece), the sums taken from the last row back in double (sum, F
// long: no difference of two long sums), the exponentials in a loop of Acc alone (it vectorizes); and
// the scaled features Qv = Q / w, Kv = K ⊙ w (rows of F, Acc; Qv = nullptr: Kv alone, for a state).
template <typename Acc>
LINATTN_CLONES void piece_factors(const Acc* __restrict__ g, int len, int64_t F, const Acc* __restrict__ Q,
                                  const Acc* __restrict__ K, double* __restrict__ sum, Acc* __restrict__ dec,
                                  Acc* __restrict__ w, Acc* __restrict__ Qv, Acc* __restrict__ Kv) {
  for (int64_t f = 0; f < F; ++f) sum[f] = 0;
  for (int i = len - 1; i >= 0; --i) {  // one loop per row: w stored once (a reload of it from
    const int64_t o = int64_t(i) * F;   // narrower stores stalled on store forwarding)
    if (Qv == nullptr) {
#pragma omp simd
      for (int64_t f = 0; f < F; ++f) {
        const Acc wx = exp_nonpositive(static_cast<Acc>(sum[f]));
        sum[f] += static_cast<double>(g[o + f]);
        w[o + f] = wx;
        Kv[o + f] = K[o + f] * wx;
      }
      continue;
    }
#pragma omp simd
    for (int64_t f = 0; f < F; ++f) {
      const Acc wx = exp_nonpositive(static_cast<Acc>(sum[f]));
      sum[f] += static_cast<double>(g[o + f]);
      w[o + f] = wx;
      Qv[o + f] = Q[o + f] / wx;
      Kv[o + f] = K[o + f] * wx;
    }
  }
  for (int64_t f = 0; f < F; ++f) dec[f] = static_cast<Acc>(sum[f]);
#pragma omp simd
  for (int64_t f = 0; f < F; ++f) dec[f] = exp_nonpositive(dec[f]);
}

// The gates' gradient over c rows, last row first: carry (starting from the end term) += Σ_f (Q dQ − K dK)
// (scalar gates: one carry, dg one per row) or per feature (vector gates: carry and dg rows of F);
// dg = the running carry, or 0 where the gate g (the same layout as dg) is below kGatedFloor
template <typename Acc>
LINATTN_CLONES void gate_grads(const Acc* __restrict__ Q, const Acc* __restrict__ dQ, const Acc* __restrict__ K,
                               const Acc* __restrict__ dK, const Acc* __restrict__ g, int c, int64_t F, bool vector,
                               double* __restrict__ carry, Acc* __restrict__ dg) {
  const Acc floor = static_cast<Acc>(kGatedFloor);
  for (int i = c - 1; i >= 0; --i) {
    const int64_t o = int64_t(i) * F;
    if (vector) {
      for (int64_t f = 0; f < F; ++f) {
        carry[f] += static_cast<double>(Q[o + f] * dQ[o + f]) - static_cast<double>(K[o + f] * dK[o + f]);
        dg[o + f] = g[o + f] < floor ? Acc(0) : static_cast<Acc>(carry[f]);
      }
    } else {
      double s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t f = 0; f < F; ++f)
        s += static_cast<double>(Q[o + f] * dQ[o + f]) - static_cast<double>(K[o + f] * dK[o + f]);
      carry[0] += s;
      dg[i] = g[i] < floor ? Acc(0) : static_cast<Acc>(carry[0]);
    }
  }
}

// The final-state term of a chunk's (or piece's) gate gradients: Σ_e S_out ⊙ R (+ z_out ⊙ r) with the
// state after it and the gradient flowing into that state, per feature (vector) or summed, in double
// (the sums over e in vector lanes: in order, one dependent add per entry ran 5% of GLA's backward)
template <typename Acc>
LINATTN_CLONES void end_term(const Acc* __restrict__ S_out, const Acc* __restrict__ R, const Acc* z_out,
                             const Acc* r, int64_t F, int64_t E, bool vector, double* __restrict__ carry) {
  if (!vector) carry[0] = 0;
  for (int64_t f = 0; f < F; ++f) {
    double s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t x = 0; x < E; ++x) s += static_cast<double>(S_out[f * E + x]) * static_cast<double>(R[f * E + x]);
    if (z_out != nullptr) s += static_cast<double>(z_out[f]) * static_cast<double>(r[f]);
    if (vector) {
      carry[f] = s;
    } else {
      carry[0] += s;
    }
  }
}

// dQ = dQv / w, dK = dKv ⊙ w (the gradients of the unscaled features of a vector-gated piece)
template <typename Acc>
LINATTN_CLONES void unscale_grads(Acc* __restrict__ dQ, Acc* __restrict__ dK, const Acc* __restrict__ w, int64_t n) {
  for (int64_t x = 0; x < n; ++x) {
    dQ[x] /= w[x];
    dK[x] *= w[x];
  }
}

// Per-thread work buffers of both passes (sizes for chunks of at most `chunk` rows)
template <typename T>
struct Work {
  using Acc = linattn_acc<T>;
  static constexpr bool low = !std::is_same<T, Acc>::value;
  Aligned<Acc> A, D, den, U, eb, w, Qv, Kv, dec, S_hat, z_hat, span;
  Aligned<double> beta, sum;
  Aligned<T> A_low, S_low, Qv_low, Kv_low;

  Work(int64_t chunk, int64_t F, int64_t E, bool vector)
      : A(chunk * chunk),
        D(vector ? 0 : chunk * chunk),
        den(chunk),
        U(low ? chunk * E : 0),
        eb(chunk),
        w(vector ? chunk * F : chunk),
        Qv(vector ? chunk * F : 0),
        Kv(chunk * F),
        dec(vector ? F : 0),
        S_hat(vector ? F * E : 0),
        z_hat(vector ? F : 0),
        span(vector ? F : 0),
        beta(chunk),
        sum(vector ? F : 0),
        A_low(low ? chunk * chunk : 0),
        S_low(low ? F * E : 0),
        Qv_low(low ? chunk * F : 0),
        Kv_low(low ? chunk * F : 0) {}
};

// The forward of one chunk of c rows (scalar gates) from the state (S, z) entering it, which it
// advances. O (c×E, T) receives the outputs, den (if normalize) the denominators.
template <typename T>
void scalar_chunk_forward(Work<T>& wk, int c, int64_t F, int64_t E, const T* Q, const T* K, const linattn_acc<T>* Qa,
                          const linattn_acc<T>* Ka, const T* V, const linattn_acc<T>* g, linattn_acc<T>* S,
                          linattn_acc<T>* z, T* O, bool normalize, linattn_acc<T> eps) {
  using Acc = linattn_acc<T>;
  const int f = static_cast<int>(F), e = static_cast<int>(E);
  scalar_decays(g, c, wk.beta.data(), wk.eb.data(), wk.w.data());
  if (O != nullptr) {
    gemm_rm<T>(false, true, c, c, f, Q, f, K, f, Acc(0), wk.A.data(), c);  // Q̃K̃ᵀ
    decay_scores(wk.A.data(), wk.D.data(), c, wk.beta.data());
    if (normalize) gated_denominators(wk.A.data(), c, Qa, z, wk.eb.data(), F, eps, wk.den.data());
    Acc* U = Work<T>::low ? wk.U.data() : reinterpret_cast<Acc*>(O);
    gemm_rm<T>(false, false, c, e, f, Q, f, as_operand<T>(S, wk.S_low, F * E), e, Acc(0), U, e);  // Q̃S
    scale_rows(U, wk.eb.data(), c, E);
    gemm_rm<T>(false, false, c, e, c, as_operand<T>(wk.A.data(), wk.A_low, int64_t(c) * c), c, V, e, Acc(1), U, e);
    if (normalize) divide_rows(U, wk.den.data(), c, E);
    if constexpr (Work<T>::low) narrow_bf16(U, O, int64_t(c) * E);
  }
  const Acc ec = wk.eb.data()[c - 1];
  scale_all(S, F * E, ec);
  weighted_rows(Ka, wk.w.data(), c, F, wk.Kv.data());
  gemm_rm<T>(true, false, f, e, c, as_operand<T>(wk.Kv.data(), wk.Kv_low, int64_t(c) * F), f, V, e, Acc(1), S, e);
  if (normalize) {
    scale_all(z, F, ec);
    add_column_sums(z, wk.Kv.data(), c, F);
  }
}

// The forward of one vector-gated piece of len rows (piece_length), from (S, z), which it advances;
// O = nullptr: the state only.
template <typename T>
void piece_forward(Work<T>& wk, int len, int64_t F, int64_t E, const linattn_acc<T>* Qa,
                   const linattn_acc<T>* Ka, const T* V, const linattn_acc<T>* g, linattn_acc<T>* S, linattn_acc<T>* z,
                   T* O, bool normalize, linattn_acc<T> eps, linattn_acc<T>* den_out) {
  using Acc = linattn_acc<T>;
  const int f = static_cast<int>(F), e = static_cast<int>(E);
  piece_factors(g, len, F, Qa, Ka, wk.sum.data(), wk.dec.data(), wk.w.data(), O != nullptr ? wk.Qv.data() : nullptr,
                wk.Kv.data());
  decay_rows(S, wk.dec.data(), F, E);
  if (normalize) decay_rows(z, wk.dec.data(), F, 1);
  const T* Kop = as_operand<T>(wk.Kv.data(), wk.Kv_low, len * F);
  if (O != nullptr) {
    const T* Qop = as_operand<T>(wk.Qv.data(), wk.Qv_low, len * F);
    gemm_rm<T>(false, true, len, len, f, Qop, f, Kop, f, Acc(0), wk.A.data(), len);  // Q̌K̂ᵀ
    mask_upper(wk.A.data(), len);
    if (normalize) gated_denominators<Acc>(wk.A.data(), len, wk.Qv.data(), z, nullptr, F, eps, wk.den.data());
    Acc* U = Work<T>::low ? wk.U.data() : reinterpret_cast<Acc*>(O);
    gemm_rm<T>(false, false, len, e, f, Qop, f, as_operand<T>(S, wk.S_low, F * E), e, Acc(0), U, e);  // Q̌Ŝ
    gemm_rm<T>(false, false, len, e, len, as_operand<T>(wk.A.data(), wk.A_low, int64_t(len) * len), len, V, e, Acc(1),
               U, e);
    if (normalize) {
      divide_rows(U, wk.den.data(), len, E);
      if (den_out != nullptr) std::copy(wk.den.begin(), wk.den.begin() + len, den_out);
    }
    if constexpr (Work<T>::low) narrow_bf16(U, O, int64_t(len) * E);
  }
  gemm_rm<T>(true, false, f, e, len, Kop, f, V, e, Acc(1), S, e);  // S = Ŝ + K̂ᵀV
  if (normalize) add_column_sums(z, wk.Kv.data(), len, F);
}

// One chunk (c rows) of vector gates, piece by piece, advancing (S, z); O = nullptr: the state only.
// valid &= every gate of the chunk is a finite g ≤ 0 (piece_length).
template <typename T>
void vector_chunk_forward(Work<T>& wk, int c, int64_t F, int64_t E, const linattn_acc<T>* Qa,
                          const linattn_acc<T>* Ka, const T* V, const linattn_acc<T>* g, linattn_acc<T>* S,
                          linattn_acc<T>* z, T* O, bool normalize, linattn_acc<T> eps, linattn_acc<T>* den_out,
                          bool& valid) {
  for (int p = 0; p < c;) {
    const int len = piece_length(g + p * F, c - p, F, wk.span.data(), valid);
    piece_forward<T>(wk, len, F, E, Qa + p * F, Ka + p * F, V + p * E, g + p * F, S, z,
                     O == nullptr ? nullptr : O + p * E, normalize, eps, den_out == nullptr ? nullptr : den_out + p);
    p += len;
  }
}

// q, k (B, H, N, F), v (B, H, N, E); g (B, H, N) or (B, H, N, F) and the state in the state dtype
void check_gates(const char* op, const at::Tensor& q, const at::Tensor& g, const at::Tensor& kv) {
  const auto n = q.sizes().slice(0, 3);
  TORCH_CHECK((g.dim() == 3 && g.sizes() == n) || (g.dim() == 4 && g.sizes().slice(0, 3) == n && g.size(3) == q.size(3)),
              op, ": g must be (B, H, N) or (B, H, N, F)");
  TORCH_CHECK(g.scalar_type() == kv.scalar_type(), op, ": g must have the state's dtype");
}

}  // namespace
