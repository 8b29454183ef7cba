// Fused CPU operators for gated causal linear attention (DESIGN §12; linattn/ops/gated/fused.py).
//
// Per (batch, head) row, features Q, K (φ = elu + 1 or the identity), values V, log-decays g ≤ 0 of
// one scalar per token or one per feature, state S (F×E) and, with normalize, z (F). One row per task,
// chunk by chunk, products by torch's BLAS gemm (chunk_common.h), like the ungated kernels.
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
// `gated_chunked_backward` walks each row back block by block (the states entering the chunks of a
// block recomputed from the saved one), chunk by chunk in reverse; the gates' gradient comes from
// the identity of §12 applied to each chunk (piece) with its entering state held fixed:
// ∂L/∂g_s = Σ_{t≥s in it} (q_t ⊙ ∂q_t − k_t ⊙ ∂k_t) + Σ_e S_out ⊙ R_out (+ z_out ⊙ r_out), in double. `gated_step` is one recurrent step.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>
#include <tuple>
#include <vector>

#include "chunk_common.h"

namespace {

// Largest log-decay of a vector-gated piece over its rows 2…len, any feature: Q̌ ≤ e^40 ≈ 2.4e17·|q|
constexpr double kSpanLimit = 40.0;

// β_i = Σ_{s≤i} g_s (double), eb_i = e^{β_i}, w_i = e^{β_{c−1} − β_i}, for one chunk of scalar gates
template <typename Acc>
LINATTN_CLONES void scalar_decays(const Acc* __restrict__ g, int c, double* __restrict__ beta, Acc* __restrict__ eb,
                                  Acc* __restrict__ w) {
  double acc = 0;
  for (int i = 0; i < c; ++i) {
    acc += static_cast<double>(g[i]);
    beta[i] = acc;
  }
  const double last = beta[c - 1];
  for (int i = 0; i < c; ++i) {
    eb[i] = exp_nonpositive(static_cast<Acc>(beta[i]));
    w[i] = exp_nonpositive(static_cast<Acc>(last - beta[i]));
  }
}

// A_ij ← A_ij · D_ij with D_ij = e^{β_i − β_j} on and below the diagonal, 0 above (D kept for the backward)
template <typename Acc>
LINATTN_CLONES void decay_scores(Acc* __restrict__ A, Acc* __restrict__ D, int c, const double* __restrict__ beta) {
  for (int i = 0; i < c; ++i) {
    Acc* __restrict__ Ai = A + int64_t(i) * c;
    Acc* __restrict__ Di = D + int64_t(i) * c;
    const double bi = beta[i];
    for (int j = 0; j <= i; ++j) {
      Di[j] = exp_nonpositive(static_cast<Acc>(bi - beta[j]));
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

// The rows of a vector-gated piece starting at g (rows of F): γ_0 = 0, γ_i = γ_{i−1} + g_i; returns the
// largest len ≤ maxlen whose γ stay ≥ −kSpanLimit (γ rows 0…len−1 left in gam)
template <typename Acc>
LINATTN_CLONES int piece_length(const Acc* __restrict__ g, int maxlen, int64_t F, double* __restrict__ gam) {
  for (int64_t f = 0; f < F; ++f) gam[f] = 0;
  int len = 1;
  for (; len < maxlen; ++len) {
    const double* __restrict__ prev = gam + (len - 1) * F;
    double* __restrict__ row = gam + len * F;
    const Acc* __restrict__ gr = g + len * F;
    double lo = 0;
#pragma omp simd reduction(min : lo)
    for (int64_t f = 0; f < F; ++f) {
      row[f] = prev[f] + static_cast<double>(gr[f]);
      lo = std::min(lo, row[f]);
    }
    if (lo < -kSpanLimit) break;
  }
  return len;
}

// A piece's decays: dec_f = e^{g_0f + γ_{len−1,f}} (the whole piece), w_if = e^{γ_{len−1,f} − γ_if} ∈
// [e^{−kSpanLimit}, 1], and its scaled features Qv = Q / w, Kv = K ⊙ w (rows of F, Acc)
template <typename Acc>
LINATTN_CLONES void piece_factors(const Acc* __restrict__ g0, const double* __restrict__ gam, int len, int64_t F,
                                  const Acc* __restrict__ Q, const Acc* __restrict__ K, Acc* __restrict__ dec,
                                  Acc* __restrict__ w, Acc* __restrict__ Qv, Acc* __restrict__ Kv) {
  const double* __restrict__ last = gam + (len - 1) * F;
  for (int64_t f = 0; f < F; ++f) dec[f] = exp_nonpositive(static_cast<Acc>(static_cast<double>(g0[f]) + last[f]));
  for (int i = 0; i < len; ++i) {
    const int64_t o = i * F;
    for (int64_t f = 0; f < F; ++f) {
      const Acc wx = exp_nonpositive(static_cast<Acc>(last[f] - gam[o + f]));
      w[o + f] = wx;
      Qv[o + f] = Q[o + f] / wx;
      Kv[o + f] = K[o + f] * wx;
    }
  }
}

// The gates' gradient over c rows, last row first: carry (starting from the end term) += Σ_f (Q dQ − K dK)
// (scalar gates: one carry, dg one per row) or per feature (vector gates: carry and dg rows of F);
// dg = the running carry
template <typename Acc>
LINATTN_CLONES void gate_grads(const Acc* __restrict__ Q, const Acc* __restrict__ dQ, const Acc* __restrict__ K,
                               const Acc* __restrict__ dK, int c, int64_t F, bool vector, double* __restrict__ carry,
                               Acc* __restrict__ dg) {
  for (int i = c - 1; i >= 0; --i) {
    const int64_t o = int64_t(i) * F;
    if (vector) {
      for (int64_t f = 0; f < F; ++f) {
        carry[f] += static_cast<double>(Q[o + f] * dQ[o + f]) - static_cast<double>(K[o + f] * dK[o + f]);
        dg[o + f] = static_cast<Acc>(carry[f]);
      }
    } else {
      double s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t f = 0; f < F; ++f)
        s += static_cast<double>(Q[o + f] * dQ[o + f]) - static_cast<double>(K[o + f] * dK[o + f]);
      carry[0] += s;
      dg[i] = static_cast<Acc>(carry[0]);
    }
  }
}

// The final-state term of a chunk's (or piece's) gate gradients: Σ_e S_out ⊙ R (+ z_out ⊙ r) with the
// state after it and the gradient flowing into that state, per feature (vector) or summed, in double
template <typename Acc>
void end_term(const Acc* S_out, const Acc* R, const Acc* z_out, const Acc* r, int64_t F, int64_t E, bool vector,
              double* carry) {
  if (!vector) carry[0] = 0;
  for (int64_t f = 0; f < F; ++f) {
    double s = 0;
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

// The features of one block of a row: T operands for the gemms (Q, K) and the same values as Acc
// (Qa, Ka; bf16: the rounded operands widened) for the elementwise work; fQ, fK: φ(x) unrounded for
// φ' (nullptr with the identity).
template <typename T>
struct BlockFeatures {
  using Acc = linattn_acc<T>;
  static constexpr bool low = !std::is_same<T, Acc>::value;
  Aligned<Acc> wide, acc;
  Aligned<T> feat;
  const T *Q = nullptr, *K = nullptr;
  const Acc *Qa = nullptr, *Ka = nullptr, *fQ = nullptr, *fK = nullptr;

  BlockFeatures(int64_t phi, int64_t block, int64_t F)
      : wide(phi == 1 ? 2 * block * F : 0), acc(low ? 2 * block * F : 0), feat(phi == 1 && low ? 2 * block * F : 0) {}

  void compute(const T* q, const T* k, int64_t n, int64_t phi) {
    Q = q;
    K = k;
    if (phi == 1) {
      if constexpr (low) {
        block_features(q, k, n, wide, feat, &Q, &K);
      } else {
        block_features(q, k, n, wide, wide, &Q, &K);
      }
      fQ = wide.data();
      fK = wide.data() + n;
    }
    if constexpr (low) {
      widen_bf16(Q, acc.data(), n);
      widen_bf16(K, acc.data() + n, n);
      Qa = acc.data();
      Ka = acc.data() + n;
    } else {
      Qa = Q;
      Ka = K;
    }
  }
};

// Per-thread work buffers of both passes (sizes for chunks of at most `chunk` rows)
template <typename T>
struct Work {
  using Acc = linattn_acc<T>;
  static constexpr bool low = !std::is_same<T, Acc>::value;
  Aligned<Acc> A, D, den, U, eb, w, Qv, Kv, dec, S_hat, z_hat;
  Aligned<double> beta, gam;
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
        beta(chunk),
        gam(vector ? chunk * F : 0),
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

// The forward of one vector-gated piece of len rows whose γ is in wk.gam, from (S, z), which it
// advances; O = nullptr: the state only.
template <typename T>
void piece_forward(Work<T>& wk, int len, int64_t F, int64_t E, const linattn_acc<T>* Qa, const linattn_acc<T>* Ka,
                   const T* V, const linattn_acc<T>* g, linattn_acc<T>* S, linattn_acc<T>* z, T* O, bool normalize,
                   linattn_acc<T> eps, linattn_acc<T>* den_out) {
  using Acc = linattn_acc<T>;
  const int f = static_cast<int>(F), e = static_cast<int>(E);
  piece_factors(g, wk.gam.data(), len, F, Qa, Ka, wk.dec.data(), wk.w.data(), wk.Qv.data(), wk.Kv.data());
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

// One chunk (c rows) of vector gates, piece by piece, advancing (S, z); O = nullptr: the state only
template <typename T>
void vector_chunk_forward(Work<T>& wk, int c, int64_t F, int64_t E, const linattn_acc<T>* Qa,
                          const linattn_acc<T>* Ka, const T* V, const linattn_acc<T>* g, linattn_acc<T>* S,
                          linattn_acc<T>* z, T* O, bool normalize, linattn_acc<T> eps, linattn_acc<T>* den_out) {
  for (int p = 0; p < c;) {
    const int len = piece_length(g + p * F, c - p, F, wk.gam.data());
    piece_forward<T>(wk, len, F, E, Qa + p * F, Ka + p * F, V + p * E, g + p * F, S, z, O == nullptr ? nullptr : O + p * E,
                     normalize, eps, den_out == nullptr ? nullptr : den_out + p);
    p += len;
  }
}

template <typename T>
void gated_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, at::Tensor& o,
                at::Tensor& kv, at::Tensor& z_all, int64_t phi, bool normalize, double eps, int64_t chunk, int64_t block,
                const Saves<linattn_acc<T>>* saves) {
  using Acc = linattn_acc<T>;
  const int64_t N = q.size(2), F = q.size(3), E = v.size(3), rows = q.size(0) * q.size(1);
  const bool vector = g.dim() == 4;
  const int64_t G = vector ? F : 1;
  const T *pq = q.data_ptr<T>(), *pk = k.data_ptr<T>(), *pv = v.data_ptr<T>();
  const Acc* pg = g.data_ptr<Acc>();
  T* po = o.data_ptr<T>();
  Acc* pS = kv.data_ptr<Acc>();
  Acc* pz = normalize ? z_all.data_ptr<Acc>() : nullptr;
  const Acc eps_t = static_cast<Acc>(eps);
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    const SequentialBlas one_thread;
    Work<T> wk(chunk, F, E, vector);
    BlockFeatures<T> fb(phi, block, F);
    for (int64_t r = r0; r < r1; ++r) {
      Acc* S = pS + r * F * E;
      Acc* z = normalize ? pz + r * F : nullptr;
      for (int64_t s = 0; s < N; s += block) {
        const int64_t m = std::min(N, s + block) - s;
        if (saves != nullptr) {
          const int64_t b = r * saves->blocks + s / block;
          std::copy(S, S + F * E, saves->S_blocks + b * F * E);
          if (normalize) std::copy(z, z + F, saves->z_blocks + b * F);
        }
        fb.compute(pq + (r * N + s) * F, pk + (r * N + s) * F, m * F, phi);
        for (int64_t c0 = 0; c0 < m; c0 += chunk) {
          const int c = static_cast<int>(std::min(chunk, m - c0));
          const int64_t t0 = r * N + s + c0;
          Acc* den_out = saves != nullptr && normalize ? saves->den + t0 : nullptr;
          if (vector) {
            vector_chunk_forward<T>(wk, c, F, E, fb.Qa + c0 * F, fb.Ka + c0 * F, pv + t0 * E, pg + t0 * G, S, z,
                                    po + t0 * E, normalize, eps_t, den_out);
          } else {
            scalar_chunk_forward<T>(wk, c, F, E, fb.Q + c0 * F, fb.K + c0 * F, fb.Qa + c0 * F, fb.Ka + c0 * F,
                                    pv + t0 * E, pg + t0, S, z, po + t0 * E, normalize, eps_t);
            if (den_out != nullptr) std::copy(wk.den.begin(), wk.den.begin() + c, den_out);
          }
        }
      }
    }
  });
}

// q, k (B, H, N, F), v (B, H, N, E); g (B, H, N) or (B, H, N, F) and the state in the state dtype
void check_gates(const char* op, const at::Tensor& q, const at::Tensor& g, const at::Tensor& kv) {
  const auto n = q.sizes().slice(0, 3);
  TORCH_CHECK((g.dim() == 3 && g.sizes() == n) || (g.dim() == 4 && g.sizes().slice(0, 3) == n && g.size(3) == q.size(3)),
              op, ": g must be (B, H, N) or (B, H, N, F)");
  TORCH_CHECK(g.scalar_type() == kv.scalar_type(), op, ": g must have the state's dtype");
}

// Returns (o, kv, z, den, S_blocks, z_blocks); z and z_blocks empty without z0 (normalize = z0 given),
// den, S_blocks, z_blocks empty unless save (training).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_chunked(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
    const at::Tensor& kv0_in, const c10::optional<at::Tensor>& z0_in, int64_t phi, double eps, int64_t chunk, bool save) {
  const bool normalize = z0_in.has_value();
  check_inputs("linattn_cpu::gated_chunked", q_in, k_in, v_in, kv0_in, normalize ? *z0_in : kv0_in, phi, chunk);
  check_gates("linattn_cpu::gated_chunked", q_in, g_in, kv0_in);
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), g = g_in.contiguous();
  const int64_t N = q.size(2), F = q.size(3), E = v.size(3), rows = q.size(0) * q.size(1);
  TORCH_CHECK(kv0_in.numel() == rows * F * E && (!normalize || z0_in->numel() == rows * F),
              "linattn_cpu::gated_chunked: the initial state must be (B, H, F, E) and (B, H, F)");
  at::Tensor kv = kv0_in.contiguous().clone();
  at::Tensor z = normalize ? z0_in->contiguous().clone() : at::empty({0}, kv.options());
  at::Tensor o = empty_result(v.sizes(), v.options());
  const int64_t block = block_tokens(chunk), blocks = (N + block - 1) / block;
  const auto acc = kv.options();
  at::Tensor den = at::empty({save && normalize ? rows : 0, N}, acc);
  at::Tensor S_blocks = at::empty({save ? rows : 0, blocks, F, E}, acc);
  at::Tensor z_blocks = at::empty({save && normalize ? rows : 0, blocks, F}, acc);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "linattn_cpu_gated_chunked", [&] {
    using Acc = linattn_acc<scalar_t>;
    const Saves<Acc> saves{normalize ? den.data_ptr<Acc>() : nullptr, S_blocks.data_ptr<Acc>(),
                           normalize ? z_blocks.data_ptr<Acc>() : nullptr, blocks};
    gated_rows<scalar_t>(q, k, v, g, o, kv, z, phi, normalize, eps, chunk, block, save ? &saves : nullptr);
  });
  return {o, kv, z, den, S_blocks, z_blocks};
}

// What the backward of one chunk or piece reads and writes besides the work buffers
template <typename T>
struct Grads {
  using Acc = linattn_acc<T>;
  Aligned<Acc> G, gd, dQ, dK, dV, P;
  Aligned<T> G_low, P_low, R_low, S_low;

  Grads(int64_t chunk, int64_t F, int64_t E)
      : G(chunk * E),
        gd(chunk),
        dQ(chunk * F),
        dK(chunk * F),
        dV(chunk * E),
        P(chunk * chunk),
        G_low(Work<T>::low ? chunk * E : 0),
        P_low(Work<T>::low ? chunk * chunk : 0),
        R_low(Work<T>::low ? F * E : 0),
        S_low(Work<T>::low ? F * E : 0) {}
};

// Row pointers of one chunk or piece in the backward (t0: its first token's index in (B·H·N))
template <typename T>
struct Span {
  using Acc = linattn_acc<T>;
  int c;
  const T *Q, *K, *V, *dO, *O;
  const Acc *Qa, *Ka, *fQ, *fK, *den, *g;
  T *dq, *dk, *dv;
  Acc* dg;
};

// ∂V = Aᵀ G + Kw R into the span's dv (bf16: through dV); A, Kw given as operands
template <typename T>
void values_grad(Grads<T>& gr, const Span<T>& sp, int64_t F, int64_t E, const T* A_op, const T* Kw_op, const T* G_op,
                 const T* R_op) {
  using Acc = linattn_acc<T>;
  const int c = sp.c, f = static_cast<int>(F), e = static_cast<int>(E);
  Acc* dV = Work<T>::low ? gr.dV.data() : reinterpret_cast<Acc*>(sp.dv);
  gemm_rm<T>(true, false, c, e, c, A_op, c, G_op, e, Acc(0), dV, e);
  gemm_rm<T>(false, false, c, e, f, Kw_op, f, R_op, e, Acc(1), dV, e);
  if constexpr (Work<T>::low) narrow_bf16(dV, sp.dv, int64_t(c) * E);
}

// The backward of one chunk of scalar gates from the state (S, z) entering it and (S_out, z_out) after
// it; (R, r) the gradients flowing into the state after it, updated to those entering it.
template <typename T>
void scalar_chunk_backward(Work<T>& wk, Grads<T>& gr, const Span<T>& sp, int64_t F, int64_t E, const linattn_acc<T>* S,
                           const linattn_acc<T>* z, const linattn_acc<T>* S_out, const linattn_acc<T>* z_out,
                           linattn_acc<T>* R, linattn_acc<T>* rr, bool normalize, double* carry) {
  using Acc = linattn_acc<T>;
  const int c = sp.c, f = static_cast<int>(F), e = static_cast<int>(E);
  const int64_t cc = int64_t(c) * c;
  end_term(S_out, R, z_out, rr, F, E, false, carry);
  scalar_decays(sp.g, c, wk.beta.data(), wk.eb.data(), wk.w.data());
  gemm_rm<T>(false, true, c, c, f, sp.Q, f, sp.K, f, Acc(0), wk.A.data(), c);  // A = (Q̃K̃ᵀ) ⊙ D
  decay_scores(wk.A.data(), wk.D.data(), c, wk.beta.data());
  output_grads(sp.dO, sp.O, sp.den, normalize, gr.G.data(), gr.gd.data(), c, E);
  const T* G_op = as_operand<T>(gr.G.data(), gr.G_low, int64_t(c) * E);
  const T* R_op = as_operand<T>(R, gr.R_low, F * E);
  weighted_rows(sp.Ka, wk.w.data(), c, F, wk.Kv.data());  // K̂ = e^{λ−β} ⊙ K̃
  const T* Kw_op = as_operand<T>(wk.Kv.data(), wk.Kv_low, int64_t(c) * F);
  values_grad<T>(gr, sp, F, E, as_operand<T>(wk.A.data(), wk.A_low, cc), Kw_op, G_op, R_op);
  // P = M ⊙ D ⊙ (G Vᵀ + g 1ᵀ)
  gemm_rm<T>(false, true, c, c, e, G_op, e, sp.V, e, Acc(0), gr.P.data(), c);
  add_rows_and_decay(gr.P.data(), normalize ? gr.gd.data() : nullptr, wk.D.data(), c);
  const T* P_op = as_operand<T>(gr.P.data(), gr.P_low, cc);
  // dQ̃ = e^{β} ⊙ (G Sᵀ + g zᵀ) + P K̃
  gemm_rm<T>(false, true, c, f, e, G_op, e, as_operand<T>(S, gr.S_low, F * E), e, Acc(0), gr.dQ.data(), f);
  if (normalize) add_outer(gr.dQ.data(), gr.gd.data(), z, c, F);
  scale_rows(gr.dQ.data(), wk.eb.data(), c, F);
  gemm_rm<T>(false, false, c, f, c, P_op, c, sp.K, f, Acc(1), gr.dQ.data(), f);
  // dK̃ = e^{λ−β} ⊙ (V Rᵀ + 1 rᵀ) + Pᵀ Q̃
  gemm_rm<T>(false, true, c, f, e, sp.V, e, R_op, e, Acc(0), gr.dK.data(), f);
  if (normalize) add_outer<Acc>(gr.dK.data(), nullptr, rr, c, F);
  scale_rows(gr.dK.data(), wk.w.data(), c, F);
  gemm_rm<T>(true, false, c, f, c, P_op, c, sp.Q, f, Acc(1), gr.dK.data(), f);
  gate_grads(sp.Qa, gr.dQ.data(), sp.Ka, gr.dK.data(), c, F, false, carry, sp.dg);
  // (R, r) ← e^{λ} (R, r) + Q̃ᵀ (e^{β} ⊙ (G, g))
  const Acc ec = wk.eb.data()[c - 1];
  scale_rows(gr.G.data(), wk.eb.data(), c, E);
  scale_all(R, F * E, ec);
  gemm_rm<T>(true, false, f, e, c, sp.Q, f, as_operand<T>(gr.G.data(), gr.G_low, int64_t(c) * E), e, Acc(1), R, e);
  if (normalize) {
    for (int i = 0; i < c; ++i) gr.gd.data()[i] *= wk.eb.data()[i];
    scale_all(rr, F, ec);
    add_weighted_rows(rr, gr.gd.data(), sp.Qa, c, F);
  }
  chain_features(gr.dQ.data(), sp.fQ, sp.dq, int64_t(c) * F);
  chain_features(gr.dK.data(), sp.fK, sp.dk, int64_t(c) * F);
}

// The backward of one vector-gated piece (γ in wk.gam) from the states (S, z) entering and (S_out, z_out)
// leaving it
template <typename T>
void piece_backward(Work<T>& wk, Grads<T>& gr, const Span<T>& sp, int64_t F, int64_t E, const linattn_acc<T>* S,
                    const linattn_acc<T>* z, const linattn_acc<T>* S_out, const linattn_acc<T>* z_out,
                    linattn_acc<T>* R, linattn_acc<T>* rr, bool normalize, double* carry) {
  using Acc = linattn_acc<T>;
  const int c = sp.c, f = static_cast<int>(F), e = static_cast<int>(E);
  const int64_t cc = int64_t(c) * c;
  end_term(S_out, R, z_out, rr, F, E, true, carry);
  piece_factors(sp.g, wk.gam.data(), c, F, sp.Qa, sp.Ka, wk.dec.data(), wk.w.data(), wk.Qv.data(), wk.Kv.data());
  std::copy(S, S + F * E, wk.S_hat.begin());
  decay_rows(wk.S_hat.data(), wk.dec.data(), F, E);  // Ŝ = e^{λ} ⊙ S
  if (normalize) {
    std::copy(z, z + F, wk.z_hat.begin());
    decay_rows(wk.z_hat.data(), wk.dec.data(), F, 1);
  }
  const T* Qop = as_operand<T>(wk.Qv.data(), wk.Qv_low, c * F);
  const T* Kop = as_operand<T>(wk.Kv.data(), wk.Kv_low, c * F);
  gemm_rm<T>(false, true, c, c, f, Qop, f, Kop, f, Acc(0), wk.A.data(), c);  // A = M ⊙ Q̌K̂ᵀ
  mask_upper(wk.A.data(), c);
  output_grads(sp.dO, sp.O, sp.den, normalize, gr.G.data(), gr.gd.data(), c, E);
  const T* G_op = as_operand<T>(gr.G.data(), gr.G_low, int64_t(c) * E);
  const T* R_op = as_operand<T>(R, gr.R_low, F * E);
  values_grad<T>(gr, sp, F, E, as_operand<T>(wk.A.data(), wk.A_low, cc), Kop, G_op, R_op);
  // P = M ⊙ (G Vᵀ + g 1ᵀ)
  gemm_rm<T>(false, true, c, c, e, G_op, e, sp.V, e, Acc(0), gr.P.data(), c);
  if (normalize) {
    add_rows_and_mask(gr.P.data(), gr.gd.data(), c);
  } else {
    mask_upper(gr.P.data(), c);
  }
  const T* P_op = as_operand<T>(gr.P.data(), gr.P_low, cc);
  // dQ̌ = P K̂ + G Ŝᵀ + g ẑᵀ,   dK̂ = Pᵀ Q̌ + V Rᵀ + 1 rᵀ
  gemm_rm<T>(false, false, c, f, c, P_op, c, Kop, f, Acc(0), gr.dQ.data(), f);
  gemm_rm<T>(false, true, c, f, e, G_op, e, as_operand<T>(wk.S_hat.data(), gr.S_low, F * E), e, Acc(1), gr.dQ.data(),
             f);
  if (normalize) add_outer(gr.dQ.data(), gr.gd.data(), wk.z_hat.data(), c, F);
  gemm_rm<T>(true, false, c, f, c, P_op, c, Qop, f, Acc(0), gr.dK.data(), f);
  gemm_rm<T>(false, true, c, f, e, sp.V, e, R_op, e, Acc(1), gr.dK.data(), f);
  if (normalize) add_outer<Acc>(gr.dK.data(), nullptr, rr, c, F);
  // q ⊙ dq − k ⊙ dk = Q̌ ⊙ dQ̌ − K̂ ⊙ dK̂
  gate_grads(wk.Qv.data(), gr.dQ.data(), wk.Kv.data(), gr.dK.data(), c, F, true, carry, sp.dg);
  // (R, r) ← e^{λ} ⊙ ((R, r) + Q̌ᵀ (G, g))
  gemm_rm<T>(true, false, f, e, c, Qop, f, G_op, e, Acc(1), R, e);
  decay_rows(R, wk.dec.data(), F, E);
  if (normalize) {
    add_weighted_rows(rr, gr.gd.data(), wk.Qv.data(), c, F);
    decay_rows(rr, wk.dec.data(), F, 1);
  }
  unscale_grads(gr.dQ.data(), gr.dK.data(), wk.w.data(), int64_t(c) * F);
  chain_features(gr.dQ.data(), sp.fQ, sp.dq, int64_t(c) * F);
  chain_features(gr.dK.data(), sp.fK, sp.dk, int64_t(c) * F);
}

// A vector-gated chunk backward: its pieces in reverse, each between the states entering and leaving it
// (recomputed into Sp, zp when the chunk has more than one piece)
template <typename T>
void vector_chunk_backward(Work<T>& wk, Grads<T>& gr, const Span<T>& ch, int64_t F, int64_t E,
                           const linattn_acc<T>* S, const linattn_acc<T>* z, const linattn_acc<T>* S_out,
                           const linattn_acc<T>* z_out, linattn_acc<T>* R, linattn_acc<T>* rr,
                           bool normalize, double* carry, std::vector<int>& starts, std::vector<linattn_acc<T>>& Sp,
                           std::vector<linattn_acc<T>>& zp) {
  starts.clear();
  for (int p = 0; p < ch.c;) {
    starts.push_back(p);
    p += piece_length(ch.g + p * F, ch.c - p, F, wk.gam.data());
  }
  const int np = static_cast<int>(starts.size());
  starts.push_back(ch.c);
  if (np > 1) {
    Sp.resize(np * F * E);
    zp.resize(normalize ? np * F : 0);
    std::copy(S, S + F * E, Sp.begin());
    if (normalize) std::copy(z, z + F, zp.begin());
    for (int i = 0; i + 1 < np; ++i) {
      const int p = starts[i], len = starts[i + 1] - p;
      std::copy(Sp.begin() + i * F * E, Sp.begin() + (i + 1) * F * E, Sp.begin() + (i + 1) * F * E);
      if (normalize) std::copy(zp.begin() + i * F, zp.begin() + (i + 1) * F, zp.begin() + (i + 1) * F);
      piece_length(ch.g + p * F, len, F, wk.gam.data());
      piece_forward<T>(wk, len, F, E, ch.Qa + p * F, ch.Ka + p * F, ch.V + p * E, ch.g + p * F,
                       Sp.data() + (i + 1) * F * E, normalize ? zp.data() + (i + 1) * F : nullptr, nullptr, normalize,
                       linattn_acc<T>(0), nullptr);
    }
  }
  for (int i = np - 1; i >= 0; --i) {
    const int p = starts[i], len = starts[i + 1] - p;
    piece_length(ch.g + p * F, len, F, wk.gam.data());
    Span<T> sp = ch;
    sp.c = len;
    sp.Q += p * F;
    sp.K += p * F;
    sp.V += p * E;
    sp.dO += p * E;
    sp.O += p * E;
    sp.Qa += p * F;
    sp.Ka += p * F;
    if (sp.fQ != nullptr) {
      sp.fQ += p * F;
      sp.fK += p * F;
    }
    if (sp.den != nullptr) sp.den += p;
    sp.g += p * F;
    sp.dq += p * F;
    sp.dk += p * F;
    sp.dv += p * E;
    sp.dg += p * F;
    const bool first = i == 0, last = i + 1 == np;
    piece_backward<T>(wk, gr, sp, F, E, first ? S : Sp.data() + i * F * E,
                      first ? z : (normalize ? zp.data() + i * F : nullptr), last ? S_out : Sp.data() + (i + 1) * F * E,
                      last ? z_out : (normalize ? zp.data() + (i + 1) * F : nullptr), R, rr, normalize, carry);
  }
}

template <typename T>
void gated_backward_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                         const at::Tensor& o, const at::Tensor& dout, const at::Tensor& den_all,
                         const at::Tensor& S_blocks, const at::Tensor& z_blocks, const at::Tensor& kvN,
                         const at::Tensor& zN, const at::Tensor& R_all, const at::Tensor& r_all, at::Tensor& dq,
                         at::Tensor& dk, at::Tensor& dv, at::Tensor& dg, int64_t phi, bool normalize, int64_t chunk,
                         int64_t block) {
  using Acc = linattn_acc<T>;
  const int64_t N = q.size(2), F = q.size(3), E = v.size(3), rows = q.size(0) * q.size(1);
  const int64_t blocks = (N + block - 1) / block, per_block = block / chunk;
  const bool vector = g.dim() == 4;
  const int64_t Gw = vector ? F : 1;
  const T *pq = q.data_ptr<T>(), *pk = k.data_ptr<T>(), *pv = v.data_ptr<T>(), *po = o.data_ptr<T>();
  const T* pdo = dout.data_ptr<T>();
  const Acc* pg = g.data_ptr<Acc>();
  const Acc* pden = normalize ? den_all.data_ptr<Acc>() : nullptr;
  const Acc* pSb = S_blocks.data_ptr<Acc>();
  const Acc* pzb = normalize ? z_blocks.data_ptr<Acc>() : nullptr;
  const Acc* pkvN = kvN.data_ptr<Acc>();
  const Acc* pzN = normalize ? zN.data_ptr<Acc>() : nullptr;
  T *pdq = dq.data_ptr<T>(), *pdk = dk.data_ptr<T>(), *pdv = dv.data_ptr<T>();
  Acc* pdg = dg.data_ptr<Acc>();
  Acc* pR = R_all.data_ptr<Acc>();
  Acc* pr = normalize ? r_all.data_ptr<Acc>() : nullptr;
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    const SequentialBlas one_thread;
    Work<T> wk(chunk, F, E, vector);
    Grads<T> gr(chunk, F, E);
    BlockFeatures<T> fb(phi, block, F);
    Aligned<Acc> Sc(per_block * F * E), zc(normalize ? per_block * F : 0);
    std::vector<double> carry(Gw);
    std::vector<int> starts;
    std::vector<Acc> Sp, zp;
    for (int64_t r = r0; r < r1; ++r) {
      Acc* R = pR + r * F * E;
      Acc* rr = normalize ? pr + r * F : nullptr;
      for (int64_t b = blocks - 1; b >= 0; --b) {
        const int64_t s = b * block, m = std::min(N, s + block) - s, nch = (m + chunk - 1) / chunk;
        fb.compute(pq + (r * N + s) * F, pk + (r * N + s) * F, m * F, phi);
        std::copy(pSb + (r * blocks + b) * F * E, pSb + (r * blocks + b + 1) * F * E, Sc.begin());
        if (normalize) std::copy(pzb + (r * blocks + b) * F, pzb + (r * blocks + b + 1) * F, zc.begin());
        for (int64_t j = 0; j + 1 < nch; ++j) {  // the states entering the block's later chunks
          const int c = static_cast<int>(std::min(chunk, m - j * chunk));
          const int64_t c0 = j * chunk, t0 = r * N + s + c0;
          Acc* Snext = Sc.data() + (j + 1) * F * E;
          Acc* znext = normalize ? zc.data() + (j + 1) * F : nullptr;
          std::copy(Sc.begin() + j * F * E, Sc.begin() + (j + 1) * F * E, Snext);
          if (normalize) std::copy(zc.begin() + j * F, zc.begin() + (j + 1) * F, znext);
          if (vector) {
            vector_chunk_forward<T>(wk, c, F, E, fb.Qa + c0 * F, fb.Ka + c0 * F, pv + t0 * E, pg + t0 * F, Snext, znext,
                                    nullptr, normalize, Acc(0), nullptr);
          } else {
            scalar_chunk_forward<T>(wk, c, F, E, fb.Q + c0 * F, fb.K + c0 * F, fb.Qa + c0 * F, fb.Ka + c0 * F,
                                    pv + t0 * E, pg + t0, Snext, znext, nullptr, normalize, Acc(0));
          }
        }
        for (int64_t j = nch - 1; j >= 0; --j) {
          const int64_t c0 = j * chunk, t0 = r * N + s + c0;
          Span<T> sp{static_cast<int>(std::min(chunk, m - c0)),
                     fb.Q + c0 * F,
                     fb.K + c0 * F,
                     pv + t0 * E,
                     pdo + t0 * E,
                     po + t0 * E,
                     fb.Qa + c0 * F,
                     fb.Ka + c0 * F,
                     fb.fQ == nullptr ? nullptr : fb.fQ + c0 * F,
                     fb.fK == nullptr ? nullptr : fb.fK + c0 * F,
                     normalize ? pden + t0 : nullptr,
                     pg + t0 * Gw,
                     pdq + t0 * F,
                     pdk + t0 * F,
                     pdv + t0 * E,
                     pdg + t0 * Gw};
          const Acc* S = Sc.data() + j * F * E;
          const Acc* z = normalize ? zc.data() + j * F : nullptr;
          // the state after the chunk: the next chunk's, the next block's, or the final state
          const bool last_block = b + 1 == blocks;
          const Acc* S_out = j + 1 < nch   ? S + F * E
                             : last_block ? pkvN + r * F * E
                                          : pSb + (r * blocks + b + 1) * F * E;
          const Acc* z_out = !normalize     ? nullptr
                             : j + 1 < nch  ? z + F
                             : last_block   ? pzN + r * F
                                            : pzb + (r * blocks + b + 1) * F;
          if (vector) {
            vector_chunk_backward<T>(wk, gr, sp, F, E, S, z, S_out, z_out, R, rr, normalize, carry.data(), starts, Sp,
                                     zp);
          } else {
            scalar_chunk_backward<T>(wk, gr, sp, F, E, S, z, S_out, z_out, R, rr, normalize, carry.data());
          }
        }
      }
    }
  });
}

// Returns (dq, dk, dv, dg, dkv0, dz0); normalize = z (the final z) given. kv, z: the final state;
// dkv, dz: its gradients (undefined: zero). dz0 is empty without normalize.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gated_chunked_backward(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
    const at::Tensor& o_in, const at::Tensor& do_in, const at::Tensor& den, const at::Tensor& S_blocks,
    const at::Tensor& z_blocks, const at::Tensor& kv_in, const c10::optional<at::Tensor>& z_in,
    const c10::optional<at::Tensor>& dkv, const c10::optional<at::Tensor>& dz, int64_t phi, int64_t chunk) {
  const char* op = "linattn_cpu::gated_chunked_backward";
  const bool normalize = z_in.has_value();
  check_inputs(op, q_in, k_in, v_in, kv_in, normalize ? *z_in : kv_in, phi, chunk);
  check_gates(op, q_in, g_in, kv_in);
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), g = g_in.contiguous(),
                   o = o_in.contiguous(), dout = do_in.to(v.scalar_type()).contiguous();
  TORCH_CHECK(o.sizes() == v.sizes() && dout.sizes() == v.sizes(), op, ": o and do must be shaped like v");
  const int64_t N = q.size(2), F = q.size(3), E = v.size(3), rows = q.size(0) * q.size(1);
  const int64_t block = block_tokens(chunk), blocks = (N + block - 1) / block;
  TORCH_CHECK(S_blocks.numel() == rows * blocks * F * E && kv_in.numel() == rows * F * E &&
                  (!normalize || (z_blocks.numel() == rows * blocks * F && den.numel() == rows * N &&
                                  z_in->numel() == rows * F)),
              op, ": the saved tensors do not match q, k, v");
  const auto acc = kv_in.options();
  at::Tensor R = dkv.has_value() ? dkv->to(acc).contiguous().clone() : at::zeros({rows, F, E}, acc);
  at::Tensor r = normalize ? (dz.has_value() ? dz->to(acc).contiguous().clone() : at::zeros({rows, F}, acc))
                           : at::empty({0}, acc);
  TORCH_CHECK(R.numel() == rows * F * E && (!normalize || r.numel() == rows * F), op,
              ": dkv, dz must be shaped like the state");
  at::Tensor dq = empty_result(q.sizes(), q.options()), dk = empty_result(k.sizes(), k.options()),
             dv = empty_result(v.sizes(), v.options()), dg = empty_result(g.sizes(), g.options());
  const at::Tensor den_c = den.contiguous(), Sb = S_blocks.contiguous(), zb = z_blocks.contiguous(),
                   kvN = kv_in.contiguous(), zN = normalize ? z_in->contiguous() : at::empty({0}, acc);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "linattn_cpu_gated_chunked_backward", [&] {
    gated_backward_rows<scalar_t>(q, k, v, g, o, dout, den_c, Sb, zb, kvN, zN, R, r, dq, dk, dv, dg, phi, normalize,
                                  chunk, block);
  });
  const auto b = q.size(0), h = q.size(1);
  return {dq, dk, dv, dg, R.view({b, h, F, E}), normalize ? r.view({b, h, F}) : r};
}

// One step of one row: kv' = diag(a) kv + k̃ vᵀ (a_f = e^{g_f}, or e^{g} for all f), out = q̃ᵀ kv'
template <typename T>
LINATTN_CLONES void gated_update_row(const T* __restrict__ src, T* __restrict__ dst, const T* __restrict__ qr,
                                     const T* __restrict__ kr, const T* __restrict__ vr, const T* __restrict__ a,
                                     bool vector, T* __restrict__ out, int64_t F, int64_t E) {
  for (int64_t e = 0; e < E; ++e) out[e] = T(0);
  for (int64_t f = 0; f < F; ++f) {
    const T kf = kr[f], qf = qr[f], af = a[vector ? f : 0];
    const T* __restrict__ s = src + f * E;
    T* __restrict__ d = dst + f * E;
    for (int64_t e = 0; e < E; ++e) {
      const T x = af * s[e] + kf * vr[e];
      d[e] = x;
      out[e] += qf * x;
    }
  }
}

// kv (…, F, E), z (…, F) or none (normalize = z given), q, k (…, 1, F), v (…, 1, E), g (…, 1) or
// (…, 1, F) of one dtype (float32/float64). Returns (o shaped like v, kv', z' or an empty tensor).
std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_step(const at::Tensor& kv_in, const c10::optional<at::Tensor>& z_in,
                                                          const at::Tensor& q_in, const at::Tensor& k_in,
                                                          const at::Tensor& v_in, const at::Tensor& g_in, int64_t phi,
                                                          double eps) {
  const char* op = "linattn_cpu::gated_step";
  const bool normalize = z_in.has_value();
  TORCH_CHECK(kv_in.dim() >= 2, op, " expects kv (..., F, E)");
  TORCH_CHECK(phi == 0 || phi == 1, op, ": phi must be 0 (identity) or 1 (elu + 1)");
  const int64_t F = kv_in.size(-2), E = kv_in.size(-1), rows = kv_in.numel() / std::max<int64_t>(1, F * E);
  const bool vector = g_in.numel() == rows * F && F != 1;
  TORCH_CHECK((!normalize || z_in->numel() == rows * F) && q_in.numel() == rows * F && k_in.numel() == rows * F &&
                  v_in.numel() == rows * E && q_in.size(-1) == F && v_in.size(-1) == E &&
                  (g_in.numel() == rows || g_in.numel() == rows * F),
              op, ": shapes of kv, z, q, k, v, g do not agree");
  for (const at::Tensor* t : {&q_in, &k_in, &v_in, &g_in}) {
    TORCH_CHECK(t->scalar_type() == kv_in.scalar_type(), op, ": all tensors must share kv's dtype");
  }
  if (normalize) TORCH_CHECK(z_in->scalar_type() == kv_in.scalar_type(), op, ": all tensors must share kv's dtype");
  const at::Tensor kv = kv_in.contiguous(), q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(),
                   g = g_in.contiguous();
  const at::Tensor z = normalize ? z_in->contiguous() : at::empty({0}, kv.options());
  at::Tensor kv_new = at::empty_like(kv), z_new = at::empty_like(z), o = at::empty(v_in.sizes(), kv.options());
  AT_DISPATCH_FLOATING_TYPES(kv.scalar_type(), "linattn_cpu_gated_step", [&] {
    const int64_t ng = g.numel();
    const scalar_t* pg = g.data_ptr<scalar_t>();
    for (int64_t i = 0; i < ng; ++i) {
      TORCH_CHECK_VALUE(pg[i] <= scalar_t(0) && pg[i] > -std::numeric_limits<scalar_t>::infinity(),
                        "g (the log of the decay) must be ≤ 0 and finite, got ", pg[i]);
    }
    // the decays e^g and, with φ = elu + 1, the features of the q rows then the k rows
    at::Tensor work = at::empty({ng + (phi == 1 ? 2 * rows * F : 0)}, kv.options());
    scalar_t* pa = work.data_ptr<scalar_t>();
    for (int64_t i = 0; i < ng; ++i) pa[i] = exp_nonpositive(pg[i]);
    scalar_t* pf = phi == 1 ? pa + ng : nullptr;
    if (phi == 1) {
      elu_plus_one(q.data_ptr<scalar_t>(), pf, rows * F);
      elu_plus_one(k.data_ptr<scalar_t>(), pf + rows * F, rows * F);
    }
    const scalar_t* pq = phi == 1 ? pf : q.data_ptr<scalar_t>();
    const scalar_t* pk = phi == 1 ? pf + rows * F : k.data_ptr<scalar_t>();
    const scalar_t *pkv = kv.data_ptr<scalar_t>(), *pv = v.data_ptr<scalar_t>();
    const scalar_t* pz = normalize ? z.data_ptr<scalar_t>() : nullptr;
    scalar_t *pkv2 = kv_new.data_ptr<scalar_t>(), *po = o.data_ptr<scalar_t>();
    scalar_t* pz2 = normalize ? z_new.data_ptr<scalar_t>() : nullptr;
    const scalar_t eps_t = static_cast<scalar_t>(eps);
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, F * E));
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t *qr = pq + r * F, *kr = pk + r * F, *a = pa + r * (vector ? F : 1);
        scalar_t* out = po + r * E;
        gated_update_row<scalar_t>(pkv + r * F * E, pkv2 + r * F * E, qr, kr, pv + r * E, a, vector, out, F, E);
        if (normalize) {
          scalar_t den = 0;
          for (int64_t f = 0; f < F; ++f) {
            const scalar_t zf = a[vector ? f : 0] * pz[r * F + f] + kr[f];
            pz2[r * F + f] = zf;
            den += qr[f] * zf;
          }
          const scalar_t inv = scalar_t(1) / (den + eps_t);
          for (int64_t e = 0; e < E; ++e) out[e] *= inv;
        }
      }
    });
  });
  return {o, kv_new, z_new};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(linattn_cpu, m) {
  m.def(
      "gated_chunked(Tensor q, Tensor k, Tensor v, Tensor g, Tensor kv0, Tensor? z0, int phi, float eps, int chunk, "
      "bool save) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "gated_chunked_backward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor o, Tensor do, Tensor den, "
      "Tensor S_blocks, Tensor z_blocks, Tensor kv, Tensor? z, Tensor? dkv, Tensor? dz, int phi, int chunk) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "gated_step(Tensor kv, Tensor? z, Tensor q, Tensor k, Tensor v, Tensor g, int phi, float eps) "
      "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(linattn_cpu, CPU, m) {
  m.impl("gated_chunked", gated_chunked);
  m.impl("gated_chunked_backward", gated_chunked_backward);
  m.impl("gated_step", gated_step);
}
